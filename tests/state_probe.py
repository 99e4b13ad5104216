"""Run by test_plan.py on one process: for each (DeepSpeed file, settings) given as JSON, the engine `harness train`
builds, stepped twice; prints one JSON line with its optimizer's state in bytes a parameter and the parameters ZeRO-3
holds whole (DeepSpeed's `ds_persist`), beside the figures the plan's memory counts for them."""
import json
import sys

import torch

from harness.api import _plan
from harness.config.ds import persistent_params
from harness.distributed.parallel import build_engine, release
from harness.distributed.world import close_world, init_world

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.seq_len=16", "train.micro_batch_size=2",
        "train.max_steps=10"]

world = init_world()
for ds, sets in json.loads(sys.argv[1]):
    plan = _plan("plan", None, [*TINY, *sets], ds, None)
    engine, _ = build_engine(plan, world, 10)
    for _ in range(2):
        loss = engine(torch.randint(0, 256, (2, 16))).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    params = list(engine.module.parameters())
    sizes = [getattr(p, "ds_numel", p.numel()) for p in params]
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO's wraps the torch optimizer
    held = sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)  # (a step count is no state a parameter)
    print(json.dumps({"ds": ds, "sets": sets, "state": held / sum(sizes), "planned": plan.ds.optimizer_state[0],
                      "persistent": sum(n for p, n in zip(params, sizes) if getattr(p, "ds_persist", False)),
                      "planned_persistent": persistent_params(sizes, plan.ds)}), flush=True)
    release(engine)
close_world()
