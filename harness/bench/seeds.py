"""`harness bench seeds 0,1,2`: a recipe's figures as a mean and a spread over seeds, not one seed's: every
configuration trained to its end once per seed and scored as `harness evaluate` scores it, every seed asked for
reported (OUT/seeds.json, seeds.md; docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
from pathlib import Path

import torch

from ..config.ds import ds_path
from ..config.run import ConfigError
from ..eval.evaluate import evaluate_run
from ..run.selection import direction, metric_key
from .device import cpu_threads, torch_threads
from .sweep import (
    Config,
    as_text,
    env_for,
    grid,
    last_error,
    launcher,
    plan_for,
    python,
)

SEEDS_FILE = "seeds.json"


def seeds_of(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {text}: expected whole numbers separated by commas, e.g. 0,1,2") from None
    if len(seeds) != len(set(seeds)) or any(s < 0 for s in seeds):
        raise ConfigError(f"--seeds {text}: each seed once, each >= 0")
    return seeds


def spread(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def train_and_score(config: Config, run_file: str | None, sets: list[str], seed: int, run_dir: Path, split: str,
                    threads: int, timeout: int) -> dict:
    """One seed of one configuration trained to its end (a launch, `threads` threads a process on a CPU) and scored
    on `split` in this process with as many threads: the evaluation's metrics, or {"error": the line that says why}."""
    train = [python(), *launcher(config), "-m", "harness", "train", "--ds", config.ds, "--overwrite"]
    train += ["--run", run_file] if run_file else []
    for s in [*sets, *config.sets, f"run.output_dir={json.dumps(str(run_dir))}", f"train.seed={seed}",
              'logging.backend="none"', "logging.plots=false"]:
        train += ["--set", s]
    try:
        proc = subprocess.run(train, env=env_for(config, threads), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout} s: {last_error(as_text(e.stdout) + as_text(e.stderr))}"}
    if proc.returncode:
        return {"error": last_error(proc.stdout + proc.stderr)}
    try:
        with contextlib.nullcontext() if torch.cuda.is_available() else torch_threads(threads):
            return evaluate_run(run_dir, split)
    except Exception as e:  # noqa: BLE001 - one seed's failure is reported with the others, not the sweep's end
        return {"error": f"evaluate: {type(e).__name__}: {e}"}


def run_seeds(args) -> dict:
    """The sweep's configurations x `--seeds`, each trained and scored; writes OUT/seeds.json and OUT/seeds.md."""
    seeds, sets = seeds_of(args.seeds), list(args.set)
    configs = grid([ds_path(d) for d in args.ds.split(",")], [int(n) for n in args.nproc.split(",")],
                   args.mixed_precision.split(","), args.vary)
    plans = {c: plan_for(c, args.run, sets) for c in configs}  # every configuration checked before any training
    metric = metric_key(args.metric or next(iter(plans.values())).run.cfg.train.select_best)
    if not metric:
        raise ConfigError("--seeds needs --metric (the evaluation's figure to report, e.g. spearman) where the run "
                          "file sets no train.select_best")
    threads = args.threads or cpu_threads(max(c.nproc for c in configs))
    out = Path(args.out)
    result = {"run_file": args.run, "sets": sets, "seeds": seeds, "split": args.split, "metric": metric,
              "baseline": args.baseline, "threads_per_process": threads, "configs": []}
    total, done = len(configs) * len(seeds), 0
    for c in configs:
        entry = {"name": c.name, "sets": list(c.sets), "runs": []}
        result["configs"].append(entry)
        for seed in seeds:
            done += 1
            print(f"[{done}/{total}] {c.name} seed {seed}", flush=True)
            scored = train_and_score(c, args.run, sets, seed, out / "runs" / f"{c.slug}-seed{seed}", args.split,
                                     threads, args.timeout)
            if "error" not in scored and not isinstance(scored.get(metric), (int, float)):
                scored = {"error": f"the evaluation reports no {metric!r} (it has {', '.join(scored)})"}
            if "error" in scored:
                print(f"  failed: {scored['error']}", flush=True)
            else:
                print(f"  {metric} {scored[metric]:.4f}" + (f", {args.baseline} {scored[args.baseline]:.4f}"
                                                           if args.baseline in scored else ""), flush=True)
            entry["runs"].append({"seed": seed, **scored})
            entry.update(summarise(entry["runs"], metric, args.baseline))
            write(result, out)  # after every seed: a sweep cut short keeps what it measured
    print(markdown(result))
    print(f"wrote {out / SEEDS_FILE}, {out / 'seeds.md'}")
    return result


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / SEEDS_FILE).write_text(json.dumps(result, indent=2) + "\n")
    (out / "seeds.md").write_text(markdown(result) + "\n")


def summarise(runs: list[dict], metric: str, baseline: str | None) -> dict:
    """Mean and spread of `metric` (and `baseline`) over the runs that finished, and the seeds above the baseline."""
    done = [r for r in runs if metric in r]
    out: dict = {"failed": len(runs) - len(done)}
    if done:
        out[metric] = spread([r[metric] for r in done])
    paired = [r for r in done if baseline and baseline in r]
    if paired:
        out[baseline] = spread([r[baseline] for r in paired])
        higher = direction(metric, "auto") == "max"
        out["above_baseline"] = sum(r[metric] > r[baseline] if higher else r[metric] < r[baseline] for r in paired)
    return out


def markdown(result: dict) -> str:
    metric, baseline = result["metric"], result["baseline"]
    head = f"| configuration | {metric} per seed ({', '.join(map(str, result['seeds']))}) | mean | sd |"
    sep = "|---|---|---|---|"
    if baseline:
        head += f" {baseline} mean (sd) | seeds better than {baseline} |"
        sep += "---|---|"
    lines = [f"{result['split']} split, {len(result['seeds'])} seeds, {result['threads_per_process']} CPU thread(s) "
             f"per process; run file {result['run_file']}" + (f", --set {' '.join(result['sets'])}"
                                                             if result["sets"] else ""), "", head, sep]
    for e in result["configs"]:
        per = ", ".join(f"{r[metric]:.4f}" if metric in r else "failed" for r in e["runs"])
        row = f"| {e['name']} | {per} |"
        row += f" {e[metric]['mean']:.4f} | {e[metric]['sd']:.4f} |" if metric in e else " - | - |"
        if baseline:
            b = e.get(baseline)
            row += (f" {b['mean']:.4f} ({b['sd']:.4f}) | {e['above_baseline']} of {b['n']} |" if b else " - | - |")
        lines.append(row)
    return "\n".join(lines)
