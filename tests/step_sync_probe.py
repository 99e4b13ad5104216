"""Run by test_parallel.py in a process of its own (a world of one): trains a small model for a few steps with one
DeepSpeed config twice, as DeepSpeed steps it and with `ds_patches.fewer_step_syncs`, on the same batches, with every
gradient made non-finite at one step and one parameter's at another; prints per step, for each, the weights (fp32
master values), the updates skipped, the loss scale and the host syncs of `engine.step()`, and whether told of
tensor parallelism it leaves DeepSpeed's check alone, and again with the fence told the DeepSpeed version is one it
was not checked on (DeepSpeed's own step must run), as one JSON line per config.
Usage: step_sync_probe.py DS_JSON..."""
import inspect
import json
import sys

import deepspeed
import torch
from torch import nn

from harness.bench.proxy import counting
from harness.distributed import ds_patches
from harness.distributed.ds_patches import fewer_step_syncs
from harness.distributed.parallel import _fp32
from harness.distributed.world import close_world, init_world
from harness.run.machine import check_precision

STEPS, ALL_BAD, ONE_BAD = 6, 2, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, poison):
        out = self.b(torch.tanh(self.a(x)))
        return out.float().pow(2).mean() + self.b.bias.float().sum() * poison  # poison: the bias's gradient only


def train(config: dict, fewer: bool) -> list[dict]:
    torch.manual_seed(0)
    model = Net()
    groups = [{"params": [model.a.weight, model.b.weight], "weight_decay": 0.1},
              {"params": [model.a.bias, model.b.bias], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if fewer:
        fewer_step_syncs(engine, tp_size=1)
    dtype = next(engine.module.parameters()).dtype
    data = torch.Generator().manual_seed(1)
    steps = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=data).to(dtype)
        loss = engine(x, float("inf") if step == ONE_BAD else 0.0)
        if step == ALL_BAD:
            loss = loss * float("inf")
        engine.backward(loss)
        with counting() as c:
            engine.step()
        steps.append({"weights": [_fp32(p).flatten().tolist() for p in engine.module.parameters()],
                      "skipped": engine.skipped_steps, "syncs": c.syncs,
                      "loss_scale": float(getattr(engine.optimizer, "loss_scale", 1.0))})
    engine.destroy()
    return steps


def kept_under_tensor_parallelism(config: dict) -> bool:
    """Whether, told of tensor parallelism, `fewer_step_syncs` leaves DeepSpeed's first check where it was."""
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True),
                                      config=config)
    fewer_step_syncs(engine, tp_size=2)
    o = engine.optimizer
    checks = [o.overflow_checker.has_overflow, o.overflow_checker.check] if hasattr(o, "overflow_checker") else \
        [o.has_overflow]
    engine.destroy()
    return all(inspect.ismethod(c) for c in checks)


init_world()
for path in sys.argv[1:]:
    config = json.loads(open(path).read())
    check_precision("fp16" if config["fp16"]["enabled"] else "bf16" if config["bf16"]["enabled"] else "fp32")
    result = {"deepspeed": train(config, False), "fewer": train(config, True),
              "kept_under_tp": kept_under_tensor_parallelism(config)}
    checked, ds_patches.version = ds_patches.version, lambda: "0.0.0"  # a DeepSpeed the fence does not know
    result["unknown_version"] = train(config, True)
    ds_patches.version = checked
    print(json.dumps(result), flush=True)
close_world()
