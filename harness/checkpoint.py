"""Checkpoints: atomic, the last K kept, resumable to the exact step; and the consolidated model export.

Layout of `RUN/checkpoints/`:
    step_00000100/      DeepSpeed's files (model, optimizer, scheduler, loss scaler) + rng_rank*.pt
    latest              the name of the newest complete checkpoint
    best                with `train.select_best`: the name of the best one (kept whatever the rotation says)
A checkpoint is written as `step_N.partial`, renamed when every rank has finished, and only then named in
`latest`: a crash mid-write leaves a `.partial` directory that is never resumed from and is removed later.
The run directory must be on a file system that every node sees (as DeepSpeed's own checkpoints assume).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ConfigError
from .world import World, barrier

LATEST = "latest"
BEST = "best"
BAD = ".bad"  # suffix of a checkpoint whose weights went bad (a non-finite stop): never resumed from


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
    return path.name.startswith("step_") and not path.name.endswith((".partial", BAD))


def latest(root: Path) -> Path | None:
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if path.is_dir() else None


def complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step_*") if p.is_dir() and is_complete(p))


def rewind_latest(root: Path, max_step: int) -> Path | None:
    """Point `latest` at the newest checkpoint at or before `max_step` (rank 0), e.g. past weights gone bad; the
    checkpoints after it are renamed `step_N.bad`, so no resume ever takes them (`resume_target` names them)."""
    good = [p for p in complete(root) if step_of(p) <= max_step]
    for bad in [p for p in complete(root) if step_of(p) > max_step]:
        os.replace(bad, bad.with_name(bad.name + BAD))
    if good:
        _write_atomic(root / LATEST, good[-1].name + "\n")
    elif (root / LATEST).exists():
        (root / LATEST).unlink()
    return good[-1] if good else None


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_").split(".")[0])


def resume_target(root: Path) -> Path | None:
    """What `--resume auto` continues from in a run's `checkpoints/`: the one `latest` names; with `latest` missing
    or naming a checkpoint that is gone, the newest complete one. None for a run that saved nothing yet. Raises
    ConfigError rather than start over a run whose checkpoints exist but none can be resumed."""
    found = latest(root)
    if found is not None:
        return found
    marker, ready = root / LATEST, complete(root)
    named = marker.read_text().strip() if marker.is_file() else None
    if ready:
        why = f"`latest` names {named}, which is gone" if named else "`latest` is missing"
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


def save(engine, root: Path, step: int, client_state: dict[str, Any], world: World, keep: int,
         best: int | None = None) -> Path:
    """Collective: every rank calls it. `best`: the step of the best checkpoint (`train.select_best`), named in
    `best` and kept beside the last `keep`."""
    name = step_name(step)
    partial = root / f"{name}.partial"
    if world.is_main:
        for stale in root.glob("*.partial"):  # left by a crash
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    engine.save_checkpoint(str(root), tag=partial.name, client_state=client_state, save_latest=False)
    partial.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), partial / f"rng_rank{world.rank:05d}.pt")
    barrier()  # every rank's shards are on disk
    final = root / name
    if world.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / LATEST, name + "\n")
        if best is not None:
            mark_best(root, best)
        for old in complete(root)[:-keep]:
            if best is None or old.name != step_name(best):
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


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
    if world.is_main:
        if not own.is_dir():
            shutil.copytree(other, own)
        mark_best(root, step)
    barrier()


def load(engine, path: Path, world: World) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, loss scaler and this rank's RNG; returns the client state."""
    _, client_state = engine.load_checkpoint(str(path.parent), tag=path.name)
    if client_state is None:
        raise RuntimeError(f"{path}: DeepSpeed could not load this checkpoint")
    rng = path / f"rng_rank{world.rank:05d}.pt"
    if rng.exists():  # absent when resuming with more ranks than saved; data order is still exact
        set_rng_state(torch.load(rng, weights_only=False))
    return client_state
