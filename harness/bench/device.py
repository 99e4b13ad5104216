"""The device's peak arithmetic rate, two ways: a datasheet table and a measured matrix multiply.

Model FLOPs utilisation (MFU) divides the model's achieved FLOP/s by one of these; both are reported, since
a datasheet peak is a promise (dense tensor-core rate at boost clock) and a measured one is what this machine
does with a large matrix product today.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from ..plan.scaling import PEAK_TFLOPS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"  # threads: per configuration


def table_peak(name: str, precision: str) -> float | None:
    """FLOP/s from the table, or None for a device (or precision) it does not list (every CPU)."""
    for key, rates in PEAK_TFLOPS.items():  # "H100 PCIe" is listed before "H100": first match wins
        if key in name and precision in rates:
            return rates[precision] * 1e12
    return None


def cpu_threads(max_nproc: int) -> int:
    """Threads per process on a CPU for a sweep whose largest configuration runs `max_nproc` processes: the same
    share of the cores in every configuration, so a 1-process baseline does not get all cores while 2 processes
    get half each (that made 2-process "speedups" of 30x on a busy machine)."""
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


def measured_peak(precision: str, n: int | None = None, repeats: int = 5, threads: int | None = None) -> float:
    """FLOP/s of an n x n x n matrix product in `precision` on this device: the median of `repeats` timed
    products after a warm-up (CUDA events on a GPU), on random data (zeros can run faster). On a CPU, with
    `threads` threads (one process's share of the cores)."""
    cuda = torch.cuda.is_available()
    if not cuda and threads:
        with torch_threads(threads):
            return measured_peak(precision, n, repeats)
    n = n or (8192 if cuda else 1024)
    dtype, device = DTYPES[precision], "cuda" if cuda else "cpu"
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, thread pool start
    times = []
    for _ in range(repeats):
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
    """The device block of bench.json: name, kind, count, threads per process (CPU) and, per precision, both peaks
    (FLOP/s per device, or per process's share of the CPU) at the start of the sweep; each configuration also
    measures the peak right before it runs."""
    name = device_name()
    cuda = torch.cuda.is_available()
    return {"name": name, "kind": "cuda" if cuda else "cpu", "count": torch.cuda.device_count() if cuda else 1,
            "threads_per_process": None if cuda else threads,
            "peak_flops": {p: {"table": table_peak(name, p), "measured": measured_peak(p, threads=threads)}
                           for p in precisions}}
