"""The `harness launch` command (`main`): the checks before any process starts, then the job.

- The checks run here, without a process group: the plan for the launch's world size, precision and DeepSpeed
  file (`plan.resolve.make_plan`, `plan_launch`), a GPU for each process (`check_gpus_per_process`), and this
  machine and run directory (`run.startup.preflight`). Bad input prints one line and exits 2 before any rank starts.
- Then `accelerate launch` runs under `supervise` (`supervise.py`), its stderr relayed and kept (`relay.py`), and
  the job's end is said in one line, with the exit code (`ending.py`).
"""
from __future__ import annotations

import os
import sys

from ..config.run import ConfigError
from .ending import ending
from .settings import launch_settings, split_argv
from .supervise import supervise


def plan_launch(run_file: str | None, sets: list[str], ds_file: str | None, settings: dict):
    """The plan of a launch with `settings` (`launch_settings`): its world, precision and accelerate's DeepSpeed
    settings as the ranks will see them."""
    from ..plan.resolve import make_plan

    exported = dict(settings.get("env", {}))  # as accelerate will export them to the ranks
    if settings["deepspeed_config_file"]:
        exported["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = settings["deepspeed_config_file"]
    before = {k: os.environ.get(k) for k in exported}
    os.environ.update(exported)
    try:
        return make_plan(run_file, sets, ds_file, settings["num_processes"], settings["mixed_precision"])
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(train_args: list[str], settings: dict, parse):
    """Everything `harness train` checks before its process group, for this launch's world; `parse` reads `harness
    train`'s arguments as the command line does (the CLI's parser, which owns them)."""
    from ..run.startup import preflight

    args = parse(train_args)
    plan = plan_launch(args.run, args.set, args.ds, settings)
    if args.stop_at is not None and args.stop_at <= 0:
        raise ConfigError(f"--stop-at must be a positive step, got {args.stop_at}")
    preflight(plan, args.resume, args.overwrite, args.data_changed_ok, settings["machine_rank"], args.stop_at)
    return plan


def check_gpus_per_process(settings: dict) -> None:
    """A GPU for each process this machine starts, where it has GPUs: without, the ranks past the last GPU end in
    CUDA's "invalid device ordinal" (and two ranks on one GPU in NCCL's "Duplicate GPU detected")."""
    from ..run.machine import device_memory_bytes

    gpus = len(device_memory_bytes())
    if not gpus:
        return
    ids, visible = settings["gpu_ids"], os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = [v.strip() for v in (ids or visible or "").split(",") if v.strip()]  # MIG-... entries counted as they are
    seen = f"gpu_ids = {ids}" if ids else f"CUDA_VISIBLE_DEVICES = {visible}"
    if len(set(listed)) < len(listed):  # NCCL's "Duplicate GPU detected", once every rank has started
        raise ConfigError(f"harness launch: {seen} names a GPU twice: each process needs a GPU of its own")
    # nvidia-smi's count has CUDA_VISIBLE_DEVICES applied: numbers it lists past this machine's GPUs are not counted
    usable, seen = (gpus if not ids and all(v.isdigit() for v in listed) else len(listed), seen) if listed else \
        (gpus, "nvidia-smi")
    if settings["per_machine"] > usable:
        raise ConfigError(f"harness launch: {settings['per_machine']} processes on this machine and {usable} GPUs for "
                          f"them ({seen}): each process needs a GPU of its own; start {usable} per machine "
                          f"(num_processes is the total over all machines), give the job more GPUs, or run on the "
                          f"CPU with CUDA_VISIBLE_DEVICES=\"\"")


def main(argv: list[str], parse) -> int:
    """`harness launch ARGV`; `parse` reads `harness train`'s arguments (the CLI's parser, which owns them)."""
    accelerate_args, train_args = split_argv(argv)
    settings = launch_settings(accelerate_args)
    if settings["runner"]:  # its ranks are not this process's children: no signal, status or log reaches here
        raise ConfigError(f"harness launch: deepspeed_multinode_launcher = {settings['runner']} starts the other hosts' "
                          f"processes from this one, where harness launch cannot pass them signals or hear how they "
                          f"end; launch it with accelerate itself: rm -f .deepspeed_env; accelerate launch "
                          f"{' '.join(accelerate_args)} -m harness {' '.join(train_args)}")
    check_gpus_per_process(settings)
    plan = check(train_args, settings, parse)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, "-m", "harness", *train_args]
    print(f"harness launch: checks passed; accelerate launch {' '.join(accelerate_args)} -m harness "
          f"{' '.join(train_args)}", flush=True)
    code, reported, relay, stopped_by = supervise(cmd, settings)
    try:
        log = relay.save(plan.run_dir, settings["machine_rank"])
    except OSError:  # a full disk, an unwritable run directory: the job's output stays where it was written
        log = relay.path
    code, line, show = ending(code, reported, relay.held_text(), plan.run_dir, log, stopped_by)
    if show:
        sys.stderr.write(show)
    if line:
        print(line, file=sys.stderr, flush=True)
    return code
