"""Where numbers go: `metrics.jsonl` / `eval.jsonl` in the run directory, and an accelerate tracker
(Weights & Biases or TensorBoard). Rank 0 only; the other ranks get a tracker that does nothing.

W&B runs online when an API key is configured (WANDB_API_KEY or a netrc entry), otherwise offline with its
files under RUN/wandb/ (`wandb sync` uploads them later); WANDB_MODE, when set, always wins. Online, it waits
WANDB_INIT_TIMEOUT (default here 30 s) for the server, then logs offline instead, saying so. A tracker that fails
is dropped with one line and the run goes on: SLURM sends SIGTERM to every process of a job it cancels, wandb's
background process among them, and the run must still stop with its checkpoint; the jsonl files keep the whole
record. A run that stops with an exit code ends its W&B run with it (failed or preempted, not finished).
"""
from __future__ import annotations

import contextlib
import errno
import json
import netrc
import os
import shutil
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..config.run import RunConfig, TrainingStopped, flatten


def wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def read_jsonl(path: Path) -> list[dict]:
    """A run's records, each line that parses: a line a killed writer or a full disk cut short is left out."""
    return _records(path.read_text().splitlines() if path.is_file() else [])


def _records(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        with contextlib.suppress(ValueError):
            if isinstance(row := json.loads(line), dict):
                rows.append(row)
    return rows


def truncate_jsonl(path: Path, after_step: int) -> int:
    """Drop records past `after_step` (written by a run that crashed before its next checkpoint), and any line cut
    short: the file rewritten whole (a temporary file renamed) only where something is dropped. Returns the last step
    it had logged (0 for none)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    rows = _records(lines)
    kept = [row for row in rows if row.get("step", 0) <= after_step]
    if len(kept) < len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, path)
    return max((row.get("step", 0) for row in rows), default=0)


ONLINE = ("online", "run", "shared")  # WANDB_MODE values of a run that talks to the server
WANDB_ID = "wandb/harness_run_id"  # the W&B run a resume continues (one id per run directory)


def wandb_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of this run directory: the one its first start wrote, on a resume; a new one otherwise."""
    import uuid

    path = run_dir / WANDB_ID
    with contextlib.suppress(OSError):
        if resumed and (known := path.read_text().strip()):
            return known
    new = uuid.uuid4().hex[:8]
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(new + "\n")
    return new


class Tracker:
    def __init__(self, cfg: RunConfig, run_dir: Path, enabled: bool, resumed: bool = False,
                 layout: dict[str, Any] | None = None):
        """`resumed`: W&B continues the run directory's own W&B run (else a new one); `layout`: what the run config
        does not say (the world, ZeRO stage, precision, global batch), logged with it."""
        self.enabled, self.run_dir, self.backend = enabled, run_dir, None
        self.files: dict[str, Any] = {}  # open for the run, line-buffered: each record is on disk when logged
        if not enabled or cfg.logging.backend == "none":
            return
        from accelerate import tracking

        name = cfg.run.name or run_dir.name
        if cfg.logging.backend == "wandb":
            self._start_wandb(cfg.logging.project, name, resumed)
        else:
            self.backend = tracking.TensorBoardTracker(name, str(run_dir / "tensorboard"))
            self._call("start")  # an unwritable folder: one line, and on without it
        config = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)  # TensorBoard's hparams: scalars
                  for k, v in {**flatten(cfg.to_dict()), **(layout or {})}.items()}
        if self.backend is not None:
            self._call("store_init_configuration", config)

    def _start_wandb(self, project: str, name: str, resumed: bool) -> None:
        """W&B's run, online where a key is configured and the server answers in WANDB_INIT_TIMEOUT, else offline
        into RUN/wandb; its mode and folder said in one line."""
        import wandb
        from accelerate import tracking

        if "WANDB_MODE" not in os.environ and not wandb_has_key():
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_INIT_TIMEOUT", "30")  # wandb's own 90 s of silence before a run's first step
        run_id = os.environ.get("WANDB_RUN_ID") or wandb_id(self.run_dir, resumed)  # the user's id and resume win

        def start(say: bool) -> Exception | None:
            self.backend = tracking.WandBTracker(project, name=name, dir=str(self.run_dir), id=run_id,
                                                 resume=os.environ.get("WANDB_RESUME", "allow"))
            return self._call("start", say=say)  # e.g. a project name W&B refuses: one line, and on without it

        mode = os.environ.get("WANDB_MODE", "online")
        failed = start(say=mode not in ONLINE)
        if failed is not None and mode in ONLINE:  # no network, or a server that does not answer: keep it offline
            with contextlib.suppress(Exception):
                wandb.teardown()  # the failed run holds its id in wandb's service until then
            print(f"harness: logging.backend wandb: could not start online ({type(failed).__name__}: "
                  f"{(str(failed).splitlines() or [''])[0]}); logging offline instead", file=sys.stderr, flush=True)
            was, os.environ["WANDB_MODE"], mode = os.environ.get("WANDB_MODE"), "offline", "offline"
            try:
                start(say=True)
            finally:  # for this run alone: a later run of the same session tries the server again
                if was is None:
                    del os.environ["WANDB_MODE"]
                else:
                    os.environ["WANDB_MODE"] = was
        if self.backend is not None and mode in ("offline", "dryrun"):
            print(f"logging: W&B offline into {self.run_dir / 'wandb'} (`wandb sync` uploads it)", flush=True)
        elif self.backend is not None and mode in ONLINE:
            print(f"logging: W&B online, project {project}, run {run_id}", flush=True)
        elif self.backend is not None and mode == "disabled":  # wandb logs nothing then, and says nothing itself
            print(f"logging: W&B disabled (WANDB_MODE=disabled): metrics.jsonl and eval.jsonl in {self.run_dir} keep "
                  f"the record", flush=True)

    def log(self, record: dict[str, Any], file: str = "metrics.jsonl") -> None:
        if not self.enabled:
            return
        whole = None  # the file's length before this record
        try:
            if file not in self.files:
                self.files[file] = (self.run_dir / file).open("a", buffering=1)
            whole = self.files[file].tell()
            self.files[file].write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk (or a quota, a file-size limit): the run cannot keep its record
            stream = self.files.pop(file, None)
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()  # its buffer's flush fails again
            if whole is not None:
                with contextlib.suppress(OSError):  # the record whole or not there (shrinking needs no room)
                    os.truncate(self.run_dir / file, whole)
            free = shutil.disk_usage(self.run_dir).free / 2**30
            kept = "its last checkpoint kept" if (self.run_dir / "checkpoints" / "latest").is_file() else \
                "no checkpoint saved yet (a resume starts at step 0)"
            fix = {errno.ENOSPC: "make room", errno.EDQUOT: "make room",
                   errno.EFBIG: "raise the file-size limit (ulimit -f)"}.get(e.errno, "fix that")
            raise TrainingStopped(f"{self.run_dir / file}: a record of step {record.get('step')} could not be "
                                  f"written ({e.strerror or e}; {free:.2f} GiB free there); the run stops, {kept}: "
                                  f"{fix} and continue with --resume auto") from None
        if self.backend is not None:
            prefix = "eval/" if file == "eval.jsonl" else "train/"
            # (its wall-clock time: the tracker keeps its own)
            values = {prefix + k: v for k, v in record.items() if k not in ("step", "time") and v is not None}
            self._call("log", values, step=record["step"])

    def close(self, exit_code: int = 0) -> None:
        """`exit_code`: the run's, where it stops with one (W&B then lists it as failed, not finished)."""
        for f in self.files.values():
            with contextlib.suppress(OSError):  # a write that failed is said where it failed (`log`)
                f.close()
        self.files.clear()
        if self.backend is not None:
            if exit_code and self.backend.name == "wandb":
                self._call(self.backend.run.finish, exit_code=exit_code)
            else:
                self._call("finish")
            self.backend = None

    def _call(self, method, *args, say: bool = True, **kwargs) -> Exception | None:
        """The backend's `method` (a name, or a function), or the exception it raised, the backend then dropped
        (`say`: with one line)."""
        try:
            (method if callable(method) else getattr(self.backend, method))(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the tracker raises, the run's own record is the jsonl files
            if say:
                what = getattr(method, "__name__", method)
                print(f"harness: logging.backend {self.backend.name}: {what} failed ({type(e).__name__}: {e}); going "
                      f"on without it (metrics.jsonl and eval.jsonl in {self.run_dir} keep the record)",
                      file=sys.stderr, flush=True)
            self.backend = None
            return e
        return None
