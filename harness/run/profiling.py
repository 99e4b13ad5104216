"""Where one training step's time goes: `train.profile_step = N` traces optimizer step N with torch.profiler on
rank 0 and writes RUN/profile.json.

- `wall_s`: the step, from fetching its batches until it ran (on a GPU, its last kernel), with the loop's reading
  of the steps before it (`step.Ledger`). A profiled step has the loop's collective to itself (`step.Span`, a
  span of one step): it shows a step that syncs, which the loop's other steps do about once a second.
- `loader_wait_s`: of that, waiting for the data loader's batches.
- `device_busy_s` (GPU): the sum of the step's kernel times; `host_overhead_s` = wall - loader wait - device busy,
  the time the GPU sat idle on Python, launches and syncs (0 when kernels overlap enough to fill the step).
- `top`: the 10 operators (CPU) or kernels (GPU) with the most self time, in seconds and share of the step.
- `sections`: the host time of each part of the loop the loop marks (`section`), in its order: the engine's
  forward, backward and step, and around it what the harness adds (fetching batches, counting the work, device
  copies, the collectives, the grad norm, logging, the progress bar); `unmarked_s`, the rest of the step.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

PROFILE_FILE = "profile.json"
SECTION = "harness."  # the prefix of the loop's marked ranges in the trace


def unmarked(name: str) -> contextlib.AbstractContextManager:
    """`StepProfile.section` on the steps not traced: nothing."""
    return contextlib.nullcontext()


class StepProfile:
    """Started before a step's batches are fetched; `finish` after the step and the reading of the ones before it
    (`step.Ledger`)."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        self.cuda = device.type == "cuda"
        self.prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])])
        self.prof.start()
        self.start = time.perf_counter()

    def section(self, name: str) -> contextlib.AbstractContextManager:
        """A named range of the step: its host time lands in the summary's `sections`."""
        return torch.profiler.record_function(f"{SECTION}{name}")

    def finish(self, loader_wait_s: float, step: int, top: int = 10) -> dict:
        if self.cuda:
            torch.cuda.synchronize()  # sync point: every kernel of the step has run
        wall = time.perf_counter() - self.start
        self.prof.stop()
        summary = {"step": step, "wall_s": wall, "loader_wait_s": loader_wait_s, "device": "cuda" if self.cuda
                   else "cpu", "device_busy_s": None, "host_overhead_s": None}
        try:  # the profiler's event API moves between torch versions: a summary it cannot make is said, not raised
            summary.update(self._times(wall, loader_wait_s, top))
        except Exception as e:  # noqa: BLE001
            summary["error"] = f"{type(e).__name__}: {e}"[:300]
        return summary

    def _times(self, wall: float, loader_wait_s: float, top: int) -> dict:
        self_s: dict[str, float] = defaultdict(float)
        sections: dict[str, float] = defaultdict(float)
        busy = 0.0
        for e in self.prof.events():
            if e.name.startswith(SECTION):  # a marked range: its whole host time, children included
                sections[e.name[len(SECTION):]] += e.cpu_time_total / 1e6
                continue
            if self.cuda:  # kernels: their device time; CPU-side ops are what launched them
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                t = e.time_range.elapsed_us() / 1e6  # a kernel's own span on the GPU
                busy += t
            else:
                t = e.self_cpu_time_total / 1e6
            self_s[e.name] += t
        ranked = sorted(self_s.items(), key=lambda kv: kv[1], reverse=True)[:top]
        out = {"top": [{"name": name[:120], "self_s": t, "share": t / wall} for name, t in ranked],
               "sections": dict(sections), "unmarked_s": max(0.0, wall - sum(sections.values()))}
        if self.cuda:
            out.update(device_busy_s=busy, host_overhead_s=max(0.0, wall - loader_wait_s - busy))
        return out


def write(summary: dict, run_dir: Path) -> Path:
    path = run_dir / PROFILE_FILE
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return path
