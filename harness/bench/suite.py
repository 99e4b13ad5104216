"""`harness bench suite`: every speed and quality figure a GPU can give (docs/benchmarks.md), in parts each under its
own time budget, since GPU time comes in short stretches; each command adds to `--out`'s suite.json. `--smoke`: all
of it, at toy size, on a CPU."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
import time
from argparse import Namespace
from importlib.metadata import version
from pathlib import Path

import torch

from ..config.ds import ds_path
from ..config.run import ConfigError, run_steps
from ..distributed.optim import deepspeed_arch_list
from ..eval.evaluate import evaluate_run
from ..plan.render import count_params
from ..run.builds import clear_stale_build_locks
from ..tasks import resolve
from . import overhead, report
from .catalog import LARGEST_TARGET, OVERHEAD_TARGET, RECIPES, SPEED, TOY, Recipe
from .results import suite_markdown
from .sweep import (ROOT, Config, cpu_threads, device_name, largest, last_error, measure, measured_peak, plan_for,
                    program, run_program, table_peak)

SCHEMA = 1
PARTS = ("ops", "speed", "overhead", "largest", "quality")
BUDGET_S = {"ops": 90, "speed": 320, "overhead": 150, "largest": 240, "quality": 330}  # two commands < 10 min
SMOKE_BUDGET_S = {"ops": 60, "speed": 90, "overhead": 90, "largest": 60, "quality": 160}
MIN_LAUNCH_S = {False: 20, True: 5}  # (by --smoke) a launch given less than this would only time out
PROBE_STEPS = 30
EVAL_SHARE = 0.25  # of a recipe's budget kept for its final evaluation, export and the test-split scoring


class Budget:
    """Seconds left to one part; every launch in it gets at most what is left."""

    def __init__(self, seconds: float, launch_s: float):
        self.seconds, self.launch_s, self.start = seconds, launch_s, time.monotonic()

    @property
    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def allows(self, launches: int = 1) -> bool:
        return self.left >= launches * self.launch_s

    def share(self, parts: int) -> Budget:
        return Budget(self.left / parts, self.launch_s)


def slug(text: str) -> str:
    """`text` as a file name: lower case, each run of other characters one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def not_run(name: str) -> dict:
    return {"name": name, "status": "not run", "error": "budget"}


def _sets(recipe_data: str, data_root: Path | None, sets: tuple[str, ...]) -> list[str]:
    path = [f"data.path={json.dumps(str(data_root / recipe_data))}"] if recipe_data and data_root else []
    return [*path, *sets]


def run_suite(args) -> dict:
    parts = args.parts = [p.strip() for p in (args.parts or ",".join(PARTS)).split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ConfigError(f"--parts: unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    budgets = dict(SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    for b in args.budget:
        part, _, seconds = b.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            raise ConfigError(f"--budget {b}: expected PART=SECONDS with a part of {', '.join(PARTS)}")
        budgets[part] = float(seconds)
    args.recipes = chosen_recipes(args.recipes, parts)
    work = Path(args.work or ROOT / "bench" / "suite-work")  # runs and checkpoints: never under results/
    data = Path(args.data) if args.data else None
    if data is None and args.smoke:  # no benchmark sets at hand: tiny stand-ins in their layout, made here
        from ..prepare.benchmarks import make_smoke

        data = make_smoke(work / "smoke-data")
        print(f"suite --smoke: no --data; made-up stand-ins of the benchmark sets in {data}", flush=True)
    if data is not None and not data.is_dir():
        raise ConfigError(f"--data {data}: not a directory (expected the benchmark sets: multi30k/, flip_ss/, flip_gb1/, ett/)")
    if any(p in parts for p in ("speed", "quality")):
        if data is None:
            raise ConfigError("--data DIR is needed for the speed and quality parts: the folder holding multi30k/, "
                              "flip_ss/, flip_gb1/ and ett/ (e.g. ../shared/data; `harness prepare TASK --from` lays "
                              "them out from their authors' files; --smoke makes stand-ins)")
        read = (*(SPEED if "speed" in parts else ()), *(args.recipes if "quality" in parts else ()))
        missing = sorted({x.data for x in read if x.data and not (data / x.data).exists()})
        if missing:
            raise ConfigError(f"--data {data}: no {', '.join(m if '.' in m else m + '/' for m in missing)} in it (the benchmark sets the "
                              f"speed and quality parts read)")
    clear_stale_build_locks()
    out = Path(args.out or ("bench/suite-smoke" if args.smoke else  # the default --out: day and device
                            f"results/gpu/{dt.date.today()}-{slug(device_name())[:40]}"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "suite.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    if result and result.get("smoke") != args.smoke:
        raise ConfigError(f"{path} holds a {'smoke' if result.get('smoke') else 'full'} run; use another --out")
    env = environment()
    if result and result["environment"]["device"] != env["device"]:
        raise ConfigError(f"{path} holds results of {result['environment']['device']}, this is {env['device']}; use "
                          f"another --out")
    result.update(schema=SCHEMA, suite="gpu", smoke=args.smoke, environment=env,
                  budgets_s={**result.get("budgets_s", {}), **{p: budgets[p] for p in parts}})
    argv = (a if re.fullmatch(r"[\w./=,:@+-]+", a) else json.dumps(a) for a in args.argv)  # quoted where needed
    result.setdefault("commands", []).append(" ".join(["python -m harness", *argv]))
    result.setdefault("parts", {})
    spare = 0.0  # what earlier parts of this command left unused goes to the next: the total stays the sum
    failed: list[str] = []
    for part in parts:
        budget = Budget(budgets[part] + spare, MIN_LAUNCH_S[args.smoke])
        print(f"== part {part} (budget {budget.seconds:.0f} s)", flush=True)
        started = time.monotonic()
        try:
            done = PART_RUNNERS[part](args, data, work / part, budget)
        except Exception as e:  # noqa: BLE001 - GPU time is scarce: a part that breaks is recorded, the rest runs
            done = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  failed: {type(e).__name__}: {e}", flush=True)
        failed += failures({part: done})  # before the merge, which may keep an earlier result over this one
        if part == "quality":  # each recipe says which command scored it: a later command may keep it
            for r in done.get("recipes", []):
                r.setdefault("command", len(result["commands"]) - 1)
            done = merge_quality(result["parts"].get(part), done)
        result["parts"][part] = {**done, "wall_s": time.monotonic() - started}
        spare = max(0.0, budget.left)
        path.write_text(json.dumps(result, indent=2) + "\n")  # after every part: a killed command keeps the rest
    (out / "suite.md").write_text(suite_markdown(result) + "\n")
    if (result["parts"].get("speed") or {}).get("bench"):
        report.plot(result["parts"]["speed"]["bench"], out / "speed.png")
    print(suite_markdown(result))
    print(f"wrote {path}, {out / 'suite.md'}")
    result["failures"] = failed
    return result


FAILED = ("failed", "timeout", "oom")


def failures(parts: dict[str, dict]) -> list[str]:
    """What a command's parts could not measure, one phrase each. Neither a budget spent ("not run") nor a largest-model
    try that ran out of memory or time (how the search finds the largest) is a failure."""
    out = []
    for part, done in parts.items():
        out += [f"{part}: {done.get('error', done['status'])}"[:200]] if done.get("status") in FAILED else []
        out += [f"{part} {e.get('name', '')}: {e['status']}" for e in (done.get("bench") or {}).get("configs", [])
                if e.get("status") in FAILED]
        out += [f"{part} {r['name']}: {r.get('error', r['status'])}"[:200] for r in done.get("recipes", [])
                if r.get("status") in FAILED]
        out += [f"{part} {c.get('name', c.get('ds', ''))} at {size}: {probe.get('error', 'failed')}"[:200]
                for c in (done.get("configs", []) if part == "largest" else [])
                for size, probe in (c.get("tried") or {}).items()
                if isinstance(probe, dict) and probe.get("status") == "failed"]
    return out


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {"device": device_name(), "kind": "cuda" if cuda else "cpu",
            "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
            "host_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "deepspeed": version("deepspeed"), "accelerate": version("accelerate"),
            "commit": commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def commit() -> str:
    """$HARNESS_COMMIT where set (a copy of the tree may carry a stale .git), else the checkout's commit."""
    if os.environ.get("HARNESS_COMMIT"):
        return os.environ["HARNESS_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("HARNESS_COMMIT", "unknown")


def part_ops(args, data, work: Path, budget: Budget) -> dict:
    """Build (or load from the cache) the DeepSpeed ops the harness uses on this device, timing each."""
    from deepspeed.accelerator import get_accelerator

    offload = "largest" in args.parts  # CPU Adam only for ZeRO-3 + offload: 50 s of GPU time
    cuda = torch.cuda.is_available()
    names = ["FusedAdamBuilder"] * cuda + ["CPUAdamBuilder"] * (offload or not cuda)
    ops = {}
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        start = time.monotonic()
        try:
            if builder is None or not builder.is_compatible(verbose=False):
                raise RuntimeError("not compatible with this machine (DeepSpeed's is_compatible)")
            with deepspeed_arch_list():
                builder.load(verbose=False)
            ops[name] = {"built": True, "seconds": time.monotonic() - start}
        except Exception as e:  # noqa: BLE001 - a failed build is a result: the harness falls back
            ops[name] = {"built": False, "seconds": time.monotonic() - start, "error": str(e).splitlines()[0][:300],
                         "fallback": "torch.optim.AdamW(fused=True)" if name == "FusedAdamBuilder" else
                         "none: ZeRO offload needs it"}
        print(f"  {name}: {'built' if ops[name]['built'] else 'FAILED: ' + ops[name]['error']} "
              f"({ops[name]['seconds']:.0f} s)", flush=True)
    return {"ops": ops, "extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR", "default")}


def part_speed(args, data, work: Path, budget: Budget) -> dict:
    """Each model x compile off/on, one process, the precision DeepSpeed picks on this device."""
    done, models, peaks = {}, [m for m in SPEED if m.smoke or not args.smoke], {}
    eager, compiled = [("false", m) for m in models], [] if args.smoke else [("true", m) for m in models]
    # Every model uncompiled first: a slow compile then costs the compiled rows, not the eager ones. Compiled, the
    # models with the highest targets go first, and none may take more than 60% of what is left unless it is the last.
    runs = eager + sorted(compiled, key=lambda run: -(run[1].target_mfu or 0))
    for i, (compile_, m) in enumerate(runs):
        base = _sets(m.data, data, m.smoke if args.smoke else m.sets)
        name = f"{m.name}, compile {'on' if compile_ == 'true' else 'off'}"
        timeout = budget.left if compile_ == "false" or i == len(runs) - 1 else 0.6 * budget.left
        if not budget.allows():
            done[compile_, m.name] = {**not_run(name), "model": m.name}
            continue
        config = Config(ds_path("zero0"), 1, "no", (f"train.compile={compile_}",))
        run_file = str(ROOT / "configs" / "runs" / m.run)
        try:
            plan = plan_for(config, run_file, base)
        except ConfigError as e:
            done[compile_, m.name] = {"name": name, "model": m.name, "status": "failed", "error": str(e)[:300]}
            continue
        precision = plan.ds.precision
        peak = measured_peak(precision, threads=cpu_threads(1))
        peaks.setdefault(precision, {"table": table_peak(device_name(), precision), "measured": peak})
        params = count_params(plan)
        print(f"  {name} ({precision}, {params:,} parameters)", flush=True)
        # a directory per model: measure names its runs by the configuration alone
        e = measure(config, plan, run_file, base, work / slug(m.name), args.warmup, args.steps, timeout, profile=True)
        done[compile_, m.name] = {**e, "name": name, "model": m.name, "params": params, "peak_flops_measured": peak,
                                  "target_mfu": m.target_mfu}
    cuda = torch.cuda.is_available()
    dev = {"name": device_name(), "kind": "cuda" if cuda else "cpu", "count": 1,
           "threads_per_process": None if cuda else cpu_threads(1), "peak_flops": peaks}
    entries = [done[compile_, m.name] for compile_, m in eager + compiled]  # the report's order: the catalog's
    report.derive(entries, dev)  # the measured entries: each has its precision's peaks
    for e in entries:
        target, mfu = e.get("target_mfu"), e.get("mfu_table")
        if e["status"] == "ok" and target is not None:
            e["target_met"] = None if mfu is None else mfu >= target  # None: no datasheet peak (CPU)
            if e["target_met"] is False:
                e["missed_by"] = target - mfu
    return {"bench": {"task": "speed suite", "steps": args.steps, "warmup": args.warmup, "device": dev,
                      "configs": entries}}


def part_overhead(args, data, work: Path, budget: Budget) -> dict:
    """The speed part's lm on 1 process, ZeRO-0: the harness against plain PyTorch (`overhead.py`)."""
    run = str(ROOT / "configs" / "runs" / "lm_demo.toml")
    sets = list(SPEED[2].smoke if args.smoke else SPEED[2].sets)
    if not budget.allows(3):
        return not_run("overhead")
    rounds = 2 if budget.allows(12) and not args.smoke else 1  # alternate twice where six launches fit with room
    o = overhead.one(Config(ds_path("zero0"), 1, "no"), run, sets, work / "overhead", rounds, args.warmup,
                     args.steps, budget.left / rounds / 3)  # a third each; the plain loop, with its paired blocks, two
    if o["status"] != "ok":
        return {"status": "failed", "error": o["error"][:300]}
    h = o["vs_plain"]["median"]
    return {**o, "rounds": rounds, "steps": args.steps, "warmup": args.warmup, "model": SPEED[2].name,
            "target": OVERHEAD_TARGET, "target_met": h <= OVERHEAD_TARGET, "missed_by": max(0.0, h - OVERHEAD_TARGET)}


def part_largest(args, data, work: Path, budget: Budget) -> dict:
    """ZeRO-0 and ZeRO-3 + CPU offload, the lm grown by layers, half the budget each."""
    run = str(ROOT / "configs" / "runs" / "lm_demo.toml")
    sets = list(TOY + ("data.seq_len=64",) if args.smoke else
                ("model.d_model=4096", "model.n_heads=32", "data.seq_len=512",
                 "train.micro_batch_size=1", "train.global_batch_size=0", "train.grad_accum_steps=1"))
    found = []
    for i, ds in enumerate(("zero0", "zero3_offload")):
        share = budget.share(2 - i)
        study = Namespace(largest="n_layers", run=run, memory_budget_gb=args.memory_budget_gb or (
            None if torch.cuda.is_available() else 4.0), largest_max=2 if args.smoke else 512,
            timeout=share.left, resolution=0.25, deadline=time.monotonic() + share.left)
        found.append(largest(Config(ds_path(ds), 1, "no"), study, sets, work))
    zero0, offload = found
    ratio = offload["params"] / zero0["params"] if zero0["params"] and offload["params"] else None
    return {"status": "ok", "key": "model.n_layers", "configs": found, "ratio": ratio, "target": LARGEST_TARGET,
            "target_met": None if ratio is None else ratio >= LARGEST_TARGET,
            "missed_by": None if ratio is None else max(0.0, LARGEST_TARGET - ratio),
            "bounds": "lower" if offload["stopped_by_budget"] or offload["capped"] else "measured"}


def chosen_recipes(names: str | None, parts: list[str]) -> tuple[Recipe, ...]:
    """`--recipes a,b`: the quality part's recipes to run (default all), in the suite's order."""
    if names is None:
        return RECIPES
    if "quality" not in parts:
        raise ConfigError(f"--recipes chooses the quality part's recipes, and --parts {','.join(parts)} has no quality")
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(wanted - {r.name for r in RECIPES})
    if unknown or not wanted:
        raise ConfigError(f"--recipes: unknown recipe(s) {', '.join(unknown) or '(none given)'}; the recipes are "
                          f"{', '.join(r.name for r in RECIPES)}")
    return tuple(r for r in RECIPES if r.name in wanted)


def merge_quality(before: dict | None, now: dict) -> dict:
    """A later command's recipes replace the same recipes' earlier results, except that a result never gives way to a
    worse one (scored > failed > not run): the earlier one then stays, the later attempt noted on it."""
    rank = {"ok": 2, "failed": 1, "not run": 0}
    kept = {r["name"]: r for r in (before or {}).get("recipes", [])}
    for r in now.get("recipes", []):
        old = kept.get(r["name"])
        if old is None or rank[r["status"]] >= rank[old["status"]]:
            kept[r["name"]] = r
        else:
            kept[r["name"]] = {**old, "later_attempt": f"{r['status']}: {r.get('error', '')}"[:300]}
    order = [r.name for r in RECIPES]  # a recipe since renamed or dropped goes last
    return {**now, "recipes": sorted(kept.values(), key=lambda r: (order.index(r["name"]) if r["name"] in order
                                                                  else len(order), r["name"]))}


def part_quality(args, data, work: Path, budget: Budget) -> dict:
    results = []
    for i, r in enumerate(args.recipes):
        share = budget.share(len(args.recipes) - i)
        if not share.allows(2):
            results.append({**not_run(r.name), "metric": r.metric, "target": r.target})
            continue
        results.append(quality(r, data, work / r.name, share, args.smoke))
    return {"recipes": results}


def quality(r: Recipe, data: Path, run_dir: Path, budget: Budget, smoke: bool) -> dict:
    """A probe of PROBE_STEPS steps (inside the warm-up: the schedule is the same whatever the final length), resumed
    to the steps the budget allows, then the test split scored once."""
    run_file = str(ROOT / "configs" / "runs" / r.run)
    sets = [*_sets(r.data, data, (*r.sets, *(r.smoke if smoke else ()))), f"run.output_dir={json.dumps(str(run_dir))}",
            'logging.backend="none"', "logging.plots=false", "train.log_every=10", "train.save_every=0"]
    entry = {"name": r.name, "metric": r.metric, "target": r.target, "run_file": f"configs/runs/{r.run}",
             "ds": f"configs/ds/{r.ds}.json", "compare": list(r.compare)}
    probe = PROBE_STEPS // 10 if smoke else PROBE_STEPS
    launched = time.monotonic()
    # A smoke run trains the probe's steps to the end (an export to score) in one launch instead of two
    smoke_sets = ["train.epochs=0.0", f"train.max_steps={probe}"] if smoke else []
    proc = _train(run_file, r.ds, [*sets, *smoke_sets], budget, "--overwrite",
                  *([] if smoke else ["--stop-at", str(probe)]))
    if proc.returncode != 0:
        return {**entry, "status": "failed", "error": last_error(proc.stdout + proc.stderr)}
    planned = re.search(r"steps (\d+)->(\d+) \((\d+) per epoch", proc.stdout + proc.stderr)
    recipe_steps = int(planned.group(2)) if planned else None
    if smoke and planned:  # the recipe's own length, from its run file and the steps per epoch just printed
        t = resolve(run_file, sets).cfg.train
        recipe_steps = run_steps(t, int(planned.group(3)))
    step_s = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step_s"]  # past the start-up
    start_up = max(0.0, time.monotonic() - launched - probe * step_s)  # the second launch pays it again
    steps = max(probe, probe + int((budget.left - start_up - EVAL_SHARE * budget.seconds) / step_s))
    steps = probe if smoke else min(steps, recipe_steps or steps)
    if not smoke:
        proc = _train(run_file, r.ds, [*sets, "train.epochs=0.0", f"train.max_steps={steps}"], budget, "--resume",
                      "auto")
        if proc.returncode != 0:
            return {**entry, "status": "failed", "error": last_error(proc.stdout + proc.stderr), "steps": steps}
    metrics = evaluate_run(run_dir, "test")
    value = metrics.get(r.metric)
    validation = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    return {**entry, "status": "ok", "value": value, "test": metrics, "validation": validation,
            "target_met": None if r.target is None or value is None else value >= r.target,
            "missed_by": None if r.target is None or value is None else max(0.0, r.target - value),
            "probe_step_s": step_s, "steps": steps, "recipe_steps": recipe_steps,
            "schedule": "complete" if recipe_steps and steps >= recipe_steps else
            f"cut by {'the smoke run' if smoke else 'the budget'} to {steps} of {recipe_steps} steps: not the "
            f"recipe's result",
            "wall_s": budget.seconds - budget.left}


def _train(run_file: str, ds: str, sets: list[str], budget: Budget, *flags: str) -> subprocess.CompletedProcess:
    return run_program(program(Config(ds_path(ds), 1, "no"), run_file, sets, "harness", "train", "--ds", ds_path(ds),
                               *flags), {**os.environ, "PYTHONUNBUFFERED": "1"}, max(1.0, budget.left))


PART_RUNNERS = {"ops": part_ops, "speed": part_speed, "overhead": part_overhead, "largest": part_largest,
                "quality": part_quality}
