"""`harness bench --overhead`: what the harness costs per step, and what DeepSpeed costs, measured apart.

For each configuration of the sweep (`--ds` x `--nproc` x `--mixed-precision`), alternating `--rounds` times
on the same processes, model and batches:
- `harness`: `harness train`, as `harness bench` times it (a metrics record every step);
- `reference`: the hand-written DeepSpeed loop (`reference.py`): the same engine and config, nothing else;
- `plain`: a plain PyTorch loop (`plain.py`), DistributedDataParallel on several processes.

Each program's step time is the time from one step's end to the next's (so nothing between steps escapes it),
in each round: harness overhead = mean harness step / mean reference step - 1, DeepSpeed overhead = mean
reference step / mean plain step - 1 (means: the harness syncs once a span of steps, `step.Span`, and that step's
cost is part of every step's), each reported as the median over the rounds, with the smallest and
largest round as the spread (a round's three runs are neighbours in time; rounds apart are not).

Each harness and reference run traces one extra step with torch.profiler (`profiling.py`, the same section
names): the report gives where the time of those steps went, section by section (medians over the rounds),
and the harness's own time: per round, its host time outside the engine's calls (forward, backward, step) less
the reference's, the median over the rounds. A busy machine blurs that difference far less than it blurs a
ratio of step times taken minutes apart. The reference must train to the harness's losses for the comparison to
be fair: `loss_max_diff` says how far apart they were.

After its timed steps, each reference run also alternates, on its own engine, blocks of its step with blocks of the
harness loop's step (`reference.py --paired`, `step.Steps`): `paired` compares them block by block, so the
harness's step code is measured without the launch-to-launch spread that blurs the programs' ratio (the same
program launched twice differs by several percent on a shared machine). Its median ratio comes with a 95%
confidence interval (distribution-free: two order statistics of the block ratios, `median_ci`).
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
from pathlib import Path

from ..config.run import ConfigError
from ..plan.resolve import Plan
from .sweep import (
    ROOT,
    Config,
    env_for,
    launcher,
    measure,
    plan_for,
    python,
    schedule_length,
    summary,
)

PROGRAMS = ("harness", "reference", "plain")


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
        return {**entry, "status": "skipped", "error": "a pipeline has no hand-written loop to compare with"}
    times = {p: [] for p in PROGRAMS}  # per program, per round: the timed steps' seconds
    losses, profiles = {}, {"harness": [], "reference": []}
    pairs = {"reference": [], "harness": []}  # block by block, over the rounds (`reference.py --paired`)
    # What the harness's timed run is told about its length, so the others follow the same schedule.
    length = [f"train.max_steps={schedule_length(warmup, steps)}", "train.epochs=0.0"]
    for r in range(rounds):  # harness, reference, plain; then the other way round: a drift in the machine's
        order = PROGRAMS if r % 2 == 0 else PROGRAMS[::-1]  # speed over the study weighs on all three alike
        for program in order:
            if program == "harness":
                h = measure(config, plan, run_file, sets, out / "overhead", warmup, steps, timeout, profile=True)
                if h["status"] != "ok":
                    return {**entry, "status": h["status"], "error": f"harness: {h['error']}"}
                result = {"step_s": h["step_s_values"], "loss": h["loss_values"]}
                profiles["harness"] += [h["profile"]] if h.get("profile") else []
            else:
                # the reference also runs the paired blocks: about 7x the steps, twice the time allowed
                result = script(program, config, plan.ds.precision, run_file, [*sets, *config.sets, *length],
                                warmup + steps, timeout * (2 if program == "reference" else 1))
                if "error" in result:
                    return {**entry, "status": "failed", "error": f"{program}: {result['error']}"}
                if "profile" in result:  # the reference's (plain.py traces nothing)
                    profiles[program].append(result["profile"])
                for name, blocks in result.get("paired", {}).items():
                    pairs[name] += blocks
                result = {k: result[k][warmup:] for k in ("step_s", "loss")}  # as the harness's record leaves them
            times[program].append(result["step_s"])
            losses.setdefault(program, result["loss"])
    return {**entry, "status": "ok", **figures(times), "loss_max_diff": max(
        abs(a - b) for a, b in zip(losses["harness"], losses["reference"])), **breakdown(profiles),
        "paired": paired(pairs)}


BLOCK = 17  # steps per paired block (`reference.py --paired`), the first one not timed: 16 timed, a span's worth


def paired_blocks(steps: int) -> int:
    """Blocks of each loop per reference run (`reference.py --paired`): about 6.8x `steps` more steps in all."""
    return max(2, steps // 5)


def paired(pairs: dict[str, list[list[float]]]) -> dict | None:
    """The harness loop's step against the reference's in one process, block by block: each pair's ratio of means
    - 1 (`ratios`, sorted; a block holds a span of the harness's steps, with the step that syncs); their median with
    a 95% confidence interval (None below 6 pairs), and the pooled mean steps."""
    if not pairs["harness"] or len(pairs["harness"]) != len(pairs["reference"]):
        return None
    each = sorted(statistics.fmean(h) / statistics.fmean(r) - 1 for h, r in zip(pairs["harness"], pairs["reference"]))
    low, high = median_ci(each) or (None, None)
    return {"median": statistics.median(each), "ci_low": low, "ci_high": high, "blocks": len(each), "ratios": each,
            "step_s": {p: statistics.fmean(s for b in pairs[p] for s in b) for p in ("harness", "reference")}}


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


def breakdown(profiles: dict[str, list[dict]]) -> dict:
    """The profiled steps (one per round and program) as medians: each section's host time for the harness and the
    reference, and `own_s`, per round the harness's time outside the engine's calls less the reference's."""
    if not profiles["harness"] or len(profiles["harness"]) != len(profiles["reference"]) or \
            not all(p.get("sections") for p in profiles["harness"] + profiles["reference"]):
        return {"profile": None}

    def outside(p: dict) -> float:
        return p["wall_s"] - p["sections"].get("engine", 0.0)

    def medians(ps: list[dict]) -> dict:
        names = list(dict.fromkeys(k for p in ps for k in p["sections"]))
        return {"steps": len(ps), "wall_s": statistics.median(p["wall_s"] for p in ps),
                "sections": {k: statistics.median(p["sections"].get(k, 0.0) for p in ps) for k in names},
                "unmarked_s": statistics.median(p["unmarked_s"] for p in ps)}

    own = [outside(h) - outside(r) for h, r in zip(profiles["harness"], profiles["reference"])]
    walls = [h["wall_s"] for h in profiles["harness"]]
    return {"profile": {**medians(profiles["harness"]), "own_s": statistics.median(own),
                        "own_share": statistics.median(o / w for o, w in zip(own, walls))},
            "reference_profile": medians(profiles["reference"])}


def figures(times: dict[str, list[list[float]]]) -> dict:
    """The study's arithmetic, from each program's step seconds per round."""
    pooled = {p: summary([s for r in times[p] for s in r]) for p in PROGRAMS}
    # means, not medians: the harness's loop syncs once a span of steps, and a median would drop the step that does
    per_round = [{p: statistics.fmean(times[p][r]) for p in PROGRAMS} for r in range(len(times["harness"]))]

    def ratio(a: str, b: str) -> dict:  # round by round: the programs of one round ran side by side
        each = [m[a] / m[b] - 1 for m in per_round]
        return {"median": statistics.median(each), "min": min(each), "max": max(each)}

    return {"step_s": pooled, "per_round": per_round, "harness_overhead": ratio("harness", "reference"),
            "deepspeed_overhead": ratio("reference", "plain")}


def script(program: str, config: Config, precision: str, run_file: str | None, sets: list[str], steps: int,
           timeout: float) -> dict:
    """Run reference.py or plain.py as `harness bench` launches the harness; its JSON line, or an error."""
    cmd = [python(), *launcher(config), "-m", f"harness.bench.{program}", "--steps", str(steps)]
    cmd += {"reference": ["--ds", config.ds, "--profile", "--paired", str(paired_blocks(steps)), "--block",
                          str(BLOCK)], "plain": ["--precision", precision]}[program]
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
    if any(c.sets for c in configs):
        raise ConfigError("--overhead compares programs, not run-config values: leave out --vary")
    split = [c.name for c in configs if json.loads(Path(c.ds).read_text()).get("sequence_parallel_size", 1) > 1]
    if split:
        raise ConfigError(f"--overhead with sequence parallelism ({', '.join(split)}): the hand-written loops it "
                          f"compares with do not split sequences; time those configurations with the sweep instead")


def markdown(result: dict) -> str:
    lines = ["## Overhead: the harness vs a hand-written DeepSpeed loop vs plain PyTorch", "",
             f"{result['rounds']} round(s) alternating the three programs; {result['steps']} timed steps after "
             f"{result['warmup']} warm-up steps each. Step time median (p10-p90) over all rounds; overhead: each "
             f"round's ratio of mean steps - 1, median over the rounds [smallest, largest].", "",
             "| configuration | harness step s | reference step s | plain step s | harness vs reference | "
             "harness's step vs reference's, one process | DeepSpeed (reference vs plain) | losses harness vs "
             "reference |", "|---|---|---|---|---|---|---|---|"]
    for e in result["configs"]:
        if e["status"] != "ok":
            lines.append(f"| {e['name']} | **{e['status']}**: {e['error'][:100]} | | | | | | |")
            continue
        s = e["step_s"]
        cells = [f"{s[p]['median']:.4f} ({s[p]['p10']:.4f}-{s[p]['p90']:.4f})" for p in PROGRAMS]
        lines.append(f"| {e['name']} | " + " | ".join(cells) + f" | {_ratio(e['harness_overhead'])} | "
                     f"{_paired(e.get('paired'))} | {_ratio(e['deepspeed_overhead'])} | "
                     f"max diff {e['loss_max_diff']:.1e} |")
    for e in result["configs"]:
        p, r = e.get("profile") or {}, e.get("reference_profile") or {}
        if p.get("sections"):
            lines += ["", f"{e['name']}, where a step's time went (host time, median of {p['steps']} profiled step(s) "
                          f"of each program; harness / reference): " + ", ".join(
                              f"{k} {v * 1e3:.2f} / {_ms(r.get('sections', {}).get(k))}"
                              for k, v in p["sections"].items()) +
                      f", the rest {p['unmarked_s'] * 1e3:.2f} / {_ms(r.get('unmarked_s'))}; the step "
                      f"{p['wall_s'] * 1e3:.1f} / {_ms(r.get('wall_s'))} ms. The harness's own time (outside the "
                      f"engine's calls, less the reference's): {p['own_s'] * 1e3:.2f} ms a step, "
                      f"{p['own_share']:+.1%} of it."]
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _paired(p: dict | None) -> str:
    if not p:
        return "-"
    if p["ci_low"] is None:
        return f"{p['median']:+.1%} ({p['blocks']} block pairs, too few for a 95% CI)"
    return f"{p['median']:+.1%} (95% CI {p['ci_low']:+.1%}..{p['ci_high']:+.1%}; {p['blocks']} block pairs)"


def _ratio(r: dict) -> str:
    return f"{r['median']:+.1%} [{r['min']:+.1%}, {r['max']:+.1%}]"


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "overhead.json", out / "overhead.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result) + "\n")
    return paths
