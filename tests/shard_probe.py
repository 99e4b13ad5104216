"""Launched by test_sharding.py under `accelerate launch --use_deepspeed` (the CPU trap's exact set-up): prints
what each rank sees, as JSON, from rank 0, and from every rank the gloo threads it still runs once the world is
closed (there must be none: world.py). With RUN DS [SET...]: every rank trains as `harness train` does instead, then
prints the same."""
import json
import os
import sys
from pathlib import Path

import torch

from harness.data.batches import StepSampler
from harness.distributed.world import close_world, init_world


def say(record: dict) -> None:
    """One JSON line in one write: the ranks share stdout, and two prints can interleave within a line."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def gloo_threads() -> list[str]:
    """This process's gloo threads (their names, from /proc): a process group's workers while it lives."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            names.append(comm.read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n)


if len(sys.argv) > 1:  # RUN DS [SET...]: `harness train`'s path (api.train): its engine and DeepSpeed's own groups
    from harness import api

    api.train(sys.argv[1], sys.argv[3:], ds=sys.argv[2])
    say({"rank": int(os.environ["RANK"]), "left_after_close": gloo_threads()})
    sys.exit()

world = init_world()
from accelerate import PartialState  # noqa: E402  (after init, as the harness does)

sampler = StepSampler(n=103, micro=2, accum=3, dp_rank=world.dp_rank, dp_size=world.dp_size, seed=7,
                      start_step=0, max_steps=4)
mine = torch.tensor([i for batch in sampler for i in batch])
gathered = [torch.zeros_like(mine) for _ in range(world.world_size)]
torch.distributed.all_gather(gathered, mine)
if world.is_main:
    say({"accelerate_num_processes": PartialState().num_processes, "world_size": world.world_size,
         "indices": [g.tolist() for g in gathered],
         "global": [sampler.step_indices(s).flatten().tolist() for s in range(4)]})
running = gloo_threads()
close_world()
say({"rank": world.rank, "gloo_threads": running, "left_after_close": gloo_threads()})
