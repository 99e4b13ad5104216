"""A plug-in task for tests/test_resilience.py: examples/digits_task.py, each micro-batch of whose evaluation takes
SLOW_EVAL_S seconds more (the environment's), so that a signal can be sent while the ranks evaluate."""
from __future__ import annotations

import os
import time

import torch

from examples.digits_task import DigitsTask


class SlowEvalDigits(DigitsTask):
    def loss_from(self, prediction, batch) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the harness evaluates without gradients
            time.sleep(float(os.environ.get("SLOW_EVAL_S", "0")))
        return super().loss_from(prediction, batch)
