"""The reference for the harness's own cost: a hand-written DeepSpeed loop, nothing else.

`python -m harness.bench.reference --run RUN.toml --ds DS.json [--set ...] --steps N` (under `accelerate launch`
for several processes) builds the engine exactly as `harness train` does (`parallel.build_engine`: the same
model, AdamW, schedule and resolved DeepSpeed config; set-up is not timed) and reads the same batches (the
harness's sampler and loader), then trains the way a 60-line script would: for each micro-batch forward,
`engine.backward(loss / items)`, `engine.step()`, and the step's loss to the host. No global item count, work
counters, grad-norm read, logging, progress bar, checkpoint or evaluation. Where the harness clips gradients
in its loop rather than in DeepSpeed (ZeRO-0 in fp32, see `ds_config.py`), this loop clips them too: the same
training, as a script would have to write it. Rank 0 prints one JSON line:
{"step_s": [seconds of each step, fetch to fetch], "loss": [the step's loss, averaged over the ranks]}, and
with `--profile` the summary of one more step traced by torch.profiler under the harness loop's section names.

The loss is each micro-batch's own mean, where the harness divides by the step's global item count: the two
agree where every micro-batch counts the same items (fixed-length language modelling, what the overhead study
trains), which is what makes the comparison fair, and what its losses check shows. A pipeline has no per-batch
forward to write by hand: it is refused.
"""
from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.reference")
    ap.add_argument("--run")
    ap.add_argument("--ds", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--profile", action="store_true", help="trace one more step after them (profiling.py)")
    args = ap.parse_args(argv)

    import torch

    from .. import profiling
    from ..config import ConfigError
    from ..data import StepSampler, train_batches
    from ..parallel import build_engine, release
    from ..startup import make_plan
    from ..world import (accelerate_mixed_precision, all_gather_objects, barrier, close_world, init_world,
                         launched_world_size)

    plan = make_plan(args.run, args.set, args.ds, launched_world_size(), accelerate_mixed_precision())
    if plan.ds.layout.pp_size > 1:
        raise ConfigError("the reference loop has no pipeline schedule: leave pipeline configs out of --overhead")
    cfg, task, accum = plan.run.cfg, plan.task, plan.ds.grad_accum_steps
    world = init_world(plan.ds.layout)
    data = task.build_data(cfg)
    engine, _ = build_engine(plan, world, cfg.train.max_steps)
    sampler = StepSampler(len(data.train), cfg.train.micro_batch_size, accum, world.dp_rank, world.dp_size,
                          cfg.train.seed, 0, args.steps + args.profile, bucket=cfg.data.bucket,
                          lengths=task.lengths(data.train) if cfg.data.bucket else None)
    loader = train_batches(data.train, sampler, task.collate, cfg.data.num_workers, cfg.train.seed, world.device)
    times, losses, profile = [], [], None
    last = time.perf_counter()
    for step in range(args.steps + args.profile):
        traced = profiling.StepProfile(world.device) if step == args.steps and world.is_main else None
        mark = traced.section if traced else profiling.unmarked  # the harness's names for the same parts
        total = torch.zeros((), device=world.device)
        for i in range(accum):
            with mark("data"):
                batch = next(loader)
            items = task.count(batch)  # host tensors: no sync
            with mark("to device"):
                batch = {k: v.to(world.device, non_blocking=True) for k, v in batch.items()}
            with mark("engine"):
                loss = task.loss(engine, batch) / items
                engine.backward(loss)
            if plan.ds.loop_clips and i == accum - 1:  # ZeRO-0 fp32: clipped here, not by DeepSpeed (ds_config.py)
                with mark("grad norm"):
                    torch.nn.utils.clip_grad_norm_(engine.module.parameters(), plan.ds.loop_clips)
            with mark("engine"):
                engine.step()
            total += loss.detach().float()
        with mark("loss to host"):
            loss_value = total.item() / accum  # sync point: the step's loss on the host, as any script prints it
        if traced:
            profile = traced.finish(0.0, step + 1)
            continue
        losses.append(loss_value)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    per_rank = all_gather_objects(losses)  # after the timed steps
    if world.is_main:
        print(json.dumps({"step_s": times, "loss": [sum(v) / len(v) for v in zip(*per_rank)],
                          **({"profile": profile} if profile else {})}), flush=True)
    barrier()
    release(engine)
    close_world()


if __name__ == "__main__":
    main()
