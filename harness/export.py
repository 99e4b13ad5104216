"""The consolidated model: one ordinary safetensors file of full fp32 weights, whatever the strategy.

Under ZeRO-3 each rank holds a shard and the module's parameters are empty placeholders; saving
`engine.module.state_dict()` there writes empty tensors. Under tensor parallelism each rank holds a slice of
the split layers, under pipeline parallelism only its stage. `parallel.full_state_dict` gathers each
parameter's full fp32 (master) value under the plain model's name instead. Under mixed precision that is the
optimizer's fp32 master copy, not the 16-bit weights.
"""
from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from .config import RunConfig, resolve
from .world import World

MODEL_FILE = "model.safetensors"


def export_model(engine, run_dir: Path, world: World) -> Path | None:
    """Collective: every rank calls it; rank 0 writes `RUN/model.safetensors` atomically."""
    from safetensors.torch import save_file

    from .parallel import full_state_dict

    state = full_state_dict(engine, world)
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
