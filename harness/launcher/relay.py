"""The job's stderr (torchrun's and every rank's), relayed to ours as it comes (`Relay`). torchrun's tracebacks,
its failure report and the ranks' tracebacks from the moment the job started failing are held back from the
terminal and kept, with everything else the job wrote to stderr, in `RUN/launch.log` (`Relay.save`; of a progress
bar, its last frame: `kept_lines`); `ending.py` decides what of them the user sees.
"""
from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

# torchrun's log lines (glog: level, date, time, pid, file) and the marks of its own tracebacks
TORCHRUN_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/\S+\] ")
TRACEBACK = b"Traceback (most recent call last):"
TORCHRUN_FRAMES = (b"torch/distributed/elastic/", b"torch/distributed/launcher/", b"torch/distributed/run.py",
                   b"accelerate/commands/launch.py")


class Relay:
    """The job's stderr (torchrun's and every rank's), which they write to the file `path`, passed on to ours as it
    comes. A file, not a pipe: should this process die, the ranks still write (to a closed pipe they would get
    BrokenPipeError in the middle of saving). From the first traceback or torchrun failure line on, lines are held
    back instead: the job is ending, and `ending` decides what the user sees. Held lines are let through after
    `release_s` if the job goes on (a traceback some library printed and survived)."""

    def __init__(self, path: Path, sink, release_s: float = 30.0, every_s: float = 0.05):
        self.path, self.sink, self.release_s, self.every_s = Path(path), sink, release_s, every_s
        self.held: list[bytes] = []
        self.holding_since: float | None = None
        self.final = False  # a torchrun failure line is held: the job is ending, nothing is let through
        self._line = b""  # the line being read, its start not yet passed on (it may begin a traceback)
        self._passing = False  # the line being read was passed on as it came (a progress bar redrawn with \r)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="harness-relay", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        with self.path.open("rb") as source:
            while True:
                done = self._done.is_set()  # read once more after the job ended: all it wrote
                chunk = source.read(1 << 16)
                if chunk:
                    self.feed(chunk)
                elif done:
                    break
                else:
                    self._done.wait(self.every_s)
        if self._line:
            self._segment(self._line)
            self._line = b""

    def finish(self) -> None:
        """Once the job has ended: relay the rest and stop."""
        self._done.set()
        self._thread.join()

    def feed(self, chunk: bytes) -> None:
        """Pass on, hold or keep `chunk`, in segments ending at a newline or a carriage return (a progress bar
        redraws its line after each \\r: a segment, shown as it comes)."""
        if self.holding_since is not None and not self.final and time.monotonic() - self.holding_since > \
                self.release_s:
            self._write(b"".join(self.held))
            self.held, self.holding_since = [], None
        *segments, self._line = re.split(rb"(?<=[\r\n])", self._line + chunk)
        for segment in segments:
            self._segment(segment)
        if self._line and self.holding_since is None and not _may_begin_failure(self._line):
            self._write(self._line)  # its start is known not to begin a failure: shown as it comes
            self._line, self._passing = b"", True
        elif self._line and self._passing:  # what follows a progress bar on its line may begin a failure: wait
            self._passing = False

    def _segment(self, segment: bytes) -> None:
        failing = _failing(segment)
        if self._passing:  # its start is on the terminal already (a progress bar's line, never ended)
            self._passing = False
            if not failing:
                self._write(segment)
                return
            self._write(b"\n")  # the bar's line ends; what failed is held below
        if segment.startswith(b"harness: ") or (self.holding_since is None and not failing):
            self._write(segment)
            return
        if self.holding_since is None:
            self.holding_since = time.monotonic()
        self.final = self.final or bool(TORCHRUN_LOG.match(segment))  # torchrun is ending the job: never let go
        self.held.append(segment)

    def _write(self, data: bytes) -> None:
        if data:
            self.sink.write(data)
            self.sink.flush()

    def held_text(self) -> str:
        return b"".join(self.held).decode(errors="replace")

    def save(self, run_dir: Path, machine_rank: int) -> Path:
        """Everything the job wrote to stderr, appended to `RUN/launch.log` (`launch_nodeK.log` on node K > 0) once
        the run has a directory of its own (its config is written); else the file it was written to stays."""
        name = "launch.log" if machine_rank == 0 else f"launch_node{machine_rank}.log"
        if not (run_dir / "config.toml").is_file():
            return self.path
        path = run_dir / name
        with path.open("ab") as out, self.path.open("rb") as kept:
            out.write(f"=== harness launch on {socket.gethostname()}, ended {time.strftime('%Y-%m-%d %H:%M:%S')}"
                      f" ===\n".encode())
            out.writelines(kept_lines(kept))
        self.path.unlink()
        return path


ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")  # a terminal's cursor moves (a second bar's redraws go up and down)
BAR = re.compile(rb"^(.*?)\s*\d+%\|")  # a tqdm frame: its description, before the percentage


def kept_lines(lines):
    """What launch.log keeps of the job's stderr: its lines as written, but of a terminal's progress bars (redrawn
    after each \\r, each second; an evaluation's below the training bar's, each redraw on a line of its own) each
    bar's last frame before something else was written, one a line: a day's run had kept 86,400 frames."""
    pending = None  # (its description, the frame): the bar's frame last drawn, not yet written
    for line in lines:
        body = ANSI.sub(b"", line).rstrip(b"\r\n")
        if b"\r" not in body:
            if pending:
                yield pending[1] + b"\n"
                pending = None
            yield line
            continue
        for frame in filter(bytes.strip, body.split(b"\r")):  # (a blank frame: a bar cleared)
            bar = BAR.match(frame)
            if pending and (bar is None or bar[1] != pending[0]):
                yield pending[1] + b"\n"
                pending = None
            if bar is None:
                yield frame + b"\n"
            else:
                pending = (bar[1], frame)
    if pending:
        yield pending[1] + b"\n"


def _failing(segment: bytes) -> bool:
    """A traceback's first line, or torchrun logging an error or the signal it sends (the job is ending)."""
    return segment.startswith(TRACEBACK) or bool(TORCHRUN_LOG.match(segment) and (segment[:1] in b"EF" or
                                                                                  b"signal" in segment))


def _may_begin_failure(start: bytes) -> bool:
    """The start of a line that could still turn out to be a traceback or a torchrun log line."""
    return TRACEBACK.startswith(start[:len(TRACEBACK)]) or bool(re.match(rb"^[IWEF]\d{0,4}( |$)", start[:6]))
