"""Resolve a DeepSpeed JSON config against the run config.

The DeepSpeed file owns the strategy: ZeRO stage, offload, precision, loss scaling, parallelism.
The run file owns the numbers of the run: batch sizes, accumulation, learning rate, clipping.
A run-owned value in the DeepSpeed file is "auto" (filled here) or must equal the run's value.
A contradiction is an error naming the key, both values and where each came from.
"""
from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, Resolved, flatten, read_file

DEFAULT_DS = {"zero_optimization": {"stage": 0}}  # plain data parallel in fp32 when no --ds is given

# Top-level keys DeepSpeed 0.19 reads; anything else is a typo that DeepSpeed would silently ignore.
KNOWN_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "seq_parallel_communication_data_type", "data_types", "activation_checkpointing", "flops_profiler",
    "comms_logger", "monitor_config", "tensorboard", "wandb", "csv_monitor", "comet", "aio", "checkpoint",
    "elasticity", "autotuning", "compile", "tensor_parallel", "pipeline", "data_efficiency",
    "curriculum_learning", "compression_training", "sparse_attention", "dump_state", "dataloader_drop_last",
    "disable_allgather", "use_data_before_expert_parallelism", "timers", "nebula", "hybrid_engine",
    "weight_quantization", "sparse_gradients", "graph_harvesting", "use_node_local_storage", "load_universal",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "mics_shard_size", "zenflow",
}
# Batch keys and clipping: DeepSpeed key -> run key.
RUN_OWNED = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "train_batch_size": "train.global_batch_size",
    "gradient_clipping": "train.grad_clip",
}
OPTIMIZER_PARAMS = {"lr": "optimizer.lr", "eps": "optimizer.eps", "weight_decay": "optimizer.weight_decay"}


@dataclass(frozen=True)
class Layout:
    """How the world is split. Data parallel only for now: every rank is its own data-parallel rank."""
    world_size: int
    dp_size: int


@dataclass(frozen=True)
class DSResolved:
    config: dict[str, Any]      # what goes to deepspeed.initialize (no optimizer/scheduler sections)
    source: dict[str, str]      # dotted DeepSpeed key -> where its value came from
    layout: Layout
    precision: str              # "fp32" | "bf16" | "fp16"
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    grad_accum_steps: int
    global_batch_size: int


def read_json(path: str | Path) -> dict[str, Any]:
    return read_file(path, "DeepSpeed config", json.loads, json.JSONDecodeError, "JSON")


def resolve_ds(run: Resolved, ds_file: str | None, world_size: int, accel_precision: str = "no") -> DSResolved:
    """`accel_precision` is accelerate's mixed_precision ("no", "fp16", "bf16") for this launch."""
    label = f"ds file {ds_file}" if ds_file else "harness default"
    ds = copy.deepcopy(read_json(ds_file) if ds_file else DEFAULT_DS)
    source = {k: label for k in flatten(ds)}
    c = run.cfg

    for key in ds:
        if key not in KNOWN_KEYS:
            close = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            raise ConfigError(f"unknown DeepSpeed key `{key}` ({label}){hint}")
    if "scheduler" in ds:
        raise ConfigError(f"`scheduler` ({label}): the learning-rate schedule belongs to the run file "
                          f"([schedule] kind/warmup_steps/min_lr_ratio); remove the section")
    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization ({label}) must be an object")
    _validate_zero(zero, label)
    stage = zero.setdefault("stage", 0)
    source.setdefault("zero_optimization.stage", "DeepSpeed default")

    layout = Layout(world_size=world_size, dp_size=world_size)
    micro, accum = c.train.micro_batch_size, c.train.grad_accum_steps
    if c.train.global_batch_size:  # derive accumulation from the global batch, or check they agree
        per_step = micro * layout.dp_size
        derived, rest = divmod(c.train.global_batch_size, per_step)
        if rest or not derived:
            raise ConfigError(f"{run.describe('train.global_batch_size')} is not a multiple of "
                              f"{run.describe('train.micro_batch_size')} x data-parallel size {layout.dp_size}")
        if run.is_set("train.grad_accum_steps") and derived != accum:
            raise ConfigError(f"micro batch x accumulation x data-parallel size != global batch: {micro} x {accum} x "
                              f"{layout.dp_size} != {c.train.global_batch_size} "
                              f"({run.describe('train.grad_accum_steps')}, {run.describe('train.global_batch_size')})")
        accum = derived
    run_values = {
        "train_micro_batch_size_per_gpu": (micro, run.source["train.micro_batch_size"]),
        "gradient_accumulation_steps": (accum, run.source["train.grad_accum_steps"]
                                        if not c.train.global_batch_size else "derived from train.global_batch_size"),
        "train_batch_size": (micro * accum * layout.dp_size, "derived: micro x accumulation x data-parallel size"),
        "gradient_clipping": (c.train.grad_clip, run.source["train.grad_clip"]),
    }
    for ds_key, (value, origin) in run_values.items():
        _fill(ds, source, ds_key, value, origin, RUN_OWNED[ds_key], label)

    if "optimizer" in ds:
        _check_optimizer(ds.pop("optimizer"), run, label)
        for k in list(source):
            if k.startswith("optimizer."):
                del source[k]

    precision = _resolve_precision(ds, source, label, accel_precision)
    offload_opt = _offload_device(zero.get("offload_optimizer")) not in ("none", None)
    offload_par = _offload_device(zero.get("offload_param")) not in ("none", None)
    if offload_par and stage != 3:
        raise ConfigError(f"zero_optimization.offload_param ({label}) needs ZeRO stage 3, got stage {stage}")
    if offload_opt and stage == 0:
        raise ConfigError(f"zero_optimization.offload_optimizer ({label}) needs ZeRO stage 1, 2 or 3, got stage 0")
    for key, value in {"steps_per_print": 10**9, "wall_clock_breakdown": False}.items():
        if key not in ds:  # DeepSpeed's own step logging would interleave with the progress bar
            ds[key] = value
            source[key] = "harness default"
    return DSResolved(ds, source, layout, precision, stage, offload_opt, offload_par, accum,
                      micro * accum * layout.dp_size)


def _fill(ds, source, ds_key, value, origin, run_key, label):
    current = ds.get(ds_key, "auto")
    if current == "auto":
        ds[ds_key] = value
        source[ds_key] = f"{'auto <- ' if ds_key in source else ''}{run_key} ({origin})"
    elif current != value:
        raise ConfigError(f"{ds_key} = {current!r} ({label}) contradicts {run_key} = {value!r} ({origin}); "
                          f"set it to \"auto\" or make them agree")


def _validate_zero(zero: dict, label: str) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as e:
        err = e.errors()[0]
        key = "zero_optimization." + ".".join(str(x) for x in err["loc"])
        hint = ""
        if err["type"] == "extra_forbidden":
            names = list(DeepSpeedZeroConfig.model_fields)
            close = difflib.get_close_matches(str(err["loc"][-1]), names, n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else ""
        raise ConfigError(f"{key} ({label}): {err['msg']}{hint}") from None


def _offload_device(section: Any) -> str | None:
    return section.get("device", "none") if isinstance(section, dict) else None


def _check_optimizer(opt: Any, run: Resolved, label: str) -> None:
    """Accept the optimizer section accelerate users keep in their DeepSpeed files, if it agrees with the run."""
    kind = str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type = {kind!r} ({label}): the harness trains with AdamW from the run file's "
                          f"[optimizer]; remove the section or set type AdamW with \"auto\" params")
    params = opt.get("params", {})
    run_values = {**{k: getattr(run.cfg.optimizer, v.split('.')[1]) for k, v in OPTIMIZER_PARAMS.items()},
                  "betas": [run.cfg.optimizer.beta1, run.cfg.optimizer.beta2]}
    for key, value in params.items():
        if key not in run_values:
            raise ConfigError(f"optimizer.params.{key} ({label}) is not supported; remove it")
        if value != "auto" and value != run_values[key]:
            run_key = OPTIMIZER_PARAMS.get(key, "optimizer.beta1/beta2")
            origin = run.source.get(run_key, run.source["optimizer.beta1"])
            raise ConfigError(f"optimizer.params.{key} = {value!r} ({label}) contradicts {run_key} = "
                              f"{run_values[key]!r} ({origin}); set it to \"auto\" or make them agree")


def _resolve_precision(ds: dict, source: dict, label: str, accel: str) -> str:
    if accel not in ("no", "fp16", "bf16"):
        raise ConfigError(f"accelerate mixed_precision = {accel!r} is not supported with DeepSpeed here; "
                          f"use 'no' and choose the precision in the DeepSpeed config")
    if "bfloat16" in ds:  # DeepSpeed's old spelling
        ds.setdefault("bf16", ds.pop("bfloat16"))
    enabled = {}
    for name in ("fp16", "bf16"):
        section = ds.get(name)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{name} ({label}) must be an object like {{\"enabled\": true}}")
        value = section.get("enabled", False)
        if value == "auto":  # accelerate's meaning: follow --mixed_precision
            section["enabled"] = value = accel == name
            source[f"{name}.enabled"] = f"auto, filled from accelerate mixed_precision={accel!r}"
        enabled[name] = bool(value)
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ConfigError(f"fp16.enabled and bf16.enabled are both true ({label}); choose one")
    precision = "fp16" if enabled.get("fp16") else "bf16" if enabled.get("bf16") else "fp32"
    if accel != "no" and accel != precision:
        raise ConfigError(f"accelerate mixed_precision = {accel!r} (launch config or --mixed_precision) contradicts "
                          f"the DeepSpeed precision {precision!r} ({label}); set mixed_precision to 'no' and let "
                          f"the DeepSpeed config decide, or make them agree")
    return precision


def model_state_bytes(n_params: int, ds: DSResolved) -> dict[str, int]:
    """Bytes of model states (weights, gradients, AdamW states) per rank, after the ZeRO paper (Rajbhandari et al.
    2020, section 3): with mixed precision 2 (16-bit weights) + 2 (16-bit grads) + 12 (fp32 master, m, v) bytes per
    parameter; in fp32 4 + 4 + 8. Stage 1 shards the optimizer part, 2 also the gradients, 3 also the weights.
    Offloaded parts move from "device" to "cpu". Activations and buffers are not included."""
    n, mixed = ds.layout.dp_size, ds.precision != "fp32"
    w, g, opt = (2, 2, 12) if mixed else (4, 4, 8)
    s = ds.zero_stage
    weights = w / n if s >= 3 else w
    grads = g / n if s >= 2 else g
    optim = opt / n if s >= 1 else opt
    device, cpu = weights + grads + optim, 0.0
    if ds.offload_optimizer:
        device, cpu = device - optim, cpu + optim
    if ds.offload_params:
        device, cpu = device - weights, cpu + weights
    return {"device": int(device * n_params), "cpu": int(cpu * n_params)}
