"""What a sweep reports: MFU and scaling derived from its measurements, bench.json, a table and a plot. How each
figure is derived, and why one above 100% is set aside as invalid: docs/benchmarks.md."""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

SCHEMA = 2
ROOT = Path(__file__).resolve().parents[2]  # the repository


def shown(path: str | None) -> str | None:
    """A path as a report records it: relative to the repository where it lies in it (the studies resolve every path
    before they start their runs there), so a result file names no machine's directories."""
    if path is None or not Path(path).is_absolute():
        return path
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return path


INVALID = {  # the fractions that cannot exceed 1: why one that does is not true
    "mfu_table": "above the datasheet peak",
    "mfu_measured": "above the matmul peak measured before the run (the machine was busier then, or the processes "
                    "shared cores)",
    "scaling_efficiency": "faster per process than the 1-process baseline (it ran slow, or the machine was busy then)"}


def derive(entries: list[dict], device: dict) -> None:
    """Adds MFU against both peaks and the speedup over each entry's 1-process baseline to the measured entries."""
    for e in entries:
        if e["status"] != "ok":
            continue
        e.pop("invalid", None)  # derived again as entries join: judged against the baseline there is now
        peaks = device["peak_flops"][e["precision"]]
        measured = e.get("peak_flops_measured") or peaks["measured"]
        e["model_flops_per_s"] = e["flops_per_step"] / e["step_s"]["median"]  # at the median step time
        e["mfu_table"] = e["model_flops_per_s"] / (peaks["table"] * e["nproc"]) if peaks["table"] else None
        e["mfu_measured"] = e["model_flops_per_s"] / (measured * e["nproc"])
        base = baseline(e, entries)
        e["baseline"] = base["name"] if base else None
        e["speedup"] = e["tokens_per_s"] / base["tokens_per_s"] if base else None
        e["scaling_efficiency"] = e["speedup"] * base["nproc"] / e["nproc"] if base else None
        for key, why in INVALID.items():
            if e[key] is not None and e[key] > 1.0:
                e.setdefault("invalid", {})[key] = {"value": e[key], "why": why}
                e[key] = None


def baseline(entry: dict, entries: list[dict]) -> dict | None:
    ones = [b for b in entries if b["status"] == "ok" and b["nproc"] == 1 and b["sets"] == entry["sets"]
            and b["precision"] == entry["precision"]]
    same = [b for b in ones if b["ds"] == entry["ds"]]
    return (same or ones or [None])[0]


@contextlib.contextmanager
def kept_if_interrupted(result: dict, total: int, write: Callable[[], list[Path]]):
    """Ctrl-C during a study: what it measured so far written, marked as cut short (it had all been lost), then the
    interrupt goes on (its processes are ended by `sweep.run_program`)."""
    try:
        yield
    except KeyboardInterrupt:
        result["interrupted"] = f"stopped by Ctrl-C after {len(result['configs'])} of {total} configurations"
        for path in write():
            print(f"wrote {path} ({result['interrupted']})", file=sys.stderr, flush=True)
        raise


def save(out: Path, name: str, result, table: str) -> list[Path]:
    """OUT/NAME.json and OUT/NAME.md, the files every bench study writes."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(table + "\n")
    return paths


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def bounded(e: dict, key: str) -> str:
    """A fraction as percent; "invalid" where it came out above 100%."""
    return "invalid (>100%)" if key in e.get("invalid", {}) else _num(e.get(key), ".1%" if "mfu" in key else ".0%")


def _mib(values) -> str:
    """Each rank's bytes in MiB; "-" where one was not measured."""
    if not values or None in values:
        return "-"
    return " / ".join(f"{v / 2**20:,.1f}" for v in values) + " MiB"


def _rounds(n: int) -> str:
    return f" and launch, {n} launches each, interleaved (round by round every configuration once), their steps " \
        f"pooled" if n > 1 else ""


def markdown(result: dict) -> str:
    d = result["device"]
    lines = [f"# harness bench: {result['task']} on {d['name']} ({d['count']} device(s))", "",
             *([f"**{result['interrupted']}**", ""] if result.get("interrupted") else []),
             f"{result['steps']} timed steps after {result['warmup']} warm-up steps per configuration"
             f"{_rounds(result.get('rounds', 1))}; step time median (p10-p90). MFU against the datasheet peak / the "
             f"measured matmul peak.", "",
             "| configuration | layout | precision | params | step s (p10-p90) | tokens/s | samples/s | model TFLOP/s "
             "| MFU table | MFU measured | peak mem/rank | activations (rank 0) | building the model: host, per rank "
             "| padding | speedup (x) | efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in result["configs"]:
        if e["status"] != "ok":
            lines.append(f"| {e['name']} | {e['layout']} | {e['precision']} | {e.get('params', 0):,} | "
                         f"**{e['status']}**: {e['error'][:80]} |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        s = e["step_s"]
        lines.append(
            f"| {e['name']} | {e['layout']} | {e['precision']} | {e['params']:,} | {s['median']:.4f} "
            f"({s['p10']:.4f}-{s['p90']:.4f}) | {e['tokens_per_s']:,.0f} | {e['samples_per_s']:,.1f} | "
            f"{e['model_flops_per_s'] / 1e12:.3f} | {bounded(e, 'mfu_table')} | {bounded(e, 'mfu_measured')} "
            f"| {e['peak_mem_bytes'] / 2**20:,.0f} MiB | {_mib([e.get('activation_bytes')])} "
            f"| {_mib(e.get('build_peak_bytes'))} | {e['padding']:.1%} | {_num(e['speedup'], '.2f')} | "
            f"{bounded(e, 'scaling_efficiency')} |")
    peaks = ", ".join(f"{p}: table {_num(v['table'] and v['table'] / 1e12, '.1f')}, measured "
                      f"{v['measured'] / 1e12:.2f} TFLOP/s" for p, v in d["peak_flops"].items())
    per_process = f" ({d['threads_per_process']} thread(s) per process)" if d.get("threads_per_process") else ""
    methods = sorted({e.get("flops_method", "analytic") for e in result["configs"] if e["status"] == "ok"})
    how = {"analytic": "the model's analytic forward_flops", "counted": "counted by FlopCounterMode on the meta device"}
    lines += ["", "Model FLOPs: " + "; ".join(how.get(m, m) for m in methods) + "."] if methods else []
    lines += ["", f"Peaks per device{per_process} at the start: {peaks}; each configuration measured its own right "
                  f"before it ran, and its MFU is against that one. \"invalid\": above 100%, which cannot be true; "
                  f"bench.json keeps the raw value."]
    if any(e.get("activation_bytes") for e in result["configs"]):
        lines += ["", "Activations: the bytes the first micro-batch's forward keeps for backward on rank 0 (autograd's "
                      "saved tensors, each storage once, parameters not counted): measured, on any device."]
    for e in result.get("largest", []):
        cap = ", the --largest-max cap: larger may fit" if e["capped"] else ""
        if e["key"] == "data.seq_len":
            lines.append(f"Longest sequence for {e['name']} within {e['budget_bytes'] / 2**30:.2f} GiB per rank: "
                         f"data.seq_len = {e['value']}{cap}.")
        else:
            lines.append(f"Largest model for {e['name']} within {e['budget_bytes'] / 2**30:.1f} GiB per rank: "
                         f"{e['params']:,} parameters ({e['key']} = {e['value']}{cap}).")
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
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.5 * len(ok) + 2.5), sharey=True)
    panels = [("tokens/s (median)", [e["tokens_per_s"] for e in ok]),
              ("MFU vs measured peak (%)", [100 * (e["mfu_measured"] or 0.0) for e in ok]),  # percent, as the table
              ("peak memory per rank (GiB)", [e["peak_mem_bytes"] / 2**30 for e in ok])]
    for ax, (title, values) in zip(axes, panels):
        ax.barh([e["name"] for e in ok], values)
        ax.set_title(title)
        ax.locator_params(axis="x", nbins=5)  # readable tick labels at any magnitude
    axes[0].xaxis.set_major_formatter(lambda x, _: f"{x / 1e3:g}k" if x >= 1e3 else f"{x:g}")
    for i, e in enumerate(ok):  # no bar for a figure that cannot be true: say so where it would be
        if "mfu_measured" in e.get("invalid", {}):
            axes[1].text(0, i, " invalid (>100%)", va="center", color="tab:red")
    axes[0].invert_yaxis()  # the sweep's order, top to bottom (the axes share it)
    fig.suptitle(f"harness bench: {result['task']} on {result['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
