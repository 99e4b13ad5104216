"""Who am I in the job: process group set-up and the ranks' roles.

`accelerate launch` (or torchrun, or the DeepSpeed launcher) exports RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address. A plain `harness train` (no launcher) is a world of one on a free local port.

Known trap: under `accelerate launch --use_deepspeed` on a machine without CUDA, accelerate's state picks no
backend and reports num_processes == 1 on every rank, although DeepSpeed has set up a gloo group of the full
size; a trainer trusting it would feed every rank the same data. We ask accelerate for its CPU (gloo) state
instead, and check its view against torch.distributed before any data is touched.
"""
from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass

import torch


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


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
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world() -> World:
    if "RANK" not in os.environ:  # no launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    quiet_deepspeed()
    from accelerate import PartialState

    # DeepSpeed 0.19 calls collectives torch has renamed; the warning is theirs to fix, not the user's.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # cpu=True routes accelerate to its MULTI_CPU (gloo) set-up, which counts processes correctly.
    with warnings.catch_warnings():  # accelerate warns that it chose OMP_NUM_THREADS for us
        warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")
        state = PartialState(cpu=not torch.cuda.is_available())
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    world_size = torch.distributed.get_world_size()
    if state.num_processes != world_size or world_size != launched_world_size():
        raise RuntimeError(f"inconsistent world size: accelerate says {state.num_processes}, torch.distributed "
                           f"{world_size}, the launcher {launched_world_size()}")
    rank = torch.distributed.get_rank()
    return World(rank=rank, world_size=world_size, local_rank=state.local_process_index,
                 dp_rank=rank, dp_size=world_size, device=state.device)


def single_world(device: str | torch.device = "cpu") -> World:
    """One process and no process group (e.g. `harness evaluate`): collectives below become no-ops."""
    return World(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1, device=torch.device(device))


def _grouped() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """In-place all-reduce (sum by default) of a small CPU/device tensor; a sync point across ranks."""
    if _grouped():
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
    return t


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
