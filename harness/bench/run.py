"""`harness bench sweep` and `overhead`: resolve the configurations, measure them, write the report.

`--largest n_layers|d_model|seq_len` (the sweep) finds, per configuration, the largest model (or the longest
`data.seq_len`, in steps of 64) whose 2-step run exits cleanly within `--memory-budget-gb` per rank, doubling then
bisecting (`plan.render.largest_fitting`); on a CPU the budget is required (offloaded states share its RAM).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..config.ds import ds_path, model_state_bytes
from ..config.run import ConfigError
from ..plan.render import count_params, largest_fitting
from ..run.startup import clear_stale_build_locks
from . import device, overhead, report
from .sweep import Config, grid, measure, model_parallel_size, plan_for

SEQ_UNIT = 64  # --largest seq_len searches multiples of this


def plans(args) -> dict:
    """Every configuration of the sweep that fits its process count, resolved and checked before any launch."""
    configs = grid([ds_path(d) for d in args.ds.split(",")], [int(n) for n in args.nproc.split(",")],
                   args.mixed_precision.split(","), getattr(args, "vary", []))
    fitting = [c for c in configs if c.nproc % model_parallel_size(c.ds) == 0]  # tp2 on 1 process: not a config
    for c in [c for c in configs if c not in fitting]:
        print(f"skipped {c.name}: its tensor x pipeline x sequence size {model_parallel_size(c.ds)} needs a "
              f"multiple of it in processes", flush=True)
    if not fitting:
        raise ConfigError("no configuration of the sweep fits its process counts (--nproc)")
    return {c: plan_for(c, args.run, args.set) for c in fitting}


def run_bench(args) -> dict:
    if args.largest and not torch.cuda.is_available() and not args.memory_budget_gb:
        raise ConfigError("--largest on a CPU needs --memory-budget-gb (the memory a 'device' may use per rank)")
    planned, sets = plans(args), list(args.set)
    configs = list(planned)
    clear_stale_build_locks()
    out = Path(args.out)
    precisions = sorted({p.ds.precision for p in planned.values()})
    threads = device.cpu_threads(max(c.nproc for c in configs))  # every process the same share of the cores
    result = {"schema": report.SCHEMA, "task": next(iter(planned.values())).run.cfg.run.task, "run_file": args.run,
              "sets": sets, "steps": args.steps, "warmup": args.warmup,
              "device": device.describe(precisions, threads), "configs": []}
    for i, c in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {c.name}", flush=True)
        peak = device.measured_peak(planned[c].ds.precision, threads=threads)  # beside the run: the machine now
        entry = measure(c, planned[c], args.run, sets, out, args.warmup, args.steps, args.timeout, threads)
        result["configs"].append({**entry, "params": count_params(planned[c]), "peak_flops_measured": peak})
    report.derive(result["configs"], result["device"])
    if args.largest:
        result["largest"] = [largest(c, args, sets, out, measured) for c, measured in zip(configs, result["configs"])]
    for path in report.write(result, out):
        print(f"wrote {path}")
    print(report.markdown(result))
    return result


def run_overhead(args) -> dict:
    """The study of `overhead.py` over the configurations."""
    planned = plans(args)
    overhead.check(list(planned))
    clear_stale_build_locks()
    out = Path(args.out)
    precisions = sorted({p.ds.precision for p in planned.values()})
    result = {"schema": report.SCHEMA, "run_file": args.run, "sets": args.set,
              "device": device.describe(precisions, device.cpu_threads(max(c.nproc for c in planned))),
              **overhead.study(planned, args.run, args.set, out, args.rounds, args.warmup, args.steps, args.timeout)}
    for path in overhead.write(result, out):
        print(f"wrote {path}")
    print(overhead.markdown(result))
    return result


def predicted_size(plan_of, budget_bytes: float, host_bytes: float) -> int:
    """The size (layers, or width units) at which the ZeRO paper's model states fill `budget_bytes` of device memory,
    or 80% of host memory with offloaded states plus the fp32 model every rank first builds there, whichever is
    smaller: where the search starts, so it needs few (slow) tries at billions of parameters."""
    one = plan_of(1)
    p1, p2 = count_params(one), count_params(plan_of(2))
    per_unit, fixed = max(1, p2 - p1), max(0, 2 * p1 - p2)
    states = model_state_bytes(10**6, one.ds)
    device_per_param, host_per_param = states["device"] / 1e6, states["cpu"] / 1e6 + 4
    k = min((0.9 * budget_bytes / max(device_per_param, 1e-9) - fixed) / per_unit,
            (0.8 * host_bytes / host_per_param - fixed) / per_unit)
    return max(1, int(k))


def largest(config: Config, args, sets: list[str], out: Path, measured: dict | None = None) -> dict:
    """`args.resolution` (relative, default exact) and `args.deadline` (time.monotonic(), default none) bound the
    search: past the deadline no try starts, and the result is then a lower bound (`stopped_by_budget`). `measured`:
    the sweep's entry for `config`, which stands for the try of the configuration's own size (its run had at least
    the try's 2 steps), instead of a second launch."""
    key = "data.seq_len" if args.largest == "seq_len" else f"model.{args.largest}"
    plan = plan_for(config, args.run, sets)
    # widths that split into heads; lengths that split over sequence-parallel ranks (up to 64)
    unit = {"n_layers": 1, "d_model": plan.run.cfg.model.n_heads * 8, "seq_len": SEQ_UNIT}[args.largest]
    budget = (args.memory_budget_gb * 2**30 if args.memory_budget_gb
              else torch.cuda.get_device_properties(0).total_memory)
    deadline, resolution = getattr(args, "deadline", None), getattr(args, "resolution", 0.0)
    tried, stopped = {}, []

    def trial(k: int) -> Config:
        return replace(config, sets=(*config.sets, f"{key}={k * unit}"))

    own = plan.run.cfg.data.seq_len if args.largest == "seq_len" else getattr(plan.run.cfg.model, args.largest)

    def fits(k: int) -> bool:
        if measured and measured.get("status") == "ok" and k * unit == own:
            tried[own] = {"status": "ok", "peak_mem_bytes": measured["peak_mem_bytes"],
                          "params": measured.get("params"), "error": None}
            return measured["peak_mem_bytes"] <= budget
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 10:
            stopped.append(k)
            return False
        try:
            trial_plan = plan_for(trial(k), args.run, sets)
        except ConfigError:
            return False
        entry = measure(trial(k), trial_plan, args.run, sets, out / "largest", 0, 2,
                        args.timeout if left is None else min(args.timeout, left))
        tried[k * unit] = {"status": entry["status"], "peak_mem_bytes": entry.get("peak_mem_bytes"),
                           "params": count_params(trial_plan), "error": entry.get("error")}
        if entry["status"] == "timeout":
            stopped.append(k)  # out of time, not out of memory: the result is a lower bound
        return entry["status"] == "ok" and entry["peak_mem_bytes"] <= budget

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    start = predicted_size(lambda k: plan_for(trial(k), args.run, sets), budget, host) \
        if resolution and args.largest != "seq_len" else \
        max(1, own // unit)
    k = largest_fitting(fits, min(start, args.largest_max), args.largest_max, resolution)
    best = tried.get(k * unit, {})
    return {"name": config.name, "key": key, "value": k * unit, "params": best.get("params", 0),
            "capped": k == args.largest_max, "budget_bytes": budget, "stopped_by_budget": bool(stopped),
            "tried": tried}
