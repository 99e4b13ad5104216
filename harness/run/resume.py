"""A run's `checkpoints/` folder: its names, which checkpoint a resume takes, and the records each one holds.

Layout of `RUN/checkpoints/`:
    step_00000100/      DeepSpeed's files (model, optimizer, scheduler, loss scaler) + rng_rank*.pt
    latest              the name of the newest complete checkpoint
    best                with `train.select_best`: the name of the best one (kept whatever the rotation says)
`latest` never names a checkpoint half written (`step_N.partial`, `checkpoint.save`) or set aside (`step_N.bad`,
`rewind_latest`); `--resume auto` continues from the one it names (`resume_target`). Beside DeepSpeed's files each
checkpoint holds the small records `save` writes (layout, data, place in the data, parameter shapes), read here
(`saved_layout`, `saved_data`, `saved_place`, `saved_shapes`); its checksums are `checksums.py`'s.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..config.run import ConfigError, one_line
from ..distributed.world import World, all_gather_objects

LATEST = "latest"
BEST = "best"
BAD = ".bad"  # suffix of a checkpoint whose weights went bad (a non-finite stop): never resumed from, removed once a
# good checkpoint at a later step is saved
UNIVERSAL = ".universal"  # suffix of a checkpoint converted for another partitioning (`reshape`)
PAST = ".past"  # suffix of a checkpoint after the one its run went on from in its own directory (a branch it left):
# never resumed from, removed once the run saves at or past its step
LAYOUT = "layout.json"
DATA = "data.json"  # what the run trained on (a prepared corpus's fingerprint): a resume on other data is refused
PLACE = "place.json"  # the step and its place in the data (StepSampler.place): a resume's train.epochs counts from it
SHAPES = "parameters.json"  # the model's parameters by name and shape: a resume into a model of other code is refused


def is_own(path: Path, run_dir: Path) -> bool:
    """Whether checkpoint `path` is in `run_dir`'s own checkpoints/ (not another run's)."""
    return path.parent.resolve() == (run_dir / "checkpoints").resolve()


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_complete(path: Path) -> bool:
    return path.name.startswith("step_") and not path.name.endswith((".partial", BAD, UNIVERSAL, PAST))


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


def rewind_latest(root: Path, max_step: int, suffix: str = BAD) -> Path | None:
    """Point `latest` at the newest checkpoint at or before `max_step` (rank 0), e.g. past weights gone bad; the
    checkpoints after it are renamed `step_N` + `suffix` (`.bad`; `.past` for a branch left by a resume from an
    earlier checkpoint), so no resume ever takes them (`resume_target` names the bad ones)."""
    good = [p for p in complete(root) if step_of(p) <= max_step]
    for later in [p for p in complete(root) if step_of(p) > max_step]:
        aside = later.with_name(later.name + suffix)
        if aside.exists():  # set aside by an earlier stop at the same step: the newer one replaces it
            shutil.rmtree(aside)
        os.replace(later, aside)
        shutil.rmtree(later.with_name(later.name + UNIVERSAL), ignore_errors=True)  # made from the weights left
    if good:
        write_atomic(root / LATEST, good[-1].name + "\n")
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
                          f"cut short, damaged or missing; {resume_before(source)}") from None


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


def check_same_data(path: Path, data: dict | None, changed_ok: bool, settings=lambda: "") -> None:
    """Before launch: a checkpoint trained on a prepared corpus resumes on that corpus (its fingerprint), else the
    samples after it are not the uninterrupted run's; `changed_ok` (--data-changed-ok) says the user means it.
    `settings()`: the data settings that changed, said after the fingerprints (which alone do not say what)."""
    saved = saved_data(path)
    if saved is None:
        return  # saved without a prepared corpus (or before data.json existed)
    if (data or {}).get("fingerprint") != saved.get("fingerprint") and not changed_ok:  # moved is the same data
        now = f"{data['path']} (fingerprint {data['fingerprint']})" if data else "data that is no prepared corpus"
        raise ConfigError(f"--resume {path}: trained on {saved['path']} (fingerprint {saved['fingerprint']}), now "
                          f"{now}{settings()}: the steps after it would not read what the uninterrupted run read; "
                          f"pass --data-changed-ok to resume on the new data anyway")
    then, now = saved.get("windows"), (data or {}).get("windows")
    if then and now and then != now and not changed_ok:  # (recorded by the lm, whose place counts windows)
        raise ConfigError(f"--resume {path}: trained on windows of {then} tokens (data.seq_len {then - 1}), now "
                          f"{now} (data.seq_len {now - 1}): its place in the data, a count of windows, falls elsewhere "
                          f"in the text, which would be read twice or skipped; pass --data-changed-ok to resume anyway")


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
        of = f" of {max_steps}" if step <= max_steps else f" (past the {max_steps} steps this run asks for)"
        print(f"{run_dir}: the run {f'stopped early at step {step} ({early})' if early else f'finished at step {step}'}"
              f"{of} and exported {model}; nothing to do ({more}, --overwrite to train again)")
    return {"step": step, **(last[0] if last else {})}


def resume_before(path: Path) -> str:
    """Where to go on from, past checkpoint `path` that cannot be read (`latest` names it: --resume auto takes it)."""
    earlier = [p for p in complete(path.parent) if step_of(p) < step_of(path)]
    return f"the one before it is {earlier[-1]}: continue from it with --resume {earlier[-1]}" if earlier else \
        "there is none before it to resume from"
