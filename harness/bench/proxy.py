"""`harness bench proxy`: what a step asks of a GPU, counted on a CPU, for the harness step and a plain PyTorch step.

Every aten operator a step dispatches passes a `TorchDispatchMode`; counts, unlike times, do not move with the
machine's load. Per step: `ops`, `launches` (not views, metadata or allocations: `NO_KERNEL`), `syncs` (the host
waits for the device: `SYNCS`, a boolean mask's gather, DeepSpeed's accelerator synchronizations) and `collectives`.
What a GPU run does on the host (collating, counting a batch before it goes to the device) is not counted.
`python -m harness.bench.proxy --run RUN.toml --ds DS.json` counts one configuration in one process and prints one
JSON line; what the counts mean and where they stop being a GPU's: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
from pathlib import Path

SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "allclose", "unique",
         "_unique2", "unique_consecutive", "repeat_interleave"}
MASKED = {"index", "index_put", "index_put_", "_index_put_impl_"}  # with a boolean mask: its nonzero, inside the op
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "lift_fresh_copy", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream", "size",
             "stride", "dim", "is_contiguous", "_nested_tensor_size"}
PRECISIONS = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)


def _counter_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        """Counts what passes through the dispatcher while active (see the module's docstring)."""

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

    return OpCounter


def _has_mask(args) -> bool:
    """Whether an indexing operator's indices hold a boolean mask (they come as a list, its second argument)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    import torch

    return any(getattr(i, "dtype", None) == torch.bool for i in indices)


def _is_view(func) -> bool:
    """An operator whose output aliases its input without writing it: a view, no kernel."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class HostWork:
    """Marks the work a GPU run does on the host (`wrap` a function, `batches` an iterator): while it runs, the
    active counter counts nothing."""

    def __init__(self):
        self.counter = None

    @contextlib.contextmanager
    def running(self):
        if self.counter is None or self.counter.on_host:
            yield
            return
        self.counter.on_host = True
        try:
            yield
        finally:
            self.counter.on_host = False

    def wrap(self, fn):
        def on_host(*args, **kwargs):
            with self.running():
                return fn(*args, **kwargs)
        return on_host

    def batches(self, it):
        while True:
            with self.running():
                batch = next(it, None)
            if batch is None:
                return
            yield batch


@contextlib.contextmanager
def counting(host: HostWork | None = None):
    """An OpCounter over the block, with DeepSpeed's accelerator synchronizations counted as syncs; `host`'s work
    is left out."""
    from deepspeed.accelerator import get_accelerator

    counter = _counter_class()()
    if host is not None:
        host.counter = counter
    accelerator = type(get_accelerator())
    real = accelerator.synchronize

    def synchronize(self, device_index=None):
        counter.syncs += 1
        return real(self, device_index)

    accelerator.synchronize = synchronize
    try:
        with counter:
            yield counter
    finally:
        accelerator.synchronize = real


def per_step(step, steps: int, host: HostWork | None = None) -> dict:
    """The counts of `steps` calls of `step`, per call, and the ten most frequent operators."""
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

    from ..distributed.world import close_world, init_world
    from ..plan.resolve import make_plan
    from ..run import step as step_module
    from ..run.startup import check_precision
    from .plain import HarnessSteps, PlainLoop

    plan = make_plan(args.run, args.set, args.ds, 1, "no")
    check_precision(plan.ds.precision)
    total = args.warmup + args.steps
    world = init_world(plan.ds.layout)
    host = HostWork()
    step_module.step_work = host.wrap(step_module.step_work)  # the batches' counts, taken before they go to the device
    harness = HarnessSteps(plan, world, total, batches=host.batches, workers=0)  # its batches made here, uncounted
    for _ in range(args.warmup):
        harness.step()
    counts = per_step(harness.step, args.steps, host)
    harness.close()
    plain = PlainLoop(plan.run.cfg, plan.ds.precision, world.device, steps=total)
    plain.loader, plain.task.count = host.batches(plain.loader), host.wrap(plain.task.count)
    for _ in range(args.warmup):
        plain.step()
    reference = per_step(plain.step, args.steps, host)
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
    """`harness bench proxy`: every speed-suite model at toy width x ZeRO stage x precision, one process each."""
    from ..config.run import ConfigError
    from ..run.startup import CPU_FP16_ENV  # fp16 runs on a CPU only when asked
    from .catalog import SPEED
    from .sweep import ROOT, python

    out = Path(args.out or "bench/proxy")
    out.mkdir(parents=True, exist_ok=True)
    stages = [int(s) for s in (args.stages or ",".join(map(str, STAGES))).split(",")]
    precisions = (args.precisions or ",".join(PRECISIONS)).split(",")
    bad = [p for p in precisions if p not in PRECISIONS] + [str(s) for s in stages if s not in STAGES]
    if bad:
        raise ConfigError(f"the proxy counts ZeRO stages {STAGES} and precisions {', '.join(PRECISIONS)}; "
                          f"not {', '.join(bad)}")
    rows = []
    env = {**os.environ, CPU_FP16_ENV: "1"}
    for model in (m for m in SPEED if m.smoke):
        for stage in stages:
            for precision in precisions:
                ds = out / f"zero{stage}_{precision}.json"
                ds.write_text(json.dumps(ds_config(stage, precision), indent=2) + "\n")
                sets = [*model.smoke, *args.set, *(f"data.path={json.dumps(str(Path(args.data) / model.data))}"
                                                   for _ in [0] if args.data and model.data)]
                cmd = [python(), "-m", "harness.bench.proxy", "--run", str(ROOT / "configs" / "runs" / model.run),
                       "--ds", str(ds), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       *(f"--set={s}" for s in sets)]
                row = {"model": model.name, "zero_stage": stage, "precision": precision}
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    row["error"] = f"timed out after {args.timeout} s"
                    rows.append(row)
                    print(render_row(row), flush=True)
                    continue
                line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("{")), None)
                if done.returncode or line is None:
                    row["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
                else:
                    row.update(json.loads(line))
                rows.append(row)
                print(render_row(row), flush=True)
    (out / "proxy.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "proxy.md").write_text(markdown(rows) + "\n")
    print(f"wrote {out / 'proxy.json'}, {out / 'proxy.md'}")
    return {"rows": rows, "failed": sum("error" in r for r in rows)}


def render_row(r: dict) -> str:
    if "error" in r:
        return f"{r['model']}, ZeRO-{r['zero_stage']} {r['precision']}: failed: {r['error']}"
    h, p = r["harness"], r["plain"]
    return (f"{r['model']}, ZeRO-{r['zero_stage']} {r['precision']}: ops {h['ops']:.0f} vs plain {p['ops']:.0f} "
            f"({h['ops'] / p['ops']:.2f}x), launches {h['launches']:.0f} vs {p['launches']:.0f}, syncs a step "
            f"{h['syncs']:g} vs {p['syncs']:g}")


def markdown(rows: list[dict]) -> str:
    lines = ["| model (toy width) | strategy | aten ops: harness / plain (ratio) | kernel launches: harness / plain "
             "(ratio) | host syncs a step: harness / plain | collectives a step (harness) |", "|---|---|---|---|---|---|"]
    for r in rows:
        strategy = f"ZeRO-{r['zero_stage']} {r['precision']}" + (" (autocast)" if r.get("autocast") else "")
        if "error" in r:
            lines.append(f"| {r['model']} | {strategy} | failed: {r['error']} | | | |")
            continue
        h, p = r["harness"], r["plain"]
        lines.append(f"| {r['model']} | {strategy} | {h['ops']:.0f} / {p['ops']:.0f} ({h['ops'] / p['ops']:.2f}x) | "
                     f"{h['launches']:.0f} / {p['launches']:.0f} ({h['launches'] / p['launches']:.2f}x) | "
                     f"{h['syncs']:g} / {p['syncs']:g} | {h['collectives']:g} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
