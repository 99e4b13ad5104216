"""`harness launch`: check a training run before any process starts, then `accelerate launch` it, and exit with the
harness's own codes (0 done, 2 bad input, 3 non-finite stop, 4 a rank stopped answering, 75 stopped by a signal
with a checkpoint).

    harness launch --config_file launch/cpu_2proc.yaml train --run RUN.toml --ds configs/ds/zero2.json

Everything before `train` is `accelerate launch`'s, passed on as given; everything from `train` on is
`harness train`'s. Why a front end: under a bare `accelerate launch` every rank starts before a bad value is
found, and torchrun reports any non-zero rank as its multi-line ChildFailedError and exits 1, so a scheduler
script cannot tell bad input from a crash from a preemption.

- The checks run here, without a process group: the plan for the launch's world size, precision and DeepSpeed
  file (`plan.resolve.make_plan`), and this machine and run directory (`run.startup.preflight`). Bad input prints one line
  and exits 2 before any rank starts.
- The ranks report how they ended to a file this process names (STATUS_ENV). A stop that every rank makes
  together (a non-finite loss, a signal) then exits 0 under torchrun, so it prints no failure report, and
  `harness launch` exits with the code the file gives.
- SIGTERM, SIGINT and SIGUSR1 to this process go straight to the ranks (the launcher runs in its own session, so
  a terminal's Ctrl-C reaches it only through here): the ranks finish their step and save a checkpoint
  (`preemption.py`) with no launcher deadline. A signal sent to torchrun itself also reaches the ranks, but
  torchrun kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (default 30).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .config.run import ConfigError
from .run.preemption import EXIT_PREEMPTED, SIGNALS

STATUS_ENV = "HARNESS_STATUS_FILE"
COLLECTIVE_STOPS = (3, EXIT_PREEMPTED)  # every rank stops at the same step: safe to exit 0 under torchrun


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch's options, harness train's arguments from `train` on)."""
    if "train" not in argv:
        raise ConfigError("harness launch: name what to run after accelerate's options: harness launch "
                          "[ACCELERATE OPTIONS] train --run RUN.toml [--ds DS.json] ...")
    i = argv.index("train")
    return argv[:i], argv[i:]


def launch_settings(accelerate_args: list[str]) -> dict:
    """What the launch will be, as accelerate reads it: its options over its config file (default: accelerate's
    default config, where there is one)."""
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.exit_on_error = False
    try:
        args = parser.parse_args([*accelerate_args, "-m", "harness"])
    except (SystemExit, Exception) as e:  # noqa: BLE001 - argparse's own message is already printed
        raise ConfigError(f"harness launch: accelerate launch refuses {' '.join(accelerate_args)}: {e}") from e
    file = args.config_file or (default_config_file if Path(default_config_file).is_file() else None)
    saved = {}
    if file:
        from accelerate.commands.config.config_args import load_config_from_file

        if not Path(file).is_file():
            raise ConfigError(f"harness launch: --config_file {file}: no such file")
        saved = load_config_from_file(file).to_dict()
    ds = saved.get("deepspeed_config") or {}
    processes = args.num_processes if args.num_processes is not None else saved.get("num_processes", 1)
    if not isinstance(processes, int) or processes < 1:  # accelerate would start torchrun with it and fail inside
        where = "--num_processes" if args.num_processes is not None else f"num_processes in {file}"
        raise ConfigError(f"harness launch: {where} = {processes}: must be 1 or more (the processes on each machine)")
    return {"num_processes": processes,
            "mixed_precision": (args.mixed_precision or saved.get("mixed_precision") or "no").lower(),
            "deepspeed_config_file": args.deepspeed_config_file or ds.get("deepspeed_config_file"),
            "env": _deepspeed_env(args)}


def _deepspeed_env(args) -> dict[str, str]:
    """The ACCELERATE_* variables of DeepSpeed that accelerate will give each rank (its config file's deepspeed_config
    and its --use_deepspeed/--zero_stage/... flags) and its PARALLELISM_CONFIG_* ones (--use_parallelism_config),
    computed by accelerate's own code as `accelerate launch` does (accelerate/commands/launch.py, `launch_command`);
    {} where the launch uses neither."""
    from accelerate.commands.launch import _validate_launch_command
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    try:
        args, defaults, _ = _validate_launch_command(args)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"harness launch: accelerate launch refuses its settings: {e}") from None
    env = {}
    if getattr(args, "use_parallelism_config", False):  # its sequence-parallel size (config/accelerate.py)
        from accelerate.utils.launch import prepare_extend_env_parallelism_config

        env = prepare_extend_env_parallelism_config(args, {})
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config.keys() if defaults else [])
        env.update(prepare_deepspeed_cmd_env(args)[1])
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_"))}


def check(train_args: list[str], settings: dict, parse) -> None:
    """Everything `harness train` checks before its process group, for this launch's world; `parse` reads `harness
    train`'s arguments as the command line does (the CLI's parser, which owns them)."""
    from .plan.resolve import make_plan
    from .run.startup import preflight

    args = parse(train_args)
    exported = dict(settings.get("env", {}))  # as accelerate will export them to the ranks
    if settings["deepspeed_config_file"]:
        exported["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = settings["deepspeed_config_file"]
    before = {k: os.environ.get(k) for k in exported}
    os.environ.update(exported)
    try:
        plan = make_plan(args.run, args.set, args.ds, settings["num_processes"], settings["mixed_precision"])
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if args.stop_at is not None and args.stop_at <= 0:
        raise ConfigError(f"--stop-at must be a positive step, got {args.stop_at}")
    preflight(plan, args.resume, args.overwrite)


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone while we looked
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def main(argv: list[str], parse) -> int:
    """`harness launch ARGV`; `parse` reads `harness train`'s arguments (the CLI's parser, which owns them)."""
    accelerate_args, train_args = split_argv(argv)
    check(train_args, launch_settings(accelerate_args), parse)
    fd, status = tempfile.mkstemp(prefix="harness-status-", suffix=".json")
    os.close(fd)
    env = {**os.environ, STATUS_ENV: status,
           # torchrun forwards SIGUSR1 too, should the scheduler signal it rather than this process
           "PET_SIGNALS_TO_HANDLE": os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, "-m", "harness", *train_args]
    print(f"harness launch: checks passed; accelerate launch {' '.join(accelerate_args)} -m harness "
          f"{' '.join(train_args)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, frame) -> None:
        ranks = [p for p in descendants(proc.pid) if _is_rank(p)]
        for pid in ranks or [proc.pid]:  # before the ranks exist, the launcher ends what it started
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    before = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        code = _wait(proc, Path(status))
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    try:
        reported = json.loads(Path(status).read_text() or "{}")
    finally:
        os.unlink(status)
    return reported.get("code", code)


def _wait(proc: subprocess.Popen, status: Path, grace_s: float = 5.0) -> int:
    """The launcher's exit code. Once a rank reports a hung rank (heartbeat.py), the ranks still there get
    `grace_s` to end, then SIGKILL: a stopped process cannot take torchrun's SIGTERM, and torchrun would wait 30 s
    before its own SIGKILL."""
    from .run.heartbeat import EXIT_HUNG

    hung_at = None
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if hung_at is None and f'"code": {EXIT_HUNG},' in status.read_text():
            hung_at = time.monotonic()
        if hung_at is not None and time.monotonic() - hung_at > grace_s:
            for pid in [p for p in descendants(proc.pid) if _is_rank(p)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            hung_at = float("inf")  # once


def _is_rank(pid: int) -> bool:
    """A rank runs `python -m harness train` (the launcher's own helpers do not)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"harness" in argv and b"train" in argv and b"accelerate.commands.launch" not in argv


def report(code: int, message: str) -> int:
    """In a rank: record how it ended for `harness launch` (local rank 0 writes) and return its exit code: 0 for a
    stop every rank made together, so torchrun prints no failure report; the code itself otherwise."""
    status = os.environ.get(STATUS_ENV)
    if not status:
        return code
    path = Path(status)
    if os.environ.get("LOCAL_RANK", "0") == "0" or not path.read_text():  # local rank 0, or the first to end
        path.write_text(json.dumps({"code": code, "message": message}))
    return 0 if code in COLLECTIVE_STOPS else code
