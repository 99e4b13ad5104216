"""The reference for the harness's overhead: a plain PyTorch loop training the same model on the same batches.

`python -m harness.bench.plain --run RUN.toml [--set ...] --steps N` builds the task's model and data, takes
the harness's batches (the same sampler, one process), and trains with torch AdamW, the same learning-rate
schedule, gradient clipping and loss normalisation, under torch.autocast for bf16/fp16; no DeepSpeed, no
logging beyond one number per step. It prints one JSON line: {"step_s": [seconds of each step]}.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.plain")
    ap.add_argument("--run")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = ap.parse_args(argv)

    from ..config import resolve
    from ..data import StepSampler
    from ..optim import lr_factor
    from ..tasks import get_task

    cfg = resolve(args.run, args.set).cfg
    task = get_task(cfg.run.task)
    task.check(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.train.seed)
    model = task.build_model(cfg).to(device)
    data = task.build_data(cfg)
    t = cfg.train
    sampler = StepSampler(len(data.train), t.micro_batch_size, t.grad_accum_steps, 0, 1, t.seed, 0, args.steps)
    loader = iter(torch.utils.data.DataLoader(data.train, batch_sampler=sampler, collate_fn=task.collate,
                                              pin_memory=device.type == "cuda"))
    o = cfg.optimizer
    decay = [p for p in model.parameters() if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=device.type == "cuda" or None)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.steps, cfg.schedule))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(enabled=args.precision == "fp16")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        batches = [next(loader) for _ in range(t.grad_accum_steps)]
        count = sum(task.count(b) for b in batches)
        total = 0.0
        for b in batches:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = task.loss(model, b)
            scaler.scale(loss / count).backward()
            total += loss.detach()
        scaler.unscale_(optimizer)
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        float(total)  # sync point: the loss of the step, as the harness reads it
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_s": times}))


if __name__ == "__main__":
    main()
