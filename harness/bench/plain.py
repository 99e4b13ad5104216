"""The reference for DeepSpeed's own cost: a plain PyTorch loop training the same model on the same batches.

`python -m harness.bench.plain --run RUN.toml [--set ...] --steps N` builds the task's model and data, takes
the harness's batches (the same sampler), and trains with torch's fused AdamW, the same learning-rate schedule,
gradient clipping and loss normalisation (each rank's mean), under torch.autocast for bf16/fp16; no DeepSpeed,
no logging beyond one number per step. Under `accelerate launch` (or torchrun) it is DistributedDataParallel
over the launched processes, gradients all-reduced at the accumulation boundary only (`no_sync` before). Rank 0
prints one JSON line: {"step_s": [seconds of each step, fetch to fetch], "loss": [each step's loss, rank 0's]}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.plain")
    ap.add_argument("--run")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = ap.parse_args(argv)

    from ..distributed.memory import keep_freed_host_memory
    from ..tasks import resolve

    keep_freed_host_memory()  # as the harness and the reference set the host allocator (world.init_world)
    ranks, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    if ranks > 1:  # the launcher's rendezvous variables
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    plain = PlainLoop(resolve(args.run, args.set).cfg, args.precision, device, rank, ranks, args.steps)
    times, losses = [], []
    last = time.perf_counter()
    for _ in range(args.steps):
        losses.append(plain.step())
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if rank == 0:
        print(json.dumps({"step_s": times, "loss": losses}), flush=True)
    if ranks > 1:
        torch.distributed.barrier()
        plain.close()  # DistributedDataParallel holds the group: it would outlive destroy_process_group (world.py)
        torch.distributed.destroy_process_group()


class PlainLoop:
    """The task's model and data, torch AdamW (fused), the run's schedule and clipping, autocast for bf16/fp16: what a
    plain PyTorch script trains with. `step()` trains one step and returns its loss (a sync point, as a script
    prints it)."""

    def __init__(self, cfg, precision: str, device: torch.device, rank: int = 0, ranks: int = 1, steps: int = 0):
        from ..config.run import length_buckets
        from ..data.batches import StepSampler, training_collate
        from ..distributed.optim import lr_factor
        from ..tasks import get_task

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
        decay = [p for p in model.parameters() if p.ndim >= 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)  # one kernel for every parameter
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, t.max_steps or steps, cfg.schedule))
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


if __name__ == "__main__":
    main()
