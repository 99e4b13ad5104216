"""How a launched job ended, in one line and an exit code (`ending`): the ranks' own report where they made one
(which the ranks leave to this process to print), else torchrun's root cause read from its failure report
(`root_cause`: a rank killed by a signal, or one that failed on its own). Only a failure nobody explained shows
the ranks' tracebacks (what `Relay` held back, less torchrun's own).
"""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

from ..run.preemption import EXIT_PREEMPTED
from .relay import TORCHRUN_FRAMES, TORCHRUN_LOG


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
    from ..run.heartbeat import EXIT_HUNG
    from ..run.resume import resume_hint

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
    from ..run.heartbeat import beats

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
