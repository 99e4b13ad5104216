"""A plug-in task for tests/test_resilience.py: examples/digits_task.py, each micro-batch of whose evaluation takes
SLOW_EVAL_S seconds more (the environment's), so that a signal can be sent while the ranks evaluate; with
SIGNAL_AT_STEP=K (SIGNAL_IN_EVAL=K), each process sends itself SIGTERM in the forward of its K-th training
(evaluation) micro-batch; with SLOW_CHECK_S, its `check` sleeps. `SlowOwnEvalDigits`: the same with an `evaluate`
of its own (SIGNAL_IN_OWN_EVAL=K there)."""
from __future__ import annotations

import os
import signal
import sys
import time

import torch

from examples.digits_task import DigitsTask
from harness.data.batches import eval_batches


class SlowEvalDigits(DigitsTask):
    trained = evaluated = 0  # training and evaluation micro-batches this process has run

    def check(self, cfg) -> None:  # SLOW_CHECK_S: the checks before launch take that long, said first on stderr
        if wait := float(os.environ.get("SLOW_CHECK_S", "0")):
            print("checking slowly", file=sys.stderr, flush=True)
            time.sleep(wait)
        super().check(cfg)

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


class SlowOwnEvalDigits(SlowEvalDigits):
    """Its own `evaluate` (the field metric `mae`, e.g. for train.select_best), which asks `world.scored` after each
    micro-batch; OWN_EVAL_LOG=FILE: a line there per micro-batch it scores."""
    scored = 0

    @torch.no_grad()
    def evaluate(self, model, cfg, split, world, in_training: bool = False, data=None) -> dict[str, float]:
        samples = self.build_data(cfg).val if data is None else data
        batches, steps = eval_batches(len(samples), cfg.train.micro_batch_size, world.dp_rank, world.dp_size)
        errors = []
        for i in range(steps):
            real = i < len(batches)
            batch = self.collate([samples[j] for j in (batches[i] if real else batches[-1])])
            error = (model(batch["digits"].to(world.device)).float().cpu() - batch["target"]).abs()
            errors += error.tolist() if real else []
            self.scored += 1
            if log := os.environ.get("OWN_EVAL_LOG"):
                with open(log, "a") as f:
                    f.write(f"{i}\n")
            if self.scored == int(os.environ.get("SIGNAL_IN_OWN_EVAL", "0")):
                os.kill(os.getpid(), signal.SIGTERM)
            world.scored(i, steps)
        errors = [e for part in world.gather(errors) for e in part]
        return {"mae": sum(errors) / len(errors)}
