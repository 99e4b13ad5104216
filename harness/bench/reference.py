"""The reference for the harness's own cost: a hand-written DeepSpeed loop, nothing else.

`python -m harness.bench.reference --run RUN.toml --ds DS.json [--set ...] --steps N` (under `accelerate launch`
for several processes) builds the engine exactly as `harness train` does (`parallel.build_engine`: the same
model, AdamW, schedule and resolved DeepSpeed config; set-up is not timed) and reads the same batches (the
harness's sampler and loader), then trains the way a 60-line script would: for each micro-batch forward,
`engine.backward(loss / items)`, `engine.step()`, and the step's loss to the host. No global item count, work
counters, grad-norm read, logging, progress bar, checkpoint or evaluation. Where the harness clips gradients
in its loop rather than in DeepSpeed (ZeRO-0 in fp32, see `config/ds.py`), this loop clips them too: the same
training, as a script would have to write it. Rank 0 prints one JSON line:
{"step_s": [seconds of each step, fetch to fetch], "loss": [the step's loss, averaged over the ranks]}, and
with `--profile` the summary of one more step traced by torch.profiler under the harness loop's section names.

`--paired BLOCKS` then alternates, in this process and on this engine, blocks of `--block` steps of this loop with
blocks of the harness loop's own step (`step.Steps`: counting, the loop's collective where a span of steps starts,
the grad norm, the `Ledger` reading the steps before and writing a metrics record every step, the progress bar;
its spans run on across blocks, as they would across steps), the order reversed every
other block; the first step of each block is not timed. Launches of one program differ by several percent on a
shared machine; steps of one process do not, so this gives the cost of the harness's step code itself:
"paired": {"reference": [each block's step seconds], "harness": [...]} in the JSON line.

The loss is each micro-batch's own mean, where the harness divides by the step's global item count: the two
agree where every micro-batch counts the same items (fixed-length language modelling, what the overhead study
trains), which is what makes the comparison fair, and what its losses check shows. A pipeline has no per-batch
forward to write by hand: it is refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.reference")
    ap.add_argument("--run")
    ap.add_argument("--ds", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--profile", action="store_true", help="trace one more step after them (profiling.py)")
    ap.add_argument("--paired", type=int, default=0, help="then this many blocks of each loop's steps, alternated")
    ap.add_argument("--block", type=int, default=17, help="steps per paired block, the first one not timed")
    return ap.parse_args(argv)


def _timed(step, steps: int, profile: bool, world) -> tuple[list[float], list[float], dict | None]:
    """`steps` steps, each timed, then with `profile` one more traced (profiling.py): seconds, losses, the trace."""
    from ..run import profiling

    times, losses, trace = [], [], None
    last = time.perf_counter()
    for i in range(steps + profile):
        traced = profiling.StepProfile(world.device) if i == steps and world.is_main else None
        loss_value = step(traced.section if traced else profiling.unmarked)  # the harness's names for the parts
        if traced:
            trace = traced.finish(0.0, i + 1)
            continue
        losses.append(loss_value)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times, losses, trace


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)

    import torch

    from ..config.run import ConfigError
    from ..data.batches import StepSampler, train_batches, training_collate
    from ..distributed.parallel import build_engine, release
    from ..distributed.world import (
        accelerate_mixed_precision,
        all_gather_objects,
        barrier,
        close_world,
        init_world,
        launched_world_size,
    )
    from ..plan.resolve import make_plan
    from ..run import profiling

    plan = make_plan(args.run, args.set, args.ds, launched_world_size(), accelerate_mixed_precision())
    if plan.ds.layout.pp_size > 1:
        raise ConfigError("the reference loop has no pipeline schedule: leave pipeline configs out of --overhead")
    cfg, task, accum = plan.run.cfg, plan.task, plan.ds.grad_accum_steps
    world = init_world(plan.ds.layout)
    data = task.build_data(cfg)
    engine, _ = build_engine(plan, world, cfg.train.max_steps)
    sampler = StepSampler(len(data.train), cfg.train.micro_batch_size, accum, world.dp_rank, world.dp_size,
                          cfg.train.seed, 0, args.steps + args.profile + 2 * args.paired * args.block,
                          bucket=cfg.data.bucket,
                          lengths=task.lengths(data.train) if cfg.data.bucket else None)
    loader = train_batches(data.train, sampler, training_collate(task, plan.run.buckets), cfg.data.num_workers,
                           cfg.train.seed, world.device)

    def step(mark=profiling.unmarked) -> float:
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
            if plan.ds.loop_clips and i == accum - 1:  # ZeRO-0 fp32: clipped here, not by DeepSpeed (config/ds.py)
                with mark("grad norm"):
                    torch.nn.utils.clip_grad_norm_(engine.module.parameters(), plan.ds.loop_clips)
            with mark("engine"):
                engine.step()
            total += loss.detach().float()
        with mark("loss to host"):
            return total.item() / accum  # sync point: the step's loss on the host, as any script prints it

    times, losses, profile = _timed(step, args.steps, args.profile, world)
    per_rank = all_gather_objects(losses)  # after the timed steps
    paired = _paired(plan, world, engine, loader, step, args.paired, args.block, args.steps + args.profile) \
        if args.paired else None
    if world.is_main:
        print(json.dumps({"step_s": times, "loss": [sum(v) / len(v) for v in zip(*per_rank)],
                          **({"profile": profile} if profile else {}), **({"paired": paired} if paired else {})}),
              flush=True)
    barrier()
    release(engine)
    close_world()


class HarnessSteps:
    """The harness loop's own step (`step.Steps`: counting, the span's collective, the grad norm, the `Ledger` reading
    the steps before and writing metrics records into a scratch directory, the progress bar) on an engine and loader
    built outside it, for the studies that run it beside another loop (here, and `proxy.py`). `step()` trains the
    next step, from `start` up to `stop`; `settle()` reads the steps not yet read; `close()` settles and lets go."""

    def __init__(self, plan, world, engine, loader, start: int, stop: int, bar_end: int, log_every: int | None = None):
        import tempfile
        from pathlib import Path

        import torch

        from ..models.flops import ForwardFlops
        from ..run.loop import _progress
        from ..run.step import Ledger, Steps
        from ..run.tracking import Tracker

        cfg = plan.run.cfg
        t = cfg.train if log_every is None else dataclasses.replace(cfg.train, log_every=log_every)
        with torch.device("meta"):
            flops = ForwardFlops(plan.task.build_model(cfg))
        self.scratch = tempfile.TemporaryDirectory(prefix="harness-steps-")
        self.tracker = Tracker(dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, backend="none")),
                               Path(self.scratch.name), enabled=world.is_main)
        self.progress = _progress(world, start, bar_end)
        self.ledger = Ledger(self.tracker, self.progress, t, 10**9, 10**9, flops, {},
                             getattr(plan.task, "items", "items"), 1.0, world)
        self.steps, self.n = Steps(engine, plan, world, loader, flops, self.ledger, self.progress, stop), start
        self.lr = engine.lr_scheduler.get_last_lr()[0] if engine.lr_scheduler else 0.0

    def step(self) -> None:
        self.n += 1
        self.steps.run(self.n, self.lr, 0)

    def settle(self) -> None:
        self.ledger.settle()

    def close(self) -> None:
        self.ledger.settle()
        self.progress.close()
        self.tracker.close()
        self.scratch.cleanup()


def _paired(plan, world, engine, loader, reference_step, blocks: int, block: int, done: int) -> dict:
    """Each loop's step seconds, block by block (see the module's docstring): {"reference": [[...], ...],
    "harness": [[...], ...]}, block i of one beside block i of the other."""
    harness = HarnessSteps(plan, world, engine, loader, done, done + blocks * block, done + 2 * blocks * block,
                           log_every=1)  # a metrics record every step, as when timed
    out = {"reference": [], "harness": []}
    for b in range(blocks):
        for name in ("reference", "harness") if b % 2 == 0 else ("harness", "reference"):
            if name == "reference":
                harness.settle()  # the harness's last step read now, not inside the reference's block
            fn = reference_step if name == "reference" else harness.step
            fn()  # the first step of a block: the switch from the other loop, not timed
            seconds, last = [], time.perf_counter()
            for _ in range(block - 1):
                fn()
                now = time.perf_counter()
                seconds.append(now - last)
                last = now
            out[name].append(seconds)
    harness.close()
    return out


if __name__ == "__main__":
    main()
