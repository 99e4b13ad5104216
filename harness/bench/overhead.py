"""`harness bench overhead`: the harness's step against a plain PyTorch step (`plain.py`) on the same model and batches,
launch by launch and block by block in the same processes. What each figure means: docs/benchmarks.md."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..config.run import ConfigError
from ..plan.resolve import Plan
from . import report
from .sweep import (Config, cpu_threads, describe, env_for, json_line, measure, plan_for, plans, program,
                    schedule_length, summary)

PROGRAMS = ("harness", "plain")
BLOCK = 17  # steps per paired block, the first one not timed: 16 timed, a span's worth


def run_overhead(args) -> dict:
    planned = plans(args)
    split = [c.name for c, plan in planned.items() if plan.ds.layout.sp_size > 1 or plan.ds.layout.tp_size > 1]
    if split:
        raise ConfigError(f"the overhead study with sequence or tensor parallelism ({', '.join(split)}): the plain "
                          f"loop it compares with splits neither sequences nor layers (it would run another batch on "
                          f"each rank); time those configurations with the sweep instead")
    precisions = sorted({p.ds.precision for p in planned.values()})
    threads = cpu_threads(max(c.nproc for c in planned))  # every process the same share of the cores, as stated
    result = {"schema": report.SCHEMA, "run_file": report.shown(args.run), "sets": args.set,
              "device": describe(precisions, threads), "rounds": args.rounds, "warmup": args.warmup,
              "steps": args.steps, "configs": []}
    with report.kept_if_interrupted(result, len(planned), lambda: report.save(Path(args.out), "overhead", result,
                                                                            markdown(result))):
        for i, (c, plan) in enumerate(planned.items()):
            print(f"[{i + 1}/{len(planned)}] overhead {c.name}", flush=True)
            result["configs"].append(one(c, args.run, args.set, Path(args.out), args.rounds, args.warmup, args.steps,
                                         args.timeout, plan, threads))
    for path in report.save(Path(args.out), "overhead", result, markdown(result)):
        print(f"wrote {path}")
    print(markdown(result))
    return result


def one(config: Config, run_file: str | None, sets: list[str], out: Path, rounds: int, warmup: int, steps: int,
        timeout: float, plan: Plan | None = None, threads: int | None = None) -> dict:
    plan = plan or plan_for(config, run_file, sets)
    entry = {"name": config.name, "nproc": config.nproc, "zero_stage": plan.ds.zero_stage,
             "precision": plan.ds.precision, "layout": plan.ds.layout.describe()}
    if plan.ds.layout.pp_size > 1:
        return {**entry, "status": "skipped", "error": "a pipeline has no plain loop to compare with"}
    # per program: each round's timed steps' seconds, the paired blocks' over the rounds, the first round's losses
    times, pairs, losses = {p: [] for p in PROGRAMS}, {p: [] for p in PROGRAMS}, {}
    # the plain loop follows the schedule the harness's timed run is told
    plain = program(config, run_file, [*sets, *config.sets, f"train.max_steps={schedule_length(warmup, steps)}",
                                       "train.epochs=0.0"], "harness.bench.plain", "--steps", str(warmup + steps),
                    "--ds", config.ds, "--paired", str(max(2, (warmup + steps) // 5)), "--block", str(BLOCK))
    for r in range(rounds):  # a drift in the machine's speed over the study weighs on both alike
        for name in PROGRAMS if r % 2 == 0 else PROGRAMS[::-1]:
            if name == "harness":
                h = measure(config, plan, run_file, sets, out / "overhead", warmup, steps, timeout, threads)
                if h["status"] != "ok":
                    return {**entry, "status": h["status"], "error": f"harness: {h['error']}"}
                result = {"step_s": h["step_s_values"], "loss": h["loss_values"]}
            else:  # with its paired blocks, about 7x the steps: twice the time allowed
                result = json_line(plain, env_for(config, threads), 2 * timeout, prefix='{"step_s"')
                if "error" in result:
                    return {**entry, "status": "failed", "error": f"plain: {result['error']}"}
                for p, blocks in result.get("paired", {}).items():
                    pairs[p] += blocks
                result = {k: result[k][warmup:] for k in ("step_s", "loss")}  # as the harness's record leaves them
            times[name].append(result["step_s"])
            losses.setdefault(name, result["loss"])
    return {**entry, "status": "ok", **figures(times), "paired": paired(pairs),
            "loss_max_diff": max(abs(a - b) for a, b in zip(losses["harness"], losses["plain"]))}


def paired(pairs: dict[str, list[list[float]]]) -> dict | None:
    """The block pairs' ratios of means - 1 (a block holds the step that syncs), their median and its 95% interval."""
    if not pairs["harness"] or len(pairs["harness"]) != len(pairs["plain"]):
        return None
    each = sorted(statistics.fmean(h) / statistics.fmean(p) - 1 for h, p in zip(pairs["harness"], pairs["plain"]))
    low, high = median_ci(each) or (None, None)
    return {"median": statistics.median(each), "ci_low": low, "ci_high": high, "blocks": len(each), "ratios": each,
            "step_s": {p: statistics.fmean(s for b in pairs[p] for s in b) for p in PROGRAMS}}


def median_ci(ordered: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The distribution-free interval for the median of a sorted sample: its order statistics j and n + 1 - j,
    j the largest with P(Bin(n, 1/2) < j) <= (1 - level) / 2; None where there is none (under 6 values at 95%)."""
    n, tail = len(ordered), (1 - level) / 2
    j, below = 0, 0.0
    while j < n and below + math.comb(n, j) / 2 ** n <= tail:
        below += math.comb(n, j) / 2 ** n
        j += 1
    return (ordered[j - 1], ordered[n - j]) if j else None


def figures(times: dict[str, list[list[float]]]) -> dict:
    """The study's arithmetic, from each program's step seconds per round."""
    pooled = {p: summary([s for r in times[p] for s in r]) for p in PROGRAMS}
    # means, not medians: the harness's loop syncs once a span of steps, and a median would drop the step that does
    per_round = [{p: statistics.fmean(times[p][r]) for p in PROGRAMS} for r in range(len(times["harness"]))]
    each = [m["harness"] / m["plain"] - 1 for m in per_round]  # round by round: a round's runs were neighbours
    return {"step_s": pooled, "per_round": per_round,
            "vs_plain": {"median": statistics.median(each), "min": min(each), "max": max(each)}}


def markdown(result: dict) -> str:
    d = result.get("device")  # (the GPU suite's part gives none: its page says the device)
    where = "" if d is None else f"{d['name']}" + (
        f", {d['threads_per_process']} CPU thread(s) per process" if d.get("threads_per_process") else "") + \
        f"; precision {', '.join(d['peak_flops'])}. "
    lines = ["## Overhead: the harness against a plain PyTorch loop", "",
             *([f"**{result['interrupted']}**", ""] if result.get("interrupted") else []),
             f"{where}{result['rounds']} round(s) alternating the two programs; {result['steps']} timed steps after "
             f"{result['warmup']} warm-up steps each. Step time: median (p10-p90) over all rounds; by launches: each "
             f"round's ratio of mean steps - 1, median over the rounds [smallest, largest]; in the same processes: "
             f"the median ratio of block pairs [95% CI].", "",
             "| configuration | harness step s | plain step s | harness vs plain, by launches | harness's step vs "
             "plain's, same processes | losses harness vs plain |", "|---|---|---|---|---|---|"]
    for e in result["configs"]:
        if e["status"] != "ok":
            lines.append(f"| {e['name']} | **{e['status']}**: {e['error'][:100]} | | | | |")
            continue
        s, r = e["step_s"], e["vs_plain"]
        cells = [f"{s[p]['median']:.4f} ({s[p]['p10']:.4f}-{s[p]['p90']:.4f})" for p in PROGRAMS]
        lines.append(f"| {e['name']} | " + " | ".join(cells) + f" | {r['median']:+.1%} [{r['min']:+.1%}, "
                     f"{r['max']:+.1%}] | {paired_text(e.get('paired'))} | max diff {e['loss_max_diff']:.1e} |")
    return "\n".join(lines)


def paired_text(p: dict | None) -> str:
    if not p:
        return "-"
    if p["ci_low"] is None:
        return f"{p['median']:+.1%} ({p['blocks']} block pairs, too few for a 95% CI)"
    return f"{p['median']:+.1%} (95% CI {p['ci_low']:+.1%}..{p['ci_high']:+.1%}; {p['blocks']} block pairs)"
