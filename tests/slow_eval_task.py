"""A plug-in task for tests/test_resilience.py: examples/digits_task.py, each micro-batch of whose evaluation takes
SLOW_EVAL_S seconds more (the environment's), so that a signal can be sent while the ranks evaluate; with
SIGNAL_AT_STEP=K (SIGNAL_IN_EVAL=K), each process sends itself SIGTERM in the forward of its K-th training
(evaluation) micro-batch."""
from __future__ import annotations

import os
import signal
import time

import torch

from examples.digits_task import DigitsTask


class SlowEvalDigits(DigitsTask):
    trained = evaluated = 0  # training and evaluation micro-batches this process has run

    def loss_from(self, prediction, batch) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the harness evaluates without gradients
            time.sleep(float(os.environ.get("SLOW_EVAL_S", "0")))
            self.evaluated += 1
            if self.evaluated == int(os.environ.get("SIGNAL_IN_EVAL", "0")):
                os.kill(os.getpid(), signal.SIGTERM)
        elif prediction.device.type != "meta":  # (not the count of FLOPs on the meta device)
            self.trained += 1
            if self.trained == int(os.environ.get("SIGNAL_AT_STEP", "0")):
                os.kill(os.getpid(), signal.SIGTERM)
        return super().loss_from(prediction, batch)
