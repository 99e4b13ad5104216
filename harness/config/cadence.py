"""How often a run evaluates, checkpoints and loses patience, in the unit that follows the data.

`train.eval_every` and `train.save_every`: a whole number of steps (`200`), or a string: `"0.5 epochs"` (a share of
an epoch, any positive number), `"20 per run"` (that many times over the run's steps) or `"200 steps"`.
`train.early_stopping_patience`: a whole number of evaluations (`5`), or `"3 epochs"` (as many evaluations as cover
that much training, rounded up) or `"5 evaluations"`.
A run on a few hundred rows has a few steps per epoch: "1 epoch" evaluates it as often as it sees new data, where a
fixed 200 steps would evaluate a 120-step run only at its end. The strings are checked as the config is read; steps
are known once the data is (`resolve`), and a cadence that comes to 0 steps is refused there, in one line.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

UNITS = {"train.eval_every": ("steps", "epochs", "per run"), "train.save_every": ("steps", "epochs", "per run"),
         "train.early_stopping_patience": ("evaluations", "epochs")}
_FORM = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(steps?|epochs?|per run|evaluations?)\s*$")


@dataclass(frozen=True)
class Cadence:
    amount: float
    unit: str  # one of UNITS[key]

    def __str__(self) -> str:
        return f"{self.amount:g} {self.unit}"


def parse(key: str, value: int | str) -> Cadence:
    """A cadence key's value; ValueError saying which forms it takes."""
    units = UNITS[key]
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{key} must be >= 0")
        return Cadence(float(value), units[0])
    m = _FORM.match(value)
    unit = m and (m.group(2) if m.group(2) == "per run" else m.group(2).rstrip("s") + "s")
    if not m or unit not in units:
        forms = {"steps": "200", "epochs": '"0.5 epochs"', "per run": '"20 per run"', "evaluations": "5"}
        raise ValueError(f"{key} must be {' or '.join(forms[u] for u in units)}; got {value!r}")
    amount = float(m.group(1))
    if unit in ("steps", "per run", "evaluations") and not amount.is_integer():
        raise ValueError(f"{key} = {value!r}: {unit} come whole")
    return Cadence(amount, unit)


@dataclass(frozen=True)
class Every:
    """The run's cadences in steps (evaluation, checkpoint; 0 = only at the end) and evaluations (patience)."""
    eval_steps: int
    save_steps: int
    patience: int

    def describe(self, steps_per_epoch: int) -> str:
        def one(steps: int) -> str:
            epochs = steps / steps_per_epoch
            return f"every {steps} steps ({epochs:.2g} epoch{'s' if epochs != 1 else ''})" if steps else "at the end"

        out = f"evaluate {one(self.eval_steps)}, checkpoint {one(self.save_steps)}"
        return out + (f", stop after {self.patience} evaluations without improvement" if self.patience else "")


def resolve(train, steps_per_epoch: int, max_steps: int, describe) -> Every:
    """`train`'s cadences in steps for a run of `max_steps` steps of `steps_per_epoch` (patience in evaluations);
    `describe(key)` is the config's "key = value (source)". ValueError (one line naming the key) for a cadence that
    comes to 0 steps."""
    def steps(key: str) -> int:
        c = parse(key, getattr(train, key.split(".")[1]))
        if c.amount == 0:
            return 0
        n = {"steps": c.amount, "epochs": math.floor(c.amount * steps_per_epoch + 0.5),  # halves up
             "per run": math.ceil(max_steps / c.amount)}[c.unit]  # at most that many times
        if n < 1:  # a share of an epoch below half a step
            raise ValueError(f"{describe(key)} comes to 0 steps in this run ({steps_per_epoch} steps per epoch, "
                             f"{max_steps} in all); give at least \"{1 / steps_per_epoch:.3g} epochs\" (one step)")
        return int(n)

    eval_steps, save_steps = steps("train.eval_every"), steps("train.save_every")
    # Patience in evaluations (epochs of patience without evaluations are refused as the config is read: run.py).
    c = parse("train.early_stopping_patience", train.early_stopping_patience)
    patience = int(c.amount) if c.unit == "evaluations" else \
        math.ceil(c.amount * steps_per_epoch / eval_steps) if c.amount and eval_steps else 0
    return Every(eval_steps, save_steps, patience)

