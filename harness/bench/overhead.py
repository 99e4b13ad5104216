"""`harness bench overhead`: the harness's step against a plain PyTorch step (`plain.py`) on the same model and batches.

For each configuration, `--rounds` times, the two programs in turn (the order reversed every other round): `harness
train` as the sweep times it, and `python -m harness.bench.plain`, which after its own timed steps alternates blocks
of plain and harness steps in the same processes (`paired`: the harness's step code measured without the spread
between launches). What each figure means and how it is read: docs/benchmarks.md.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
from pathlib import Path

from ..config.run import ConfigError
from ..plan.resolve import Plan
from .sweep import ROOT, Config, env_for, launcher, measure, plan_for, python, schedule_length, summary

PROGRAMS = ("harness", "plain")
BLOCK = 17  # steps per paired block, the first one not timed: 16 timed, a span's worth


def study(plans: dict[Config, Plan], run_file: str | None, sets: list[str], out: Path, rounds: int, warmup: int,
          steps: int, timeout: float) -> dict:
    """`one` for each configuration, with the plan it was checked by before any launch."""
    entries = []
    for i, (c, plan) in enumerate(plans.items()):
        print(f"[{i + 1}/{len(plans)}] overhead {c.name}", flush=True)
        entries.append(one(c, run_file, sets, out, rounds, warmup, steps, timeout, plan))
    return {"rounds": rounds, "warmup": warmup, "steps": steps, "configs": entries}


def one(config: Config, run_file: str | None, sets: list[str], out: Path, rounds: int, warmup: int, steps: int,
        timeout: float, plan: Plan | None = None) -> dict:
    plan = plan or plan_for(config, run_file, sets)
    entry = {"name": config.name, "nproc": config.nproc, "zero_stage": plan.ds.zero_stage,
             "precision": plan.ds.precision, "layout": plan.ds.layout.describe()}
    if plan.ds.layout.pp_size > 1:
        return {**entry, "status": "skipped", "error": "a pipeline has no plain loop to compare with"}
    times, losses = {p: [] for p in PROGRAMS}, {}  # per program, per round: the timed steps' seconds
    pairs = {p: [] for p in PROGRAMS}  # block by block, over the rounds
    # What the harness's timed run is told about its length, so the plain loop follows the same schedule.
    length = [f"train.max_steps={schedule_length(warmup, steps)}", "train.epochs=0.0"]
    for r in range(rounds):  # a drift in the machine's speed over the study weighs on both alike
        for program in PROGRAMS if r % 2 == 0 else PROGRAMS[::-1]:
            if program == "harness":
                h = measure(config, plan, run_file, sets, out / "overhead", warmup, steps, timeout)
                if h["status"] != "ok":
                    return {**entry, "status": h["status"], "error": f"harness: {h['error']}"}
                result = {"step_s": h["step_s_values"], "loss": h["loss_values"]}
            else:  # with its paired blocks, about 7x the steps: twice the time allowed
                result = script(config, run_file, [*sets, *config.sets, *length], warmup + steps, 2 * timeout)
                if "error" in result:
                    return {**entry, "status": "failed", "error": f"plain: {result['error']}"}
                for name, blocks in result.get("paired", {}).items():
                    pairs[name] += blocks
                result = {k: result[k][warmup:] for k in ("step_s", "loss")}  # as the harness's record leaves them
            times[program].append(result["step_s"])
            losses.setdefault(program, result["loss"])
    return {**entry, "status": "ok", **figures(times), "paired": paired(pairs),
            "loss_max_diff": max(abs(a - b) for a, b in zip(losses["harness"], losses["plain"]))}


def paired_blocks(steps: int) -> int:
    """Blocks of each loop per plain run: about 6.8x `steps` more steps in all."""
    return max(2, steps // 5)


def paired(pairs: dict[str, list[list[float]]]) -> dict | None:
    """The harness's step against the plain one in the same processes, block by block: each pair's ratio of means
    - 1 (`ratios`, sorted; a block holds a span of the harness's steps, with the step that syncs); their median with
    a 95% confidence interval (None below 6 pairs), and the pooled mean steps."""
    if not pairs["harness"] or len(pairs["harness"]) != len(pairs["plain"]):
        return None
    each = sorted(statistics.fmean(h) / statistics.fmean(p) - 1 for h, p in zip(pairs["harness"], pairs["plain"]))
    low, high = median_ci(each) or (None, None)
    return {"median": statistics.median(each), "ci_low": low, "ci_high": high, "blocks": len(each), "ratios": each,
            "step_s": {p: statistics.fmean(s for b in pairs[p] for s in b) for p in PROGRAMS}}


def median_ci(ordered: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The distribution-free confidence interval for the median of a sorted sample: its order statistics j and
    n + 1 - j (1-based), j the largest with P(Bin(n, 1/2) < j) <= (1 - level) / 2, so that it covers the median
    with probability at least `level` whatever the distribution; None where no such j exists (fewer than 6 values
    at 95%)."""
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


def script(config: Config, run_file: str | None, sets: list[str], steps: int, timeout: float) -> dict:
    """`python -m harness.bench.plain`, launched as the harness is; its JSON line, or an error."""
    cmd = [python(), *launcher(config), "-m", "harness.bench.plain", "--steps", str(steps), "--ds", config.ds,
           "--paired", str(paired_blocks(steps)), "--block", str(BLOCK)]
    cmd += ["--run", run_file] if run_file else []
    for s in sets:
        cmd += ["--set", s]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env_for(config), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"step_s"')]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
        return {"error": f"exit {proc.returncode}: {tail[-300:]}"}
    return json.loads(lines[-1])


def check(configs: list[Config]) -> None:
    split = [c.name for c in configs if json.loads(Path(c.ds).read_text()).get("sequence_parallel_size", 1) > 1]
    if split:
        raise ConfigError(f"the overhead study with sequence parallelism ({', '.join(split)}): the plain loop it "
                          f"compares with does not split sequences; time those configurations with the sweep instead")


def markdown(result: dict) -> str:
    lines = ["## Overhead: the harness against a plain PyTorch loop", "",
             f"{result['rounds']} round(s) alternating the two programs; {result['steps']} timed steps after "
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


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "overhead.json", out / "overhead.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result) + "\n")
    return paths
