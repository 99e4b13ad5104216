"""A checkpoint's layout, and resuming it onto another.

Each checkpoint holds `layout.json` (data, tensor and pipeline sizes, ZeRO stage, offload, how the weights are held:
`layout_of`). Resuming onto another data-parallel size or ZeRO stage (1-3) converts it once, beside it, to DeepSpeed's
universal format (`step_N.universal`, made by `ds_to_universal`: `to_universal`), which DeepSpeed then loads into any
partitioning; see `reshape`. Also what else a resume may change: the lr schedule's kind (`schedule_kind`,
`saved_schedule`) and the global batch (`batch_note`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..config.run import ConfigError
from ..distributed import ds_patches
from ..distributed.world import World, barrier
from .checksums import write_sums
from .resume import LAYOUT, UNIVERSAL, is_own, saved_layout
from .trust import checkpoint_reads

SOURCE = "source.json"  # in a universal conversion: what the checkpoint it was made from held (`_stamp`)
LAYOUT_KEYS = ("dp_size", "tp_size", "pp_size", "sp_size", "zero_stage", "offload_optimizer", "offload_params")


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
    if is_own(path, run_dir):
        return path.with_name(path.name + UNIVERSAL)
    source = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    return run_dir / "checkpoints" / f"{path.name}.from-{source}{UNIVERSAL}"


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
