"""Best checkpoint and early stopping: `train.select_best`, `train.select_mode`, `train.early_stopping_patience`.

Every evaluation's value of the selected metric is compared with the best so far (strictly better counts). An
improvement is checkpointed at its step; that checkpoint is named in `checkpoints/best`, outlives
`train.keep_checkpoints`, and is what the run exports. After `early_stopping_patience` evaluations in a row without
improvement the run stops (exit 0). The state (best value, its step, evaluations since) travels in every checkpoint,
so a resumed run takes the decisions an uninterrupted one takes; rank 0 records it in `RUN/best.json`.

Every rank decides alike: the metrics come from all-reduced sums (and gathered field evaluations), the same numbers
on every rank, so ranks agree without another collective on whether to save or stop.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config.run import ConfigError, TrainSection
from ..plan.resolve import metric_key
from .resume import step_name

BEST_FILE = "best.json"
# `auto` minimises a metric named (or ending, or starting) with one of these, and maximises any other.
LOWER_IS_BETTER = ("loss", "mse", "mae", "rmse", "perplexity", "nll", "bits_per_byte", "error")


def direction(name: str, mode: str) -> str:
    if mode != "auto":
        return mode
    key = metric_key(name)
    lower = any(key == w or key.endswith(f"_{w}") or key.startswith(f"{w}_") for w in LOWER_IS_BETTER)
    return "min" if lower else "max"


@dataclass
class Selection:
    metric: str               # the key in the evaluation's metrics
    mode: str                 # "min" or "max"
    patience: int             # 0: never stop early
    value: float | None = None  # the best so far; None before the first evaluation
    step: int = 0             # where it was measured (its checkpoint is checkpoints/step_<step>)
    since: int = 0            # evaluations since the best
    stopped_at: int = 0       # the step the run stopped early at; 0 while it goes on

    @classmethod
    def start(cls, t: TrainSection, patience: int, saved: dict | None) -> Selection | None:
        """None when `select_best` is off; else the state saved in a checkpoint, when it selected the same thing.
        `patience`: train.early_stopping_patience in evaluations (`config.cadence`)."""
        if not t.select_best:
            return None
        fresh = cls(metric_key(t.select_best), direction(t.select_best, t.select_mode), patience)
        if not saved or (saved["metric"], saved["mode"]) != (fresh.metric, fresh.mode):
            return fresh
        s = cls(fresh.metric, fresh.mode, fresh.patience, saved["value"], saved["step"], saved["since"])
        s.stopped_at = saved["stopped_at"] if s.patience and s.since >= s.patience else 0  # more patience: go on
        return s

    @staticmethod
    def resumed_note(t: TrainSection, saved: dict | None, step: int) -> str | None:
        """A line where a resume selects by another metric or direction than the checkpoint's run (its best is then
        left behind), or selects nothing now; None where it goes on with the same."""
        if not saved:
            return None
        then = f"{saved['metric']} ({saved['mode']}; best {saved['value']:.6g} at step {saved['step']})" \
            if saved.get("value") is not None else f"{saved['metric']} ({saved['mode']})"
        if not t.select_best:
            return f"note: train.select_best is off here, where the checkpoint's run selected by {then}: the export " \
                   f"is the last step's"
        now = (metric_key(t.select_best), direction(t.select_best, t.select_mode))
        if now == (saved["metric"], saved["mode"]):
            return None
        return f"note: train.select_best selects by {now[0]} ({now[1]}) here, where the checkpoint's run selected by " \
               f"{then}: the best is tracked anew from step {step + 1}"

    def state(self) -> dict:
        return asdict(self)

    def update(self, metrics: dict, step: int, savable: bool = True, final: bool = False) -> bool:
        """Take one evaluation; returns whether it is the new best. `savable`: its weights can be checkpointed (an
        evaluation after a non-finite step, which is never checkpointed, cannot be the best). `final`: the
        evaluation at the last step, where there is nothing left to stop."""
        if self.metric not in metrics or isinstance(metrics[self.metric], str):
            numbers = sorted(k for k, v in metrics.items() if not isinstance(v, str))
            raise ConfigError(f"train.select_best = {self.metric!r}: the validation evaluation at step {step} "
                              f"reports no such metric; it reports {', '.join(numbers) or 'nothing'}")
        value = float(metrics[self.metric])
        better = savable and math.isfinite(value) and (
            self.value is None or (value < self.value if self.mode == "min" else value > self.value))
        if better:
            self.value, self.step, self.since = value, step, 0
        else:
            self.since += 1
        if self.patience and self.since >= self.patience and not final:
            self.stopped_at = step
        return better

    def why_stopped(self) -> str:
        return (f"no improvement of validation {self.metric} ({self.mode}) in {self.since} evaluations "
                f"(train.early_stopping_patience: {self.patience} evaluations); best {self.value:.6g} at step "
                f"{self.step}")

    def record(self, run_dir: Path) -> None:
        """RUN/best.json (rank 0): what was selected, where, and why the run stopped early if it did."""
        record = {**self.state(), "checkpoint": f"checkpoints/{step_name(self.step)}" if self.value is not None else None,
                  "stopped_early": self.why_stopped() if self.stopped_at else None}
        path = run_dir / BEST_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
