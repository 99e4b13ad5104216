"""This process's memory: the resident set, the peak on the host or the device, what a block took at its peak
(`allocation_peak`: building the model), and glibc's thresholds that keep the memory a step frees for the next
(`keep_freed_host_memory`) or, while a model is built partitioned, hand it back (`freed_blocks_returned`).
"""
from __future__ import annotations

import contextlib
import os

import torch

MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_host_memory(mmap_above: int = 16 << 20, trim_above: int = 64 << 20) -> bool:
    """Let glibc keep the host memory a training step frees for the next step, instead of handing it back to the system
    and faulting it in again: fixed thresholds (blocks over `mmap_above` bytes mapped on their own, the heap trimmed
    once `trim_above` bytes lie free at its top) in place of glibc's dynamic ones, which follow what the process
    allocated before. Each step frees and allocates its gradients and activations again; with glibc's defaults that
    cost `lm_demo` under ZeRO-0 3,200-5,700 minor page faults a step (it varied from launch to launch, and the harness,
    which allocates more before training, drew more of them than a bare script), about none with these, at the same
    peak resident set. Called by `init_world` (so by `harness train` and the overhead study's hand-written loop alike)
    and by the plain PyTorch loop. Leaves glibc's settings alone where the user set them (MALLOC_ENV) or off glibc;
    True where it set them."""
    if any(k in os.environ for k in MALLOC_ENV):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): its own allocator's policy stands
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, mmap_above)) and bool(mallopt(m_trim_threshold, trim_above))


@contextlib.contextmanager
def freed_blocks_returned(mmap_above: int = 1 << 20):
    """Blocks over `mmap_above` bytes mapped on their own, so freeing one hands it back, while a model is built
    partitioned on the host: `deepspeed.zero.Init` allocates each parameter whole and then keeps only this rank's
    share, and with the training thresholds the freed whole tensors (under 16 MiB each in a mid-sized model) stay in
    glibc's heap, pinned by the shares allocated above them: a rank could end its build holding more than the whole
    model (docs/plugins-and-api.md). The training thresholds come back after."""
    changed = keep_freed_host_memory(mmap_above=mmap_above)
    try:
        yield
    finally:
        if changed:
            keep_freed_host_memory()


def resident_bytes() -> int:
    """This process's resident set now (Linux), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set of this process



@contextlib.contextmanager
def allocation_peak(device: torch.device):
    """What the block took at its peak above what was in use before, set on the dict it yields: `host`, the rise of
    the process's peak resident set (an upper bound: it keeps what the allocator freed but did not return; torch
    counts no CPU tensor bytes), and on a GPU `device`, the most bytes of tensors live at once there."""
    out: dict = {"host": None, "device": None}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start_device = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = resident_bytes()
    yield out
    out["host"] = max(0, peak_memory_bytes(torch.device("cpu")) - start)
    if cuda:
        torch.cuda.synchronize(device)
        out["device"] = torch.cuda.max_memory_allocated(device) - start_device
