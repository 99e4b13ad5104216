"""The one reference the benchmarks compare the harness with: a plain PyTorch loop (`PlainLoop`) on the same model and
batches, and the harness loop's own step (`HarnessSteps`). `python -m harness.bench.plain` is the overhead study's
second program: N plain steps timed, then blocks of each loop alternated in the same processes; rank 0 prints
{"step_s": [...], "loss": [the ranks' mean a step], "paired": {"plain": [[...]], "harness": [[...]]}}."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from ..config.run import ConfigError, length_buckets
from ..data.batches import StepSampler, train_batches, training_collate
from ..distributed.optim import make_schedule, param_groups
from ..distributed.parallel import build_engine, release
from ..distributed.world import accelerate_mixed_precision, all_gather_objects, barrier, close_world, init_world, \
    launched_world_size
from ..models.flops import ForwardFlops
from ..plan.resolve import make_plan
from ..run.loop import _progress
from ..run.step import Ledger, Steps
from ..run.tracking import Tracker
from ..tasks import get_task


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.plain")
    ap.add_argument("--run")
    ap.add_argument("--ds", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--paired", type=int, default=0, help="then this many blocks of each loop's steps, alternated")
    ap.add_argument("--block", type=int, default=17, help="steps per paired block, the first one not timed")
    args = ap.parse_args(argv)
    plan = make_plan(args.run, args.set, args.ds, launched_world_size(), accelerate_mixed_precision())
    if plan.ds.layout.pp_size > 1:
        raise ConfigError("a plain loop has no pipeline schedule: leave pipeline configs out of the overhead study")
    world = init_world(plan.ds.layout)
    plain = PlainLoop(plan.run.cfg, plan.ds.precision, world.device, world.rank, world.world_size,
                      args.steps + args.paired * args.block)
    times, losses = timed(plain.step, args.steps)
    per_rank = all_gather_objects(losses)
    paired = _paired(plan, world, plain, args.paired, args.block) if args.paired else None
    if world.is_main:
        print(json.dumps({"step_s": times, "loss": [sum(v) / len(v) for v in zip(*per_rank)],
                          **({"paired": paired} if paired else {})}), flush=True)
    barrier()
    plain.close()  # DistributedDataParallel holds the group: it would outlive destroy_process_group (world.py)
    close_world()


def timed(fn, n: int) -> tuple[list[float], list]:
    """Seconds of each of `n` calls, end to end so that nothing between them goes untimed; what each returned."""
    seconds, out, last = [], [], time.perf_counter()
    for _ in range(n):
        out.append(fn())
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    return seconds, out


class PlainLoop:
    """What a plain PyTorch script trains with: torch's fused AdamW, the run's schedule and clipping, autocast."""

    def __init__(self, cfg, precision: str, device: torch.device, rank: int = 0, ranks: int = 1, steps: int = 0):
        task = get_task(cfg.run.task)
        task.check(cfg)
        torch.manual_seed(cfg.train.seed)
        model = task.build_model(cfg).to(device)
        data = task.build_data(cfg)
        t = cfg.train
        sampler = StepSampler(len(data.train), t.micro_batch_size, t.grad_accum_steps, rank, ranks, t.seed, 0,
                              steps or t.max_steps)
        self.loader = iter(torch.utils.data.DataLoader(data.train, batch_sampler=sampler,
                                                       collate_fn=training_collate(task, length_buckets(cfg)),
                                                       pin_memory=device.type == "cuda"))
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(param_groups(model, cfg), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           fused=True)  # one kernel for every parameter
        self.schedule = make_schedule(self.optimizer, cfg, t.max_steps or steps)
        self.model, self.task, self.device, self.t, self.ranks = model, task, device, t, ranks
        self.wrapped = model if ranks == 1 else torch.nn.parallel.DistributedDataParallel(model)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(self) -> float:
        t, task = self.t, self.task
        batches = [next(self.loader) for _ in range(t.grad_accum_steps)]
        count = sum(task.count(b) for b in batches)
        total = 0.0
        for i, b in enumerate(batches):
            b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
            boundary = i == len(batches) - 1
            with contextlib.nullcontext() if boundary or self.ranks == 1 else self.wrapped.no_sync():
                with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                    loss = task.loss(self.wrapped, b)
                self.scaler.scale(loss / count).backward()  # DDP averages over ranks: the mean of the ranks' means
            total += loss.detach()
        self.scaler.unscale_(self.optimizer)
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return float(total) / count  # sync point: the loss of the step, as the harness reads it

    def close(self) -> None:
        del self.wrapped


class HarnessSteps:
    """The harness loop's own step (`step.Steps`, its `Ledger` writing into a scratch directory) on an engine built as
    `harness train` builds it; `batches` wraps the batches' iterator, `workers` replaces data.num_workers."""

    def __init__(self, plan, world, stop: int, log_every: int | None = None, batches=lambda it: it,
                 workers: int | None = None):
        cfg, task = plan.run.cfg, plan.task
        t = cfg.train if log_every is None else dataclasses.replace(cfg.train, log_every=log_every)
        data = task.build_data(cfg)
        self.engine, _ = build_engine(plan, world, stop)
        sampler = StepSampler(len(data.train), t.micro_batch_size, plan.ds.grad_accum_steps, world.dp_rank,
                              world.dp_size, t.seed, 0, stop, bucket=cfg.data.bucket,
                              lengths=task.lengths(data.train) if cfg.data.bucket else None)
        loader = batches(train_batches(data.train, sampler, training_collate(task, plan.run.buckets),
                                       cfg.data.num_workers if workers is None else workers, t.seed, world.device))
        with torch.device("meta"):
            flops = ForwardFlops(task.build_model(cfg))
        self.scratch = tempfile.TemporaryDirectory(prefix="harness-steps-")
        self.tracker = Tracker(dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, backend="none")),
                               Path(self.scratch.name), enabled=world.is_main)
        self.progress = _progress(world, 0, stop)
        self.ledger = Ledger(self.tracker, self.progress, t, 10**9, lambda step: step / 10**9, flops, {},
                             getattr(task, "items", "items"), 1.0, world)
        self.steps, self.n = Steps(self.engine, plan, world, loader, flops, self.ledger, self.progress, stop), 0
        self.lr = self.engine.lr_scheduler.get_last_lr()[0] if self.engine.lr_scheduler else 0.0

    def step(self) -> None:
        self.n += 1
        self.steps.run(self.n, self.lr, 0)

    def close(self) -> None:
        self.ledger.settle()
        self.progress.close()
        self.tracker.close()
        self.scratch.cleanup()
        release(self.engine)


def _paired(plan, world, plain: PlainLoop, blocks: int, block: int) -> dict:
    """Each loop's step seconds, block by block, the order reversed every other block and its first step not timed."""
    harness = HarnessSteps(plan, world, blocks * block, log_every=1)  # a metrics record every step, as when timed
    out = {"plain": [], "harness": []}
    for b in range(blocks):
        for name in ("plain", "harness") if b % 2 == 0 else ("harness", "plain"):
            if name == "plain":
                harness.ledger.settle()  # the harness's last step read now, not inside the plain loop's block
            fn = plain.step if name == "plain" else harness.step
            fn()
            out[name].append(timed(fn, block - 1)[0])
    harness.close()
    return out


if __name__ == "__main__":
    main()
