"""`harness bench seeds 0,1,2`: a recipe's figures as a mean and a spread over seeds, not one seed's: each configuration
trained to its end once per seed and scored as `harness evaluate` scores it (OUT/seeds.json, seeds.md)."""
from __future__ import annotations

import contextlib
import itertools
import json
import statistics
from pathlib import Path

import torch

from ..config.run import ConfigError
from ..eval.evaluate import evaluate_run
from ..plan.resolve import Plan, loss_metric_names
from ..run.selection import direction, metric_key
from .report import save, shown
from .sweep import Config, cpu_threads, env_for, grid, last_error, plan_for, program, run_program, torch_threads


def seeds_of(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {text}: expected whole numbers separated by commas, e.g. 0,1,2") from None
    if len(seeds) != len(set(seeds)) or any(s < 0 for s in seeds):
        raise ConfigError(f"--seeds {text}: each seed once, each >= 0")
    return seeds


def spread(values: list[float]) -> dict[str, float]:
    """Mean and sample standard deviation (None for one value: there is none)."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values)}


def train_and_score(config: Config, run_file: str | None, sets: list[str], seed: int, run_dir: Path, split: str,
                    threads: int, timeout: int) -> dict:
    """The metrics of one seed trained to its end, scored here with as many threads; or {"error": why}."""
    sets = [*sets, *config.sets, f"run.output_dir={json.dumps(str(run_dir))}", f"train.seed={seed}",
            'logging.backend="none"', "logging.plots=false"]
    proc = run_program(program(config, run_file, sets, "harness", "train", "--ds", config.ds, "--overwrite"),
                       env_for(config, threads), timeout, cwd=None)
    if proc.returncode != 0:
        return {"error": last_error(proc.stdout + proc.stderr)}
    try:
        with contextlib.nullcontext() if torch.cuda.is_available() else torch_threads(threads):
            return evaluate_run(run_dir, split)
    except Exception as e:  # noqa: BLE001 - one seed's failure is reported with the others, not the sweep's end
        return {"error": f"evaluate: {type(e).__name__}: {e}"}


def run_seeds(args) -> dict:
    seeds, sets, configs = seeds_of(args.seeds), list(args.set), grid(args)
    plans = {c: plan_for(c, args.run, sets) for c in configs}  # every configuration checked before any training
    metric = metric_key(args.metric or next(iter(plans.values())).run.cfg.train.select_best)
    if not metric:
        raise ConfigError("--seeds needs --metric (the evaluation's figure to report, e.g. spearman) where the run "
                          "file sets no train.select_best")
    for plan in plans.values():
        check_scorable(plan, args.split, metric, args.baseline)
    threads = args.threads or cpu_threads(max(c.nproc for c in configs))
    out = Path(args.out)
    result = {"run_file": shown(args.run), "sets": sets, "seeds": seeds, "split": args.split, "metric": metric,
              "baseline": args.baseline, "threads_per_process": threads, "configs": []}
    for i, (c, seed) in enumerate(itertools.product(configs, seeds)):
        if seed == seeds[0]:  # a configuration's entry joins the report as it starts
            result["configs"].append({"name": c.name, "sets": list(c.sets), "runs": []})
        entry = result["configs"][-1]
        print(f"[{i + 1}/{len(configs) * len(seeds)}] {c.name} seed {seed}", flush=True)
        scored = train_and_score(c, args.run, sets, seed, out / "runs" / f"{c.slug}-seed{seed}", args.split,
                                 threads, args.timeout)
        check_reported(scored, metric, args.baseline, out / "runs" / f"{c.slug}-seed{seed}")
        if "error" in scored:
            print(f"  failed: {scored['error']}", flush=True)
        else:
            print(f"  {metric} {scored[metric]:.4f}" + (f", {args.baseline} {scored[args.baseline]:.4f}"
                                                       if args.baseline in scored else ""), flush=True)
        entry["runs"].append({"seed": seed, **scored})
        entry.update(summarise(entry["runs"], metric, args.baseline))
        save(out, "seeds", result, markdown(result))  # after every seed: a sweep cut short keeps what it measured
    print(markdown(result))
    print(f"wrote {out / 'seeds.json'}, {out / 'seeds.md'}")
    return result


def check_reported(scored: dict, metric: str, baseline: str | None, run_dir: Path) -> None:
    """After a run's evaluation: the figures --metric and --baseline name are among those it reports, or the study
    stops there, in one line (a task with a field evaluation of its own says them only once it ran)."""
    if "error" in scored:
        return
    missing = [f"{flag} {name}" for flag, name in (("--metric", metric), ("--baseline", baseline))
               if name and not isinstance(scored.get(name), (int, float))]
    if missing:
        figures = ", ".join(k for k, v in scored.items() if isinstance(v, (int, float)))
        raise ConfigError(f"{' and '.join(missing)}: the evaluation reports no such figure (it has {figures}); the "
                          f"study stops after its first run ({run_dir})")


def check_scorable(plan: Plan, split: str, metric: str, baseline: str | None = None) -> None:
    """What `harness evaluate` would refuse after every seed's training, refused before the first: a split the task
    does not build, a figure its evaluation does not report (known before a run where they all come from the loss)."""
    task, cfg = plan.task, plan.run.cfg
    reported = loss_metric_names(task)
    if reported is None:
        return
    for flag, name in (("--metric", metric), ("--baseline", baseline)):
        if name is not None and name not in reported:
            raise ConfigError(f"{flag} {name}: task {cfg.run.task!r} reports {', '.join(reported)}")
    if split == "test" and getattr(task.build_data(cfg), "test", None) is None:
        raise ConfigError(f"--split test: task {cfg.run.task!r} builds no test split (its build_data gives training "
                          f"and validation data); score --split validation")


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
    head = f"| configuration | {metric} per seed ({', '.join(map(str, result['seeds']))}) | mean | sd |" + (
        f" {baseline} mean (sd) | seeds better than {baseline} |" if baseline else "")
    sep = "|---|---|---|---|" + ("---|---|" if baseline else "")
    lines = [f"{result['split']} split, {len(result['seeds'])} seeds, {result['threads_per_process']} CPU thread(s) "
             f"per process; run file {result['run_file']}" + (f", --set {' '.join(result['sets'])}"
                                                             if result["sets"] else ""), "", head, sep]
    for e in result["configs"]:
        per = ", ".join(f"{r[metric]:.4f}" if metric in r else "failed" for r in e["runs"])
        row = f"| {e['name']} | {per} |"
        row += f" {e[metric]['mean']:.4f} | {_sd(e[metric]['sd'])} |" if metric in e else " - | - |"
        if baseline:
            b = e.get(baseline)
            row += (f" {b['mean']:.4f} ({_sd(b['sd'])}) | {e['above_baseline']} of {b['n']} |" if b else " - | - |")
        lines.append(row)
    return "\n".join(lines)


def _sd(sd: float | None) -> str:
    return "n/a (1 seed)" if sd is None else f"{sd:.4f}"
