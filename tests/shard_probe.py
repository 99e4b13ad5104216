"""Launched by test_sharding.py under `accelerate launch --use_deepspeed` (the CPU trap's exact set-up):
prints what each rank sees, as JSON, from rank 0."""
import json
import os
import sys

import torch

from harness.data import StepSampler
from harness.world import init_world

world = init_world()
from accelerate import PartialState  # noqa: E402  (after init, as the harness does)

sampler = StepSampler(n=103, micro=2, accum=3, dp_rank=world.dp_rank, dp_size=world.dp_size, seed=7,
                      start_step=0, max_steps=4)
mine = torch.tensor([i for batch in sampler for i in batch])
gathered = [torch.zeros_like(mine) for _ in range(world.world_size)]
torch.distributed.all_gather(gathered, mine)
if world.is_main:
    print(json.dumps({"accelerate_num_processes": PartialState().num_processes, "world_size": world.world_size,
                      "indices": [g.tolist() for g in gathered],
                      "global": [sampler.step_indices(s).flatten().tolist() for s in range(4)]}))
torch.distributed.destroy_process_group()
# Leave without running C++ static destructors: under load this bare DeepSpeed set-up has aborted at exit on one
# rank ("terminate called without an active exception", SIGABRT) after printing everything. What the test reads is
# written and flushed by then; the harness's own processes have not shown it.
sys.stdout.flush()
os._exit(0)
