"""`harness bench sweep`: every configuration resolved and checked first, then launched once and timed from its own
metrics records beside the device's peak FLOP/s, from a datasheet (a promise) and measured here (what this machine does
today); `--largest` also finds the largest model each fits. What the figures mean: docs/benchmarks.md."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..config.ds import ds_path, model_state_bytes
from ..config.run import ConfigError
from ..distributed.parallel import DTYPES
from ..plan.render import count_params, largest_fitting
from ..plan.resolve import Plan, make_plan
from ..plan.scaling import PEAK_TFLOPS
from ..run.builds import clear_stale_build_locks
from ..run.machine import FIT_CHECK_ENV
from ..run.profiling import PROFILE_FILE
from ..run.tracking import read_jsonl
from . import report

ROOT = Path(__file__).resolve().parents[2]  # the repository: launch/ configs live there
SEQ_UNIT = 64  # --largest seq_len searches multiples of this


@dataclass(frozen=True)
class Config:
    ds: str                     # path of the DeepSpeed JSON
    nproc: int
    mixed_precision: str        # accelerate's --mixed_precision: no | bf16 | fp16
    sets: tuple[str, ...] = ()  # the compared run-config values, "section.key=value"

    @property
    def name(self) -> str:
        precision = [self.mixed_precision] if self.mixed_precision != "no" else []
        return " ".join([Path(self.ds).stem, f"x{self.nproc}", *precision, *self.sets])

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)


def grid(args) -> list[Config]:
    """Every combination of --ds, --nproc, --mixed-precision and each --vary's values."""
    axes = []
    for vary in getattr(args, "vary", []):  # the overhead study has no --vary
        key, eq, values = vary.partition("=")
        if not eq or not values:
            raise ConfigError(f"--vary expects section.key=value1,value2; got {vary!r}")
        axes.append([f"{key}={v}" for v in values.split(",")])
    counts = [n.strip() for n in args.nproc.split(",")]
    if not all(n.isdigit() and int(n) >= 1 for n in counts):
        raise ConfigError(f"--nproc {args.nproc}: comma-separated process counts, each 1 or more")
    runs = itertools.product([ds_path(d.strip()) for d in args.ds.split(",")], [int(n) for n in counts],
                             [m.strip() for m in args.mixed_precision.split(",")])
    configs = [Config(ds, n, p, tuple(sets)) for ds, n, p in runs for sets in itertools.product(*axes)]
    names = [c.name for c in configs]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice:  # one row and one log for two configurations (two DeepSpeed files of one name), or one run twice
        raise ConfigError(f"two configurations are named {twice!r}: give each value once, and DeepSpeed files of "
                          f"different names")
    return configs


def model_parallel_size(ds: str) -> int:
    """Tensor x pipeline x sequence size: the process counts a DeepSpeed file can run on are its multiples."""
    cfg = json.loads(Path(ds).read_text())
    tp = (cfg.get("tensor_parallel") or {}).get("autotp_size", 1) or 1
    return tp * (cfg.get("pipeline") or {}).get("stages", 1) * (cfg.get("sequence_parallel_size") or 1)


def plan_for(config: Config, run_file: str | None, sets: list[str]) -> Plan:
    """The configuration checked as `harness train` would (the bench sets the length itself)."""
    return make_plan(run_file, [*sets, *config.sets, "train.epochs=0.0", "train.max_steps=1"], config.ds,
                     config.nproc, config.mixed_precision)


def plans(args) -> dict[Config, Plan]:
    """Every configuration that fits its process count, checked before any launch (and stale build locks cleared)."""
    configs = grid(args)
    fitting = [c for c in configs if c.nproc % model_parallel_size(c.ds) == 0]  # tp2 on 1 process: not a config
    for c in [c for c in configs if c not in fitting]:
        print(f"skipped {c.name}: its tensor x pipeline x sequence size {model_parallel_size(c.ds)} needs a "
              f"multiple of it in processes", flush=True)
    if not fitting:
        raise ConfigError("no configuration of the sweep fits its process counts (--nproc)")
    planned = {c: plan_for(c, args.run, args.set) for c in fitting}
    clear_stale_build_locks()
    return planned


def python() -> str:
    """The bench's programs' interpreter: PYTHON_EXEC where set (the tests start them warm), else this one."""
    return os.environ.get("PYTHON_EXEC") or sys.executable


def launcher(config: Config) -> list[str]:
    """`accelerate launch` for several processes; one starts directly, saving accelerate's seconds per launch."""
    launch = ROOT / "launch" / ("multi_gpu.yaml" if torch.cuda.is_available() else "cpu_2proc.yaml")
    return ["-m", "accelerate.commands.launch", "--config_file", str(launch), "--num_processes",
            str(config.nproc), "--mixed_precision", config.mixed_precision] if config.nproc > 1 else []


def program(config: Config, run_file: str | None, sets: list[str], *module: str) -> list[str]:
    """`python -m MODULE ARGS...`, launched as `launcher` says, with the run file and `sets` as --set."""
    return [python(), *launcher(config), "-m", *module, *(["--run", run_file] if run_file else []),
            *(a for s in sets for a in ("--set", s))]


def run_program(cmd: list[str], env: dict[str, str], timeout: float,
                cwd: Path | None = ROOT) -> subprocess.CompletedProcess:
    """The finished process; a timed-out one has returncode None and says so as its last line."""
    # A session of its own: a timeout, or Ctrl-C here, ends every process it started (torchrun's ranks too, which
    # would train on, adopted by init, beside the next measurement).
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_group(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the session keeps the pipes: its output is lost
            out, err = "", ""
        return subprocess.CompletedProcess(cmd, None, out or "", f"{err or ''}\ntimed out after {timeout:.0f} s")
    except BaseException:
        _end_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _end_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def json_line(cmd: list[str], env: dict[str, str], timeout: float, cwd: Path | None = ROOT,
              prefix: str = "{") -> dict:
    """The last line a program prints that starts with `prefix`, read as JSON; or {"error": the line that says why}."""
    proc = run_program(cmd, env, timeout, cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    if proc.returncode != 0 or not lines:
        return {"error": last_error(proc.stdout + proc.stderr)}
    return json.loads(lines[-1])


def env_for(config: Config, threads: int | None = None) -> dict[str, str]:
    """On a CPU each process gets `threads` threads (default: its share of the cores)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ACCELERATE_MIXED_PRECISION": config.mixed_precision,
           FIT_CHECK_ENV: "0"}  # a bench measures what fits (--largest tries sizes until one runs out of memory)
    if not torch.cuda.is_available():  # the processes share the cores
        env["OMP_NUM_THREADS"] = str(threads or cpu_threads(config.nproc))
    return env


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"  # threads: per configuration


def table_peak(name: str, precision: str) -> float | None:
    """FLOP/s from the table, or None for a device (or precision) it does not list (every CPU)."""
    for key, rates in PEAK_TFLOPS.items():  # "H100 PCIe" is listed before "H100": first match wins
        if key in name and precision in rates:
            return rates[precision] * 1e12
    return None


def cpu_threads(max_nproc: int) -> int:
    """Each process's share of the cores: the same in every configuration of a sweep, so that they compare alike."""
    return max(1, (os.cpu_count() or 1) // max(1, max_nproc))


@contextlib.contextmanager
def torch_threads(threads: int):
    """Within: `threads` torch threads (a CPU process's share of the cores); as they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measured_peak(precision: str, threads: int | None = None) -> float:
    """FLOP/s of a square matrix product in `precision`: the median of 5 after a warm-up, on random data (zeros can
    run faster); on a CPU with `threads` threads."""
    cuda, times = torch.cuda.is_available(), []
    n = 8192 if cuda else 1024
    a, b = (torch.randn(n, n, device="cuda" if cuda else "cpu", dtype=DTYPES[precision]) for _ in range(2))
    with torch_threads(threads) if threads and not cuda else contextlib.nullcontext():
        a @ b  # warm-up: kernel selection, thread pool start
        for _ in range(5):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                a @ b
                end.record()
                torch.cuda.synchronize()  # sync point
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def describe(precisions: list[str], threads: int | None = None) -> dict:
    """bench.json's device, with both peaks per precision (per device, or per process's share of a CPU)."""
    name, cuda = device_name(), torch.cuda.is_available()
    return {"name": name, "kind": "cuda" if cuda else "cpu", "count": torch.cuda.device_count() if cuda else 1,
            "threads_per_process": None if cuda else threads,
            "peak_flops": {p: {"table": table_peak(name, p), "measured": measured_peak(p, threads=threads)}
                           for p in precisions}}


def schedule_length(warmup: int, steps: int) -> int:
    """Past the timed steps and a profiled one: the run stops by --stop-at, with no final evaluation or export."""
    return warmup + steps + 2


def last_error(text: str) -> str:
    """A failed run's last error line, else its last line."""
    errors = [line for line in text.splitlines() if "Error" in line or "error:" in line or "timed out" in line]
    return ((errors or text.splitlines() or [""])[-1])[-300:]


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread: on a shared machine single timings are noise, their median is not."""
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return {"median": statistics.median(ordered), "p10": pick(0.1), "p90": pick(0.9), "min": ordered[0],
            "max": ordered[-1], "n": len(ordered)}


def measure(config: Config, plan: Plan, run_file: str | None, sets: list[str], out: Path, warmup: int,
            steps: int, timeout: float, threads: int | None = None, profile: bool = False) -> dict:
    """One launch, its timed steps summarised; a failure is recorded, not raised. `profile` traces one more step."""
    run_dir, log = out / "runs" / config.slug, out / "runs" / f"{config.slug}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    entry = {"name": config.name, **asdict(config), "ds": os.path.relpath(config.ds, ROOT),
             "precision": plan.ds.precision, "zero_stage": plan.ds.zero_stage, "layout": plan.ds.layout.describe(),
             "global_batch": plan.ds.global_batch_size, "micro_batch": plan.run.cfg.train.micro_batch_size,
             "grad_accum": plan.ds.grad_accum_steps, "seq_len": plan.run.cfg.data.seq_len}
    stop_at = warmup + steps + int(profile)
    timing = [f"run.output_dir={json.dumps(str(run_dir))}", "train.log_every=1", "train.eval_every=0",
              "train.save_every=0", 'logging.backend="none"', "logging.plots=false",
              f"train.max_steps={schedule_length(warmup, steps)}", "train.epochs=0.0"]
    sets = [*sets, *([f"train.profile_step={stop_at}"] if profile else []), *config.sets, *timing]
    proc = run_program(program(config, run_file, sets, "harness", "train", "--ds", config.ds, "--overwrite",
                               "--stop-at", str(stop_at)), env_for(config, threads), timeout)
    text = proc.stdout + proc.stderr
    log.write_text(text)
    if proc.returncode is None:
        return {**entry, "status": "timeout", "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        oom = re.search(r"out of memory|OutOfMemoryError|Killed|MemoryError", text, re.I)
        return {**entry, "status": "oom" if oom else "failed", "error": last_error(text)}
    records = read_jsonl(run_dir / "metrics.jsonl")
    timed = [r for r in records if warmup < r["step"] <= warmup + steps]
    if not timed:
        return {**entry, "status": "failed", "error": f"no step after the {warmup} warm-up steps was recorded"}
    step_s = summary([r["step_s"] for r in timed])
    return {**entry, "status": "ok", "step_s": step_s, "step_s_values": [r["step_s"] for r in timed],
            "loss_values": [r["loss"] for r in timed],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "samples_per_s": entry["global_batch"] / step_s["median"],
            "flops_per_step": statistics.median(r["tflops"] * 1e12 * r["step_s"] for r in timed),
            "flops_method": timed[-1].get("flops_method", "analytic"),
            "padding": statistics.median(r["padding"] for r in timed),
            # train.compile's seconds compiling, warm-up steps included: kept out of every step_s above
            "compile_s": sum(r["compile_s"] for r in records) if "compile_s" in records[0] else None,
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in timed),
            "build_peak_bytes": timed[-1].get("build_peak_bytes"), "log": os.path.relpath(log, out),
            "activation_bytes": timed[-1].get("activation_bytes"),  # rank 0's first micro-batch, kept for backward
            **({"profile": json.loads((run_dir / PROFILE_FILE).read_text())}
               if profile and (run_dir / PROFILE_FILE).is_file() else {})}


def pooled(entries: list[dict]) -> dict:
    """One configuration's launches (`--rounds`) as one entry: every launch's timed steps pooled (step time, its rates
    and the FLOP/s from it), the largest peaks, the median measured matmul peak. A launch that failed is the entry."""
    if len(entries) == 1 or any(e["status"] != "ok" for e in entries):
        return next((e for e in entries if e["status"] != "ok"), entries[0])
    first, steps = entries[0], [v for e in entries for v in e["step_s_values"]]
    median = statistics.median(steps)
    return {**first, "step_s": summary(steps), "step_s_values": steps, "rounds": len(entries),
            "tokens_per_s": first["tokens_per_s"] * first["step_s"]["median"] / median,  # (the same work a step)
            "samples_per_s": first["global_batch"] / median,
            "peak_mem_bytes": max(e["peak_mem_bytes"] for e in entries),
            "peak_flops_measured": statistics.median(e["peak_flops_measured"] for e in entries)}


def run_bench(args) -> dict:
    if args.largest and not torch.cuda.is_available() and not args.memory_budget_gb:
        raise ConfigError("--largest on a CPU needs --memory-budget-gb (the memory a 'device' may use per rank)")
    planned, sets, out = plans(args), list(args.set), Path(args.out)
    threads = cpu_threads(max(c.nproc for c in planned))  # every process the same share of the cores
    rounds = getattr(args, "rounds", 1)
    result = {"schema": report.SCHEMA, "task": next(iter(planned.values())).run.cfg.run.task,
              "run_file": report.shown(args.run), "sets": sets, "steps": args.steps, "warmup": args.warmup,
              "rounds": rounds, "device": describe(sorted({p.ds.precision for p in planned.values()}), threads),
              "configs": []}
    runs: dict[Config, list[dict]] = {c: [] for c in planned}
    with report.kept_if_interrupted(result, len(planned) * rounds, lambda: report.save(out, "bench", result,
                                                                                     report.markdown(result))):
        for r, (i, (c, plan)) in itertools.product(range(rounds), enumerate(planned.items())):
            print(f"[{i + 1}/{len(planned)}{f', round {r + 1} of {rounds}' if rounds > 1 else ''}] {c.name}",
                  flush=True)
            peak = measured_peak(plan.ds.precision, threads=threads)  # beside the run: the machine now
            entry = measure(c, plan, args.run, sets, out, args.warmup, args.steps, args.timeout, threads)
            runs[c].append({**entry, "params": count_params(plan), "peak_flops_measured": peak})
            result["configs"] = [pooled(done) for done in runs.values() if done]
            report.derive(result["configs"], result["device"])
    if args.largest:
        result["largest"] = [largest(c, args, sets, out, measured) for c, measured in zip(planned, result["configs"])]
    written = report.save(out, "bench", result, report.markdown(result)) + [report.plot(result, out / "bench.png")]
    for path in filter(None, written):  # no plot where nothing was measured
        print(f"wrote {path}")
    print(report.markdown(result))
    return result


def predicted_size(plan_of, budget_bytes: float, host_bytes: float) -> int:
    """Where a search at billions of parameters starts, so it needs few slow tries: the size at which the model states
    fill the device's budget, or the host (offloaded states and the fp32 model every rank first builds there)."""
    one = plan_of(1)
    p1, p2 = count_params(one), count_params(plan_of(2))
    per_unit, fixed = max(1, p2 - p1), max(0, 2 * p1 - p2)
    states = model_state_bytes(10**6, one.ds)
    device_per_param, host_per_param = states["device"] / 1e6, states["cpu"] / 1e6 + 4
    k = min((0.9 * budget_bytes / max(device_per_param, 1e-9) - fixed) / per_unit,
            (0.8 * host_bytes / host_per_param - fixed) / per_unit)
    return max(1, int(k))


def largest(config: Config, args, sets: list[str], out: Path, measured: dict | None = None) -> dict:
    """The largest `args.largest` whose 2-step run fits the memory budget; past `args.deadline` no try starts and the
    result is a lower bound. `measured`, the sweep's entry, stands for the try at the configuration's own size."""
    key = "data.seq_len" if args.largest == "seq_len" else f"model.{args.largest}"
    plan = plan_for(config, args.run, sets)
    # widths that split into heads; lengths that split over sequence-parallel ranks (up to 64)
    unit = {"n_layers": 1, "d_model": plan.run.cfg.model.n_heads * 8, "seq_len": SEQ_UNIT}[args.largest]
    budget = (args.memory_budget_gb * 2**30 if args.memory_budget_gb
              else torch.cuda.get_device_properties(0).total_memory)
    deadline, resolution = getattr(args, "deadline", None), getattr(args, "resolution", 0.0)
    tried, stopped = {}, []
    own = plan.run.cfg.data.seq_len if args.largest == "seq_len" else getattr(plan.run.cfg.model, args.largest)

    def trial(k: int) -> Config:
        return replace(config, sets=(*config.sets, f"{key}={k * unit}"))

    def fits(k: int) -> bool:
        left = None if deadline is None else deadline - time.monotonic()
        if measured and measured.get("status") == "ok" and k * unit == own:
            entry = measured  # the sweep's own run had the try's 2 steps and more
        elif left is not None and left < 10:
            stopped.append(k)
            return False
        else:
            try:
                trial_plan = plan_for(trial(k), args.run, sets)
            except ConfigError:
                return False
            entry = {**measure(trial(k), trial_plan, args.run, sets, out / "largest", 0, 2,
                               args.timeout if left is None else min(args.timeout, left)),
                     "params": count_params(trial_plan)}
        tried[k * unit] = {f: entry.get(f) for f in ("status", "peak_mem_bytes", "params", "error")}
        if entry["status"] == "timeout":
            stopped.append(k)  # out of time, not out of memory: the result is a lower bound
        return entry["status"] == "ok" and entry["peak_mem_bytes"] <= budget

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    start = predicted_size(lambda k: plan_for(trial(k), args.run, sets), budget, host) \
        if resolution and args.largest != "seq_len" else max(1, own // unit)
    k = largest_fitting(fits, min(start, args.largest_max), args.largest_max, resolution)
    return {"name": config.name, "key": key, "value": k * unit, "params": tried.get(k * unit, {}).get("params", 0),
            "capped": k == args.largest_max, "budget_bytes": budget, "stopped_by_budget": bool(stopped),
            "tried": tried}
