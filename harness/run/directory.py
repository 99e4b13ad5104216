"""The run directory: one this process can write in, with room for the run's checkpoints and export
(`check_free_space`), told as a run's own before a start replaces it (`is_run_dir`, `never_trained`), and taken by
rank 0 with the resolved configs written into it (`prepare_run_dir`, `write_configs`); its lock is `lock.py`'s.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from ..config.run import ConfigError, flatten, read_toml, to_toml
from ..distributed.world import World
from ..plan.resolve import Plan
from .nodes import check_shared


def _nearest_existing(run_dir: Path) -> Path:
    """The run directory, or the nearest folder above it that exists (where it will be made)."""
    return next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())


def check_writable(run_dir: Path, described: str) -> None:
    """The run directory, or the nearest folder above it that exists, is a directory this process can write in."""
    existing = _nearest_existing(run_dir)
    if not existing.is_dir():
        raise ConfigError(f"{described}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{described}: cannot write in {existing}")
    if existing == run_dir:  # written in at start anyway; a probe in it is a file the other ranks' checks see
        return
    try:  # a folder made and removed: what access() grants root is not what /proc, /sys or a full quota allow
        os.rmdir(tempfile.mkdtemp(prefix=".harness-probe-", dir=existing))
    except OSError as e:
        raise ConfigError(f"{described}: cannot write in {existing} ({e.strerror or e})") from None


def checkpoint_bytes_per_param(plan: Plan) -> tuple[float, str]:
    """About what one DeepSpeed checkpoint holds per parameter, and how that adds up: the module's weights in the
    training precision (ZeRO-3 keeps them in the optimizer's shards), the fp32 master weights (where DeepSpeed keeps a
    copy: mixed precision or a ZeRO stage) and the optimizer's state (`config.ds_optim.state_bytes`). Measured
    checkpoints are 5 to 15% larger on toy models (file headers, RNG states), the same on large ones."""
    ds = plan.ds
    fp32 = ds.precision == "fp32" or ds.autocast  # autocast trains fp32 weights, with no master copy
    weights = 0 if ds.zero_stage == 3 else 4 if fp32 else 2
    master = 4 if not fp32 or ds.zero_stage >= 1 else 0
    state = ds.optimizer_state[0]
    parts = [f"{n:g} {what}" for n, what in ((weights, "weights"), (master, "fp32 master"), (state, "optimizer state"))
             if n]
    return weights + master + state, " + ".join(parts)


CONVERSION_FACTOR = 1.5  # a universal conversion's peak on disk over its source checkpoint (1.47x measured, ZeRO-2)


def _bytes_on_disk(directory: Path) -> int:
    """The size of the files under `directory` (a checkpoint)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def size(n: float) -> str:
    """Bytes in the unit that shows them (a small run on a small tmpfs is not "0.0 GiB needs 0.0 GiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def check_free_space(plan: Plan, n_params: int, resume_from: Path | None = None) -> str | None:
    """Why the file system of the run directory cannot hold this run's checkpoints and export, or None: the checkpoints
    it keeps (train.keep_checkpoints, one more while the next is written, the best with select_best) less the
    complete ones already there that it will keep (not set-aside `.bad` ones or `.universal` conversions), at least
    the next one, and the fp32 model.safetensors; and, for a resume onto another layout whose checkpoint is not
    converted yet, the universal conversion (`reshape.to_universal`: CONVERSION_FACTOR x that checkpoint while it
    is written, 1.05x once done, in this run's checkpoints)."""
    from . import reshape

    t = plan.run.cfg.train
    per, parts = checkpoint_bytes_per_param(plan)
    count = t.keep_checkpoints + 1 + bool(t.select_best)
    ckpts = plan.run_dir / "checkpoints"
    kept = sorted(ckpts.glob("step_*[0-9]"))[-(count - 1):] if ckpts.is_dir() else []  # rotated out, these free
    held = sum(map(_bytes_on_disk, kept))
    need = n_params * 4 + max(n_params * per, n_params * per * count - held)  # the next one is written in any case
    convert = 0
    if resume_from is not None and reshape.reshape(resume_from, plan.ds) and \
            not reshape.conversion_of(resume_from, plan.run_dir).is_dir():
        convert = CONVERSION_FACTOR * _bytes_on_disk(resume_from)
    free = shutil.disk_usage(_nearest_existing(plan.run_dir)).free
    if free >= need + convert:
        return None
    return (f"{plan.run.describe('run.output_dir')}: {size(free)} free on its file system; this run needs "
            f"about {size(need + convert)}: {count} checkpoints (train.keep_checkpoints = "
            f"{t.keep_checkpoints}, one more while the next is written{', the best' if t.select_best else ''}) of "
            f"{n_params:,} parameters x {per:g} bytes ({parts}), and the exported model"
            f"{', less the checkpoints already there' if held else ''}"
            f"{f', and {size(convert)} to convert {resume_from.name} for the new layout' if convert else ''}."
            f" Free space, lower train.keep_checkpoints or choose another run.output_dir")


# What a run writes in its directory: one holding nothing else is a run's, whatever state a crash left it in
RUN_FILES = {"config.toml", "ds_config.json", "metrics.jsonl", "eval.jsonl", "eval.json", "best.json", "checkpoints",
             "model.safetensors", "hf", "data", "curves.png", "profile.json", "deepspeed.log", "launch.log", ".lock",
             ".ranks", ".nodes", "tensorboard", "wandb"}


def is_run_dir(path: Path) -> bool:
    """A directory a run wrote: its config.toml (the first file it writes), or only files a run writes (a crash or
    an interrupted --overwrite can leave any of them without it)."""
    return (path / "config.toml").is_file() or \
        all(p.name in RUN_FILES or p.name.startswith("launch_node") for p in path.iterdir())


# What a start writes before its first step (its configs, logs, RUN/data/'s tokenizer, a tracker's first files)
START_FILES = {"config.toml", "ds_config.json", "deepspeed.log", "launch.log", ".lock", ".ranks", ".nodes", "data",
               "tensorboard", "wandb"}


def never_trained(plan: Plan) -> bool:
    """Whether the run directory holds a start that never trained a step and nothing else: the config.toml a start
    writes first, naming this directory, beside start-up files alone, and nothing the run names (its data, a model,
    a file of its own settings) under it. A new start replaces it without --overwrite (a start refused by its data
    once its configs were written, say)."""
    run_dir = plan.run_dir.resolve()
    try:
        named = Path(read_toml(run_dir / "config.toml")["run"]["output_dir"]).resolve()
    except (ConfigError, OSError, KeyError, TypeError):
        return False

    def strings(value) -> list[str]:
        return [value] if isinstance(value, str) else [s for v in value for s in strings(v)] \
            if isinstance(value, (list, tuple)) else []

    def under(text: str) -> bool:
        try:
            return run_dir in Path(text).resolve().parents
        except (OSError, ValueError):  # not a path (a NUL in it)
            return False

    given = [s for k, v in flatten(plan.run.cfg.to_dict()).items() if k != "run.output_dir" for s in strings(v)]
    return named == run_dir and all(p.name in START_FILES or p.name.startswith("launch_node")
                                    for p in run_dir.iterdir()) and not any(under(s) for s in given if s)


def check_replaceable(plan: Plan, overwrite: bool) -> None:
    """A run directory that holds something, started anew: only with --overwrite, which deletes it, so only a run's
    own, never a folder named by mistake."""
    run_dir = plan.run_dir
    if not overwrite:
        raise ConfigError(f"{run_dir}: run directory exists and is not empty; pass --resume auto to continue "
                          f"it, --overwrite to replace it (in Python: resume=\"auto\", overwrite=True), or set "
                          f"run.output_dir")
    if not is_run_dir(run_dir):
        names = sorted(p.name for p in run_dir.iterdir()  # (a run's own: not named)
                       if p.name not in RUN_FILES and not p.name.startswith("launch_node"))
        held = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"{plan.run.describe('run.output_dir')}: --overwrite replaces a run directory, and "
                          f"{run_dir} is not one (no config.toml, and it holds {held}, which a run does not write): it "
                          f"was left as it is; set run.output_dir to a new directory or a run's")


def prepare_run_dir(plan: Plan, world: World, resume_from: Path | None, overwrite: bool):
    """Rank 0 takes the run directory's lock (`lock.py`; returned, None on other ranks) and, for a new run, writes the
    resolved configs (a resume writes them once it knows it will train: `write_configs`); an --overwrite clears the
    old run first, as a new run clears the start-up files of one that never trained a step (`never_trained`).
    Collective: a lock taken meanwhile by another run is refused on every rank."""
    from ..distributed.world import all_gather_objects
    from .lock import Lock

    held, error = None, None
    if world.is_main:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            held = Lock(plan.run_dir)
        except ConfigError as e:
            error = str(e)
        # cleared once it is ours (a run that started meanwhile holds the lock, and this one is refused above)
        if held and resume_from is None and (overwrite or never_trained(plan)):
            for old in plan.run_dir.iterdir():
                if old != held.path:
                    shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    error = all_gather_objects(error)[0]
    if error:
        raise ConfigError(error)
    try:  # the lock is let go of whatever fails from here (a later train() in this process takes it again)
        if resume_from is None:  # first: what tells a run directory (`is_run_dir`, `harness launch`'s launch.log)
            write_configs(plan, world, None)
        if world.is_main and world.library_output:  # DeepSpeed's own lines at start-up: kept, out of the terminal
            with open(plan.run_dir / "deepspeed.log", "a") as f:  # each start's under a line saying when
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n{world.library_output}")
        check_shared(plan, world)
    except BaseException:
        if held:
            held.release()
        raise
    return held


def write_configs(plan: Plan, world: World, resume_from: Path | None) -> None:
    """Rank 0 writes the resolved configs: a new run's at once, a resume's once it will train (a resume of a finished
    run leaves its record as it was; a checkpoint loaded has read its own run's ds_config.json), saying what the
    resume changed."""
    from ..plan.render import ds_json

    if not world.is_main:
        return
    saved = plan.run_dir / "config.toml"
    if resume_from is not None and saved.exists():
        old = flatten(read_toml(saved))
        changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in flatten(plan.run.cfg.to_dict()).items()
                   if old.get(k) != v]
        if changed:
            print(f"note: the config differs from the saved run's: {'; '.join(changed)}", flush=True)
    saved.write_text(to_toml(plan.run.cfg))
    # in full: the optimizer and scheduler the run trains with too
    (plan.run_dir / "ds_config.json").write_text(ds_json(plan) + "\n")
