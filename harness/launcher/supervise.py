"""The job: `accelerate launch` started in a session of its own and watched to its end (`supervise`).

- The ranks report how they ended to a file this process names (STATUS_ENV, `report`). A stop that every rank
  makes together (a non-finite loss, a signal) then exits 0 under torchrun, so it prints no failure report, and
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

from ..distributed.world import STATUS_ENV
from ..run.preemption import EXIT_PREEMPTED, SIGNALS
from .relay import Relay

COLLECTIVE_STOPS = (3, EXIT_PREEMPTED)  # every rank stops at the same step: safe to exit 0 under torchrun


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


def supervise(cmd: list[str], settings: dict) -> tuple[int, dict, Relay, int | None]:
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
        from ..console import STDERR_TTY_ENV

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
    from ..run.heartbeat import EXIT_HUNG

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
    from ..run.heartbeat import EXIT_HUNG

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
