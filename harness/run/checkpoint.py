"""Checkpoints: atomic, the last K kept, resumable to the exact step; and the consolidated model export.

Layout of `RUN/checkpoints/`:
    step_00000100/      DeepSpeed's files (model, optimizer, scheduler, loss scaler) + rng_rank*.pt
    latest              the name of the newest complete checkpoint
    best                with `train.select_best`: the name of the best one (kept whatever the rotation says)
A checkpoint is written as `step_N.partial`, renamed when every rank has finished, and only then named in
`latest`: a crash mid-write leaves a `.partial` directory that is never resumed from and is removed later.
Each holds `layout.json` (data, tensor and pipeline sizes, ZeRO stage, offload, how the weights are held) and
`checksums.json` (every file's size and SHA-256, checked before the checkpoint is read: `verify`).
Resuming onto another data-parallel size or ZeRO stage (1-3) converts it once, beside it, to DeepSpeed's universal format (`step_N.universal`, made by
`ds_to_universal`), which DeepSpeed then loads into any partitioning; see `reshape`.
The run directory must be on a file system that every node sees (as DeepSpeed's own checkpoints assume).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.run import ConfigError, TrainingStopped, one_line
from ..distributed import ds_patches
from ..distributed.optim import place_schedule
from ..distributed.world import World, all_gather_objects, barrier, is_lost, is_timeout
from .trust import checkpoint_reads

LATEST = "latest"
BEST = "best"
BAD = ".bad"  # suffix of a checkpoint whose weights went bad (a non-finite stop): never resumed from, removed once a
# good checkpoint at a later step is saved
UNIVERSAL = ".universal"  # suffix of a checkpoint converted for another partitioning (`reshape`)
LAYOUT = "layout.json"
DATA = "data.json"  # what the run trained on (a prepared corpus's fingerprint): a resume on other data is refused
SOURCE = "source.json"  # in a universal conversion: what the checkpoint it was made from held (`_stamp`)
PLACE = "place.json"  # the step and its place in the data (StepSampler.place): a resume's train.epochs counts from it
SUMS = "checksums.json"  # every other file of the checkpoint: size and SHA-256 (`record_sums`, `verify`)
SHAPES = "parameters.json"  # the model's parameters by name and shape: a resume into a model of other code is refused
LAYOUT_KEYS = ("dp_size", "tp_size", "pp_size", "sp_size", "zero_stage", "offload_optimizer", "offload_params")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def is_complete(path: Path) -> bool:
    return path.name.startswith("step_") and not path.name.endswith((".partial", BAD, UNIVERSAL))


def latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, a step_N folder of `root` (an empty or damaged file named `root` itself),
    never one set aside or half written; else None."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text().strip()
    path = root / name
    return path if Path(name).name == name and is_complete(path) and path.is_dir() else None


def resume_hint(root: Path) -> str:
    """How a stopped run goes on, for the line that says it stopped: the checkpoint `latest` names under `root`."""
    saved = latest(root)
    return (f"latest checkpoint: {saved.name}; continue with --resume auto" if saved else
            "no checkpoint was saved; --resume auto starts from step 0")


def complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))


def rewind_latest(root: Path, max_step: int) -> Path | None:
    """Point `latest` at the newest checkpoint at or before `max_step` (rank 0), e.g. past weights gone bad; the
    checkpoints after it are renamed `step_N.bad`, so no resume ever takes them (`resume_target` names them)."""
    good = [p for p in complete(root) if step_of(p) <= max_step]
    for bad in [p for p in complete(root) if step_of(p) > max_step]:
        aside = bad.with_name(bad.name + BAD)
        if aside.exists():  # set aside by an earlier non-finite stop at the same step: the newer one replaces it
            shutil.rmtree(aside)
        os.replace(bad, aside)
        shutil.rmtree(bad.with_name(bad.name + UNIVERSAL), ignore_errors=True)  # made from the weights gone bad
    if good:
        _write_atomic(root / LATEST, good[-1].name + "\n")
    elif (root / LATEST).exists():
        (root / LATEST).unlink()
    return good[-1] if good else None


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").split(".")[0])


def resume_target(root: Path, say: bool = True) -> Path | None:
    """What `--resume auto` continues from in a run's `checkpoints/`: the one `latest` names; with `latest` missing
    or naming a checkpoint that is gone, the newest complete one (with a note, where `say`). None for a run that saved
    nothing yet. Raises ConfigError rather than start over a run whose checkpoints exist but none can be resumed."""
    found = latest(root)
    if found is not None:
        return found
    marker, ready = root / LATEST, complete(root)
    named = marker.read_text().strip() if marker.is_file() else None
    if ready:
        why = f"`latest` names {named}, which is gone or no complete checkpoint of it" if named else \
            f"`latest` is {'empty' if marker.is_file() else 'missing'}"
        if say:
            print(f"note: {root}: {why}; resuming from the newest complete checkpoint, {ready[-1].name}", flush=True)
        return ready[-1]
    bad = sorted(root.glob(f"step_*{BAD}"))
    if named or bad:
        found_there = ", ".join(p.name for p in bad) or "no complete checkpoint"
        raise ConfigError(f"--resume auto: {root} holds nothing to resume from (`latest` names "
                          f"{named or 'nothing'}; found: {found_there}"
                          f"{' (saved with weights gone bad, at a non-finite stop)' if bad else ''}); "
                          f"--overwrite starts the run again")
    return None


def layout_of(ds) -> dict[str, Any]:
    """What a checkpoint's partitioning depends on, from a `config.ds.DSResolved` (written as layout.json)."""
    return {"dp_size": ds.layout.dp_size, "tp_size": ds.layout.tp_size, "pp_size": ds.layout.pp_size,
            "sp_size": ds.layout.sp_size, "zero_stage": ds.zero_stage, "offload_optimizer": ds.offload_optimizer,
            "offload_params": ds.offload_params,
            "weights": _weights(ds.precision, ds.autocast), "global_batch": ds.global_batch_size,
            "schedule": schedule_kind(ds), "optimizer": ds.optimizer_kind}


def schedule_kind(ds) -> str:
    """The lr schedule's kind: DeepSpeed's scheduler section's type, or "harness" (the run's [schedule])."""
    return ds.sections.scheduler["type"] if ds.sections.scheduler else "harness"


def saved_schedule(path: Path) -> str | None:
    """`schedule_kind` of checkpoint `path`; for one saved before layout.json said it, its run's resolved DeepSpeed
    config's (the run's latest start's: an earlier checkpoint may have had another)."""
    kind = (saved_layout(path) or {}).get("schedule")
    if kind is None and (ds := _run_ds_config(path)) is not None:
        section = ds.get("scheduler") or {}
        kind = section.get("type", "harness") if isinstance(section, dict) else None
    return kind


def batch_note(path: Path, ds, placed: bool) -> str | None:
    """A line where resuming checkpoint `path` under `ds` changes the global batch (e.g. fewer processes at the same
    micro-batch): the steps after it are then not the uninterrupted run's. `placed`: the checkpoint kept its place in
    the data (StepSampler.place), so the data goes on from the samples read. None where it is kept or not recorded."""
    saved, now = (saved_layout(path) or {}).get("global_batch"), ds.global_batch_size  # (tensor parallel: not in
    # DeepSpeed's config, which then derives it)
    if not saved or not now or saved == now:
        return None
    data = "the data goes on from the samples read (with data.bucket the epoch is arranged anew for the new batch, " \
        "and samples of this epoch may be read twice or skipped)" \
        if placed else "this checkpoint, saved before checkpoints kept their place in the data, takes it up at step " \
        "x batch: samples of this epoch are read twice or skipped"
    return (f"note: global batch {now}, where the checkpoint's run had {saved}: {data}, and the steps from here are "
            f"not the uninterrupted run's; --set train.global_batch_size={saved} --unset train.grad_accum_steps keeps "
            f"it (with a train.micro_batch_size that divides it over the data-parallel ranks)")


def _weights(precision: str, autocast: bool) -> str:
    """How a checkpoint holds the weights: "fp32" (fp32, or bf16 by torch autocast: the optimizer steps them) or
    "16-bit + fp32 master" (DeepSpeed's bf16/fp16 wrapper or ZeRO optimizer). Neither loads as the other."""
    return "fp32" if precision == "fp32" or autocast else "16-bit + fp32 master"


def _run_ds_config(path: Path) -> dict | None:
    """The resolved DeepSpeed config of checkpoint `path`'s run (its latest start's), for what an older layout.json
    does not say; None where it cannot be read."""
    try:
        ds = json.loads((path.parent.parent / "ds_config.json").read_text())
    except (OSError, ValueError):
        return None
    return ds if isinstance(ds, dict) else None


def _saved_weights(path: Path) -> str | None:
    """`_weights` of a checkpoint saved before layout.json said it, from its run's resolved DeepSpeed config."""
    if (ds := _run_ds_config(path)) is None:
        return None
    sixteen = any(isinstance(ds.get(k), dict) and ds[k].get("enabled") is True for k in ("bf16", "fp16"))
    return _weights("bf16" if sixteen else "fp32", bool((ds.get("torch_autocast") or {}).get("enabled")))


def _describe(layout: dict[str, Any]) -> str:
    offload = [k.removeprefix("offload_") for k in ("offload_optimizer", "offload_params") if layout.get(k)]
    sequence = f" x sequence {layout['sp_size']}" if layout.get("sp_size", 1) > 1 else ""
    return (f"data {layout['dp_size']}{sequence} x tensor {layout['tp_size']} x pipeline {layout['pp_size']}, ZeRO-"
            f"{layout['zero_stage']}{' offload ' + '+'.join(offload) if offload else ''}")


def _how(layout: dict[str, Any]) -> str:
    """The launch a saved layout needs, in the DeepSpeed file's words."""
    n = layout["dp_size"] * layout.get("sp_size", 1) * layout["tp_size"] * layout["pp_size"]
    keys = [f"zero_optimization.stage {layout['zero_stage']}"]
    keys += [f"{k} {layout[v]}" for k, v in (("tensor_parallel.autotp_size", "tp_size"), ("pipeline.stages", "pp_size"),
                                              ("sequence_parallel_size", "sp_size")) if layout.get(v, 1) > 1]
    return f"{n} process{'es' if n > 1 else ''} with a DeepSpeed file of {', '.join(keys)}"


def _saved(path: Path, name: str) -> Any:
    """A record `save` wrote in checkpoint `path` (a universal conversion's: in the one it was made from); None where
    there is none (saved before it was recorded). One that is there but cannot be read is a damaged checkpoint: read
    as none, a layout would have let DeepSpeed fail on the files it describes."""
    source = path.with_name(path.name.removesuffix(UNIVERSAL))
    try:
        return json.loads((source / name).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        said = one_line(e, 200) or "empty"
        raise ConfigError(f"checkpoint {source} cannot be read ({name}: {type(e).__name__}: {said}): a file in it is "
                          f"cut short, damaged or missing; {_before(source)}") from None


def saved_layout(path: Path) -> dict[str, Any] | None:
    return _saved(path, LAYOUT)


def saved_data(path: Path) -> dict | None:
    """What its run trained on (`data.json`); None for a checkpoint saved before it was recorded."""
    return _saved(path, DATA)


def saved_place(path: Path) -> dict | None:
    """Its step and place in the data ({"step", "data_position"}); None for a checkpoint saved before it was kept."""
    return _saved(path, PLACE)


def saved_shapes(path: Path) -> dict[str, list[int]] | None:
    """Its model's parameter shapes by name."""
    return _saved(path, SHAPES)


def check_same_data(path: Path, data: dict | None, changed_ok: bool) -> None:
    """Before launch: a checkpoint trained on a prepared corpus resumes on that corpus (its fingerprint), else the
    samples after it are not the uninterrupted run's; `changed_ok` (--data-changed-ok) says the user means it."""
    saved = saved_data(path)
    if saved is None:
        return  # saved without a prepared corpus (or before data.json existed)
    if (data or {}).get("fingerprint") != saved.get("fingerprint") and not changed_ok:  # moved is the same data
        now = f"{data['path']} (fingerprint {data['fingerprint']})" if data else "data that is no prepared corpus"
        raise ConfigError(f"--resume {path}: trained on {saved['path']} (fingerprint {saved['fingerprint']}), now "
                          f"{now}: the steps after it would not read what the uninterrupted run read; pass "
                          f"--data-changed-ok to resume on the new data anyway")


def reshape(path: Path, ds) -> bool:
    """Before launch: whether resuming checkpoint `path` under `ds` needs the universal conversion (another data-
    parallel size, ZeRO stage, optimizer offload or precision). Raises ConfigError, naming both layouts, for a
    change it cannot make: another tensor- or pipeline-parallel size, or between ZeRO-0 and a ZeRO stage. A
    checkpoint without layout.json (saved before it existed) is loaded as it is."""
    saved = saved_layout(path)
    if saved is None:
        return False
    new = layout_of(ds)
    saved.setdefault("sp_size", 1)  # saved before sequence parallelism
    if "weights" not in saved and (weights := _saved_weights(path)):
        saved["weights"] = weights  # layout.json written before it recorded the weights
    saved.setdefault("weights", new["weights"])  # not known: taken as unchanged, as before
    if saved == new:
        return False
    if saved["zero_stage"] == new["zero_stage"] == 0 and saved["weights"] != new["weights"]:
        # ZeRO-0's optimizer state is a plain optimizer's over fp32 weights, or DeepSpeed's wrapper's over 16-bit ones
        fix = 'add "torch_autocast": {"enabled": false} to the DeepSpeed file' if saved["weights"] != "fp32" else \
            "resume with fp32, or bf16 by autocast (no torch_autocast section)"
        raise ConfigError(f"--resume: {path} holds its ZeRO-0 weights as {saved['weights']}; this run as "
                          f"{new['weights']} (bf16 under ZeRO-0 runs as torch autocast over fp32 weights), and neither "
                          f"loads as the other: {fix}")
    # ZeRO partitions over the data x sequence ranks (distributed/sequence.py). Its optimizer files hold the state
    # of the optimizer and precision they were saved under: DeepSpeed's CPU Adam (offload) reads no torch AdamW param
    # groups (KeyError 'bias_correction'), and a 16-bit run's files are not an fp32 one's; the conversion rewrites both
    convert = saved["zero_stage"] != 0 and _zero_files(saved) != _zero_files(new)
    if (saved["tp_size"], saved["pp_size"]) != (new["tp_size"], new["pp_size"]) or \
            0 in (saved["zero_stage"], new["zero_stage"]) and saved["zero_stage"] != new["zero_stage"]:
        raise ConfigError(f"--resume: {path} was saved as {_describe(saved)}; this run is {_describe(new)}. The "
                          f"harness resumes a checkpoint on another data- or sequence-parallel size or ZeRO stage 1-3 "
                          f"(and any offload), and ZeRO-0 on any data-parallel size; not on another tensor- or pipeline-"
                          f"parallel size, or between ZeRO-0 and ZeRO. Resume it as it was saved: {_how(saved)}; or "
                          f"start a new run on this layout from its exported weights (a run exports as it finishes): "
                          f"model.init_from = its run directory, with another run.output_dir")
    return convert


def _zero_files(layout: dict[str, Any]) -> tuple:
    """What a ZeRO checkpoint's files depend on: resumed under anything else, they go through the conversion."""
    return (layout["dp_size"] * layout["sp_size"], layout["zero_stage"], bool(layout.get("offload_optimizer")),
            layout.get("weights"))


def conversion_of(path: Path, run_dir: Path) -> Path:
    """Where `to_universal` converts `path`: beside it when it is this run's own checkpoint (kept, and reused by a
    later resume), else in this run's checkpoints under a name of its source's (another run's directory is not this
    run's to write, and may be read-only)."""
    own = run_dir / "checkpoints"
    if path.parent.resolve() == own.resolve():
        return path.with_name(path.name + UNIVERSAL)
    source = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return own / f"{path.name}.from-{source}{UNIVERSAL}"


def to_universal(path: Path, out: Path, world: World, afresh: bool = False) -> Path:
    """Collective: `path` converted to DeepSpeed's universal checkpoint as `out` (rank 0, once; `afresh`: again
    whatever `out` holds), for an engine built with checkpoint.load_universal."""
    if world.is_main and out.is_dir() and not afresh and _source_of(out) != _stamp(path):
        print(f"note: {out.name} was converted from an earlier save of {path.name}; converting it again", flush=True)
        afresh = True
    if world.is_main and afresh:
        shutil.rmtree(out, ignore_errors=True)
    if world.is_main and not out.is_dir():
        import argparse
        import contextlib
        import io

        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        work = out.with_name(out.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        args = argparse.Namespace(input_folder=str(path), output_folder=str(work), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, no_strict=False,
                                  inject_missing_state=True)  # the state Megatron adds; DeepSpeed's default
        print(f"converting {path.name} to DeepSpeed's universal checkpoint for this layout: {out}", flush=True)
        try:  # a source that cannot be read leaves no half conversion behind
            with checkpoint_reads():  # the source's files and the converted ones: data, not code (trust.py)
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    ds_to_universal(args)  # (its progress bars and steps)
                (out.parent / "latest_universal").unlink(missing_ok=True)  # it names the work folder; tags name ours
                for name in (LAYOUT, *(p.name for p in path.glob("rng_rank*.pt"))):
                    shutil.copy(path / name, work / name)
                ds_patches.fix_universal_conversion(work, path)
                (work / SOURCE).write_text(json.dumps(_stamp(path)) + "\n")
            # The engine reads its metadata (client state, scheduler) from the file its own stage names: ZeRO-3
            # zero_pp_rank_0_mp_rank_XX_model_states.pt, ZeRO-1/2 mp_rank_XX_model_states.pt. Both are there.
            for states in list(work.glob("*mp_rank_*_model_states.pt")):
                mp = states.name.split("mp_rank_")[1]
                for twin in (f"mp_rank_{mp}", f"zero_pp_rank_0_mp_rank_{mp}"):
                    if not (work / twin).exists():
                        os.link(states, work / twin)
            write_sums(work)  # reused by later resumes: checked as a checkpoint is (both twins: a copy may part them)
            os.replace(work, out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    barrier()
    return out


def _stamp(path: Path) -> list:
    """What a checkpoint's files are (name, size, modification time): a conversion made from other files of the same
    name (the step saved again, after a resume from an earlier one) is not reused."""
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in path.iterdir() if p.is_file())


def _source_of(out: Path) -> list | None:
    try:
        return json.loads((out / SOURCE).read_text())
    except (OSError, ValueError):  # converted before it was recorded, or damaged: made again
        return None


def finished(run_dir: Path, model: Path, world: World, step: int, max_steps: int,
             early: str | None = None) -> dict | None:
    """Collective. A resumed run that has nothing left to train (its last step reached, or stopped early: `early`,
    why) and whose model was exported (rank 0's view decides): said, and its last evaluation returned; else None
    (train on)."""
    from .tracking import read_jsonl

    if not all_gather_objects(model.is_file() if world.is_main else None)[0]:
        return None
    last = read_jsonl(run_dir / "eval.jsonl")[-1:] if world.is_main else []
    if world.is_main:
        more = "raise train.early_stopping_patience to train on" if early else \
            "raise train.max_steps or train.epochs to train on"
        print(f"{run_dir}: the run {f'stopped early at step {step} ({early})' if early else f'finished at step {step}'}"
              f" of {max_steps} and exported {model}; nothing to do ({more}, --overwrite to train again)")
    return {"step": step, **(last[0] if last else {})}


def save(engine, root: Path, step: int, client_state: dict[str, Any], world: World, keep: int,
         best: int | None = None, layout: dict[str, Any] | None = None, data: dict | None = None,
         shapes: dict[str, list[int]] | None = None, checksums: bool = True) -> Path:
    """Collective: every rank calls it. `best`: the step of the best checkpoint (`train.select_best`), named in
    `best` and kept beside the last `keep`. `layout` (`layout_of`) is written as layout.json, `data` as data.json,
    `shapes` as parameters.json; `checksums`: then its files' checksums (`record_sums`)."""
    name = step_name(step)
    partial = root / f"{name}.partial"
    if world.is_main:
        for stale in root.glob("*.partial"):  # left by a crash
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    failed, failures = None, []
    try:
        with ds_patches.writes_that_fail_in_step(engine, failures):
            engine.save_checkpoint(str(root), tag=partial.name, client_state=client_state, save_latest=False)
        if failures:
            raise failures[0]
        partial.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), partial / f"rng_rank{world.rank:05d}.pt")
        if world.is_main and layout is not None:
            (partial / LAYOUT).write_text(json.dumps(layout) + "\n")
        place = {k: client_state[k] for k in ("step", "data_position")} if "data_position" in client_state else None
        for file, record in ((DATA, data), (SHAPES, shapes), (PLACE, place)):
            if world.is_main and record is not None:
                (partial / file).write_text(json.dumps(record) + "\n")
    except (OSError, RuntimeError) as e:  # a full disk: OSError, or torch.save's RuntimeError "file write failed"
        failed = f"a write failed on rank {world.rank}: {type(e).__name__}: {one_line(e)}"
    failures = [f for f in all_gather_objects(failed) if f]  # every rank's shards are on disk, or none goes on
    if failures:
        if world.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        kept = latest(root)
        raise TrainingStopped(f"checkpoint {name} could not be written ({failures[0]}); "
                              f"{shutil.disk_usage(root).free / 2**30:.2f} GiB free under {root}. The partial write "
                              f"was removed; {'`latest` still names ' + kept.name if kept else 'no checkpoint is kept'}"
                              f": make room (or lower train.keep_checkpoints) and continue with --resume auto")
    final = root / name
    if world.is_main:
        if final.exists():
            shutil.rmtree(final)
        shutil.rmtree(final.with_name(name + UNIVERSAL), ignore_errors=True)  # a conversion of the step saved before
        os.replace(partial, final)
        _write_atomic(root / LATEST, name + "\n")
        if best is not None:
            mark_best(root, best)
        for old in complete(root)[:-keep]:
            if best is None or old.name != step_name(best):
                shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(old.with_name(old.name + UNIVERSAL), ignore_errors=True)
        for bad in root.glob(f"step_*{BAD}"):  # weights gone bad at a step this run has now passed with good ones
            if step_of(bad) <= step:
                shutil.rmtree(bad, ignore_errors=True)
    barrier()
    if checksums:  # once the checkpoint is whole and named: a kill while hashing leaves it, read unchecked
        failed = record_sums(final, world)
        if failed and world.is_main:
            print(f"note: {name} has no checksums ({failed}): a resume reads it unchecked", flush=True)
    return final


CHUNK = 1 << 30  # bytes a rank hashes as one piece: a file far larger than the rest is hashed by several ranks


def _pieces(size: int) -> int:
    """How many CHUNK-sized pieces a file of `size` bytes is hashed in (an empty file: one)."""
    return max(1, -(-size // CHUNK))


def _listing(path: Path) -> dict[str, int]:
    """Every file of checkpoint `path` (subfolders too) but its checksums, by relative name, with its size."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file() and
            p.name != SUMS}


def _shares(sizes: dict[str, int], ranks: int) -> list[list[tuple[str, int]]]:
    """Each rank's pieces (name, chunk index) of the files, the largest first to the least loaded rank: the same on
    every rank, given the same sizes."""
    pieces = sorted(((min(CHUNK, size - i * CHUNK), name, i) for name, size in sizes.items()
                     for i in range(_pieces(size))), key=lambda p: (-p[0], p[1], p[2]))
    load, shares = [0] * ranks, [[] for _ in range(ranks)]
    for nbytes, name, i in pieces:
        r = load.index(min(load))
        load[r] += nbytes
        shares[r].append((name, i))
    return shares


def _digest(file: Path, chunk: int) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        f.seek(chunk * CHUNK)
        left = CHUNK
        while left and (block := f.read(min(left, 1 << 24))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _write_sums(path: Path, sizes: dict[str, int], digests: dict[tuple[str, int], str]) -> None:
    sums = {name: {"size": size, "sha256": [digests[name, i] for i in range(_pieces(size))]}
            for name, size in sizes.items()}
    _write_atomic(path / SUMS, json.dumps(sums, indent=1) + "\n")


def record_sums(path: Path, world: World) -> str | None:
    """Collective, on a checkpoint every rank has written: each file's size and the SHA-256 of each GiB of it in
    `checksums.json` (rank 0 writes it), the ranks hashing shares of equal bytes side by side. What failed, or None
    (the checkpoint is then read unchecked, as one saved before checksums were recorded)."""
    try:
        listing = _listing(path) if world.is_main else None
    except OSError as e:  # (said by every rank below: none is left waiting in the gather)
        listing = f"listing {path.name}: {type(e).__name__}: {one_line(e)}"
    sizes = all_gather_objects(listing)[0]  # rank 0's view, on every rank
    if isinstance(sizes, str):
        return sizes
    try:
        mine = {(name, i): _digest(path / name, i) for name, i in _shares(sizes, world.world_size)[world.rank]}
    except OSError as e:
        mine = f"reading {path.name} back on rank {world.rank}: {type(e).__name__}: {one_line(e)}"
    gathered = all_gather_objects(mine)
    failed = next((m for m in gathered if isinstance(m, str)), None)
    if failed is None and world.is_main:
        try:
            _write_sums(path, sizes, {k: v for m in gathered for k, v in m.items()})
        except OSError as e:
            failed = f"writing {path.name}/{SUMS}: {type(e).__name__}: {one_line(e)}"
    return failed


def write_sums(path: Path) -> None:
    """`record_sums` on one process (a universal conversion, which rank 0 makes alone)."""
    sizes = _listing(path)
    _write_sums(path, sizes, {(name, i): _digest(path / name, i) for name, i in _shares(sizes, 1)[0]})


def verify(path: Path, world: World) -> None:
    """Collective, before DeepSpeed reads a checkpoint: every file `checksums.json` lists is there, of its size, and
    each GiB of it of its SHA-256 (the ranks check shares of equal bytes side by side), else every rank stops with
    the line naming the checkpoint before. Bytes changed since the save (a copy between clusters, a failing disk) had
    loaded silently. One without checksums (saved before they were recorded, or on a stop signal) is read as it is."""
    found = damage(path, world)
    if found and path.name.endswith(UNIVERSAL):  # made from a checkpoint by a resume: it can be made again
        raise ConfigError(f"{path}, a conversion of a checkpoint for another layout, is damaged: {found}; remove it "
                          f"and resume again, which converts the checkpoint afresh")
    if found and found.startswith("its "):  # the record itself: the files may be whole
        raise ConfigError(f"checkpoint {path} is damaged: {found}; remove it to read the checkpoint unchecked, or "
                          f"go back: {_before(path)}")
    if found:
        raise ConfigError(f"checkpoint {path} is damaged: {found} (checked against the {SUMS} saved with it); "
                          f"{_before(path)}")


def damage(path: Path, world: World) -> str | None:
    """Collective: what is wrong with checkpoint `path` against its checksums (`verify`), the same on every rank."""
    sums = all_gather_objects(_read_sums(path) if world.is_main else None)[0]  # rank 0's reading, on every rank
    found = None
    if isinstance(sums, str):
        found = sums
    elif sums is not None:
        sizes = {name: entry["size"] for name, entry in sums.items()}
        mine = _shares(sizes, world.world_size)[world.rank]
        found = next((why for name, i in mine if (why := _changed(path, name, i, sums[name]))), None)
    return next((f for f in all_gather_objects(found) if f), None)


def check_records(path: Path) -> None:
    """The small records the checks before launch read (layout, shapes, data, place) against the checkpoint's
    checksums, on one process: a changed one had sent the user after a wrong cause (another layout, changed code)."""
    sums = _read_sums(path)
    if isinstance(sums, dict):
        for name in (LAYOUT, SHAPES, DATA, PLACE):
            if name in sums and (why := _changed(path, name, 0, sums[name])):
                raise ConfigError(f"checkpoint {path} is damaged: {why} (checked against the {SUMS} saved with it); "
                                  f"{_before(path)}")


def _read_sums(path: Path) -> dict | str | None:
    """A checkpoint's checksums; None where it has none; what is wrong with them where they cannot be used."""
    try:
        sums = json.loads((path / SUMS).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        return f"its {SUMS} cannot be read ({type(e).__name__})"
    if not isinstance(sums, dict) or not sums or not all(_entry_ok(n, e) for n, e in sums.items()):
        return f"its {SUMS} cannot be read (not the sizes and SHA-256 digests of files within it)"
    return sums


def _entry_ok(name: str, e: Any) -> bool:
    return isinstance(e, dict) and isinstance(e.get("size"), int) and e["size"] >= 0 and \
        isinstance(e.get("sha256"), list) and len(e["sha256"]) == _pieces(e["size"]) and \
        all(isinstance(h, str) for h in e["sha256"]) and not Path(name).is_absolute() and ".." not in Path(name).parts


def _changed(path: Path, name: str, chunk: int, recorded: dict) -> str | None:
    """What is wrong with piece `chunk` of one file of checkpoint `path` against its record, or None."""
    file = path / name
    try:
        if not file.is_file():
            return f"{name} is gone"
        if file.stat().st_size != recorded["size"]:
            return f"{name} is {file.stat().st_size:,} bytes, saved as {recorded['size']:,}"
        where = f" in its GiB number {chunk + 1}" if chunk else ""
        return None if _digest(file, chunk) == recorded["sha256"][chunk] else \
            f"{name} has changed since it was saved (another SHA-256{where})"
    except Exception as e:  # noqa: BLE001 - any failure is this file's line, said by every rank, not one rank gone
        return f"{name} cannot be read ({type(e).__name__}: {one_line(e, 200)})"


def mark_best(root: Path, step: int) -> None:
    """Name the checkpoint of `step` in `best` (rank 0), if it was written."""
    if (root / step_name(step)).is_dir():
        _write_atomic(root / BEST, step_name(step) + "\n")


def adopt_best(root: Path, step: int, source: Path, world: World) -> None:
    """Collective, on resume: make sure the best checkpoint (of `step`) is in this run's `root`, copying it from the
    checkpoints of the run resumed from (`source`, for `--resume DIR`), and name it in `best`."""
    own, other = root / step_name(step), source / step_name(step)
    if not own.is_dir() and not other.is_dir():  # every rank sees the same file system: all raise alike
        raise ConfigError(f"the resumed state names step {step} as the best checkpoint (train.select_best), but "
                          f"{own} is gone; set train.select_best = \"\" to go on without it")
    best = own if own.is_dir() else other
    found = damage(best, world)  # (collective) a damaged one was found only when the run ended, after training
    if found:
        raise ConfigError(f"the best checkpoint the resumed run kept (train.select_best), {best}, is damaged: {found}; "
                          f"set train.select_best = \"\" to go on without it")
    if world.is_main:
        if not own.is_dir():
            shutil.copytree(other, own)
        mark_best(root, step)
    barrier()


def load(engine, path: Path, world: World, named: Path | None = None, schedule: str | None = None) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, loss scaler and this rank's RNG; returns the client state. A
    step_N.universal checkpoint (`to_universal`) loads into whatever partitioning the engine has; `named`: the
    checkpoint it was converted from, which a file that cannot be read is said of. A scheduler of another kind than
    the checkpoint's (`schedule`, `schedule_kind`) is set at its step instead (its state had failed to read as
    another's: "cut short, damaged or missing")."""
    saved = saved_schedule(named or path)
    other = saved is not None and schedule is not None and saved != schedule
    # DeepSpeed reads checkpoint.load_universal only while loading (engine.load_checkpoint and the ZeRO optimizers'
    # load_state_dict): set per load, so one engine loads a converted checkpoint and, later, its own.
    engine._config.load_universal_checkpoint = path.name.endswith(UNIVERSAL)
    verify(path, world)
    try:
        with checkpoint_reads():  # DeepSpeed's reads too: data, not code (trust.py)
            _, client_state = engine.load_checkpoint(str(path.parent), tag=path.name,
                                                     load_lr_scheduler_states=not other)
            if client_state is None:
                raise RuntimeError("DeepSpeed found no state in it")
            if other:
                place_schedule(engine.lr_scheduler, client_state["step"])
            if path.name.endswith(UNIVERSAL):
                ds_patches.after_universal_load(engine, path)
            rng = path / f"rng_rank{world.rank:05d}.pt"
            if rng.exists():  # absent when resuming with more ranks than saved; data order is still exact
                set_rng_state(torch.load(rng))
                if world.sp_size > 1 and (saved_layout(path) or {}).get("sp_size", 1) != world.sp_size:
                    # saved by ranks whose streams were one (data parallel): each rank of a sequence group draws
                    # its own dropout masks again (parallel.build_engine)
                    torch.manual_seed(int(torch.randint(2**31, ())) + 7919 * world.sp_rank)
    except UNREADABLE as e:
        _said_unreadable(named or path, world, e)
    return client_state


# What reading a checkpoint cut short (torch's zip reader), emptied or gone (DeepSpeed's bare assert) raises
UNREADABLE = (RuntimeError, OSError, EOFError, AssertionError, ValueError, KeyError, pickle.UnpicklingError)


def load_onto(engine, path: Path, run_dir: Path, ds, world: World) -> dict[str, Any]:
    """`load` into this engine's layout: converted first where it is not the checkpoint's (`reshape`). Another run's
    checkpoint is converted afresh into this run's checkpoints, read, and the conversion removed."""
    if not reshape(path, ds):
        return load(engine, path, world, schedule=schedule_kind(ds))
    verify(path, world)
    out = conversion_of(path, run_dir)
    foreign = out.parent != path.parent
    try:
        try:
            converted = to_universal(path, out, world, afresh=foreign)
        except UNREADABLE as e:
            _said_unreadable(path, world, e)
        state = load(engine, converted, world, named=path, schedule=schedule_kind(ds))
    except BaseException:
        if foreign and world.is_main:  # (no barrier: the other ranks may be anywhere in the load)
            shutil.rmtree(out, ignore_errors=True)
        raise
    if foreign:
        barrier()  # every rank has read it
        if world.is_main:
            shutil.rmtree(out, ignore_errors=True)
    return state


def _said_unreadable(path: Path, world: World, e: BaseException) -> None:
    """Raise the line for a checkpoint that cannot be read, naming the one before it (`latest` names this one, so
    `--resume auto` would take it again). A collective that failed (a lost rank, a timeout) or memory that ran out
    is not the file's fault: raised as it is."""
    if isinstance(e, torch.OutOfMemoryError) or is_lost(e) or is_timeout(e) or \
            type(e).__module__.startswith("torch.distributed"):
        raise e
    said = one_line(e, 200) or "no message"
    raise ConfigError(f"checkpoint {path} cannot be read on rank {world.rank} ({type(e).__name__}: {said}): a file "
                      f"in it is cut short, damaged or missing; {_before(path)}") from None


def _before(path: Path) -> str:
    """Where to go on from, past checkpoint `path` that cannot be read (`latest` names it: --resume auto takes it)."""
    earlier = [p for p in complete(path.parent) if step_of(p) < step_of(path)]
    return f"the one before it is {earlier[-1]}: continue from it with --resume {earlier[-1]}" if earlier else \
        "there is none before it to resume from"
