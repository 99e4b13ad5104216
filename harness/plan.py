"""`harness plan`: everything resolved, nothing trained. Prints each value with where it came from."""
from __future__ import annotations

import json

import torch

from .config import all_keys, flatten
from .ds_config import model_state_bytes
from .startup import Plan


def count_params(plan: Plan) -> int:
    if hasattr(plan.task, "prepare"):  # the model's vocabulary may come from the prepared data: prepare it for real
        plan.task.prepare(plan.run.cfg)
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = plan.task.build_model(plan.run.cfg)
    return sum(p.numel() for p in model.parameters())


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render(plan: Plan) -> str:
    run, ds = plan.run, plan.ds
    lines = ["# run config (defaults < run file < command line)"]
    for key, value in flatten(run.cfg.to_dict()).items():
        lines.append(f"{key:32} = {json.dumps(value):24} # {run.source[key]}")
    lines.append("")
    lines.append("# DeepSpeed config (as passed to deepspeed.initialize)")
    for key, value in flatten(ds.config).items():
        lines.append(f"{key:48} = {json.dumps(value):14} # {ds.source.get(key, 'DeepSpeed default')}")
    n = count_params(plan)
    mem = model_state_bytes(n, ds)
    lines += [
        "",
        f"world size {ds.layout.world_size} (data parallel {ds.layout.dp_size}); ZeRO stage {ds.zero_stage}, "
        f"{ds.precision}, optimizer offload {'on' if ds.offload_optimizer else 'off'}, "
        f"parameter offload {'on' if ds.offload_params else 'off'}",
        f"global batch {ds.global_batch_size} = micro {run.cfg.train.micro_batch_size} x accumulation "
        f"{ds.grad_accum_steps} x data parallel {ds.layout.dp_size}",
        f"model: {n:,} parameters",
        f"model states per rank (weights, gradients, AdamW; activations not included): "
        f"device {_gib(mem['device'])}, CPU {_gib(mem['cpu'])}",
        f"run directory: {plan.run_dir}",
    ]
    return "\n".join(lines)


def render_keys() -> str:
    lines = []
    for key, f in all_keys().items():
        choices = f.metadata["choices"]
        extra = f" (one of {', '.join(choices)})" if choices else ""
        lines.append(f"{key:30} {json.dumps(f.default):10} {f.metadata['help']}{extra}")
    return "\n".join(lines)
