"""Who am I in the job: process group set-up and the ranks' roles.

`accelerate launch` (or torchrun, or the DeepSpeed launcher) exports RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address. A plain `harness train` (no launcher) is a world of one on a free local port.

Known trap: under `accelerate launch --use_deepspeed` on a machine without CUDA, accelerate's state picks no
backend and reports num_processes == 1 on every rank, although DeepSpeed has set up a gloo group of the full
size; a trainer trusting it would feed every rank the same data. We ask accelerate for its CPU (gloo) state
instead, and check its view against torch.distributed before any data is touched.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import io
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ..config.layout import Layout
from .memory import keep_freed_host_memory


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


STATUS_ENV = "HARNESS_STATUS_FILE"  # the file the ranks of `harness launch` report how they ended to
# (launcher/supervise.py)


def under_launcher() -> bool:
    """In a rank: `harness launch` started it, checked the run before (and said its notes), and prints how the job
    ended (`launcher.ending`)."""
    return bool(os.environ.get(STATUS_ENV))


def local_size() -> int:
    """The ranks on this node: torchrun's LOCAL_WORLD_SIZE, or LOCAL_SIZE from DeepSpeed's own launcher (pdsh, nossh,
    launcher/launch.py), which sets no LOCAL_WORLD_SIZE."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1))


def cpu_threads() -> str:
    """Set this process's torch threads and say how they were chosen: OMP_NUM_THREADS where set (by the user or a
    launcher: accelerate gives each CPU rank 1), else the CPUs this process may use (sched_getaffinity: a SLURM job's
    or taskset's share, not the whole machine) divided among the ranks on this node (`local_size`)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{torch.get_num_threads()} (OMP_NUM_THREADS)"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = local_size()
    torch.set_num_threads(max(1, usable // local))
    cpus, ranks = f"{usable} CPU{'s' * (usable != 1)}", f"{local} rank{'s' * (local > 1)}"
    return f"{torch.get_num_threads()} ({cpus} this process may use, {ranks} on the node)"


def oversubscribed() -> str | None:
    """One line where this node runs more CPU ranks than it has CPUs for them (they take turns: every step waits for
    the slowest); None on a GPU or where they fit."""
    local = local_size()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.cuda.is_available() or local <= usable:
        return None
    return (f"warning: {local} ranks on this node share {usable} CPU{'s' * (usable != 1)}: they take turns, and every "
            f"step waits for the slowest; launch at most {usable} processes per node")


def accelerate_mixed_precision() -> str:
    """What `accelerate launch` was told (yaml `mixed_precision` or --mixed_precision); "no" without accelerate."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()


def quiet_deepspeed() -> None:
    """Name the accelerator up front so DeepSpeed doesn't print its auto-detection warning on every rank."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    dp_rank: int          # which shard of the data this rank reads; tensor-parallel peers and the stages of
    dp_size: int          # one pipeline read the same one
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    stage: int = 0        # pipeline stage
    pp_size: int = 1
    sp_rank: int = 0      # which chunk of each sequence's positions (sequence parallel)
    sp_size: int = 1
    library_output: str = ""  # what DeepSpeed printed while the world started (the run's deepspeed.log)
    # set by the training loop while a task's own evaluation runs (a stop signal ends it: `scored`); else None
    between_batches: Callable[[int, int], None] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """Ranks that read the same batch: world / data-parallel size (tensor-parallel peers, stages or the ranks
        that split its sequences)."""
        return self.world_size // self.dp_size

    @property
    def loss_replicas(self) -> int:
        """Ranks that compute the same loss: `replicas` but the sequence ranks (each sums over its own positions)."""
        return self.replicas // self.sp_size

    def scored(self, i: int, steps: int) -> None:
        """A task's own evaluation calls this after its micro-batch `i` (from 0) of `steps`, on every rank alike. In
        training, where a rank got a stop signal, the ranks end the evaluation there together (it raises; the loop
        saves a checkpoint that owes it): they ask each other, a small collective. Elsewhere nothing."""
        if self.between_batches is not None:
            self.between_batches(i, steps)

    def gather(self, obj) -> list:
        """Every data-parallel rank's `obj` (picklable), in data-parallel order, on every rank; a sync point.
        Of the ranks that read the same batch (tensor-parallel peers, pipeline stages, sequence ranks) only the first
        counts."""
        first = self.tp_rank == 0 and self.stage == 0 and self.sp_rank == 0
        return [o for lead, o in all_gather_objects((first, obj)) if lead]


_OWN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_set_env: list[str] = []  # what init_world put in the environment itself (no launcher), for close_world
_inits = [0]  # worlds this process has started (`_rendezvous_again`)
_excepthook: list = []  # sys.excepthook before torch's rank-prefixing one, restored by close_world in a world of one


def init_world(layout=None, timeout_s: float | None = None, agree: Callable[[], None] | None = None) -> World:
    """The process group and this rank's place in `layout` (a `config.layout.Layout`; None = data parallel only). A
    collective that waits longer than `timeout_s` raises (None: torch's default, 30 min). `agree`: a collective check
    that the ranks mean the same run, made before any subgroup (ranks that differ in them would hang)."""
    keep_freed_host_memory()
    if "RANK" not in os.environ:  # no launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        _set_env[:] = _OWN_ENV
        _excepthook[:] = [sys.excepthook]  # torch's group start wraps it for good: "[rank0]: " on every line
    quiet_deepspeed()
    # Before the group exists: DeepSpeed's TorchBackend.barrier and torch.distributed.nn's collectives take
    # `group=WORLD` as a default argument, so importing them after the group is made keeps that group alive past
    # destroy_process_group. Its gloo worker threads then outlive Python's finalization, and the one that frees the
    # last collective's work needs the GIL from a dying interpreter: "terminate called without an active exception",
    # SIGABRT, on a finished run (tests/test_sharding.py).
    import deepspeed.comm.torch  # noqa: F401
    import torch.distributed.nn  # noqa: F401
    from accelerate import PartialState

    # DeepSpeed 0.19 calls collectives torch has renamed; the warning is theirs to fix, not the user's.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # A pipeline's tied weights are broadcast in place at build; backward then warns on every rank that the
    # broadcast has no autograd kernel. Nothing flows back through it (the tests match 1-process losses).
    warnings.filterwarnings("ignore", message="c10d::broadcast_: an autograd kernel was not registered")
    # cpu=True routes accelerate to its MULTI_CPU (gloo) set-up, which counts processes correctly.
    with warnings.catch_warnings():  # accelerate warns that it chose OMP_NUM_THREADS for us
        warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")
        timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        if _inits[0] and not _set_env:  # a launched process's second world (the API called again in its script)
            _rendezvous_again(_inits[0], **timeout)
        _inits[0] += 1
        state = PartialState(cpu=not torch.cuda.is_available(), **timeout)
    _default_group_timeout(timeout.get("timeout"))
    import deepspeed

    said = io.StringIO()  # its op builder's "... built successfully" on each rank: for the run's log, not the terminal
    try:
        with contextlib.redirect_stdout(said):
            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    except BaseException:
        sys.stdout.write(said.getvalue())  # what it said before failing explains the failure
        raise
    world_size = torch.distributed.get_world_size()
    if state.num_processes != world_size or world_size != launched_world_size():
        raise RuntimeError(f"inconsistent world size: accelerate says {state.num_processes}, torch.distributed "
                           f"{world_size}, the launcher {launched_world_size()}")
    rank = torch.distributed.get_rank()
    if layout is None:
        layout = Layout(world_size=world_size, dp_size=world_size)
    if layout.world_size != world_size:
        raise RuntimeError(f"planned for a world of {layout.world_size}, launched {world_size}")
    if agree is not None and world_size > 1:
        try:
            agree()
        except BaseException:  # refused: the process can start again (the API called again, its script fixed)
            close_world()
            raise
    if layout.sp_size > 1:  # DeepSpeed's Ulysses groups (distributed/sequence.py), handed to it as the mpu
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(layout.sp_size)
    return World(rank=rank, world_size=world_size, local_rank=state.local_process_index, device=state.device,
                 dp_size=layout.dp_size, tp_size=layout.tp_size, pp_size=layout.pp_size, sp_size=layout.sp_size,
                 library_output=said.getvalue(), **layout.coords(rank))


def _rendezvous_again(count: int, timeout: datetime.timedelta | None = None) -> None:
    """The world group of a process whose launcher's store already held one: under torchrun, every group start keys
    its ranks' addresses in the launcher's store by a group counter that destroy_process_group resets (torch 2.x), so
    a second start reads the first's stale addresses (gloo: "connectFullMesh failed ... Connection refused", or a
    hang). A prefix of our own per start keeps them apart; accelerate's PartialState then takes this group."""
    import torch.distributed as dist

    store, rank, size = next(dist.rendezvous("env://"))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.PrefixStore(
        f"harness/world{count}", store), rank=rank, world_size=size,
        **({"timeout": timeout} if timeout else {}))


def _default_group_timeout(timeout: datetime.timedelta | None) -> None:
    """The timeout of every group made later: DeepSpeed makes its own (data parallel, ZeRO's reductions...) with
    torch.distributed.new_group and no timeout, which falls back to torch's module-wide default (30 min) and not the
    world group's. None: torch's own defaults."""
    import torch.distributed.constants as constants
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout or constants.default_pg_timeout
    if isinstance(constants.default_pg_nccl_timeout, datetime.timedelta):  # None where NCCL is not compiled in
        c10d.default_pg_nccl_timeout = timeout or constants.default_pg_nccl_timeout


def close_world() -> None:
    """Undo init_world, so the same process can train again (a notebook cell run twice): the process group,
    DeepSpeed's and accelerate's memory of it (both keep a process-wide singleton that would otherwise claim a
    group that no longer exists), and the rendezvous variables init_world chose itself."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    from accelerate.state import PartialState

    from .ds_patches import forget_groups

    forget_groups()
    PartialState._reset_state()
    # DeepSpeed's engine holds its groups in reference cycles: collect them now, while the interpreter can still
    # join their threads, not in its finalization (the abort above)
    gc.collect()
    for name in _set_env:
        os.environ.pop(name, None)
    _set_env.clear()
    if _excepthook:  # one process, no launcher: an error after the run reads as Python prints it, once
        sys.excepthook = _excepthook.pop()


def single_world(device: str | torch.device = "cpu") -> World:
    """One process and no process group (e.g. `harness evaluate`): collectives below become no-ops."""
    return World(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1, device=torch.device(device))


def _grouped() -> bool:
    """Whether there are other ranks to talk to (a world of one skips its collectives: they cost, do nothing)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """In-place all-reduce (sum by default) of a small CPU/device tensor; a sync point across ranks."""
    if _grouped():
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
    return t


def all_gather_start(t: torch.Tensor):
    """Start gathering every rank's 1-d `t` and return at once: (out, handle), `out` of world x len(t) in rank
    order; `.wait()` on the handle (None in a world of one, where `out` is `t`) before reading it. Work done in
    between overlaps the collective."""
    if not _grouped():
        return t, None
    out = torch.empty(torch.distributed.get_world_size() * t.numel(), dtype=t.dtype, device=t.device)
    return out, torch.distributed.all_gather_into_tensor(out, t, async_op=True)


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-d `t`, stacked in rank order: (world, len(t)); a sync point."""
    out, handle = all_gather_start(t)
    if handle is not None:
        handle.wait()
    return out.view(-1, t.numel())


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`; to a GPU from pinned memory, so the host does not wait for the work queued
    there (a copy from pageable memory would)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def to_host_later(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`t` on the host, to be read later: on a GPU copied now into pinned memory behind the work queued so far, and
    the function returned waits for that copy alone (not for work queued since); elsewhere `t` itself."""
    if t.device.type != "cuda":
        return lambda: t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))

    def read() -> torch.Tensor:
        copied.synchronize()  # sync point: with the copy alone
        return host
    return read


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank; a sync point."""
    if not _grouped():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if _grouped():
        torch.distributed.barrier()


# What a failed collective says (run/loop.py names the rank; run/checkpoint.py does not blame the file it read)
def is_timeout(error: BaseException) -> bool:
    """A collective that gave up waiting (gloo: "Timed out waiting ...ms", or "Application timeout caused pair
    closure" in an all-gather; NCCL's watchdog: "Watchdog caught collective operation timeout")."""
    text = str(error).lower()
    return "timed out" in text or "application timeout" in text or ("timeout" in text and "collective" in text)


def is_lost(error: BaseException) -> bool:
    """A collective whose peer went away (gloo: "Connection closed by peer", "Connection reset by peer"; NCCL:
    "remote process exited or there was a network error"): a rank died, or its node did."""
    text = str(error).lower()
    return any(s in text for s in ("connection closed by peer", "connection reset by peer", "broken pipe",
                                   "remote process exited"))
