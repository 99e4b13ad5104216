"""Stopping for the scheduler: SIGTERM (SLURM and Kubernetes send it before the kill), SIGINT (Ctrl-C) and SIGUSR1
(SLURM's `--signal` warning before the time limit) end a run with a checkpoint instead of a traceback.

A handler only records the signal. The loop carries "a signal came" in the collective it starts anyway about once
a second (`step.Span`), so every rank learns of it at the same step, however many got the signal, at no extra
sync: they finish that step, save a checkpoint, and the command exits with `EXIT_PREEMPTED`. Rank 0 says so once,
at that step: which ranks the signal reached first differs from one stop to the next (SLURM signals every process
of a step, launchers pass it on again), so no rank speaks on receiving it. A second signal changes nothing; SIGKILL
still ends a run at once.
"""
from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL, "try again later": resume with --resume auto


class Watch:
    """`with Watch() as watch:` records the first of SIGNALS this process gets in `watch.signal` (its name in
    `watch.name`); the handlers it replaced come back on exit. Outside the main thread (where Python cannot take
    signals) it records nothing."""

    def __init__(self):
        self.signal, self._before = None, {}

    @property
    def name(self) -> str | None:
        return None if self.signal is None else signal.Signals(self.signal).name

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def __enter__(self) -> Watch:
        if threading.current_thread() is threading.main_thread():
            self._before = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)
        self._before = {}
