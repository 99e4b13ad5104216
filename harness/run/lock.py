"""Who owns a run directory: `RUN/.lock`, held by rank 0 of the run training in it.

The file names its holder (host, pid, since when). A background thread touches it every HEARTBEAT_S seconds,
so a holder on another host counts as gone once the file is older than STALE_S; on this host, once its process
is (its pid and start time: a pid given since to another process is not the holder).
A second run (or a `--resume`) into a live directory is refused before launch, naming the holder; a lock whose
holder is gone (a SIGKILL, a lost node) is taken over with a note. A run that ends in any way it can catch
(done, bad input, non-finite stop, a signal) removes its lock.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from ..config.run import ConfigError
from .heartbeat import every, running_here, started

LOCK = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 180.0


def holder(run_dir: Path) -> dict | None:
    """The lock's holder ({host, pid, since, ...} and its heartbeat's `age_s`), or None when there is no lock."""
    path = Path(run_dir) / LOCK
    try:
        info = json.loads(path.read_text())
        info["age_s"] = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # half-written or garbled: whoever wrote it is not a harness run we can name
        return {"host": "?", "pid": -1, "since": "?", "age_s": STALE_S + 1}
    return info


def alive(info: dict) -> bool:
    here = running_here(info["host"], info["pid"], info.get("started"))
    return info["age_s"] < STALE_S if here is None else here


def describe(info: dict) -> str:
    return f"pid {info['pid']} on {info['host']}, since {info['since']}"


def check(run_dir: Path) -> str | None:
    """Before launch: raise ConfigError if a live run holds `run_dir`; a note if a dead one's lock is left."""
    info = holder(run_dir)
    if info is None:
        return None
    if alive(info):
        raise ConfigError(f"{run_dir} is in use by another run ({describe(info)}; its lock {Path(run_dir) / LOCK} "
                          f"was renewed {info['age_s']:.0f} s ago): wait for it to end, or set run.output_dir")
    return f"note: {run_dir}: taking over the lock of a run that is gone ({describe(info)})"


class Lock:
    """Held by rank 0 while it trains in `run_dir`; `release()` ends it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": started(os.getpid()),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.me) + "\n")
        try:
            os.link(tmp, self.path)  # atomic, and fails if a lock is there (also on NFS)
        except FileExistsError:
            info = holder(run_dir)
            if info is not None and alive(info):  # it started between our check and now
                tmp.unlink()
                raise ConfigError(f"{run_dir} is in use by another run ({describe(info)}): set run.output_dir")
            os.replace(tmp, self.path)
        else:
            tmp.unlink()
        self._stop = every(HEARTBEAT_S, lambda: os.utime(self.path), "harness-lock")

    def release(self) -> None:
        self._stop.set()
        info = holder(self.path.parent)
        if info and info.get("pid") == self.me["pid"] and info.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)
