"""`harness bench proxy`: what the harness's step and a plain PyTorch one ask of a GPU, counted on a CPU: counts, unlike
times, do not move with the machine's load. What each means and where it stops being a GPU's: docs/benchmarks.md."""
from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config.run import ConfigError
from ..distributed.world import close_world, init_world
from ..plan.resolve import make_plan
from ..run import step as step_module
from ..run.machine import CPU_FP16_ENV, check_kernel, check_precision, check_zeropp
from .catalog import SPEED
from .plain import HarnessSteps, PlainLoop
from .report import save
from .sweep import ROOT, Config, json_line, program

SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "allclose", "unique",
         "_unique2", "unique_consecutive", "repeat_interleave"}
MASKED = {"index", "index_put", "index_put_", "_index_put_impl_"}  # with a boolean mask: its nonzero, inside the op
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "lift_fresh_copy", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream", "size",
             "stride", "dim", "is_contiguous", "_nested_tensor_size"}
PRECISIONS = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)


class OpCounter(TorchDispatchMode):
    """Every aten operator dispatched while active: ops, kernel launches, host waits for the device, collectives."""

    def __init__(self):
        super().__init__()
        self.by_name = collections.Counter()
        self.ops = self.launches = self.syncs = self.collectives = 0
        self.on_host = False  # inside host-side work (`HostWork`): not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on_host:
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops += 1
        self.by_name[name] += 1
        if func.namespace == "c10d":
            self.collectives += 1
        elif name in SYNCS or (name in MASKED and _has_mask(args)):
            self.syncs += 1
        elif name not in NO_KERNEL and not _is_view(func):
            self.launches += 1
        return func(*args, **(kwargs or {}))


def _has_mask(args) -> bool:
    """Whether an indexing operator's indices hold a boolean mask (they come as a list, its second argument)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(getattr(i, "dtype", None) == torch.bool for i in indices)


def _is_view(func) -> bool:
    """An operator whose output aliases its input without writing it: a view, no kernel."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class HostWork:
    """The work a GPU run does on the host (`wrap` a function, `batches` an iterator), which the counter leaves out."""

    def __init__(self):
        self.counter = None

    def running(self):
        """Within: nothing counted (nested, the flag is left as it was found)."""
        if self.counter is None:
            return contextlib.nullcontext()
        return mock.patch.object(self.counter, "on_host", True)

    def wrap(self, fn):
        def on_host(*args, **kwargs):
            with self.running():
                return fn(*args, **kwargs)
        return on_host

    def batches(self, it):
        take = self.wrap(next)
        while (batch := take(it, None)) is not None:
            yield batch


@contextlib.contextmanager
def counting(host: HostWork | None = None):
    """An OpCounter over the block that counts DeepSpeed's accelerator synchronizations too and the loop's read of a
    span's rows (`to_host_later`), and leaves `host` out."""
    from deepspeed.accelerator import get_accelerator

    counter = OpCounter()
    if host is not None:
        host.counter = counter
    accelerator = type(get_accelerator())
    real, real_later = accelerator.synchronize, step_module.to_host_later

    def synchronize(self, device_index=None):
        counter.syncs += 1
        return real(self, device_index)

    def to_host_later(t: torch.Tensor):
        read = real_later(t)

        def wait() -> torch.Tensor:  # a GPU's host waits here for the rows' copy; a CPU's reads `t` through no op
            counter.syncs += 1
            return read()
        return wait

    with mock.patch.object(accelerator, "synchronize", synchronize), \
            mock.patch.object(step_module, "to_host_later", to_host_later), counter:
        yield counter


def per_step(step, warmup: int, steps: int, host: HostWork) -> dict:
    """The counts of `steps` calls of `step` after `warmup` ones, per call, and the ten most frequent operators."""
    for _ in range(warmup):
        step()
    with counting(host) as c:
        for _ in range(steps):
            step()
    out = {k: getattr(c, k) / steps for k in ("ops", "launches", "syncs", "collectives")}
    out["top"] = {k: v / steps for k, v in c.by_name.most_common(10)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.proxy")
    ap.add_argument("--run")
    ap.add_argument("--ds", required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--steps", type=int, default=16, help="steps counted, after the warm-up")
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args(argv)
    plan = make_plan(args.run, args.set, args.ds, 1, "no")
    check_precision(plan.ds.precision)
    check_zeropp(plan.ds)
    check_kernel(plan.ds)
    total = args.warmup + args.steps
    world = init_world(plan.ds.layout)
    host = HostWork()
    step_module.step_work = host.wrap(step_module.step_work)  # the batches' counts, taken before they go to the device
    # spans as long as a GPU's steps make them (milliseconds each): the loop's collective once a span, however
    # slowly this host steps (a loaded CPU's steps made shorter spans, and the counts moved with the load)
    step_module.span_length = lambda step_s: step_module.MAX_SPAN
    harness = HarnessSteps(plan, world, total, batches=host.batches, workers=0)  # its batches made here, uncounted
    counts = per_step(harness.step, args.warmup, args.steps, host)
    harness.close()
    plain = PlainLoop(plan.run.cfg, plan.ds.precision, world.device, steps=total)
    plain.loader, plain.task.count = host.batches(plain.loader), host.wrap(plain.task.count)
    reference = per_step(plain.step, args.warmup, args.steps, host)
    close_world()
    print(json.dumps({"harness": counts, "plain": reference, "precision": plan.ds.precision,
                      "autocast": plan.ds.autocast, "zero_stage": plan.ds.zero_stage}), flush=True)


def ds_config(stage: int, precision: str) -> dict:
    """The DeepSpeed file of one configuration: the run owns the numbers ("auto")."""
    auto = {k: "auto" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                                "gradient_clipping")}
    return {**auto, "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"},
            "zero_optimization": {"stage": stage}}


def run_proxy(args) -> dict:
    """Every speed-suite model at toy width x ZeRO stage x precision, one process each."""
    out = Path(args.out or "bench/proxy")
    given = [x.strip() for x in (",".join(map(str, STAGES)) if args.stages is None else args.stages).split(",")]
    precisions = [x.strip() for x in (",".join(PRECISIONS) if args.precisions is None else args.precisions).split(",")]
    stages = [int(x) for x in given if x.isdigit()]
    bad = [p or '""' for p in precisions if p not in PRECISIONS] + \
        [x or '""' for x in given if not x.isdigit() or int(x) not in STAGES]
    if bad:  # before anything is written (--stages a had been a ValueError, "" every stage)
        raise ConfigError(f"the proxy counts ZeRO stages {STAGES} and precisions {', '.join(PRECISIONS)}; "
                          f"not {', '.join(bad)}")
    if len(set(stages)) < len(stages) or len(set(precisions)) < len(precisions):  # each row counted twice
        raise ConfigError(f"--stages {','.join(given)} --precisions {','.join(precisions)}: give each value once")
    out.mkdir(parents=True, exist_ok=True)
    rows, env = [], {**os.environ, CPU_FP16_ENV: "1"}  # fp16 runs on a CPU only when asked
    for model, stage, precision in itertools.product([m for m in SPEED if m.smoke], stages, precisions):
        ds = out / f"zero{stage}_{precision}.json"
        ds.write_text(json.dumps(ds_config(stage, precision), indent=2) + "\n")
        data = [f"data.path={json.dumps(str(Path(args.data) / model.data))}"] if args.data and model.data else []
        cmd = program(Config(str(ds), 1, "no"), str(ROOT / "configs" / "runs" / model.run),
                      [*model.smoke, *args.set, *data], "harness.bench.proxy", "--ds", str(ds), "--steps",
                      str(args.steps), "--warmup", str(args.warmup))
        rows.append({"model": model.name, "zero_stage": stage, "precision": precision,
                     **json_line(cmd, env, args.timeout, cwd=None)})
        print(row(rows[-1]), flush=True)
        save(out, "proxy", rows, markdown(rows))  # after every row: a study cut short keeps what it counted
    print(f"wrote {out / 'proxy.json'}, {out / 'proxy.md'}")
    return {"rows": rows, "failed": sum("error" in r for r in rows)}


def markdown(rows: list[dict]) -> str:
    return "\n".join(["| model (toy width) | strategy | aten ops: harness / plain (ratio) | kernel launches: harness / "
                      "plain (ratio) | host syncs a step: harness / plain | collectives a step (harness) |",
                      "|---|---|---|---|---|---|", *map(row, rows)])


def row(r: dict) -> str:
    strategy = f"ZeRO-{r['zero_stage']} {r['precision']}" + (" (autocast)" if r.get("autocast") else "")
    if "error" in r:
        return f"| {r['model']} | {strategy} | failed: {r['error']} | | | |"
    h, p = r["harness"], r["plain"]
    return (f"| {r['model']} | {strategy} | {h['ops']:.0f} / {p['ops']:.0f} ({h['ops'] / p['ops']:.2f}x) | "
            f"{h['launches']:.0f} / {p['launches']:.0f} ({h['launches'] / p['launches']:.2f}x) | "
            f"{h['syncs']:g} / {p['syncs']:g} | {h['collectives']:g} |")


if __name__ == "__main__":
    main()
