"""`harness evaluate` and `harness translate`: a finished run's exported model, one process, any split.

`eval.json` in the run directory keeps the latest result per split: {split: {metric: value}}.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ConfigError, RunConfig
from .export import MODEL_FILE, load_model
from .tasks import get_task
from .world import single_world

RESULTS = "eval.json"


def _load(run_dir: Path) -> tuple[torch.nn.Module, RunConfig, object]:
    for name in ("config.toml", MODEL_FILE):
        if not (run_dir / name).is_file():
            raise ConfigError(f"{run_dir}: no {name}; is it a finished run directory? (an unfinished run can be "
                              f"continued with `harness train ... --resume auto`)")
    model, cfg = load_model(run_dir)
    task = get_task(cfg.run.task)
    if not hasattr(task, "evaluate"):
        raise ConfigError(f"{run_dir}: task {cfg.run.task!r} has no field evaluation; its validation loss is in "
                          f"{run_dir / 'eval.jsonl'}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device), cfg, task


def evaluate_run(run_dir: str | Path, split: str) -> dict[str, float | str]:
    run_dir = Path(run_dir)
    model, cfg, task = _load(run_dir)
    metrics = task.evaluate(model, cfg, split, single_world(next(model.parameters()).device))
    path = run_dir / RESULTS
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[split] = metrics
    tmp = path.with_name(f".{RESULTS}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)
    return metrics


def translate(run_dir: str | Path, sentences: list[str]) -> list[str]:
    run_dir = Path(run_dir)
    model, cfg, task = _load(run_dir)
    if not hasattr(task, "translate"):
        raise ConfigError(f"{run_dir}: run.task is {cfg.run.task!r}; `harness translate` needs a translation run")
    return task.translate(model, cfg, sentences)


def _number(v: float) -> str:
    """Counts as integers; other figures to 6 significant digits, enough to tell close ones apart."""
    return f"{int(v):,}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:.6g}"


def render_table(split: str, metrics: dict[str, float | str]) -> str:
    """Numbers first, in a two-column table; signatures and other strings below it."""
    numbers = {k: v for k, v in metrics.items() if not isinstance(v, str)}
    width = max((len(k) for k in numbers), default=6)
    lines = [f"| {'metric':{width}} | {split:>12} |", f"|{'-' * (width + 2)}|{'-' * 14}|"]
    lines += [f"| {k:{width}} | {_number(v):>12} |" for k, v in numbers.items()]
    lines += [f"{k}: {v}" for k, v in metrics.items() if isinstance(v, str)]
    return "\n".join(lines)
