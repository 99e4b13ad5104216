"""Checkpoints: atomic, the last K kept, resumable to the exact step: `save` and `load` (`load_onto`: converted first
where the layout changed), each rank's RNG with them, and the best checkpoint kept (`mark_best`, `adopt_best`).

A checkpoint is written as `step_N.partial`, renamed when every rank has finished, and only then named in
`latest`: a crash mid-write leaves a `.partial` directory that is never resumed from and is removed later.
The folder's names, which checkpoint a resume takes and the records each holds are `resume.py`'s; the checksums
checked before a checkpoint is read `checksums.py`'s; the conversion for another layout `reshape.py`'s; the
consolidated model export `export.py`'s.
The run directory must be on a file system that every node sees (as DeepSpeed's own checkpoints assume).
"""
from __future__ import annotations

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
from .checksums import damage, record_sums, verify
from .reshape import conversion_of, reshape, saved_schedule, schedule_kind, to_universal
from .resume import (
    BAD,
    BEST,
    DATA,
    LATEST,
    LAYOUT,
    PAST,
    PLACE,
    SHAPES,
    UNIVERSAL,
    complete,
    latest,
    resume_before,
    saved_layout,
    step_name,
    step_of,
    write_atomic,
)
from .trust import checkpoint_reads


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
        write_atomic(root / LATEST, name + "\n")
        if best is not None:
            mark_best(root, best)
        for old in complete(root)[:-keep]:
            if best is None or old.name != step_name(best):
                shutil.rmtree(old, ignore_errors=True)
                shutil.rmtree(old.with_name(old.name + UNIVERSAL), ignore_errors=True)
        # weights gone bad, or a branch left, at a step this run has now passed with good ones
        for aside in [*root.glob(f"step_*{BAD}"), *root.glob(f"step_*{PAST}")]:
            if step_of(aside) <= step:
                shutil.rmtree(aside, ignore_errors=True)
    barrier()
    if checksums:  # once the checkpoint is whole and named: a kill while hashing leaves it, read unchecked
        failed = record_sums(final, world)
        if failed and world.is_main:
            print(f"note: {name} has no checksums ({failed}): a resume reads it unchecked", flush=True)
    return final


def mark_best(root: Path, step: int) -> None:
    """Name the checkpoint of `step` in `best` (rank 0), if it was written."""
    if (root / step_name(step)).is_dir():
        write_atomic(root / BEST, step_name(step) + "\n")


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
                      f"in it is cut short, damaged or missing; {resume_before(path)}") from None
