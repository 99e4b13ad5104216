"""What a sweep reports: utilisation and scaling derived from the measurements, bench.json, a table, a plot.

- MFU = the model's achieved FLOP/s (the median step's analytic training FLOPs, `models/flops.py`, over the
  median step time) / (peak FLOP/s per device x devices), against the datasheet peak and against the measured
  matmul peak.
  On a CPU the processes share one machine, whose measured peak is the denominator (devices = 1).
- speedup = tokens/s of a configuration / tokens/s of its 1-process baseline (same precision and compared
  values; the same DeepSpeed file if it ran on 1 process, else the first 1-process one); scaling efficiency =
  speedup / processes. Data parallel keeps the micro-batch per rank, so the global batch grows with the
  processes: this is weak scaling, the way data parallelism is used.
"""
from __future__ import annotations

import json
from pathlib import Path

SCHEMA = 1


def derive(entries: list[dict], device: dict) -> list[dict]:
    """Adds flops_per_step, mfu_table, mfu_measured, speedup and scaling_efficiency to each measured entry."""
    gpu = device["kind"] == "cuda"
    for e in entries:
        if e["status"] != "ok":
            continue
        peaks = device["peak_flops"][e["precision"]]
        devices = e["nproc"] if gpu else 1
        e["model_flops_per_s"] = e["flops_per_step"] / e["step_s"]["median"]  # at the median step time
        e["mfu_table"] = e["model_flops_per_s"] / (peaks["table"] * devices) if peaks["table"] else None
        e["mfu_measured"] = e["model_flops_per_s"] / (peaks["measured"] * devices)
        base = baseline(e, entries)
        e["baseline"] = base["name"] if base else None
        e["speedup"] = e["tokens_per_s"] / base["tokens_per_s"] if base else None
        e["scaling_efficiency"] = e["speedup"] * base["nproc"] / e["nproc"] if base else None
    return entries


def baseline(entry: dict, entries: list[dict]) -> dict | None:
    ones = [b for b in entries if b["status"] == "ok" and b["nproc"] == 1 and b["sets"] == entry["sets"]
            and b["precision"] == entry["precision"]]
    same = [b for b in ones if b["ds"] == entry["ds"]]
    return (same or ones or [None])[0]


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result) + "\n")
    png = plot(result, out / "bench.png")
    return paths + ([png] if png else [])


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    d = result["device"]
    lines = [f"# harness bench: {result['task']} on {d['name']} ({d['count']} device(s))", "",
             f"{result['steps']} timed steps after {result['warmup']} warm-up steps per configuration; step time "
             f"median (p10-p90). MFU against the datasheet peak / the measured matmul peak.", "",
             "| configuration | layout | precision | params | step s (p10-p90) | tokens/s | samples/s | model TFLOP/s "
             "| MFU table | MFU measured | peak mem/rank | padding | speedup (x) | efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in result["configs"]:
        if e["status"] != "ok":
            lines.append(f"| {e['name']} | {e['layout']} | {e['precision']} | {e.get('params', 0):,} | "
                         f"**{e['status']}**: {e['error'][:80]} |  |  |  |  |  |  |  |  |  |")
            continue
        s = e["step_s"]
        lines.append(
            f"| {e['name']} | {e['layout']} | {e['precision']} | {e['params']:,} | {s['median']:.4f} "
            f"({s['p10']:.4f}-{s['p90']:.4f}) | {e['tokens_per_s']:,.0f} | {e['samples_per_s']:,.1f} | "
            f"{e['model_flops_per_s'] / 1e12:.3f} | {_num(e['mfu_table'], '.1%')} | {_num(e['mfu_measured'], '.1%')} "
            f"| {e['peak_mem_bytes'] / 2**20:,.0f} MiB | {e['padding']:.1%} | {_num(e['speedup'], '.2f')} | "
            f"{_num(e['scaling_efficiency'], '.0%')} |")
    peaks = ", ".join(f"{p}: table {_num(v['table'] and v['table'] / 1e12, '.1f')}, measured "
                      f"{v['measured'] / 1e12:.2f} TFLOP/s" for p, v in d["peak_flops"].items())
    lines += ["", f"Peaks per device: {peaks}."]
    if result.get("overhead"):
        o = result["overhead"]
        lines += ["", f"Harness overhead against a plain PyTorch loop on the same model and batches: "
                      f"{o['overhead']:+.1%} (median step {o['harness_step_s']:.4f} s vs {o['plain_step_s']:.4f} s)."]
    for e in result.get("largest", []):
        lines.append(f"Largest model for {e['name']} within {e['budget_bytes'] / 2**30:.1f} GiB per rank: "
                     f"{e['params']:,} parameters ({e['key']} = {e['value']}"
                     f"{', the --largest-max cap: larger may fit' if e['capped'] else ''}).")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """Tokens/s and MFU per configuration, bars side by side; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [e for e in result["configs"] if e["status"] == "ok"]
    if not ok:
        return None
    names = [e["name"] for e in ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.5 * len(ok) + 2.5), sharey=True)
    panels = [("tokens/s (median)", [e["tokens_per_s"] for e in ok]),
              ("MFU vs measured peak", [e["mfu_measured"] for e in ok]),
              ("peak memory per rank (GiB)", [e["peak_mem_bytes"] / 2**30 for e in ok])]
    for ax, (title, values) in zip(axes, panels):
        ax.barh(names, values)
        ax.set_title(title)
    axes[0].invert_yaxis()  # the sweep's order, top to bottom (the axes share it)
    fig.suptitle(f"harness bench: {result['task']} on {result['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
