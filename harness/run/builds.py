"""DeepSpeed's JIT builds of C++/CUDA ops on this machine: the folder they go in (`extension_root`), the compilers
that show one runs, and the locks a build killed midway leaves behind, which every later start would wait on in
silence (`BuildLocks`: removed where proven stale, the wait said where it is not).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from pathlib import Path


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
