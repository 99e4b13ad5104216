"""Everything between the plan and the first step: preflight, the machine's JIT builds, the run directory.

`preflight` runs before any process group exists, so bad input ends with one line and exit code 2 on every
rank instead of a stack trace on rank 7. The plan is made in `harness/plan/`; parallelism is applied to the model
in `harness/distributed/parallel.py`.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
from pathlib import Path

from ..config.run import ConfigError, flatten, read_toml, to_toml
from ..distributed import ds_patches
from ..distributed.world import World, launched_world_size, quiet_deepspeed
from ..plan.resolve import Plan
from ..prepare import META, fingerprint
from ..tasks.registry import moved_plugin

CPU_FP16_ENV = "HARNESS_CPU_FP16"


def check_precision(precision: str) -> None:
    """Refuse a precision DeepSpeed's accelerator does not support; fp16 on a CPU without it only where opted in
    (CPU_FP16_ENV), which tells DeepSpeed it is supported (`ds_patches.claim_cpu_fp16`)."""
    quiet_deepspeed()
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if precision == "fp16" and not acc.is_fp16_supported():
        opted = os.environ.get(CPU_FP16_ENV) == "1" and acc.device_name() == "cpu"
        if opted and not ds_patches.claim_cpu_fp16(acc):
            raise ConfigError(f"fp16 is not supported on this cpu (DeepSpeed's check), and {CPU_FP16_ENV}=1 steps "
                              f"aside on DeepSpeed {ds_patches.version()} (the line above says why); use a bf16 or "
                              f"fp32 config")
        if not opted:
            raise ConfigError(f"fp16 is not supported on this {acc.device_name()} (DeepSpeed's check); use a bf16 "
                              f"or fp32 config, or set {CPU_FP16_ENV}=1 to run fp16 slowly on a CPU for testing")
    if precision == "bf16" and not acc.is_bf16_supported():
        raise ConfigError(f"bf16 is not supported on this {acc.device_name()}; use an fp16 or fp32 config")


def check_nvme(ds) -> None:
    """NVMe offload reads and writes through DeepSpeed's async_io op, which needs libaio at build time: without it
    the ranks fail at start, each with its traceback."""
    from ..config.ds import offload_device

    zero = ds.config["zero_optimization"]
    if "nvme" not in (offload_device(zero.get(k)) for k in ("offload_optimizer", "offload_param")):
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    made = get_accelerator().create_op_builder("AsyncIOBuilder")
    if not installed_ops.get("async_io") and (made is None or not made.is_compatible(verbose=False)):
        raise ConfigError(f"NVMe offload ({ds.origin}) needs DeepSpeed's async_io op, which this machine cannot "
                          f"build (`ds_report` says why; usually libaio is missing: libaio-dev); offload to \"cpu\"")


# ZeRO++'s quantized communication, which loads DeepSpeed's quantizer kernel (0.19: partition_parameters.CUDAQuantizer
# for weights, coalesced_collectives.all_to_all_quant_reduce for gradients); its hpZ partitioning needs no kernel
ZEROPP_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


def check_kernel(ds) -> None:
    """The optimizer DeepSpeed builds from the file's section runs a kernel this machine can build (`harness plan`
    only notes it: a plan may be for other machines)."""
    from ..config.ds_optim import kernel_missing

    if why := kernel_missing(ds.sections.optimizer, ds.offload_optimizer):
        raise ConfigError(f"optimizer.type = {ds.sections.optimizer['type']!r} ({ds.origin}): DeepSpeed cannot train "
                          f"it here: {why}")


def check_zeropp(ds) -> None:
    """ZeRO++'s quantized weights and gradients (ZeRO-3) on an accelerator without a build of DeepSpeed's quantizer
    kernel (the CPU's): every rank fails as the engine is built or at the first backward, each with its traceback."""
    asked = [k for k in ZEROPP_QUANTIZED if ds.config["zero_optimization"].get(k)]
    if not asked or ds.zero_stage != 3:  # ZeRO 1-2 do not read them
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    acc = get_accelerator()
    made = acc.create_op_builder("QuantizerBuilder")  # the CPU's is DeepSpeed's NotImplementedBuilder
    if not installed_ops.get("quantizer") and (made is None or type(made).__name__ == "NotImplementedBuilder"
                                               or not made.is_compatible(verbose=False)):
        raise ConfigError(f"zero_optimization.{asked[0]} ({ds.origin}): ZeRO++'s quantized communication needs "
                          f"DeepSpeed's quantizer kernel, which has no build for the {acc.device_name()} accelerator; "
                          f"remove {' and '.join(asked)} (zero_hpz_partition_size runs without it)")


EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"


def extension_root() -> Path:
    """Where torch (and so DeepSpeed's op builder) JIT-builds C++/CUDA ops: $TORCH_EXTENSIONS_DIR as the user set
    it, else a folder of this Python environment and host, which this sets in the variable for this process and the
    ones it starts: ~/.cache/torch_extensions/<python>_<cuda|cpu>/<environment>-<host>. torch's own default is keyed
    by the Python and CUDA versions only (torch.utils.cpp_extension._get_build_directory), so two environments on
    one machine rebuild each other's ops in turn (their build.ninja names different include paths) and each start
    waits on the other's lock; nodes that share a home directory wait on locks they cannot see are alive."""
    import socket
    import sys

    if os.environ.get(EXTENSIONS_ENV):
        return Path(os.environ[EXTENSIONS_ENV])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    device = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    env = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:8]
    root = Path(get_default_build_root()) / f"{python}_{device}" / f"env-{env}-{socket.gethostname().split('.')[0]}"
    os.environ[EXTENSIONS_ENV] = str(root)
    return root


COMPILERS = {"ninja", "cc1plus", "nvcc", "cicc", "ptxas", "c++", "g++", "gcc", "clang++"}


def compilers_in(where: Path) -> list[int]:
    """The pids of the compilers and ninjas running in `where` or below it: a JIT build there (torch's
    cpp_extension runs ninja, and ninja its compilers, in the extension's build directory, the one holding the
    lock). A compiler elsewhere, e.g. torch.compile's in /tmp, does not count."""
    where, found = where.resolve(), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            if Path(argv0).name not in COMPILERS:
                continue
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:  # the process ended while we looked, or is not ours to read
            continue
        if cwd == where or where in cwd.parents:
            found.append(int(proc.name))
    return found


NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs", "panfs",
              "wekafs", "9p", "fuse.glusterfs", "fuse.sshfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse"}


def network_fs(path: Path, mounts: str | None = None) -> str | None:
    """The type of the file system `path` is on where other hosts may write to it too (NFS, Lustre, ...), from
    /proc/mounts (`mounts`: its text); None for a local one, or where it cannot be told."""
    try:
        mounts = Path("/proc/mounts").read_text() if mounts is None else mounts
        path = Path(os.path.realpath(path))
    except OSError:
        return None
    best, kind = -1, None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]))  # \040: a space
        if (point == path or point in path.parents) and len(point.parts) >= best:  # the last mounted on top
            best, kind = len(point.parts), fields[2]
    return kind if kind in NETWORK_FS else None


class BuildLocks:
    """JIT-build locks seen through repeated `look()`s. torch's FileBaton takes `<extension>/lock` for a build and
    every other process polls for the file to vanish, silently and forever: a build killed midway leaves it behind
    (pytorch/pytorch#189245; DeepSpeed's hang reports, e.g. deepspeedai/DeepSpeedExamples#302, end in
    `file_baton.py wait`). A lock is proven stale, and removed with a line saying so, when it is `min_age_s` old
    and no compiler ran in its folder in two looks at least `confirm_s` apart (the holder writes its build file and
    starts ninja within a second of taking it, and releases it as the build ends). Where this process's main
    thread waits in FileBaton.wait, it says once what it waits for and where, then every `say_every_s` how long.
    Under a root on a network file system (a TORCH_EXTENSIONS_DIR the nodes share) no lock is removed: another
    host's build cannot be seen from here; the wait then says so."""

    def __init__(self, root: Path | None = None, min_age_s: float = 10.0, confirm_s: float = 3.0,
                 say_every_s: float = 30.0, say=None):
        import socket
        import sys

        self.root = root or extension_root()
        self.min_age_s, self.confirm_s, self.say_every_s = min_age_s, confirm_s, say_every_s
        # one rank of a node speaks (its siblings wait on the same builds)
        quiet = os.environ.get("LOCAL_RANK", "0") != "0"
        self.say = say or (lambda line: quiet or print(f"harness: {line}", file=sys.stderr, flush=True))
        own = self.root.name.startswith("env-") and self.root.name.endswith(f"-{socket.gethostname().split('.')[0]}")
        self.shared = None if own else network_fs(self.root)  # extension_root's default is this host's alone
        self.idle: dict[Path, float] = {}  # lock -> when a look first found no compiler in its folder
        self.waiting: tuple[Path, float, float] | None = None  # the lock waited on, since, last said

    def look(self, now: float | None = None) -> list[Path]:
        """One look at every lock under the root (and the one this process waits on): the stale ones removed."""

        now = time.time() if now is None else now
        locks = {p for p in (*self.root.glob("*/lock"), *self.root.glob("*/*/lock")) if p.is_file()}
        waited = _waited_lock()
        if waited is not None:
            locks.add(waited)
        cleared = []
        for lock in sorted(locks):
            try:
                age = now - lock.stat().st_mtime
            except OSError:  # released meanwhile
                continue
            builders = compilers_in(lock.parent)
            if builders:
                self.idle.pop(lock, None)
            else:
                self.idle.setdefault(lock, now)
            if not builders and age >= self.min_age_s and now - self.idle[lock] >= self.confirm_s and not self.shared:
                try:
                    lock.unlink()
                except FileNotFoundError:
                    pass
                else:
                    ours = " (this one, which waited on it, may fail to load the half-built op: start again)"
                    self.say(f"removed {lock}: a JIT build of DeepSpeed's {lock.parent.name} op left it "
                             f"{age:.0f} s ago and no build runs there (one killed midway); the next start builds it"
                             f"{ours if lock == waited else ''}")
                cleared.append(lock)
                self.idle.pop(lock, None)
            elif lock == waited:
                self._waits(lock, builders, now)
        if waited is None:
            self.waiting = None
        return cleared

    def _waits(self, lock: Path, builders: list[int], now: float) -> None:
        if self.waiting is None or self.waiting[0] != lock:
            who = f"by pid {', '.join(map(str, builders))}" if builders else \
                f"on another host, or left by one killed midway: {lock.parent} is on {self.shared}, shared by the " \
                f"hosts; remove the lock if no host builds there" if self.shared else "with no compiler running yet"
            self.say(f"waiting for another process's JIT build of DeepSpeed's {lock.parent.name} op ({who}): "
                     f"torch waits until its lock {lock} is gone")
            self.waiting = (lock, now, now)
        elif now - self.waiting[2] >= self.say_every_s:
            self.say(f"still waiting for the build of {lock.parent.name} ({now - self.waiting[1]:.0f} s; {lock})")
            self.waiting = (lock, self.waiting[1], now)


def _waited_lock() -> Path | None:
    """The lock this process's main thread waits on in torch's FileBaton.wait, if it does."""
    import sys
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("file_baton.py"):
            baton = frame.f_locals.get("self")
            return Path(baton.lock_file_path) if baton is not None else None
        frame = frame.f_back
    return None


def clear_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Before starting: the locks proven stale now (two looks `confirm_s` apart where one is found), removed."""

    locks = BuildLocks(root)
    cleared = locks.look()
    if locks.idle and not locks.shared:
        time.sleep(locks.confirm_s)
        cleared += locks.look()
    return cleared


@contextlib.contextmanager
def watching_build_locks(every_s: float = 1.0, **kwargs):
    """`BuildLocks(**kwargs).look()` every `every_s` from a daemon thread while the block runs (a build may be
    killed, or another process's may start, after this process looked): the wait says where it is, a stale lock
    goes."""
    import threading

    locks, stop = BuildLocks(**kwargs), threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            try:
                locks.look()
            except OSError:
                pass

    thread = threading.Thread(target=run, name="harness-build-locks", daemon=True)
    thread.start()
    try:
        yield locks
    finally:
        stop.set()


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
    converted yet, the universal conversion (`checkpoint.to_universal`: CONVERSION_FACTOR x that checkpoint while it
    is written, 1.05x once done, in this run's checkpoints)."""
    from . import checkpoint

    t = plan.run.cfg.train
    per, parts = checkpoint_bytes_per_param(plan)
    count = t.keep_checkpoints + 1 + bool(t.select_best)
    ckpts = plan.run_dir / "checkpoints"
    kept = sorted(ckpts.glob("step_*[0-9]"))[-(count - 1):] if ckpts.is_dir() else []  # rotated out, these free
    held = sum(map(_bytes_on_disk, kept))
    need = n_params * 4 + max(n_params * per, n_params * per * count - held)  # the next one is written in any case
    convert = 0
    if resume_from is not None and checkpoint.reshape(resume_from, plan.ds) and \
            not checkpoint.conversion_of(resume_from, plan.run_dir).is_dir():
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


# Settings of the built-in models that give another function of the same parameters: a checkpoint resumed across
# a change of one loaded, and its weights trained on as other heads
REGROUPING = ("model.n_heads",)


def check_same_model(plan: Plan, found: Path) -> None:
    """A checkpoint resumes only into the model it was saved from: the saving run's config (RUN/config.toml beside
    RUN/checkpoints/) and this one build models compared by parameter name and shape on the meta device, before
    anything is loaded or written. Refused in one line naming the settings that differ."""
    import torch

    from . import checkpoint
    from .export import run_config
    from .trust import TRUST, trusting

    source = found.parent.parent
    if found.parent.name != "checkpoints" or not (source / "config.toml").is_file():
        return  # a checkpoint without its run's config: DeepSpeed's load is the check
    ours, raw = plan.run.cfg, read_toml(source / "config.toml")
    saved_task = raw.get("run", {}).get("task")
    if saved_task != ours.run.task and not moved_plugin(saved_task, ours.run.task):  # (the project moved: the same)
        raise ConfigError(f"--resume {found}: saved by a {saved_task!r} run, but {plan.run.describe('run.task')}")
    # the task is this run's own (the user named it), and remote model code only where this run trusts it too
    now = TRUST.get()
    with trusting(checkpoint=now.checkpoint, task=ours.run.task, run_dir=now.run_dir or (
            ours.model.trust_remote_code and raw.get("model", {}).get("trust_remote_code") is True)):
        theirs = run_config(source)
    with torch.device("meta"):
        shapes = [{n: list(p.shape) for n, p in plan.task.build_model(c).named_parameters()} for c in (theirs, ours)]
    saved = checkpoint.saved_shapes(found)
    old, new = flatten(theirs.to_dict()), flatten(ours.to_dict())
    built_in = type(plan.task).__module__.startswith("harness.tasks.")  # (a plug-in's model may not read n_heads)
    regrouped = [k for k in REGROUPING if built_in and not ours.model.hf and old.get(k) != new.get(k)]
    if shapes[0] == shapes[1] and saved in (None, shapes[1]) and not regrouped:
        return
    shaping = ("model.", f"{ours.task_section}.", "data.seq_len", "data.path", "data.vocab")
    keys = [f"{k} {old.get(k)!r} there, {new[k]!r} here ({plan.run.source.get(k, 'default')})" for k in new
            if k.startswith(shaping) and old.get(k) != new[k]]
    if shapes[0] == shapes[1] and not regrouped:  # the same settings build another model: its code changed since
        shapes[0], keys = saved, [f"the model's code ({type(plan.task).__name__}), or the data or config.json it is "
                                  f"built from, changed since it was saved"]
    differ = [f"{n} {shapes[0].get(n)} -> {shapes[1].get(n)}" for n in sorted(shapes[0].keys() | shapes[1].keys())
              if shapes[0].get(n) != shapes[1].get(n)]
    params = f"parameters {', '.join(differ[:3])}{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}" \
        if differ else "the same parameters, read as other heads"
    raise ConfigError(f"--resume {found}: its model is not this run's ({'; '.join(keys) or 'the data it was built for'}"
                      f"; {params}): resume with the settings and code it was saved with, or start a new run "
                      f"(--overwrite, or another run.output_dir)")


def data_identity(plan: Plan) -> dict | None:
    """What a checkpoint records of the data, so that a resume on other data is refused: a prepared corpus's path and
    fingerprint (the task's `data_identity`), else the content of the directory its `prepare` gives (a case study's
    rows and tokenizer); None for data read as it is."""
    task, cfg = plan.task, plan.run.cfg
    found = task.data_identity(cfg) if hasattr(task, "data_identity") else None
    prepared = _prepared(plan) if found is None else None
    if prepared is not None:
        found = {"path": cfg.data.path or "the embedded default", "fingerprint": fingerprint(prepared)}
    return found


def _prepared(plan: Plan) -> Path | None:
    """The prepared directory (with meta.json) the task's `prepare` gives; None where it has none (a plug-in's
    `prepare` may give anything)."""
    now = plan.task.prepare(plan.run.cfg) if hasattr(plan.task, "prepare") else None
    return Path(now) if isinstance(now, (str, Path)) and (Path(now) / META).is_file() else None


def _stored_changes(plan: Plan, run_dir: Path) -> tuple[Path | None, list[str]]:
    """The artefacts run `run_dir` stored (RUN/data/: tokenizer, statistics) and what differs in those this run's data
    is prepared with now (`prepare.differences`); (None, []) where either has none."""
    from ..prepare import differences, stored

    kept = stored(run_dir)
    now = _prepared(plan) if kept is not None else None
    return kept, differences(kept, now) if now is not None else []


def _check_same_data(plan: Plan, found: Path, changed_ok: bool) -> None:
    """Before a resume: the data prepared now is what checkpoint `found` trained on (its `data.json`). A checkpoint
    saved before checkpoints recorded their data: the tokenizer and statistics its run stored (RUN/data/) against
    those prepared now, so a resume onto a new tokenizer whose ids mean other pieces is refused too (preparation
    rules and draws change between versions)."""
    from . import checkpoint

    if checkpoint.saved_data(found) is not None:
        checkpoint.check_same_data(found, data_identity(plan), changed_ok)
        return
    kept, changed = _stored_changes(plan, found.parent.parent)  # the checkpoint's own run's
    if changed and not changed_ok:
        raise ConfigError(f"--resume {found}: the data prepared now differs from what its run trained with (kept in "
                          f"{kept}) in {', '.join(changed)}: the ids its model learned would mean other pieces; pass "
                          f"--data-changed-ok to resume on the new data anyway")


def check_init_from(plan: Plan, say: bool) -> None:
    """model.init_from, before a run's first step: a run of this task that exported its weights, which fit this run's
    model (`_check_fits`), with the tokenizer this run's data is prepared with where the task keeps one (an
    embedding's rows mean its tokenizer's pieces). Its layout is not compared: the export is whole, under the plain
    model's names, whatever the run was split into."""
    from .export import MODEL_FILE, trained_on_note

    cfg, key = plan.run.cfg, plan.run.describe("model.init_from")
    source = Path(cfg.model.init_from)
    if source.resolve() == plan.run_dir.resolve():
        raise ConfigError(f"{key} is this run's own directory, whose files a new run replaces: name another "
                          f"run.output_dir, or continue that run with --resume auto")
    if not source.is_dir():
        raise ConfigError(f"{key}: {'a file, not a' if source.exists() else 'no such'} run directory")
    if not (source / "config.toml").is_file():
        raise ConfigError(f"{key}: not a run directory (it holds no config.toml): name a finished run's "
                          f"run.output_dir")
    if not (source / MODEL_FILE).is_file():
        raise ConfigError(f"{key}: that run has not exported its weights (no {MODEL_FILE}; a run exports them as it "
                          f"finishes): finish it on its own layout, `--resume auto` with --set train.max_steps=N for a "
                          f"step N it has saved to end it there")
    raw = read_toml(source / "config.toml")  # read, not resolved: resolving imports the task it names
    task = raw.get("run", {}).get("task", "lm")
    if task != cfg.run.task and not moved_plugin(task, cfg.run.task):
        raise ConfigError(f"{key}: a run of task {task!r}, but {plan.run.describe('run.task')}")
    _check_fits(plan, key, source, raw)
    kept, changed = _stored_changes(plan, source)
    changed = [n for n in changed if not n.startswith(f"{META} ")]  # its statistics may differ: new data
    if changed:
        raise ConfigError(f"{key}: its tokenizer ({', '.join(changed)} in {kept}) is not the one this run's data is "
                          f"prepared with: the ids its model learned would mean other pieces")
    if say and (note := trained_on_note(source)):
        print(note, flush=True)


def _check_fits(plan: Plan, key: str, source: Path, raw: dict) -> None:
    """model.init_from's export fits this run's model by name and shape (on the meta device: nothing loaded), and
    a built-in model reads it with the heads it was trained with."""
    from ..plan.render import meta_model
    from .export import MODEL_FILE, exported_shapes, misfit

    cfg = plan.run.cfg
    shapes, _ = exported_shapes(source / MODEL_FILE)
    only_there, only_here, differ = misfit(shapes, model := meta_model(plan))
    old, new = flatten(raw), flatten(cfg.to_dict())
    settings = [f"{k} {old[k]!r} there, {new[k]!r} here" for k in new if k in old and old[k] != new[k] and (
        k.startswith("model.") and k not in ("model.init_from", "model.dropout", "model.zero_init")
        or k == "data.seq_len")]
    built_in = type(plan.task).__module__.startswith("harness.tasks.")  # (a plug-in's model may not read n_heads)
    regrouped = [k for k in REGROUPING if built_in and old.get(k, new[k]) != new[k]]
    if not (only_there or only_here or differ or regrouped):
        return
    mine, task_keys = model.state_dict(), [f"{k} {old[k]!r} there, {new[k]!r} here" for k in new
                                           if k.startswith(f"{cfg.task_section}.") and k in old and old[k] != new[k]]
    named = [*settings, *(f"{k} {list(shapes[k])} there, {list(mine[k].shape)} here" for k in differ),
             *(f"{k} only there" for k in only_there), *(f"{k} only here" for k in only_here), *task_keys]
    what = "its weights do not fit this run's model" if only_there or only_here or differ else \
        "its weights would be read as other heads"
    raise ConfigError(f"{key}: {what} ({'; '.join(named[:3])}{f' and {len(named) - 3} more' if len(named) > 3 else ''}"
                      f"): start from a run of the same model settings")


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


def _check_replaceable(plan: Plan, overwrite: bool) -> None:
    """A run directory that holds something, started anew: only with --overwrite, which deletes it, so only a run's
    own, never a folder named by mistake."""
    run_dir = plan.run_dir
    if not overwrite:
        raise ConfigError(f"{run_dir}: run directory exists and is not empty; pass --resume auto to continue "
                          f"it, --overwrite to replace it (in Python: resume=\"auto\", overwrite=True), or set "
                          f"run.output_dir")
    if not is_run_dir(run_dir):
        names = sorted(p.name for p in run_dir.iterdir())
        held = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"{plan.run.describe('run.output_dir')}: --overwrite replaces a run directory, and "
                          f"{run_dir} is not one (no config.toml, and it holds {held}, which a run does not write): it "
                          f"was left as it is; set run.output_dir to a new directory or a run's")


def _resume_target(resume: str, run_dir: Path, say: bool) -> Path | None:
    """The checkpoint --resume names: `auto`'s (None where the run saved none yet: it starts from step 0), or the
    latest of a run directory or its checkpoints/ folder, or a step_* checkpoint given."""
    from . import checkpoint

    if resume == "auto":
        found = checkpoint.resume_target(run_dir / "checkpoints", say)
        if found is None and (run_dir / "metrics.jsonl").is_file() and say:
            print(f"note: --resume auto: {run_dir} holds no checkpoint (its run stopped before it saved one); "
                  f"starting from step 0", flush=True)
        return found
    path = Path(resume)
    found = checkpoint.latest(path / "checkpoints") or checkpoint.latest(path) or (
        path if path.is_dir() and checkpoint.is_complete(path) else None)
    if found is None:
        raise ConfigError(f"--resume {resume}: no checkpoint there (expected a run directory, its checkpoints/ "
                          f"folder, or a step_* checkpoint)")
    return found


def preflight(plan: Plan, resume: str | None, overwrite: bool, data_changed_ok: bool = False,
              machine_rank: int = 0) -> Path | None:
    """Checks of this machine that need no process group (`machine_rank`: the node's, for `harness launch` on each
    node). Returns the checkpoint to resume from, if any. The notes about what is resumed are said by the first rank,
    or by `harness launch`'s own check where it started the ranks."""
    clear_stale_build_locks()
    check_precision(plan.ds.precision)
    check_nvme(plan.ds)
    check_zeropp(plan.ds)
    check_kernel(plan.ds)
    shared_wait_s()
    from ..distributed.world import launched_rank, under_launcher
    from . import checkpoint, lock

    run_dir = plan.run_dir
    check_writable(run_dir, plan.run.describe("run.output_dir"))
    # A live run in this directory: refused, whatever the flags say. Judged here by one process alone, before any
    # rank starts: `harness train`, or `harness launch` on the first node. A lock's holder is told by its pid on its
    # own host but by the lock's age elsewhere, and a rank or node refusing alone would leave the others waiting at
    # the rendezvous: launched ranks leave it to rank 0's taking of the lock, which refuses on every rank together
    # (prepare_run_dir).
    note = lock.check(run_dir) if launched_world_size() == 1 and machine_rank == 0 else None
    if note:
        print(note, flush=True)
    if resume and overwrite:
        raise ConfigError(f"--resume {resume} and --overwrite: continue the run or replace it; name one")
    found = _resume_target(resume, run_dir, launched_rank() == 0 and not under_launcher()) if resume else None
    if resume:
        if found is not None:
            checkpoint.check_records(found)  # what the checks below read: as it was saved
            checkpoint.reshape(found, plan.ds)  # a layout it cannot convert to: refused here
            check_same_model(plan, found)
            _check_same_data(plan, found, data_changed_ok)
    elif run_dir.exists() and any(run_dir.iterdir()):
        if overwrite or not never_trained(plan):
            _check_replaceable(plan, overwrite)
        elif launched_rank() == 0 and not under_launcher():
            print(f"note: {run_dir} holds only the start-up files of a run that never trained a step: replaced",
                  flush=True)
    if launched_world_size() == 1:  # `harness launch`'s check, or one process: ranks would prepare the data at once
        from ..plan.render import meta_model  # prepares the data where the model's size depends on it

        if found is None and plan.run.cfg.model.init_from:
            check_init_from(plan, launched_rank() == 0 and not under_launcher())
        model = meta_model(plan)
        # the loop checks ranks started otherwise
        problem = check_free_space(plan, sum(p.numel() for p in model.parameters()), found)
        gpus = device_memory_bytes() if os.environ.get(FIT_CHECK_ENV) != "0" else []
        problem = problem or (check_fits(plan, model, min(gpus)) if gpus else None)
        if problem:
            raise ConfigError(problem)
    return found


FIT_CHECK_ENV = "HARNESS_FIT_CHECK"  # "0": no refusal on paper (`harness bench` tries sizes for real)


def device_memory_bytes() -> list[int]:
    """The memory of each GPU this process may use, from nvidia-smi (CUDA_VISIBLE_DEVICES applied): no CUDA context
    in this process, which stays alive beside the ranks under `harness launch`. [] without nvidia-smi."""
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    sizes = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            sizes[int(index)] = int(float(mib) * 2**20)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        return [sizes[int(v)] for v in visible.split(",") if v.strip() and int(v) in sizes]
    return list(sizes.values())


def check_fits(plan: Plan, model, capacity: int) -> str | None:
    """The problem, if one micro-batch of `model` (its meta-device twin) does not fit a GPU of `capacity` bytes on
    paper: the model states per rank
    (`config.ds.model_state_bytes`, after the ZeRO paper) and one micro-batch's activations (`plan.render.
    activation_bytes`, after Korthikanti et al.) together, before the CUDA context and the allocator's slack; None
    outside the estimates' scope (`plan.render.memory_on_paper`)."""
    from ..plan.render import memory_on_paper, size_text

    ds, c, paper = plan.ds, plan.run.cfg, memory_on_paper(plan, model)
    if paper is None or sum(paper[:2]) <= capacity:
        return None
    states, acts, positions = paper
    return (f"{plan.run.describe('train.micro_batch_size')} of {positions} positions does not fit one GPU of "
            f"{size_text(capacity)} on paper: model states {size_text(states)} per rank ({ds.precision}, "
            f"ZeRO-{ds.zero_stage}) "
            f"+ activations {size_text(acts)} of one micro-batch "
            f"({'checkpointed' if c.train.activation_checkpointing else 'no recomputation'}); "
            f"lower train.micro_batch_size (raise train.grad_accum_steps to keep the global batch), set "
            f"train.activation_checkpointing=true, or shard more (ZeRO-3, sequence_parallel_size); `harness plan` "
            f"shows the figures")


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


SHARED_WAIT_ENV = "HARNESS_SHARED_WAIT_S"  # how long a node looks for the others' tokens (a slow NFS cache)


def shared_wait_s() -> float:
    """$HARNESS_SHARED_WAIT_S, seconds (default 30), checked before launch by `preflight`."""
    raw = os.environ.get(SHARED_WAIT_ENV, "30")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ConfigError(f"{SHARED_WAIT_ENV}={raw!r}: the seconds each node looks for the others' files in the run "
                          f"directory, a number 0 or more (default 30)")
    return value


# May differ by node, a copy staged on each node's own disk: the data (compared by its content once read, loop._data),
# the run directory (check_shared finds the nodes' tokens in it) and NVMe offload's folder
NODE_PATHS = ("data.path", "data.val_path", "data.mix", "run.output_dir")
SAMPLED = 2**20  # bytes of an export read from each end to tell its weights (model.init_from) on each node


def _export_digest(path: Path) -> str:
    """An export told by its header (names, shapes, step) and its first and last MiB of weights, read alike on every
    node; one that is not there or cannot be read (a resume no longer reads it) is said to be so."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            header = int.from_bytes(f.read(8), "little")
            if header > size - 8:
                return f"no safetensors file ({size} bytes)"
            head = f.read(header + SAMPLED)
            f.seek(max(8 + len(head), size - SAMPLED))
            return f"an export whose weights are {hashlib.sha256(head + f.read()).hexdigest()[:12]}"
    except OSError:
        return "no readable export"


def _meaning(key: str, value):
    """What a setting means whichever node reads it: a local model.hf directory by its config.json, model.init_from's
    export by its header and first and last MiB, a plug-in task by its file's name and class."""
    if key == "model.hf" and isinstance(value, str) and (Path(value) / "config.json").is_file():
        digest = hashlib.sha256((Path(value) / "config.json").read_bytes()).hexdigest()[:12]
        return f"a model whose config.json is {digest}"
    if key == "model.init_from" and value:
        return _export_digest(Path(value) / "model.safetensors")
    if key == "run.task" and isinstance(value, str) and ".py:" in value:
        file, cls = value.rsplit(":", 1)
        return f"{Path(file).name}:{cls}"
    return value


def check_same_plan(plan: Plan) -> None:
    """Every rank resolved the same run and DeepSpeed config, paths aside (`NODE_PATHS`, `_meaning`). A node started
    with another --set, --ds or run file had trained its share of the weights with other settings (an lr apart, said
    nowhere) or hung before the first step (ZeRO stages apart). Collective: called as the process group starts, before
    its subgroups (`init_world`'s `agree`)."""
    import json
    import socket

    from ..distributed.world import all_gather_objects

    mine = {"ZeRO stage": plan.ds.zero_stage, "precision": plan.ds.precision,  # said first: what --ds names
            **{k: _meaning(k, v) for k, v in flatten(plan.run.cfg.to_dict()).items() if k not in NODE_PATHS},
            **{f"DeepSpeed {k}": v for k, v in flatten(plan.ds.config).items() if not k.endswith("nvme_path")}}
    digests = all_gather_objects(hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    everyone = all_gather_objects((mine, socket.gethostname()))  # in full, only where they differ
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    (first, _), (theirs, host) = everyone[0], everyone[other]
    keys = [k for k in dict.fromkeys([*first, *theirs]) if first.get(k, ()) != theirs.get(k, ())]

    def value(d: dict, key: str) -> str:
        return repr(d[key]) if key in d else "unset"

    said = "; ".join(f"{k} = {value(theirs, k)} there, {value(first, k)} on rank 0" for k in keys[:3]) + \
        ("; ..." if keys[3:] else "")
    raise ConfigError(f"rank {other} (on {host}) resolved another run than rank 0: {said}; start every node with the "
                      f"same run file, --ds and --set (data paths and the run directory's may differ)")


def check_shared(plan: Plan, world: World) -> None:
    """Under several nodes, the run directory must be one that every node sees: every node writes checkpoints into
    it and reads them back on resume, and a node-local folder of the same name would lose them silently. Local rank
    0 of each node writes a token named by a nonce of rank 0's into `RUN/.nodes/`, then looks for every node's
    (up to $HARNESS_SHARED_WAIT_S, default 30 s); a node that misses one refuses on every rank. Collective, but
    only where torchrun says the world spans nodes (LOCAL_WORLD_SIZE < WORLD_SIZE)."""
    import secrets
    import socket

    from ..distributed.world import all_gather_objects, barrier

    # torchrun's names, else DeepSpeed's own launcher's (pdsh: deepspeed/launcher/launch.py)
    local_size = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world.world_size
    if int(local_size) >= world.world_size:
        return
    node = os.environ.get("GROUP_RANK") or os.environ.get("CROSS_RANK") or socket.gethostname()
    local0 = os.environ.get("LOCAL_RANK", "0") == "0"
    seen = all_gather_objects((node, secrets.token_hex(8) if world.rank == 0 else None))
    nodes, nonce = sorted({n for n, _ in seen}, key=str), seen[0][1]
    folder = plan.run_dir / ".nodes"
    if local0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{nonce}-{node}").write_text(socket.gethostname())
    barrier()
    missing = []
    if local0:
        deadline = time.time() + shared_wait_s()
        while (missing := [n for n in nodes if not (folder / f"{nonce}-{n}").exists()]) and time.time() < deadline:
            time.sleep(0.5)
    problems = [p for p in all_gather_objects((node, socket.gethostname(), missing) if missing else None) if p]
    if local0:
        (folder / f"{nonce}-{node}").unlink(missing_ok=True)
    if problems:
        node, host, missing = problems[0]
        raise ConfigError(f"{plan.run.describe('run.output_dir')}: {plan.run_dir.absolute()} is not on storage every "
                          f"node shares: node {node} ({host}) does not see what node {', '.join(map(str, missing))} "
                          f"wrote there. Every node writes checkpoints into it and reads them back on resume: put it "
                          f"on a shared file system (NFS, Lustre, GPFS), the same path on every node")
