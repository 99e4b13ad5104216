"""Progress on a terminal or in a log: a tqdm bar where stderr is a terminal (or `harness launch` relays the ranks'
stderr to one), else one plain line every `every` seconds, with no carriage-return frames in the log."""
from __future__ import annotations

import os
import sys

STDERR_TTY_ENV = "HARNESS_STDERR_TTY"  # set by `harness launch`: the ranks' stderr is a file it relays to a terminal


def on_terminal() -> bool:
    return sys.stderr.isatty() or bool(os.environ.get(STDERR_TTY_ENV))


def progress(iterable=None, *, every: float = 30.0, **kwargs):
    """tqdm(iterable, **kwargs) on stderr: redrawn each second on a terminal, a line every `every` s in a log."""
    from tqdm.auto import tqdm

    if on_terminal():
        kind = _relayed(tqdm) if os.environ.get(STDERR_TTY_ENV) else tqdm
        return kind(iterable, mininterval=1.0, dynamic_ncols=True, file=sys.stderr, **kwargs)
    return _lines()(iterable, mininterval=every, ncols=100, file=sys.stderr, **kwargs)


def write(line: str) -> None:
    """A line between a bar's redraws (an evaluation's figures)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr if os.environ.get(STDERR_TTY_ENV) else None)


def _relayed(base):
    class Relayed(base):
        """Under `harness launch` the bar reaches the terminal through the launcher's relay of stderr, while stdout
        goes straight there: a line tqdm writes to stdout lands in the middle of the bar, so lines go where it goes."""

        @classmethod
        def write(cls, s, file=None, end="\n", nolock=False):
            super().write(s, file=file or sys.stderr, end=end, nolock=nolock)

    return Relayed


def _lines():
    from tqdm import tqdm

    class Lines(tqdm):
        """Each refresh one plain line. At the end the last line, unless one at the same count was just written; a
        bar that leaves nothing behind (leave=False) says where it ended too if it said where it began."""
        shown: int | None = None  # the count of the last line written
        # no monitor thread: it redraws a bar every 10 s, and an iterable's count moves only when the bar draws
        # itself, so its lines repeated a stale count with a later time
        monitor_interval = 0

        def display(self, msg=None, pos=None):
            if msg == "":  # tqdm's "clear the line": nothing to clear in a log (False: no "\r" either)
                return False
            self.fp.write((msg or self.__str__()) + "\n")
            self.fp.flush()
            self.shown = self.n
            return True

        def clear(self, nolock=False):  # around tqdm.write's lines (the evaluations): nothing drawn to clear
            pass

        def close(self):  # tqdm ends a bar it leaves with a newline of its own: the last line alone instead
            if not self.disable and (self.leave or self.shown is not None) and self.shown != self.n:
                self.display()
            self.leave = False
            super().close()

    return Lines
