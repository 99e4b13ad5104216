"""The consolidated model: one ordinary safetensors file of full fp32 weights, whatever the strategy.

Under ZeRO-3 each rank holds a shard and the module's parameters are empty placeholders; saving
`engine.module.state_dict()` there writes empty tensors. We gather each parameter's full fp32 (master)
value instead. Under mixed precision that is the optimizer's fp32 master copy, not the 16-bit weights.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .config import RunConfig, resolve
from .world import World

MODEL_FILE = "model.safetensors"


def _full_fp32(param: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)  # collective under ZeRO-3; None without a DeepSpeed master copy
    return (param if full is None else full).detach().float().cpu()


def export_model(engine, run_dir: Path, world: World) -> Path | None:
    """Collective: every rank calls it; rank 0 writes `RUN/model.safetensors` atomically."""
    from safetensors.torch import save_file

    state = {name: _full_fp32(p) for name, p in engine.module.named_parameters()}
    for name, buf in engine.module.named_buffers():
        state[name] = buf.detach().cpu()
    if not world.is_main:
        return None
    path = run_dir / MODEL_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def load_model(run_dir: str | Path) -> tuple[nn.Module, RunConfig]:
    """Rebuild the task's model from a run directory and load the exported weights, on one process."""
    from safetensors.torch import load_file

    from .tasks import get_task

    run_dir = Path(run_dir)
    cfg = resolve(str(run_dir / "config.toml")).cfg
    model = get_task(cfg.run.task).build_model(cfg)
    model.load_state_dict(load_file(str(run_dir / MODEL_FILE)))
    return model.eval(), cfg
