"""`harness launch`: check a training run before any process starts, then `accelerate launch` it, and exit with the
harness's own codes (0 done, 2 bad input, 3 non-finite stop, 4 a rank stopped answering, 75 stopped by a signal
with a checkpoint).

    harness launch --config_file launch/cpu_2proc.yaml train --run RUN.toml --ds configs/ds/zero2.json

Everything before `train` is `accelerate launch`'s, passed on as given; everything from `train` on is
`harness train`'s. Why a front end: under a bare `accelerate launch` every rank starts before a bad value is
found, and torchrun reports any non-zero rank as its multi-line ChildFailedError and exits 1, so a scheduler
script cannot tell bad input from a crash from a preemption.

- The checks run here, without a process group: the plan for the launch's world size, precision and DeepSpeed
  file (`plan.resolve.make_plan`), and this machine and run directory (`run.startup.preflight`). Bad input prints
  one line and exits 2 before any rank starts.
- The ranks report how they ended to a file this process names (STATUS_ENV). A stop that every rank makes
  together (a non-finite loss, a signal) then exits 0 under torchrun, so it prints no failure report, and
  `harness launch` exits with the code the file gives.
- SIGTERM, SIGINT and SIGUSR1 to this process go straight to the ranks (the launcher runs in its own session, so
  a terminal's Ctrl-C reaches it only through here): the ranks finish their step and save a checkpoint
  (`preemption.py`) with no launcher deadline. A signal sent to torchrun itself also reaches the ranks, but
  torchrun kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (default 30).
- How the job ended is one line (`ending`): the ranks' own report where they made one (which the ranks leave to
  this process to print), else torchrun's root cause read from its failure report (a rank killed by a signal,
  or one that failed on its own). torchrun's tracebacks, its failure report and the ranks' tracebacks from the
  moment the job started failing are held back from the terminal (`Relay`) and kept, with everything else the
  job wrote to stderr, in `RUN/launch.log`; only a failure nobody explained shows the ranks' tracebacks.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .config.run import ConfigError, closest
from .distributed.world import STATUS_ENV
from .run.preemption import EXIT_PREEMPTED, SIGNALS

COLLECTIVE_STOPS = (3, EXIT_PREEMPTED)  # every rank stops at the same step: safe to exit 0 under torchrun


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch's options, harness train's arguments from the word `train` on): the first `train` that is
    no option's value (`--role train` is accelerate's)."""
    from accelerate.commands.launch import launch_command_parser

    valued = {o for a in launch_command_parser()._actions if a.nargs != 0 for o in a.option_strings}
    for i, word in enumerate(argv):
        if word == "train" and not (i and argv[i - 1] in valued):
            return argv[:i], argv[i:]
    raise ConfigError("harness launch: name what to run after accelerate's options: harness launch "
                      "[ACCELERATE OPTIONS] train --run RUN.toml [--ds DS.json] ...")


LAUNCH = "harness launch"  # it refuses DeepSpeed's launchers that start other hosts' ranks (REMOTE), hostfile or not


def launch_settings(accelerate_args: list[str], who: str = LAUNCH) -> dict:
    """What the launch will be, as accelerate reads it: its options over its config file (default: accelerate's
    default config, where there is one). `who` names the command in errors."""
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    from .config.accelerate import PARALLELISM_KEYS, SP_FORM, read_config

    parser = launch_command_parser()

    def refuse(message: str):  # argparse's error, without its usage text and exit: one line
        options = [o for a in parser._actions for o in a.option_strings]
        unknown = [w for w in accelerate_args if w.startswith("--") and w.split("=")[0] not in options]
        close = closest(unknown[0].split("=")[0], options) if unknown and message.startswith("unrecognized") else None
        hint = f"; did you mean {close}?" if close else ""
        raise ConfigError(f"{who}: accelerate launch refuses {' '.join(accelerate_args)}: {message}{hint}")

    parser.error = refuse
    args = parser.parse_args([*accelerate_args, "-m", "harness"])
    given = dict(vars(args))  # the command line's own values: accelerate fills in args from its file
    file = args.config_file or (default_config_file if Path(default_config_file).is_file() else None)
    raw, saved = read_config(file, who) if file else ({}, {})

    def where(name: str) -> str:  # where a setting came from, for a refusal
        return f"--{name}" if given.get(name) is not None else f"{name} in {file}" if name in raw or name in (
            raw.get("deepspeed_config") or {}) else f"{name} (accelerate's default)"

    ds = saved.get("deepspeed_config") or {}
    processes = args.num_processes if args.num_processes is not None else saved.get("num_processes", 1)
    if not isinstance(processes, int) or processes < 1:  # accelerate would start torchrun with it and fail inside
        raise ConfigError(f"{who}: {where('num_processes')} = {processes}: must be 1 or more (the processes of all "
                          f"machines together)")
    precision = args.mixed_precision if args.mixed_precision is not None else saved.get("mixed_precision", "no")
    if precision.lower() not in ("no", "fp16", "bf16"):  # fp8: accelerate fails with a traceback without its libraries
        raise ConfigError(f"{who}: {where('mixed_precision')} = {precision!r}: the harness runs DeepSpeed in no, fp16 "
                          f"or bf16; use no and choose the precision in the DeepSpeed file")
    args, defaults = _validated(args, who)
    _check_machines(args, processes, where, who)
    asked = [f"--{k}" for k in sorted(PARALLELISM_KEYS) if given.get(k) != parser.get_default(k)] + \
        [f"parallelism_config in {file}"] * bool(raw.get("parallelism_config"))
    if asked and not args.use_parallelism_config:  # accelerate would launch without them, saying nothing
        raise ConfigError(f"{who}: {', '.join(asked)} would be ignored: accelerate takes parallelism settings only "
                          f"from a config file that has them, with no launch type (--use_deepspeed, --multi_gpu, ...) "
                          f"on the command line; with DeepSpeed write {SP_FORM}")
    machines = 1 if args.num_machines is None else args.num_machines
    gpu_ids = str(args.gpu_ids or "all").strip()
    return {"num_processes": processes, "machine_rank": args.machine_rank or 0, "mixed_precision": precision.lower(),
            "per_machine": processes // machines, "gpu_ids": None if gpu_ids == "all" else gpu_ids,
            "deepspeed_config_file": given["deepspeed_config_file"] or ds.get("deepspeed_config_file"),
            "env": _deepspeed_env(args, defaults, who),
            # DeepSpeed's launchers that start other hosts' ranks from this one (over ssh, mpirun or srun)
            "runner": launcher if machines > 1 and (launcher := _multinode_launcher(args)) in REMOTE else False}


REMOTE = ("pdsh", "openmpi", "mpich", "impi", "mvapich", "slurm")  # DeepSpeed's (standard, nossh: each node its own)


def _multinode_launcher(args) -> str | None:
    """The launcher DeepSpeed starts several machines with (accelerate's default pdsh); None without DeepSpeed."""
    return (args.deepspeed_multinode_launcher or "pdsh") if args.use_deepspeed else None


def _validated(args, who: str):
    """(args, the config file's settings) as accelerate launch completes and checks them (accelerate/commands/launch.py,
    `_validate_launch_command`)."""
    from accelerate.commands.launch import _validate_launch_command

    from .config.accelerate import SP_FORM

    try:  # its note on defaults it chose goes to the terminal when accelerate launch itself runs, not twice
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, defaults, _ = _validate_launch_command(args)
    except (ValueError, TypeError) as e:
        hint = f" With DeepSpeed, write {SP_FORM}." if "--use_parallelism_config" in str(e) else ""
        raise ConfigError(f"{who}: accelerate launch refuses its settings: {str(e).strip()}{hint}") from None
    return args, defaults


def _check_machines(args, processes: int, where, who: str) -> None:
    """A launch over several machines that could not start as planned: accelerate (1.15, utils/launch.py) starts
    num_processes // num_machines processes on each, and its torchrun meets at main_process_ip."""
    machines, rank = 1 if args.num_machines is None else args.num_machines, args.machine_rank or 0
    if not isinstance(machines, int) or machines < 1:
        raise ConfigError(f"{who}: {where('num_machines')} = {machines}: must be 1 or more")
    if not 0 <= rank < machines:
        raise ConfigError(f"{who}: {where('machine_rank')} = {rank} with {where('num_machines')} = {machines}: must be "
                          f"{'0' if machines == 1 else f'0 to {machines - 1}'}")
    if processes % machines:
        raise ConfigError(f"{who}: {where('num_processes')} = {processes} is not a multiple of {where('num_machines')} "
                          f"= {machines}: it is the total over all machines, and accelerate would start "
                          f"{processes // machines} on each")
    port = args.main_process_port
    if port is not None and not 0 <= port <= 65535:  # torchrun's ValueError, from inside the launch
        raise ConfigError(f"{who}: {where('main_process_port')} = {port}: a port is 0 to 65535")
    # DeepSpeed's own multi-node launchers (pdsh, accelerate's default, nossh and the MPI ones) read the hosts from
    # the hostfile, and find the first one's address over ssh where none is given (nossh too); torchrun's
    # rendezvous, static or c10d, waits (900 s) for a host named None
    launcher = _multinode_launcher(args)
    each_node = launcher in (None, "standard", "nossh")  # a launch on every machine (pdsh and MPI: one, from here)
    if machines > 1 and launcher not in (None, "standard") and not (who == LAUNCH and launcher in REMOTE):
        _check_hostfile(args.deepspeed_hostfile, machines, processes // machines, args, where, who)
    if machines > 1 and not args.main_process_ip and each_node:
        raise ConfigError(f"{who}: {where('num_machines')} = {machines} needs --main_process_ip (or main_process_ip in "
                          f"the config file): the address of machine rank 0, where the ranks meet")
    if machines > 1 and port == 0 and each_node:  # each machine would pick a free port of its own, and never meet
        raise ConfigError(f"{who}: {where('main_process_port')} = 0 (a free port picked on each machine) with "
                          f"{machines} machines: they would each wait at a port of their own; name one port")
    if machines > 1 and rank > 0 and each_node:  # an address no machine answers to: c10d's warnings, then a timeout
        try:
            socket.getaddrinfo(args.main_process_ip, None)
        except OSError as e:
            raise ConfigError(f"{who}: {where('main_process_ip')} = {args.main_process_ip!r}: no such host from this "
                              f"machine ({e.strerror or e})") from None


HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's (launcher/runner.py, _parse_hostfile, 0.14-0.19)


def _check_hostfile(path, machines: int, per_machine: int, args, where, who: str) -> None:
    """DeepSpeed's launchers take the world from the hostfile, whatever num_machines says: without one it trains
    on this machine alone, with more hosts on all of them; a host's slots are not checked against --num_gpus."""
    named = f"{where('deepspeed_hostfile')} = {path}"
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except (OSError, TypeError) as e:
        raise ConfigError(f"{who}: {named}: cannot read it ({getattr(e, 'strerror', None) or e}); DeepSpeed would "
                          f"train on this machine alone") from None
    hosts: dict[str, int] = {}
    for line in (x for x in lines if x and not x.startswith("#")):
        match = HOST_LINE.match(line)
        if not match or match.group(1) in hosts:
            why = "a second line for its host" if match else "not HOST slots=N"
            raise ConfigError(f"{who}: {named}: line {line!r} is {why}")
        hosts[match.group(1)] = int(match.group(2))
    filtered = args.deepspeed_inclusion_filter or args.deepspeed_exclusion_filter
    if not filtered and len(hosts) != machines:
        raise ConfigError(f"{who}: {named} lists {len(hosts)} host(s), {where('num_machines')} = {machines}: DeepSpeed "
                          f"starts ranks on every host it lists")
    short = {h: n for h, n in hosts.items() if n < per_machine}
    if short and not filtered:
        raise ConfigError(f"{who}: {named} gives {', '.join(f'{h} slots={n}' for h, n in short.items())}, fewer than "
                          f"the {per_machine} processes each machine starts (num_processes / num_machines)")


def _deepspeed_env(args, defaults, who: str) -> dict[str, str]:
    """The ACCELERATE_* variables of DeepSpeed that accelerate will give each rank (its config file's deepspeed_config
    and its --use_deepspeed/--zero_stage/... flags) and its PARALLELISM_CONFIG_* ones (its config file's
    parallelism_config), computed by accelerate's own code as `accelerate launch` does (accelerate/commands/launch.py,
    `launch_command`); {} where the launch uses neither."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    env = {}
    if getattr(args, "use_parallelism_config", False):  # its sequence-parallel size (config/accelerate.py)
        from accelerate.utils.launch import prepare_extend_env_parallelism_config

        env = prepare_extend_env_parallelism_config(args, {})
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config.keys() if defaults else [])
        try:
            env.update(prepare_deepspeed_cmd_env(args)[1])
        except ConnectionError as e:  # machine rank 0 of several: its main_process_port is taken
            raise ConfigError(f"{who}: accelerate launch refuses its settings: {e}") from None
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_"))}


def launch_options(argv: list[str], own: set[str]) -> tuple[list[str], list[str]]:
    """`harness plan`'s arguments split into accelerate launch's options (as `harness launch` takes them before
    `train`) and the rest: an option accelerate's parser knows and `own` does not, with its value, is accelerate's."""
    if all(a.split("=")[0] in own for a in argv if a.startswith("-")):
        return [], argv  # accelerate not imported: a plain plan stays quick
    from accelerate.commands.launch import launch_command_parser

    takes = {o: a.nargs != 0 for a in launch_command_parser()._actions for o in a.option_strings
             if o not in own and o not in ("-m", "--module")}
    accelerate, rest, i = [], [], 0
    while i < len(argv):
        name = argv[i].split("=")[0]
        if name in takes:
            value = takes[name] and "=" not in argv[i] and i + 1 < len(argv)
            accelerate += argv[i:i + 1 + value]
            i += 1 + value
        else:
            rest.append(argv[i])
            i += 1
    return accelerate, rest


def plan_launch(run_file: str | None, sets: list[str], ds_file: str | None, settings: dict):
    """The plan of a launch with `settings` (`launch_settings`): its world, precision and accelerate's DeepSpeed
    settings as the ranks will see them."""
    from .plan.resolve import make_plan

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
    from .run.startup import preflight

    args = parse(train_args)
    plan = plan_launch(args.run, args.set, args.ds, settings)
    if args.stop_at is not None and args.stop_at <= 0:
        raise ConfigError(f"--stop-at must be a positive step, got {args.stop_at}")
    preflight(plan, args.resume, args.overwrite, args.data_changed_ok, settings["machine_rank"])
    return plan


def check_gpus_per_process(settings: dict) -> None:
    """A GPU for each process this machine starts, where it has GPUs: without, the ranks past the last GPU end in
    CUDA's "invalid device ordinal" (and two ranks on one GPU in NCCL's "Duplicate GPU detected")."""
    from .run.machine import device_memory_bytes

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
    code, reported, relay, stopped_by = _supervise(cmd, settings)
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


def _supervise(cmd: list[str], settings: dict) -> tuple[int, dict, Relay, int | None]:
    """Run accelerate launch, passing signals on to the ranks and relaying their stderr; its exit code, what the
    ranks reported, the relay, and the first signal passed on (None when the job was not being stopped)."""
    fd, status = tempfile.mkstemp(prefix="harness-status-", suffix=".json")
    os.close(fd)
    env = _launch_env(settings, status)
    fd, captured = tempfile.mkstemp(prefix="harness-launch-", suffix=".log")
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=fd, preexec_fn=_ending_with(os.getpid()))
    finally:
        os.close(fd)
    relay = Relay(Path(captured), sys.stderr.buffer)

    got: list[int] = []  # the signals this process passed on: the job was being stopped

    def forward(signum, frame) -> None:
        got.append(signum)
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
        relay.finish()
    try:
        reported = json.loads(Path(status).read_text() or "{}")
    except ValueError:  # a rank killed while writing it
        reported = {}
    finally:
        os.unlink(status)
    return code, reported, relay, got[0] if got else None


def _launch_env(settings: dict, status: str) -> dict[str, str]:
    """accelerate launch's environment: where the ranks report how they ended (`status`), and what torchrun does."""
    env = {**os.environ, STATUS_ENV: status,
           # torchrun forwards SIGUSR1 too, should the scheduler signal it rather than this process
           "PET_SIGNALS_TO_HANDLE": os.environ.get("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")}
    if settings["per_machine"] > 1 and "OMP_NUM_THREADS" not in os.environ:  # what torchrun sets (torch 2.x
        env["OMP_NUM_THREADS"] = "1"  # distributed/run.py), without its four-line banner on every launch
    if sys.stderr.isatty():  # the ranks' stderr is a file this process relays to a terminal: draw as on one
        from .console import STDERR_TTY_ENV

        env[STDERR_TTY_ENV] = "1"
    return env


def _ending_with(parent: int):
    """A preexec_fn for the launcher's child: SIGTERM when this process dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so torchrun stops its ranks with a checkpoint instead of training on unwatched in a session of
    its own. prctl is looked up here, in the parent: the child between fork and exec may not load libraries."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def child() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before the call: nothing would tell us
            os.kill(os.getpid(), signal.SIGTERM)

    return child


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
    from .run.heartbeat import EXIT_HUNG

    path = Path(status)
    earlier, lost = json.loads(path.read_text() or "{}"), code == EXIT_HUNG  # lost: a peer gone from a collective
    local_zero = os.environ.get("LOCAL_RANK", "0") == "0"
    # the first to end, or local rank 0; but a rank's own failure is the cause of its peers' losing it: it replaces
    # their report, and theirs never replaces it, whichever ended first
    if not earlier or (local_zero or not lost if earlier["code"] == EXIT_HUNG else local_zero and not lost):
        tmp = path.with_name(f"{path.name}.{os.getpid()}")  # whole or not at all: the launcher may read it now
        tmp.write_text(json.dumps({"code": code, "message": message}))
        os.replace(tmp, path)
    return 0 if code in COLLECTIVE_STOPS else code


# torchrun's log lines (glog: level, date, time, pid, file) and the marks of its own tracebacks
TORCHRUN_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/\S+\] ")
TRACEBACK = b"Traceback (most recent call last):"
TORCHRUN_FRAMES = (b"torch/distributed/elastic/", b"torch/distributed/launcher/", b"torch/distributed/run.py",
                   b"accelerate/commands/launch.py")


class Relay:
    """The job's stderr (torchrun's and every rank's), which they write to the file `path`, passed on to ours as it
    comes. A file, not a pipe: should this process die, the ranks still write (to a closed pipe they would get
    BrokenPipeError in the middle of saving). From the first traceback or torchrun failure line on, lines are held
    back instead: the job is ending, and `ending` decides what the user sees. Held lines are let through after
    `release_s` if the job goes on (a traceback some library printed and survived)."""

    def __init__(self, path: Path, sink, release_s: float = 30.0, every_s: float = 0.05):
        self.path, self.sink, self.release_s, self.every_s = Path(path), sink, release_s, every_s
        self.held: list[bytes] = []
        self.holding_since: float | None = None
        self.final = False  # a torchrun failure line is held: the job is ending, nothing is let through
        self._line = b""  # the line being read, its start not yet passed on (it may begin a traceback)
        self._passing = False  # the line being read was passed on as it came (a progress bar redrawn with \r)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="harness-relay", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        with self.path.open("rb") as source:
            while True:
                done = self._done.is_set()  # read once more after the job ended: all it wrote
                chunk = source.read(1 << 16)
                if chunk:
                    self.feed(chunk)
                elif done:
                    break
                else:
                    self._done.wait(self.every_s)
        if self._line:
            self._segment(self._line)
            self._line = b""

    def finish(self) -> None:
        """Once the job has ended: relay the rest and stop."""
        self._done.set()
        self._thread.join()

    def feed(self, chunk: bytes) -> None:
        """Pass on, hold or keep `chunk`, in segments ending at a newline or a carriage return (a progress bar
        redraws its line after each \\r: a segment, shown as it comes)."""
        if self.holding_since is not None and not self.final and time.monotonic() - self.holding_since > \
                self.release_s:
            self._write(b"".join(self.held))
            self.held, self.holding_since = [], None
        *segments, self._line = re.split(rb"(?<=[\r\n])", self._line + chunk)
        for segment in segments:
            self._segment(segment)
        if self._line and self.holding_since is None and not _may_begin_failure(self._line):
            self._write(self._line)  # its start is known not to begin a failure: shown as it comes
            self._line, self._passing = b"", True
        elif self._line and self._passing:  # what follows a progress bar on its line may begin a failure: wait
            self._passing = False

    def _segment(self, segment: bytes) -> None:
        failing = _failing(segment)
        if self._passing:  # its start is on the terminal already (a progress bar's line, never ended)
            self._passing = False
            if not failing:
                self._write(segment)
                return
            self._write(b"\n")  # the bar's line ends; what failed is held below
        if segment.startswith(b"harness: ") or (self.holding_since is None and not failing):
            self._write(segment)
            return
        if self.holding_since is None:
            self.holding_since = time.monotonic()
        self.final = self.final or bool(TORCHRUN_LOG.match(segment))  # torchrun is ending the job: never let go
        self.held.append(segment)

    def _write(self, data: bytes) -> None:
        if data:
            self.sink.write(data)
            self.sink.flush()

    def held_text(self) -> str:
        return b"".join(self.held).decode(errors="replace")

    def save(self, run_dir: Path, machine_rank: int) -> Path:
        """Everything the job wrote to stderr, appended to `RUN/launch.log` (`launch_nodeK.log` on node K > 0) once
        the run has a directory of its own (its config is written); else the file it was written to stays."""
        name = "launch.log" if machine_rank == 0 else f"launch_node{machine_rank}.log"
        if not (run_dir / "config.toml").is_file():
            return self.path
        path = run_dir / name
        with path.open("ab") as out, self.path.open("rb") as kept:
            out.write(f"=== harness launch on {socket.gethostname()}, ended {time.strftime('%Y-%m-%d %H:%M:%S')}"
                      f" ===\n".encode())
            out.writelines(kept_lines(kept))
        self.path.unlink()
        return path


ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")  # a terminal's cursor moves (a second bar's redraws go up and down)
BAR = re.compile(rb"^(.*?)\s*\d+%\|")  # a tqdm frame: its description, before the percentage


def kept_lines(lines):
    """What launch.log keeps of the job's stderr: its lines as written, but of a terminal's progress bars (redrawn
    after each \\r, each second; an evaluation's below the training bar's, each redraw on a line of its own) each
    bar's last frame before something else was written, one a line: a day's run had kept 86,400 frames."""
    pending = None  # (its description, the frame): the bar's frame last drawn, not yet written
    for line in lines:
        body = ANSI.sub(b"", line).rstrip(b"\r\n")
        if b"\r" not in body:
            if pending:
                yield pending[1] + b"\n"
                pending = None
            yield line
            continue
        for frame in filter(bytes.strip, body.split(b"\r")):  # (a blank frame: a bar cleared)
            bar = BAR.match(frame)
            if pending and (bar is None or bar[1] != pending[0]):
                yield pending[1] + b"\n"
                pending = None
            if bar is None:
                yield frame + b"\n"
            else:
                pending = (bar[1], frame)
    if pending:
        yield pending[1] + b"\n"


def _failing(segment: bytes) -> bool:
    """A traceback's first line, or torchrun logging an error or the signal it sends (the job is ending)."""
    return segment.startswith(TRACEBACK) or bool(TORCHRUN_LOG.match(segment) and (segment[:1] in b"EF" or
                                                                                  b"signal" in segment))


def _may_begin_failure(start: bytes) -> bool:
    """The start of a line that could still turn out to be a traceback or a torchrun log line."""
    return TRACEBACK.startswith(start[:len(TRACEBACK)]) or bool(re.match(rb"^[IWEF]\d{0,4}( |$)", start[:6]))


def root_cause(held: str) -> dict | None:
    """torchrun's "Root Cause (first observed failure)" (torch/distributed/elastic/multiprocessing/errors): the rank,
    its host, pid and exit code (negative: the signal that killed it); None where torchrun reported none."""
    _, found, cause = held.partition("Root Cause (first observed failure):")
    fields = dict(re.findall(r"^\s+(host|rank|exitcode)\s+:\s+(.*)$", cause, re.M)) if found else {}
    if not {"host", "rank", "exitcode"} <= fields.keys():
        return None
    exitcode = re.match(r"(-?\d+) \(pid: (\d+)\)", fields["exitcode"])
    rank = re.match(r"(\d+)", fields["rank"])
    if not exitcode or not rank:
        return None
    return {"rank": int(rank[1]), "host": fields["host"].strip(), "pid": int(exitcode[2]), "code": int(exitcode[1])}


def ending(code: int, reported: dict, held: str, run_dir: Path, log: Path, signalled: int | None = None
           ) -> tuple[int, str | None, str]:
    """(exit code, the one line to print, the held-back text to show above it) for a job torchrun ended with
    `code`, whose ranks reported `reported` (may be {}), and whose stderr from its first failure on was `held`;
    `signalled`: the first signal this launcher passed on to the ranks. A job that fails while it stops for a
    signal says so: SLURM's scancel signals every process of a job, not the ranks alone, and a helper that dies
    of it (wandb's, a data loader's) can take a rank with it."""
    code, line, show = _ending(code, reported, held, run_dir, log)
    if signalled is not None and line and code not in (0, EXIT_PREEMPTED):
        line += f" (the job was stopping: this launcher had passed {signal.Signals(signalled).name} on to the ranks)"
    return code, line, show


def _ending(code: int, reported: dict, held: str, run_dir: Path, log: Path) -> tuple[int, str | None, str]:
    from .run.resume import resume_hint
    from .run.heartbeat import EXIT_HUNG

    cause = root_cause(held)
    killed = cause is not None and cause["code"] < 0
    # a rank that failed on its own (its code, or a signal) is the cause, not the peers that lost it (their exit 4)
    own = cause is not None and cause["code"] not in (0, EXIT_HUNG)
    if reported and not (own and reported["code"] == EXIT_HUNG):  # the ranks' own account
        preempted = reported["code"] == EXIT_PREEMPTED
        return reported["code"], f"harness: {'' if preempted else 'error: '}{reported['message']}", ""
    if code == 0:
        return 0, None, ""
    resume = resume_hint(run_dir / "checkpoints")
    if cause is None:  # torchrun itself failed (or was killed): what it wrote is all there is
        return code, (f"harness: error: the launcher (torchrun) exited with code {code}; {resume}; its output: "
                      f"{log}"), _without_torchrun(held) or held
    step = _last_step(run_dir)
    when = f" after step {step}" if step else " before the first step"
    who = f"rank {cause['rank']} (pid {cause['pid']} on {cause['host']})"
    if killed:
        number = -cause["code"]
        try:
            name = signal.Signals(number).name
        except ValueError:  # a real-time signal
            name = f"signal {number}"
        if name in ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP"):  # ended from outside: the job can go on
            why = " (kill -9, or the kernel's out-of-memory killer: see `dmesg`)" if name == "SIGKILL" else ""
            return EXIT_HUNG, f"harness: error: {who} was killed by {name}{when}{why}; {resume}; every rank's " \
                              f"stderr: {log}", ""
        why = (" (its collective library aborts a rank whose collective failed, timed out or did not match the other "
               "ranks', e.g. NCCL's watchdog or gloo's size check: see its output)"
               if name == "SIGABRT" else "")
        return 1, f"harness: error: {who} crashed with {name}{when}{why}; {resume}; every rank's stderr: {log}", \
            _without_torchrun(held)
    return code, f"harness: error: {who} failed with exit code {cause['code']}{when}: its error is above; " \
                 f"{resume}; every rank's stderr: {log}", _without_torchrun(held)


def _last_step(run_dir: Path) -> int:
    """The last step the run finished: the furthest of what it logged (`metrics.jsonl`, every train.log_every steps:
    the last line that parses, a killed writer's half line skipped) and what its ranks' heartbeats say (written as
    each rank stops); 0 for none."""
    from .run.heartbeat import beats

    steps = [0]
    try:
        with (run_dir / "metrics.jsonl").open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        try:
            steps.append(int(json.loads(line)["step"]))
            break
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps + [int(b.get("step", 0)) for b in beats(run_dir).values()])


def _without_torchrun(held: str) -> str:
    """The held-back text less torchrun's own: its log lines and its tracebacks (blocks through its frames)."""
    blocks, kept = re.split(r"(?m)^(?=Traceback \(most recent call last\):|[IWEF]\d{4} \d\d:)", held), []
    for block in blocks:
        if TORCHRUN_LOG.match(block.encode()):
            block = block.split("\n", 1)[1] if "\n" in block else ""
        if block.startswith("Traceback") and any(f.decode() in block for f in TORCHRUN_FRAMES):
            continue
        kept.append(block)
    return "".join(kept)
