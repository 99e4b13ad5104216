"""Hung and lost ranks: a collective that waits longer than `train.collective_timeout_s`, or whose peer went away,
ends the job, naming the rank.

A rank that stops answering (SIGSTOP, stuck in I/O, a GPU hang) leaves the others waiting in their next
collective. The process group is created with that timeout, so they fail after it instead of never. To say which
rank it was, every rank keeps `RUN/.ranks/rank_N.json` (its host, pid, the last step it finished and when) up to
date from a background thread; the ranks that timed out read those files and name the ones behind: a stopped
process's thread stops too (its file goes stale), a rank stuck in I/O still beats but stays at an older step.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

EXIT_HUNG = 4
DIR = ".ranks"


class RankHung(Exception):
    """A collective timed out: a rank stopped answering. Exit code 4."""


def every(seconds: float, write, name: str) -> threading.Event:
    """Call `write()` every `seconds` from a daemon thread until the returned event is set, or until `write` raises
    OSError (the run directory went away: nothing to write to). The lock (`lock.py`) and the heartbeat both beat so."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(seconds):
            try:
                write()
            except OSError:
                return

    threading.Thread(target=run, name=name, daemon=True).start()
    return stop


class Heartbeat:
    """`RUN/.ranks/rank_N.json`, rewritten every `every_s` seconds with `step` (set by the loop) until `stop()`."""

    def __init__(self, run_dir: Path, rank: int, every_s: float):
        self.path = Path(run_dir) / DIR / f"rank_{rank:05d}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.step, self.every_s, self.started = rank, 0, every_s, started(os.getpid())
        self._write()
        self._stop = every(every_s, self._write, "harness-heartbeat")

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                                   "started": self.started, "step": self.step, "time": time.time()}))
        os.replace(tmp, self.path)

    def stop(self) -> None:
        self._stop.set()
        try:  # the step it stopped at, for the launcher's last line (`launcher.ending._last_step`)
            self._write()
        except OSError:
            pass


def started(pid: int) -> int | None:
    """When process `pid` started (Linux /proc: clock ticks since boot), None if there is none: with its pid, it
    names one process, where a pid alone may since have been given to another (a restarted container's)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def running_here(host: str, pid: int, since: int | None = None) -> bool | None:
    """Whether process `pid` of `host`, started at `since` (`started`; any process of that pid when not recorded),
    still runs: known on this host only (None elsewhere). A heartbeat's rank, the run directory's lock holder."""
    if host != socket.gethostname():
        return None
    now = started(pid)
    return now is not None and since in (None, now)


def beats(run_dir: Path) -> dict[int, dict]:
    """Each rank's last heartbeat that reads whole (RUN/.ranks/), by rank."""
    out = {}
    for path in (Path(run_dir) / DIR).glob("rank_*.json"):
        try:
            beat = json.loads(path.read_text())
            out[int(beat["rank"])] = beat
        except (OSError, ValueError, KeyError, TypeError):  # being replaced, or cut short
            continue
    return out


def diagnose(run_dir: Path, world_size: int, me: int, timeout_s: float, every_s: float, lost: bool = False,
             step: int | None = None) -> RankHung:
    """The error to raise on rank `me`, whose last finished step is `step`, after a collective timed out (or, `lost`,
    lost its connection to a peer): the ranks whose process is gone, whose heartbeat went stale or who are behind
    the others, from their files."""
    now, found = time.time(), beats(run_dir)
    heard = {rank: found.get(rank) for rank in range(world_size)}
    running = {r: b and running_here(b["host"], b["pid"], b.get("started")) for r, b in heard.items()}
    gone = [r for r in heard if running[r] is False]
    silent = [r for r, b in heard.items() if b is None or now - b["time"] > 3 * every_s]
    steps = {r: b["step"] for r, b in heard.items() if b is not None}
    behind = [r for r, s in steps.items() if s < max(steps.values(), default=0)]
    # lost and none gone here: the ranks not seen running on this machine (another machine's: its own ranks see)
    if lost:
        suspects = gone or [r for r in range(world_size) if r != me and running[r] is not True]
    else:
        suspects = sorted(set(gone) | set(silent) | set(behind))
    suspects = suspects or [r for r in range(world_size) if r != me]

    def say(r: int) -> str:
        b = heard[r]
        if b is None:
            return f"rank {r} (never reported)"
        where = f"pid {b['pid']} on {b['host']}"
        if lost:  # its file is up to every_s old: its step and age would mislead; the ranks were at `step` together
            return f"rank {r} ({where}{': its process is gone' if r in gone else ''})"
        state = "its process is gone; " if r in gone else ""
        # (its file is written every every_s: the rank may have finished steps after the one it names)
        return f"rank {r} ({where}: {state}had finished step {b['step']} when last heard of, " \
               f"{now - b['time']:.0f} s ago)"

    from .resume import resume_hint

    then = f"Ending the job; {resume_hint(Path(run_dir) / 'checkpoints')}"
    if lost:
        after = f" after step {step}" if step is not None else ""
        return RankHung(f"rank {me}: a collective{after} lost its connection to another rank (a rank that died: "
                        f"killed, out of memory, or its node went down); {'gone' if gone else 'suspects'}: "
                        f"{', '.join(say(r) for r in suspects)}. {then}")
    return RankHung(f"rank {me}: a collective got no answer within train.collective_timeout_s = {timeout_s:g} s; "
                    f"stopped answering: {', '.join(say(r) for r in suspects)}. {then}")
