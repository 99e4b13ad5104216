"""A run's curves as a picture: `RUN/curves.png` at the end of every run (rank 0, `logging.plots`), and
`harness plot RUN... --out FILE.png` to overlay several runs.

Four panels against the optimizer step (or the samples read, `--x samples`): the training loss and the learning rate
(`metrics.jsonl`), the validation loss and the task's own metric (`eval.jsonl`: BLEU, Q3, accuracy, MSE... whichever
the run's evaluations hold, the first of `METRICS` found, else the first other figure). An evaluation made only at
the end is one marked point. Every line is in the legend, a single run's too, named by its directory (and the
folders above it that tell the runs apart). The validation panels mark the step `train.select_best` chose
(RUN/best.json) with a dotted line; the metric's panel draws the baselines the evaluations report beside it (the
figure `NAME_METRIC`, e.g. persistence_mse, copy_source_bleu) as dashed lines at their last value.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..config.run import ConfigError, tomllib
from .tracking import read_jsonl

PLOT_FILE = "curves.png"
METRICS = ("bleu", "q3", "spearman", "auroc", "accuracy", "masked_accuracy", "mse", "perplexity", "bits_per_byte")
_SKIP = {"step", "loss", "epoch"}
RUN_RECORDS = ("config.toml", "metrics.jsonl", "eval.jsonl")


def task_metric(evals: list[dict]) -> str | None:
    """The figure the run's evaluations are about, besides their loss."""
    keys = [k for row in evals for k, v in row.items() if isinstance(v, (int, float)) and k not in _SKIP]
    return next((m for m in METRICS if m in keys), keys[0] if keys else None)


AXES = {"step": "step", "samples": "samples seen"}  # --x: what the curves are drawn against


def curves(run_dirs: list[str | Path], x: str = "step") -> list[dict]:
    """Per panel: its title and, per run, the (x, values) to draw; a panel no run has data for is left out. `x`:
    "step", or "samples" (the samples read by then: runs of other global batches compared by the data they read; an
    evaluation's from the records around its step)."""
    runs, metric = _runs(run_dirs)
    names = run_names([d for d, _, _ in runs])
    panels = [("training loss", "loss", 1), ("learning rate", "lr", 1), ("validation loss", "loss", 2)]
    if metric:
        panels.append((f"validation {metric}", metric, 2))
    out = []
    for title, key, source in panels:
        lines, best, baselines = {}, {}, {}
        for (run_dir, metrics, evals), name in zip(runs, names):
            rows = metrics if source == 1 else evals
            at = _samples_at(metrics) if x == "samples" else lambda step: step
            # the training loss: the mean over the steps each record stands for (a record written before records
            # had one: its step's own)
            value = (lambda r: r.get("loss_avg", r.get("loss"))) if title == "training loss" else \
                (lambda r: r.get(key))
            points = [(at(r["step"]), value(r)) for r in rows
                      if isinstance(value(r), (int, float)) and isinstance(r.get("step"), (int, float))]
            points = [(where, v) for where, v in points if where is not None]
            if points:
                lines[name] = points
            chosen = _best(run_dir) if source == 2 else {}
            if isinstance(chosen.get("step"), int) and at(chosen["step"]) is not None:
                best[name] = at(chosen["step"])
            if source == 2 and key == metric:
                for b, v in baselines_of(evals[-1] if evals else {}, metric).items():
                    baselines[f"{b}{'' if len(runs) == 1 else f' ({name})'}"] = v
        if lines:
            out.append({"title": title, "key": key, "lines": lines, "best": best, "baselines": baselines})
    return out


def _runs(run_dirs: list[str | Path]) -> tuple[list[tuple[Path, list[dict], list[dict]]], str | None]:
    """Each run's (directory, metrics.jsonl's records, eval.jsonl's), and the task metric their evaluations hold."""
    runs = [(Path(d), read_jsonl(Path(d) / "metrics.jsonl"), read_jsonl(Path(d) / "eval.jsonl")) for d in run_dirs]
    return runs, next((m for _, _, evals in runs if (m := task_metric(evals))), None)


def run_names(run_dirs: list[Path]) -> list[str]:
    """Each run's name in a legend: its directory's name, with as many folders above it as tell the runs apart."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    for n in range(1, max(map(len, parts)) + 1):
        names = ["/".join(p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


def _samples_at(metrics: list[dict]):
    """step -> the samples read by its end, from the records' samples_seen: exact at a record's step, else along the
    line between the records around it (the global batch between them); None outside the records."""
    known = sorted({r["step"]: r["samples_seen"] for r in metrics if isinstance(r.get("step"), (int, float))
                    and isinstance(r.get("samples_seen"), (int, float))}.items())

    def at(step):
        after = next((i for i, (s, _) in enumerate(known) if s >= step), None)
        if after is None:
            return None
        (s1, n1), (s0, n0) = known[after], known[after - 1] if after else (0, 0)
        return n1 if s1 == step else n0 + (n1 - n0) * (step - s0) / (s1 - s0)
    return at


def _best(run_dir: Path) -> dict:
    """RUN/best.json (the step train.select_best chose); {} where there is none, or none that reads as one."""
    try:
        chosen = json.loads((run_dir / "best.json").read_text())
    except (OSError, ValueError):
        return {}
    return chosen if isinstance(chosen, dict) else {}


def _check(run_dirs: list[str | Path], out: Path) -> None:
    """What `plot` refuses before it draws: a run directory that is not there, runs of different tasks (their losses
    and metrics on different scales, on one axis), an --out that names no PNG file."""
    missing = [str(d) for d in run_dirs if not Path(d).is_dir()]
    if missing:  # one run drawn without the other, silently, had looked like a comparison
        raise ConfigError(f"no such run directory: {', '.join(missing)}")
    stray = [str(d) for d in run_dirs if not any((Path(d) / f).is_file() for f in RUN_RECORDS)]
    if stray and len(run_dirs) > 1:  # (alone: "nothing to draw")
        raise ConfigError(f"{', '.join(stray)}: no run directory (none of {', '.join(RUN_RECORDS)} there)")
    resolved = [Path(d).resolve() for d in run_dirs]
    twice = next((str(d) for d, r in zip(run_dirs, resolved) if resolved.count(r) > 1), None)
    if twice is not None:  # drawn once, under one name: it had looked like two runs that agree
        raise ConfigError(f"{twice} is named twice: name each run once")
    tasks: dict[str, list[str]] = {}
    for d in run_dirs:
        with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):  # no readable config: not judged
            tasks.setdefault(tomllib.loads((Path(d) / "config.toml").read_text())["run"]["task"], []).append(str(d))
    if len(tasks) > 1:
        which = "; ".join(f"{task}: {', '.join(dirs)}" for task, dirs in tasks.items())
        raise ConfigError(f"runs of different tasks ({which}): their losses and metrics are on different scales; plot "
                          f"each task's runs apart")
    if out.is_dir() or out.suffix.lower() != ".png":
        raise ConfigError(f"--out {out}: name a .png file to draw into")


def baselines_of(row: dict, metric: str) -> dict[str, float]:
    """The baselines' figures `NAME_METRIC` of one evaluation, on the model's scale: a NAME that others qualify
    (price, in persistence_price_mse) is a scale of the model's own (price_mse), not a baseline, and is left out
    with the baselines it qualifies."""
    found = {k[:-len(metric) - 1]: v for k, v in row.items()
             if k.endswith(f"_{metric}") and not k.startswith("period_") and isinstance(v, (int, float))}
    scales = {q for q in found if any(other.endswith(f"_{q}") for other in found)}
    return {b: v for b, v in found.items() if b not in scales and not any(b.endswith(f"_{q}") for q in scales)}


def summary(run_dirs: list[str | Path]) -> str:
    """Each run's last figures, one row a run, beside the picture: its last step, training loss (`loss_avg`), last
    validation loss and task metric, and the evaluation train.select_best chose (a sweep had been read from the
    jsonl files by hand)."""
    runs, metric = _runs(run_dirs)
    header = ["run", "step", "training loss", "validation loss", *([f"validation {metric}"] if metric else []), "best"]
    rows = [header]
    for (run_dir, metrics, evals), name in zip(runs, run_names([d for d, _, _ in runs])):
        last, evaluated, chosen = (metrics or [{}])[-1], (evals or [{}])[-1], _best(run_dir)
        best = f"{chosen['metric']} {_figure(chosen.get('value'))} at step {chosen['step']}" \
            if isinstance(chosen.get("step"), int) and "metric" in chosen else "-"
        rows.append([name, _figure(last.get("step")), _figure(last.get("loss_avg", last.get("loss"))),
                     _figure(evaluated.get("loss")), *([_figure(evaluated.get(metric))] if metric else []), best])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


def _figure(value) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:,}" if isinstance(value, int) else f"{value:.6g}"


def default_out(run_dirs: list[str | Path]) -> Path:
    """Where `harness plot` draws without --out: one run's own curves.png (what the run drew at its end), or
    compare.png beside the first of several."""
    first = Path(run_dirs[0])
    return first / PLOT_FILE if len(run_dirs) == 1 else first.parent / "compare.png"


def plot(run_dirs: list[str | Path], out: str | Path, x: str = "step") -> Path:
    """Draw the runs' curves into a PNG, against `x` (`curves`); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out)
    _check(run_dirs, out)
    panels = curves(run_dirs, x)
    if not panels:
        why = "records with samples_seen (--x samples; those written before records had it: draw against the step)" \
            if x == "samples" and curves(run_dirs) else "metrics.jsonl or eval.jsonl with figures"
        raise ConfigError(f"nothing to draw: no {why} in {', '.join(map(str, run_dirs))}")
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, points in panel["lines"].items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 3 else None, label=label)
        for label, step in panel["best"].items():
            ax.axvline(step, linestyle=":", color="gray", label=f"best, {x} {step:,.0f}" + (
                f" ({label})" if len(panel["lines"]) > 1 else ""))
        for label, value in panel["baselines"].items():
            ax.axhline(value, linestyle="--", linewidth=1, color="black", alpha=0.6, label=f"{label}: {value:.4g}")
        ax.set_title(panel["title"])
        ax.set_xlabel(AXES[x])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # (a run of few steps had ticks at 0.96, 1.04)
        ax.set_ylabel(panel["key"] if panel["key"] != "lr" else "learning rate")
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=90)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out
