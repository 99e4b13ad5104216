"""Helpers that run the harness for real: `python -m harness` for one process, `accelerate launch` for several.

Runs are tiny (a 2-layer, 32-wide model on generated text) so the whole suite fits in minutes on 2 cores.
Runs that several tests compare against are cached for the session by their arguments.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DS = ROOT / "configs" / "ds"
LAUNCH = ROOT / "launch"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.seq_len=32", "train.micro_batch_size=4",
        "train.max_steps=6", "train.log_every=1", "optimizer.lr=3e-3", "schedule.warmup_steps=2",
        "logging.backend=\"none\"", "data.val_fraction=0.1"]
TINY_RUN = [s for s in TINY if not s.startswith("model.")]  # for a model whose sizes come from its own config


# The slowest files start first, so neither worker is left with a long file at the end (pyproject's
# --no-loadscope-reorder keeps this order: xdist's own puts the files with the most tests first).
LONGEST_FIRST = ("test_suite.py", "test_checkpoint.py", "test_parallel.py", "test_hf.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST_FIRST) if item.path.name == name),
                                     len(LONGEST_FIRST)))


@dataclass
class Run:
    dir: Path
    proc: subprocess.CompletedProcess

    @property
    def metrics(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics}

    @property
    def evals(self) -> list[dict]:
        return [json.loads(line) for line in (self.dir / "eval.jsonl").read_text().splitlines()]


def write_corpus(path: Path, lines: int = 1500, seed: int = 0) -> Path:
    """Generated English-like text: deterministic, varied enough that the loss falls over a few steps."""
    rng = random.Random(seed)
    words = ("the model trains on many small batches of text and learns which byte comes next while every rank "
             "sees its own shard of data so the gradients agree").split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
                              for _ in range(lines)) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


def _env(extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": os.environ.get("HF_DATASETS_CACHE", str(ROOT / ".pytest_cache" / "hf")),
           "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION"):
        env.pop(key, None)
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}  # None removes a variable


def harness(out: Path, corpus: Path, *, nproc: int = 1, ds: str | None = None, sets: list[str] = (),
            args: list[str] = (), env: dict | None = None, launch: list[str] | None = None,
            check: bool = True, timeout: int = 300, base: list[str] = TINY) -> Run:
    """Train into `out`; nproc > 1 goes through `accelerate launch --config_file launch/cpu_2proc.yaml`."""
    cmd = ["-m", "harness", "train", "--set", f"data.path={json.dumps(str(corpus))}",
           "--set", f"run.output_dir={json.dumps(str(out))}"]
    for s in [*base, *sets]:
        cmd += ["--set", s]
    if ds:
        cmd += ["--ds", str(DS / ds) if not Path(ds).is_absolute() else ds]
    cmd += list(args)
    if launch is not None:
        cmd = launch + cmd
    elif nproc > 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH / "cpu_2proc.yaml"),
               "--num_processes", str(nproc)] + cmd
    else:
        cmd = [sys.executable] + cmd
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        log = out.parent / "failed.log"  # the whole output: the cause is often far above the launcher's summary
        log.write_text(f"{' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        causes = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
        raise AssertionError(f"harness failed ({proc.returncode}), full log in {log}:\n" + "\n".join(causes[-20:]))
    return Run(out, proc)


@pytest.fixture(scope="session")
def cached_run(tmp_path_factory, corpus):
    """cached_run(name, **kwargs): one run per name for the whole session."""
    runs: dict[str, Run] = {}

    def get(name: str, **kwargs) -> Run:
        if name not in runs:
            runs[name] = harness(tmp_path_factory.mktemp(name) / "run", corpus, **kwargs)
        return runs[name]

    return get


def ds_variant(tmp: Path, base: str, **zero) -> str:
    """A shipped DeepSpeed config with some zero_optimization keys changed (e.g. to force real sharding)."""
    cfg = json.loads((DS / base).read_text())
    cfg["zero_optimization"].update(zero)
    path = tmp / f"{Path(base).stem}-variant.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def assert_losses_close(a: dict[int, float], b: dict[int, float], rel: float) -> None:
    assert a.keys() == b.keys() and a, (a, b)
    for step in a:
        assert abs(a[step] - b[step]) <= rel * abs(b[step]), f"step {step}: {a[step]} vs {b[step]} (rel {rel})"


def val_loss_of_export(run_dir: Path) -> float:
    """The exported model's mean validation loss, computed in this process with a plain module."""
    import torch

    from harness.export import load_model
    from harness.tasks import get_task

    model, cfg = load_model(run_dir)
    task = get_task(cfg.run.task)
    val = task.build_data(cfg).val
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(val), 8):
            batch = task.collate([val[j] for j in range(i, min(i + 8, len(val)))])
            total += task.loss(model, batch).item()
            count += task.count(batch)
    return total / count
