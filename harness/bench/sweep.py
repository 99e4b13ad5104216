"""`harness bench`: a sweep of configurations, one launch each, timed from the runs' own metrics.

A configuration is a DeepSpeed file x a number of processes x accelerate's mixed precision x any run-config
values being compared (`--vary model.d_model=256,512`, `--vary train.compile=false,true`). Each is resolved
with `harness plan`'s checks before anything launches, then trained for `warmup + steps` steps with a metrics
record every step; the warm-up steps are dropped and the rest summarised by their median and spread. The run
stops with `--stop-at` (a checkpoint, no final evaluation or export), so only training steps are timed.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config.run import ConfigError
from ..plan.resolve import Plan, make_plan
from ..run.profiling import PROFILE_FILE
from ..run.startup import FIT_CHECK_ENV
from .device import cpu_threads

ROOT = Path(__file__).resolve().parents[2]  # the repository: launch/ configs live there


@dataclass(frozen=True)
class Config:
    ds: str                     # path of the DeepSpeed JSON
    nproc: int
    mixed_precision: str        # accelerate's --mixed_precision: no | bf16 | fp16
    sets: tuple[str, ...] = ()  # the compared run-config values, "section.key=value"

    @property
    def name(self) -> str:
        parts = [Path(self.ds).stem, f"x{self.nproc}"]
        parts += [self.mixed_precision] if self.mixed_precision != "no" else []
        return " ".join(parts + list(self.sets))

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.name)


def grid(ds_files: list[str], nprocs: list[int], precisions: list[str], varies: list[str]) -> list[Config]:
    """Every combination; `varies` are "section.key=v1,v2,..." (values as on the command line)."""
    axes = []
    for vary in varies:
        key, eq, values = vary.partition("=")
        if not eq or not values:
            raise ConfigError(f"--vary expects section.key=value1,value2; got {vary!r}")
        axes.append([f"{key}={v}" for v in values.split(",")])
    return [Config(ds, n, p, tuple(sets)) for ds, n, p in itertools.product(ds_files, nprocs, precisions)
            for sets in itertools.product(*axes)]


def model_parallel_size(ds: str) -> int:
    """Tensor x pipeline x sequence size named in a DeepSpeed file: the process counts it can run on are its
    multiples."""
    cfg = json.loads(Path(ds).read_text())
    tp = (cfg.get("tensor_parallel") or {}).get("autotp_size", 1) or 1
    return tp * (cfg.get("pipeline") or {}).get("stages", 1) * (cfg.get("sequence_parallel_size") or 1)


def plan_for(config: Config, run_file: str | None, sets: list[str]) -> Plan:
    """The configuration resolved and checked as `harness train` would (the bench sets the length itself)."""
    return make_plan(run_file, [*sets, *config.sets, "train.epochs=0.0", "train.max_steps=1"], config.ds,
                     config.nproc, config.mixed_precision)


def python() -> str:
    """The interpreter that starts the bench's programs: torchrun's own override, PYTHON_EXEC, where it is set (the
    tests set it to start them warm), else this one."""
    return os.environ.get("PYTHON_EXEC") or sys.executable


def launcher(config: Config) -> list[str]:
    """What goes between `python` and `-m module`: `accelerate launch` for several processes; one process is
    started directly (a world of one, as `harness train` without a launcher), which saves accelerate's few
    seconds of start-up per launch."""
    launch = ROOT / "launch" / ("multi_gpu.yaml" if torch.cuda.is_available() else "cpu_2proc.yaml")
    return ["-m", "accelerate.commands.launch", "--config_file", str(launch), "--num_processes",
            str(config.nproc), "--mixed_precision", config.mixed_precision] if config.nproc > 1 else []


def env_for(config: Config, threads: int | None = None) -> dict[str, str]:
    """The launch's environment: accelerate's precision, no refusal of a batch on paper, and on a CPU `threads` per
    process (default: its share of the cores)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ACCELERATE_MIXED_PRECISION": config.mixed_precision,
           FIT_CHECK_ENV: "0"}  # a bench measures what fits (--largest tries sizes until one runs out of memory)
    if not torch.cuda.is_available():  # the processes share the cores
        env["OMP_NUM_THREADS"] = str(threads or cpu_threads(config.nproc))
    return env


def schedule_length(warmup: int, steps: int) -> int:
    """The training length a timed run is told (its learning-rate schedule's): past the timed steps and the profiled
    one after them, so the run stops by --stop-at (no final evaluation or export), whether profiled or not."""
    return warmup + steps + 2


def command(config: Config, run_file: str | None, sets: list[str], run_dir: Path, stop_at: int,
            max_steps: int) -> list[str]:
    """`harness train` for `stop_at` steps with a metrics record every step, launched as `launcher` says."""
    cmd = [python(), *launcher(config), "-m", "harness", "train", "--ds", config.ds, "--overwrite", "--stop-at",
           str(stop_at)]
    cmd += ["--run", run_file] if run_file else []
    timing = [f"run.output_dir={json.dumps(str(run_dir))}", "train.log_every=1", "train.eval_every=0",
              "train.save_every=0", 'logging.backend="none"', "logging.plots=false", f"train.max_steps={max_steps}",
              "train.epochs=0.0"]
    for s in [*sets, *config.sets, *timing]:
        cmd += ["--set", s]
    return cmd


def as_text(output: str | bytes | None) -> str:
    """A timed-out process's partial output: bytes even under text=True on some Pythons."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def last_error(text: str) -> str:
    """The line of a failed run's output that says why: its last error line, else its last line."""
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
    """Launch one configuration and summarise its timed steps; a failure is recorded, not raised. On a CPU each
    process runs `threads` threads (default: its share of the cores). `profile` adds one step after the timed
    ones, traced by torch.profiler (`train.profile_step`): its summary lands in the entry as "profile"."""
    run_dir = out / "runs" / config.slug
    log = out / "runs" / f"{config.slug}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    entry = {"name": config.name, **asdict(config), "ds": os.path.relpath(config.ds, ROOT),
             "precision": plan.ds.precision, "zero_stage": plan.ds.zero_stage, "layout": plan.ds.layout.describe(),
             "global_batch": plan.ds.global_batch_size, "micro_batch": plan.run.cfg.train.micro_batch_size,
             "grad_accum": plan.ds.grad_accum_steps, "seq_len": plan.run.cfg.data.seq_len}
    env = env_for(config, threads)
    stop_at, extra = warmup + steps, []
    if profile:
        stop_at += 1
        extra = [f"train.profile_step={stop_at}"]
    try:
        proc = subprocess.run(command(config, run_file, [*sets, *extra], run_dir, stop_at,
                                      schedule_length(warmup, steps)), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        log.write_text(proc.stdout + proc.stderr)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log.write_text(f"timed out after {timeout:.0f} s\n{as_text(e.stdout)}{as_text(e.stderr)}")
        return {**entry, "status": "timeout", "error": f"timed out after {timeout:.0f} s"}
    if rc != 0:
        oom = re.search(r"out of memory|OutOfMemoryError|Killed|MemoryError", text, re.I)
        return {**entry, "status": "oom" if oom else "failed", "error": last_error(text)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
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
