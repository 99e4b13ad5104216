"""What a launch will be, as accelerate reads it (`launch_settings`): its options over its config file, checked
before anything starts where accelerate would start processes that fail inside (the number of processes and
machines, the precision, the hostfile, parallelism settings it would ignore).

Everything before `train` is `accelerate launch`'s, passed on as given; everything from `train` on is
`harness train`'s (`split_argv`). `harness plan` takes accelerate launch's options among its own (`launch_options`).
"""
from __future__ import annotations

import contextlib
import io
import re
import socket
from pathlib import Path

from ..config.run import ConfigError, closest


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

    from ..config.accelerate import PARALLELISM_KEYS, SP_FORM, read_config

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
    if who == LAUNCH:  # (a plan may be for GPUs elsewhere)
        _check_launch_type(args, processes, where, who)
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

    from ..config.accelerate import SP_FORM

    try:  # its note on defaults it chose goes to the terminal when accelerate launch itself runs, not twice
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, defaults, _ = _validate_launch_command(args)
    except (ValueError, TypeError) as e:
        hint = f" With DeepSpeed, write {SP_FORM}." if "--use_parallelism_config" in str(e) else ""
        raise ConfigError(f"{who}: accelerate launch refuses its settings: {str(e).strip()}{hint}") from None
    return args, defaults


def _check_launch_type(args, processes: int, where, who: str) -> None:
    """Several processes asked for, where accelerate launch would start one: without a launch type it picks the
    multi-GPU launcher for 2 GPUs or more only, and with --cpu none (accelerate/commands/launch.py `launch_command`:
    any other case is its `simple_launcher`, one process). `harness plan` had planned the processes asked for."""
    several = any(getattr(args, k, False) for k in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "multi_gpu", "tpu"))
    if processes > 1 and (args.cpu or not several) and not getattr(args, "mpirun_hostfile", None):
        why = "--cpu sends it to its one-process launcher" if args.cpu else \
            "no launch type is set (--use_deepspeed, --multi_gpu, ...) and it picks one itself only for 2 GPUs or more"
        raise ConfigError(f"{who}: {where('num_processes')} = {processes}, but accelerate launch would start one "
                          f"process: {why}; add --use_deepspeed (as launch/cpu_2proc.yaml does), without --cpu: the "
                          f"harness runs on the CPU where there is no GPU")


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
