"""accelerate's DeepSpeed settings, as `accelerate launch` hands them to each rank.

`accelerate config` with DeepSpeed writes `deepspeed_config: {zero_stage: 3, offload_optimizer_device: cpu, ...}`
and `accelerate launch --use_deepspeed --zero_stage 3 ...` says the same with flags; either way each rank gets
ACCELERATE_* variables (accelerate/utils/launch.py, `prepare_deepspeed_cmd_env`), which `harness launch` also
computes before it starts anything (`launcher.launch_settings`). Without `--ds` they are the strategy; with `--ds`
they must agree with it. `deepspeed_config_file` names the DeepSpeed file itself (`plan/resolve.py`, `ds_file_arg`).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .run import ConfigError

# ACCELERATE_* variable -> accelerate's name for the setting
ENV = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "zero3_init_flag",
}
# accelerate's parallelism_config (`accelerate launch --use_parallelism_config --parallelism_config_sp_size N`, or
# its config file's parallelism_config): PARALLELISM_CONFIG_* variable -> its name; sizes of 1 are off
PARALLELISM_ENV = {"PARALLELISM_CONFIG_SP_SIZE": "sp_size", "PARALLELISM_CONFIG_SP_BACKEND": "sp_backend",
                   "PARALLELISM_CONFIG_CP_SIZE": "cp_size", "PARALLELISM_CONFIG_TP_SIZE": "tp_size"}
# settings that are run-file numbers, not strategy: accelerate name -> run key
RUN_KEYS = {"gradient_accumulation_steps": "train.grad_accum_steps", "gradient_clipping": "train.grad_clip",
            "zero3_init_flag": "model.zero_init"}


def settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """accelerate's DeepSpeed settings for this launch ({} without DeepSpeed or without any set)."""
    env = os.environ if env is None else env
    out = {}
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        out = {name: env[var] for var, name in ENV.items() if env.get(var) not in (None, "")}
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        sizes = {name: env[var] for var, name in PARALLELISM_ENV.items()
                 if name.endswith("_size") and env.get(var) not in (None, "", "1")}
        if "sp_size" in sizes:
            sizes["sp_backend"] = env.get("PARALLELISM_CONFIG_SP_BACKEND") or "deepspeed"
        out.update(sizes)
    return out


def describe(given: dict[str, str]) -> str:
    return "accelerate config (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"


def strategy(given: dict[str, str]) -> dict[str, Any]:
    """The DeepSpeed config the strategy settings mean (the run-file numbers are `run_values`)."""
    zero: dict[str, Any] = {}
    try:
        if "zero_stage" in given:
            zero["stage"] = int(given["zero_stage"])
    except ValueError:
        raise ConfigError(f"accelerate zero_stage = {given['zero_stage']!r} must be 0, 1, 2 or 3") from None
    for name, key in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        device = given.get(name, "none").lower()
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"accelerate {name} = {given[name]!r} must be none, cpu or nvme")
        if device != "none":
            zero[key] = {"device": device}
    if "zero3_save_16bit_model" in given:
        zero["stage3_gather_16bit_weights_on_model_save"] = _bool(given, "zero3_save_16bit_model")
    out: dict[str, Any] = {"zero_optimization": zero} if zero else {}
    sp = sequence_parallel(given)
    if sp:
        out["sequence_parallel_size"] = sp
    return out


def sequence_parallel(given: dict[str, str]) -> int | None:
    """The sequence-parallel size accelerate's parallelism_config names (None: none); its other sizes refused with
    the harness's way to say them."""
    if "cp_size" in given:
        raise ConfigError(f"accelerate parallelism_config cp_size = {given['cp_size']} is context parallelism through "
                          f"FSDP2, which the harness does not run; its sequence parallelism is DeepSpeed's Ulysses: "
                          f"--parallelism_config_sp_size N, or \"sequence_parallel_size\": N in the DeepSpeed file")
    if "tp_size" in given:
        raise ConfigError(f"accelerate parallelism_config tp_size = {given['tp_size']}: the harness's tensor "
                          f"parallelism is DeepSpeed's AutoTP, named in the DeepSpeed file (\"tensor_parallel\": "
                          f"{{\"autotp_size\": N, ...}}, configs/ds/tp2_zero1.json)")
    if "sp_size" not in given:
        return None
    if given.get("sp_backend", "deepspeed") != "deepspeed":
        raise ConfigError(f"accelerate parallelism_config sp_backend = {given['sp_backend']!r}: the harness runs "
                          f"DeepSpeed's Ulysses (sp_backend deepspeed)")
    try:
        return int(given["sp_size"])
    except ValueError:
        raise ConfigError(f"accelerate parallelism_config sp_size = {given['sp_size']!r} is not a whole number") \
            from None


def run_values(given: dict[str, str]) -> dict[str, tuple[str, Any]]:
    """accelerate name -> (run key, value) for the settings the run file owns."""
    out: dict[str, tuple[str, Any]] = {}
    for name, key in RUN_KEYS.items():
        if name not in given:
            continue
        try:
            value = int(given[name]) if name == "gradient_accumulation_steps" else \
                float(given[name]) if name == "gradient_clipping" else _bool(given, name)
        except ValueError:
            raise ConfigError(f"accelerate {name} = {given[name]!r} is not a number") from None
        out[name] = (key, value)
    return out


def _bool(given: dict[str, str], name: str) -> bool:
    value = given[name].lower()
    if value not in ("true", "false"):
        raise ConfigError(f"accelerate {name} = {given[name]!r} must be true or false")
    return value == "true"


def contradictions(ds: dict[str, Any], given: dict[str, str]) -> list[str]:
    """Where a --ds file and accelerate's strategy settings disagree: one entry each."""
    wanted = strategy(given)
    zero, mine = ds.get("zero_optimization", {}), wanted.get("zero_optimization", {})
    out = []
    sp = wanted.get("sequence_parallel_size")
    if sp is not None and ds.get("sequence_parallel_size", 1) != sp:
        out.append(f"sequence_parallel_size = {ds.get('sequence_parallel_size', 1)} vs accelerate parallelism_config "
                   f"sp_size = {sp}")
    if "stage" in mine and zero.get("stage", 0) != mine["stage"]:
        out.append(f"zero_optimization.stage = {zero.get('stage', 0)} vs accelerate zero_stage = {mine['stage']}")
    for key, name in (("offload_optimizer", "offload_optimizer_device"), ("offload_param", "offload_param_device")):
        theirs = (zero.get(key) or {}).get("device", "none") if isinstance(zero.get(key), dict) else "none"
        if name in given and theirs != given[name].lower():
            out.append(f"zero_optimization.{key}.device = {theirs!r} vs accelerate {name} = {given[name]!r}")
    return out
