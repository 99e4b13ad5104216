"""accelerate's DeepSpeed settings, as `accelerate launch` hands them to each rank.

`accelerate config` with DeepSpeed writes `deepspeed_config: {zero_stage: 3, offload_optimizer_device: cpu, ...}`
and `accelerate launch --use_deepspeed --zero_stage 3 ...` says the same with flags; either way each rank gets
ACCELERATE_* variables (accelerate/utils/launch.py, `prepare_deepspeed_cmd_env`), which `harness launch` also
computes before it starts anything (`launcher/settings.py`). Without `--ds` they are the strategy; with `--ds`
they must agree with it. `deepspeed_config_file` names the DeepSpeed file itself (`plan/resolve.py`, `ds_file_arg`).
`read_config` reads accelerate's config file for `harness launch` and refuses what accelerate would fail on with a
traceback or ignore without a word.
"""
from __future__ import annotations

import json
import os
import typing
from pathlib import Path
from typing import Any, Mapping

from .run import ConfigError, closest

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
# accelerate's parallelism_config (its config file's `parallelism_config: {parallelism_config_sp_size: N}`, SP_FORM):
# PARALLELISM_CONFIG_* variable -> its name; sizes of 1 are off
PARALLELISM_ENV = {"PARALLELISM_CONFIG_SP_SIZE": "sp_size", "PARALLELISM_CONFIG_SP_BACKEND": "sp_backend",
                   "PARALLELISM_CONFIG_CP_SIZE": "cp_size", "PARALLELISM_CONFIG_TP_SIZE": "tp_size"}
# The keys accelerate reads under its config file's deepspeed_config and parallelism_config (checked on accelerate
# 1.15.0: `accelerate launch`'s "DeepSpeed Arguments" and "ParallelismConfig Arguments", which `accelerate config`
# writes and `_validate_launch_command` copies onto the launch's arguments by name; it copies any other key too, and
# nothing reads it)
DEEPSPEED_KEYS = frozenset({
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
    "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile", "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter", "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names"})
PARALLELISM_KEYS = frozenset("parallelism_config_" + k for k in (
    "dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "cp_comm_strategy", "sp_size",
    "sp_backend", "sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"))
# accelerate 1.15 refuses --use_parallelism_config without FSDP2: with DeepSpeed its config file is the only way
SP_FORM = "parallelism_config: {parallelism_config_sp_size: N} in accelerate's config file"
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
                          f"{SP_FORM}, or \"sequence_parallel_size\": N in the DeepSpeed file")
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
    if "stage" in mine and zero.get("stage", 0) not in ("auto", mine["stage"]):  # "auto": accelerate's to fill
        out.append(f"zero_optimization.stage = {zero.get('stage', 0)} vs accelerate zero_stage = {mine['stage']}")
    for key, name in (("offload_optimizer", "offload_optimizer_device"), ("offload_param", "offload_param_device")):
        theirs = (zero.get(key) or {}).get("device", "none") if isinstance(zero.get(key), dict) else "none"
        if name in given and theirs not in ("auto", given[name].lower()):
            out.append(f"zero_optimization.{key}.device = {theirs!r} vs accelerate {name} = {given[name]!r}")
    return out


def read_config(file: str, who: str) -> tuple[dict, dict]:
    """accelerate's config file as written (to say where a value came from) and as accelerate reads it (its
    `load_config_from_file`, defaults filled in). What accelerate would end with a traceback later (an empty file, a
    list, text that is not YAML, an unknown key, a value of the wrong kind) is refused here, naming the file."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(file)
    if path.is_dir():
        raise ConfigError(f"{who}: --config_file {file} is a directory: name accelerate's config file in it "
                          f"(a .yaml or .json file, as launch/cpu_2proc.yaml)")
    if not path.is_file():
        raise ConfigError(f"{who}: --config_file {file}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if file.endswith(".json") else yaml.safe_load(text)  # as accelerate tells them apart
    except yaml.YAMLError as e:  # its own message runs over several lines
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{who}: accelerate config {file} is not YAML: {getattr(e, 'problem', None) or e}{at}") \
            from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ConfigError(f"{who}: cannot read accelerate config {file}: {e}") from None
    if not isinstance(raw, dict):
        what = "is empty" if raw is None else f"holds a {type(raw).__name__}"
        raise ConfigError(f"{who}: accelerate config {file} {what}, not accelerate's settings (key: value lines, as "
                          f"in launch/cpu_2proc.yaml)")
    if raw.get("compute_environment") != "AMAZON_SAGEMAKER":  # SageMaker's keys are others
        _check_keys(raw, file, who)
    try:
        return raw, load_config_from_file(file).to_dict()
    except (ValueError, TypeError) as e:  # what accelerate checks itself: a missing distributed_type, SageMaker's keys
        raise ConfigError(f"{who}: accelerate config {file}: {e}") from None


def _check_keys(raw: dict, file: str, who: str) -> None:
    """The keys of a local machine's accelerate config (its ClusterConfig's fields) and the kind of each value, and the
    keys under deepspeed_config and parallelism_config, which accelerate otherwise ignores when misspelled."""
    import dataclasses

    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    hints = typing.get_type_hints(ClusterConfig)
    unknown = _unknown(raw, {*hints, "fp16", "dynamo_backend"})  # the last two: old spellings accelerate converts
    if unknown:
        raise ConfigError(f"{who}: accelerate config {file}: {unknown}")
    for key, kind in (("compute_environment", ComputeEnvironment), ("distributed_type", DistributedType)):
        values = [v.value for v in kind]
        if key in raw and raw[key] not in values:
            hint = _close(str(raw[key]), values) or f"; accelerate's are {', '.join(values)}"
            raise ConfigError(f"{who}: {key} in {file} = {raw[key]!r} is not one of accelerate's{hint}")
    defaults = {f.name: f.default for f in dataclasses.fields(ClusterConfig)}
    for key, value in raw.items():
        kinds = _kinds(hints.get(key))
        if kinds and not _is(value, kinds) and not (value is None and defaults.get(key) is None):
            quote = ": put it in quotes (YAML reads a bare yes, no, on or off as true or false)" \
                if str in kinds and isinstance(value, bool) else ""
            raise ConfigError(f"{who}: {key} in {file} = {value!r}: must be "
                              f"{' or '.join(KINDS[k] for k in kinds if k in KINDS)}{quote}")
    for section, names in (("deepspeed_config", DEEPSPEED_KEYS), ("parallelism_config", PARALLELISM_KEYS)):
        unknown = _unknown(raw.get(section) or {}, names)
        if unknown:
            raise ConfigError(f"{who}: {section} in {file}: {unknown}; accelerate reads {', '.join(sorted(names))} "
                              f"there")


KINDS = {int: "a whole number", str: "text", bool: "true or false", dict: "a section of key: value lines",
         list: "a list"}


def _kinds(hint) -> tuple:
    """The Python types a config field's type hint allows; () where it is not plain (an enum, a union of them)."""
    args = typing.get_args(hint) if typing.get_origin(hint) is typing.Union else (hint,)
    kinds = tuple(typing.get_origin(a) or a for a in args)
    return kinds if all(k in KINDS or k is type(None) for k in kinds) else ()


def _is(value, kinds: tuple) -> bool:
    if bool in kinds and isinstance(value, str) and value.lower() in ("yes", "no", "true", "false"):
        return True  # `accelerate config` itself writes some switches so (downcast_bf16: 'no')
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)  # True is an int too


def _unknown(keys, names) -> str:
    """'unknown key K (did you mean N?), ...' for the keys not among `names`; '' for none."""
    unknown = [f"{k}{_close(str(k), names, ' (did you mean {}?)')}" for k in keys if k not in names]
    return f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}" if unknown else ""


def _close(word: str, names, form: str = "; did you mean {}?") -> str:
    """The name `word` was meant to be, in `form`: one ending in it (sp_size: parallelism_config_sp_size), else
    the closest spelling; '' for none."""
    ending = [n for n in names if n.endswith("_" + word)]
    close = ending[0] if len(ending) == 1 else closest(word, names)
    return form.format(close) if close else ""
