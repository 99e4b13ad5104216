"""Everything between the command line and the first step: resolve, preflight, run directory, engine.

`preflight` runs before any process group exists, so bad input ends with one line and exit code 2 on every
rank instead of a stack trace on rank 7. Parallelism is applied to the model in `parallel.py`.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, Resolved, check_training_length, flatten, read_toml, resolve, to_toml
from .ds_config import DSResolved, resolve_ds
from .tasks import Task, get_task
from .world import World, accelerate_mixed_precision, launched_world_size, quiet_deepspeed

CPU_FP16_ENV = "HARNESS_CPU_FP16"


@dataclass(frozen=True)
class Plan:
    run: Resolved
    ds: DSResolved
    task: Task
    run_dir: Path


def ds_file_arg(ds_file: str | None) -> str | None:
    """--ds, else the DeepSpeed file named in the accelerate launch config (deepspeed_config_file)."""
    from_accelerate = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if ds_file and from_accelerate and Path(ds_file).resolve() != Path(from_accelerate).resolve():
        raise ConfigError(f"--ds {ds_file} contradicts the accelerate launch config's deepspeed_config_file "
                          f"{from_accelerate}; name one")
    return ds_file or from_accelerate


def make_plan(run_file: str | None, overrides: list[str], ds_file: str | None, world_size: int | None = None,
              accel_precision: str | None = None) -> Plan:
    run = resolve(run_file, overrides)
    check_training_length(run.cfg)
    task = get_task(run.cfg.run.task)
    task.check(run.cfg)
    if run.cfg.data.bucket and not hasattr(task, "lengths"):
        raise ConfigError(f"{run.describe('data.bucket')}: task {run.cfg.run.task!r} has samples of one length; "
                          f"bucketing them changes nothing, set it to 0")
    ds = resolve_ds(run, ds_file_arg(ds_file), world_size or launched_world_size(),
                    accel_precision or accelerate_mixed_precision())
    if run.cfg.train.activation_checkpointing and ds.layout.pp_size > 1:
        raise ConfigError(f"{run.describe('train.activation_checkpointing')} with a pipeline: set "
                          f"pipeline.activation_checkpoint_interval in the DeepSpeed config instead")
    return Plan(run, ds, task, Path(run.cfg.run.output_dir))


def check_device(ds: DSResolved) -> None:
    quiet_deepspeed()
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if ds.precision == "fp16" and not acc.is_fp16_supported():
        if os.environ.get(CPU_FP16_ENV) == "1" and acc.device_name() == "cpu":
            acc.is_fp16_supported = lambda: True  # opted in: fp16 math runs on this CPU, only slowly
        else:
            raise ConfigError(f"fp16 is not supported on this {acc.device_name()} (DeepSpeed's check); use a bf16 "
                              f"or fp32 config, or set {CPU_FP16_ENV}=1 to run fp16 slowly on a CPU for testing")
    if ds.precision == "bf16" and not acc.is_bf16_supported():
        raise ConfigError(f"bf16 is not supported on this {acc.device_name()}; use an fp16 or fp32 config")


def preflight(plan: Plan, resume: str | None, overwrite: bool) -> Path | None:
    """Checks of this machine that need no process group. Returns the checkpoint to resume from, if any."""
    check_device(plan.ds)
    from . import checkpoint

    run_dir = plan.run_dir
    if resume and resume != "auto":
        path = Path(resume)
        found = checkpoint.latest(path / "checkpoints") or checkpoint.latest(path) or (
            path if path.is_dir() and checkpoint.is_complete(path) else None)
        if found is None:
            raise ConfigError(f"--resume {resume}: no checkpoint there (expected a run directory, its "
                              f"checkpoints/ folder, or a step_* checkpoint)")
        return found
    if resume == "auto":
        return checkpoint.latest(run_dir / "checkpoints")
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{run_dir}: run directory exists and is not empty; pass --resume auto to continue "
                          f"it, --overwrite to replace it, or set run.output_dir")
    return None


def prepare_run_dir(plan: Plan, world: World, resume_from: Path | None, overwrite: bool) -> None:
    """Rank 0 writes the resolved configs; an --overwrite clears the old run first."""
    from .world import barrier

    if world.is_main:
        if overwrite and resume_from is None and plan.run_dir.exists():
            shutil.rmtree(plan.run_dir)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        saved = plan.run_dir / "config.toml"
        if resume_from is not None and saved.exists():
            old = flatten(read_toml(saved))
            changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in flatten(plan.run.cfg.to_dict()).items()
                       if old.get(k) != v]
            if changed:
                print(f"note: the config differs from the saved run's: {'; '.join(changed)}", flush=True)
        saved.write_text(to_toml(plan.run.cfg))
        (plan.run_dir / "ds_config.json").write_text(json.dumps(plan.ds.config, indent=2) + "\n")
    barrier()
