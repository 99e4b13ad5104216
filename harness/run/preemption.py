"""Stopping for the scheduler: SIGTERM (SLURM and Kubernetes send it before the kill), SIGINT (Ctrl-C) and SIGUSR1
(SLURM's `--signal` warning before the time limit) end a run with a checkpoint instead of a traceback.

A handler only records the signal. The loop carries "a signal came" in the collective it starts anyway about once
a second (`step.Span`), so every rank learns of it at the same step, however many got the signal, at no extra
sync: they finish that step, save a checkpoint, and the command exits with `EXIT_PREEMPTED`. Rank 0 says so once,
at that step: which ranks the signal reached first differs from one stop to the next (SLURM signals every process
of a step, launchers pass it on again), so no rank speaks on receiving it. A second signal changes nothing; SIGKILL
still ends a run at once.

An evaluation runs no steps: the ranks ask each other whether a signal came (`cut_between`, a small collective of
its own) after its micro-batches 1, 2, 4, ..., `CUT_EVERY` and every `CUT_EVERY` more, and after each batch of a
task's own evaluation, whose batches may take seconds each (decoding), where it asks through `World.scored` (the
built-in tasks do). If one came, every rank stops it at the same batch, and the run stops as after a step, with a
checkpoint that owes the evaluation (a resumed run makes it first). Once an evaluation in training is whole they
ask again (`agreed`), so the run stops at that step.

Before the loop watches, while a rank starts (imports, the process group, the model), SIGTERM and SIGUSR1 would
kill it by their default action, which the launcher reads as a crash (exit 4 or 1) that no scheduler requeues:
`starting` takes them from the process's first line, and the run stops with EXIT_PREEMPTED, nothing saved.
"""
from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL, "try again later": resume with --resume auto
_early: list[int] = []  # a scheduler's signal that came while the run was starting (`starting`)
_armed: list[bool] = []  # where Preempted is caught: raised at once (`stop_if_signalled`)


def starting() -> None:
    """At a training process's first line: a scheduler's signal (SIGTERM, SIGUSR1; Ctrl-C keeps its
    KeyboardInterrupt) stops the run until the loop's Watch takes it; recorded until `stop_if_signalled`."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, _starting)


def _starting(signum, frame) -> None:
    _early.append(signum)
    if _armed:
        stop_if_signalled()


def stop_if_signalled() -> None:
    """Raise Preempted for a signal that came while the run was starting, and from now on at once when one comes."""
    from ..config.run import Preempted

    _armed.append(True)
    if _early:
        raise Preempted(f"stopped by {signal.Signals(_early[0]).name} while the run was starting, before its first "
                        f"step: nothing was saved; --resume auto goes on from the run's last checkpoint, if it has one")


CUT_EVERY = 32  # an evaluation's micro-batches between two checks for a signal (a collective each), at most


def checks_after(i: int) -> bool:
    """Whether the ranks ask for a signal after an evaluation's micro-batch `i` (from 0): after 1, 2, 4, ...,
    CUT_EVERY of them, then every CUT_EVERY more (an evaluation of a few slow batches is cut short too)."""
    return (i + 1) % CUT_EVERY == 0 or (i + 1) & i == 0


class Cut(Exception):
    """An evaluation stopped by a stop signal, raised alike on every rank (`cut_if_signalled`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def agreed(signalled: int | None, world) -> int:
    """Collective: the stop signal any rank got (the highest number of them), the same on every rank; else 0."""
    import torch

    from ..distributed.world import all_reduce

    got = all_reduce(torch.tensor([signalled or 0], device=world.device), torch.distributed.ReduceOp.MAX)
    return int(got.item())  # sync point (in evaluations only, see cut_between)


def cut_if_signalled(signalled: int | None, world) -> None:
    """Collective: raise Cut on every rank if any rank got a stop signal, else return."""
    if got := agreed(signalled, world):
        raise Cut(got)


def cut_between(i: int, steps: int, signalled: int | None, world, every: bool = False) -> None:
    """After an evaluation's micro-batch `i` of `steps`, on every rank: `cut_if_signalled` where `checks_after(i)`
    (`every`: after each batch), but not after the last (the loop asks then, `agreed`, and keeps the whole
    evaluation)."""
    if (every or checks_after(i)) and i + 1 < steps:
        cut_if_signalled(signalled, world)


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
            before = {s: signal.signal(s, self._handle) for s in SIGNALS}
            # the start is over: after the loop (a lost peer's diagnosis, torchrun's stop) a signal acts as it did
            self._before = {s: signal.SIG_DFL if h is _starting else h for s, h in before.items()}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)
        self._before = {}
