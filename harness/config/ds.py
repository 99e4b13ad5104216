"""Resolve a DeepSpeed JSON config against the run config.

The DeepSpeed file owns the strategy: ZeRO stage, offload, precision, loss scaling, parallelism (without a file:
accelerate's DeepSpeed settings, `accelerate.py`, else plain data parallel in fp32).
The run file owns the numbers of the run: batch sizes, accumulation, learning rate, clipping.
A run-owned value in the DeepSpeed file is "auto" (filled here) or must equal the run's value (the optimizer's and
scheduler's may also replace a run default: `ds_optim.py`).
A contradiction is an error naming the key, both values and where each came from.
How the world is split (data x tensor x pipeline) is read from the same file by `layout.py`.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import accelerate
from .ds_optim import Sections, resolve_sections, state_bytes
from .layout import Layout, resolve_layout
from .run import ConfigError, Resolved, closest, flatten, read_file

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
    "sequence_parallel_size",
}
# Sections DeepSpeed reads but acts on only when the training script asks it to, which the harness does not (or does
# the work itself): refused where they are on, as they would be ignored.
NOT_APPLIED = {
    "activation_checkpointing": "DeepSpeed recomputes only what a model passes to deepspeed.checkpointing; the "
                                "harness's recomputation is train.activation_checkpointing (each block)",
    "compile": "the harness compiles the model's blocks itself: set train.compile = true",
    "data_efficiency": "the harness's sampler orders the data: DeepSpeed's curriculum and data routing are not applied",
    "comms_logger": "DeepSpeed prints its summary only when the training script calls deepspeed.comm.log_summary()",
    "autotuning": "DeepSpeed's autotuner runs from the deepspeed launcher; `harness bench sweep` tries sizes here",
    "dataloader_drop_last": "the harness's sampler makes the batches (DeepSpeed's data loader is not used)",
}
# DeepSpeed's monitors log from the engine beside the harness's own logging: its W&B fails rank 0 where no API key is
# configured, its files land in the working directory (jobs started there overwrite each other), and it prints
# per-step timing lines. Refused where enabled, naming the harness's way, which writes into the run directory.
MONITORS = {
    "wandb": 'logging.backend = "wandb" (offline in the run directory where no API key is configured)',
    "tensorboard": 'logging.backend = "tensorboard" (RUN/tensorboard/)',
    "csv_monitor": "RUN/metrics.jsonl and RUN/eval.jsonl, which every run writes",
    "comet": 'logging.backend = "wandb" or "tensorboard"',
}
# Sections DeepSpeed 0.19 reads key by key from a plain dict (no model of its own): a misspelled key is dropped
PLAIN_SECTIONS = {
    "flops_profiler": {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
                       "output_file"},
    "checkpoint": {"tag_validation", "load_universal", "use_node_local_storage", "parallel_write", "writer",
                   "checkpoint_serialization"},
}
# zero_optimization keys of DeepSpeed's old spelling, which it still maps: the harness reads the new ones alone
OLD_ZERO = {"cpu_offload": 'offload_optimizer: {"device": "cpu"}', "cpu_offload_param": 'offload_param: {"device": '
            '"cpu"}', "cpu_offload_use_pin_memory": '"pin_memory": true in offload_optimizer or offload_param'}
# Batch keys and clipping: DeepSpeed key -> run key.
RUN_OWNED = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum_steps",
    "train_batch_size": "train.global_batch_size",
    "gradient_clipping": "train.grad_clip",
}


@dataclass(frozen=True)
class DSResolved:
    config: dict[str, Any]      # what goes to deepspeed.initialize (its optimizer and scheduler: `sections`)
    source: dict[str, str]      # dotted DeepSpeed key -> where its value came from
    layout: Layout
    precision: str              # "fp32" | "bf16" | "fp16"
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    grad_accum_steps: int
    global_batch_size: int
    loop_clips: float = 0.0     # > 0: the loop clips to this itself (DeepSpeed's gradient_clipping is then 0)
    autocast: bool = False      # bf16 as torch autocast over fp32 weights (`AUTOCAST`), not DeepSpeed's bf16 wrapper
    sections: Sections = dataclasses.field(default_factory=Sections)  # its optimizer and scheduler sections
    origin: str = "harness default"  # where the strategy came from: the --ds file, accelerate's config, the default
    optimizer_state: tuple[float, str] = (8.0, "AdamW")  # its state's bytes per parameter, its name (state_bytes)

    @property
    def optimizer_kind(self) -> str:
        """The optimizer whose state a checkpoint holds: the type DeepSpeed builds from the file's section, else the
        harness's AdamW or SGD. A state loads only into its own kind (`run.continuity.check_same_optimizer`)."""
        return self.sections.optimizer["type"] if self.sections.optimizer else self.optimizer_state[1]

    @property
    def loop_norms(self) -> bool:
        """ZeRO-0 in fp32 (or bf16 by autocast, which keeps fp32 weights and gradients) without model parallelism
        keeps no gradient norm: the loop computes it (and clips), once, instead of DeepSpeed's own clipping pass plus
        a second pass for the norm."""
        return self.zero_stage == 0 and (self.precision == "fp32" or self.autocast) and \
            self.layout.tp_size == self.layout.pp_size == 1


class KeyTwice(ValueError):
    pass


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if twice := next((k for k in keys if keys.count(k) > 1), None):  # json keeps the last; DeepSpeed refuses it
        raise KeyTwice(f"the key {twice!r} is given twice in one object")
    return dict(pairs)


def _parse(text: str) -> Any:
    """JSON, or what DeepSpeed's own reader (hjson) also takes: comments, trailing commas."""
    try:
        return json.loads(text, object_pairs_hook=_once)
    except json.JSONDecodeError:
        if not text.strip():  # hjson reads nothing as {}
            raise
        try:
            import hjson

            return hjson.loads(text, object_pairs_hook=_once)
        except KeyTwice:
            raise
        except (ImportError, ValueError):  # neither reads it: JSON's own error says where
            pass
        raise


def read_json(path: str | Path) -> dict[str, Any]:
    return read_file(path, "DeepSpeed config", _parse, (json.JSONDecodeError, KeyTwice), "JSON")


SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "ds"  # the repository's DeepSpeed files


def ds_path(name: str) -> str:
    """`--ds`, the same rule in every command: a file's path, or the name of one of configs/ds/*.json (`zero2` or
    `zero2.json`)."""
    if Path(name).is_file() or "/" in name:  # a path: its reader says if it is missing
        return name
    shipped = SHIPPED / (name if name.endswith(".json") else f"{name}.json")
    if shipped.is_file():
        return str(shipped)
    names = ", ".join(sorted(f.stem for f in SHIPPED.glob("*.json"))) or "none here"
    raise ConfigError(f"--ds {name}: neither a file nor one of configs/ds/*.json ({names})")


def resolve_ds(run: Resolved, ds_file: str | None, world_size: int, accel_precision: str = "no",
               accel: dict[str, str] | None = None) -> DSResolved:
    """`accel_precision` is accelerate's mixed_precision ("no", "fp16", "bf16") for this launch; `accel` its
    DeepSpeed settings (`accelerate.settings`, read from this process's environment when None): the strategy where
    no DeepSpeed file is named, else checked against it."""
    given = accelerate.settings() if accel is None else accel
    label, ds = _strategy(ds_file, given)
    source = {k: label for k in flatten(ds)}
    c = run.cfg
    _check_sections(ds, label)
    zero = ds["zero_optimization"]
    _accelerate_auto(zero, given, source)
    _check_types(ds, label)
    _validate_zero(zero, label)
    _validate_precision(ds, label)
    stage = zero.setdefault("stage", 0)
    source.setdefault("zero_optimization.stage", "DeepSpeed default")

    layout, micro_batches = resolve_layout(ds, source, run, world_size, stage, label)
    micro, accum = c.train.micro_batch_size, _accumulation(run, layout.dp_size, micro_batches, label)
    run_values = {
        "train_micro_batch_size_per_gpu": (micro, run.source["train.micro_batch_size"]),
        "gradient_accumulation_steps": (accum, f"pipeline.micro_batches ({label})" if micro_batches is not None
                                        else run.source["train.grad_accum_steps"]
                                        if run.is_set("train.grad_accum_steps") or not c.train.global_batch_size
                                        else "derived from train.global_batch_size"),
        "train_batch_size": (micro * accum * layout.dp_size, "derived: micro x accumulation x data-parallel size"),
        "gradient_clipping": (c.train.grad_clip, run.source["train.grad_clip"]),
    }
    for ds_key, (value, origin) in run_values.items():  # (a global batch is some number of micro x data-parallel)
        _fill(ds, source, ds_key, value, origin, RUN_OWNED[ds_key], label,
              micro * layout.dp_size if ds_key == "train_batch_size" else 1)

    from_accelerate = [(f"accelerate {name}", value, key, accelerate.describe(given))
                       for name, (key, value) in accelerate.run_values(given).items()]
    offload_opt = offload_device(zero.get("offload_optimizer")) not in ("none", None)
    offload_par = offload_device(zero.get("offload_param")) not in ("none", None)
    # optimizer, scheduler: the harness builds them (or has DeepSpeed build its others)
    sections = resolve_sections(ds, run, label, offload_opt, stage, from_accelerate)
    for k in list(source):
        if k.startswith(("optimizer.", "scheduler.")):
            del source[k]

    precision = _resolve_precision(ds, source, label, accel_precision)
    _check_combinations(ds, source, run, stage, offload_opt, offload_par, sections, precision, layout, label)
    _harness_defaults(ds, source, layout)
    autocast, precision = _autocast(ds, source, precision, stage, layout, label)
    resolved = DSResolved(ds, source, layout, precision, stage, offload_opt, offload_par, accum,
                          micro * accum * layout.dp_size, autocast=autocast, sections=sections, origin=label,
                          optimizer_state=state_bytes(sections, run.cfg.optimizer, stage))
    if resolved.loop_norms and ds["gradient_clipping"]:
        resolved = dataclasses.replace(resolved, loop_clips=ds["gradient_clipping"])
        ds["gradient_clipping"] = 0.0
        source["gradient_clipping"] += ("; clipped by the harness loop, which computes the norm ZeRO-0 in fp32 (or bf16 "
                                        "by autocast) keeps none of")
    _deepspeed_reads(ds, label)
    return resolved


def _deepspeed_reads(ds: dict, label: str) -> None:
    """The whole config read by DeepSpeed's own `DeepSpeedConfig`, as each rank's engine will read it, for the
    sections the checks above do not cover (its removed features, the monitors', checkpoint's and compile's keys,
    communication_data_type, ...): its refusal in one line here, not a traceback on every rank."""
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from deepspeed.utils import logger
    from pydantic import ValidationError

    # without train_batch_size DeepSpeed derives it for the world it sees: 1 before a process group, else the group's
    mine = {k: v for k, v in ds.items() if k != "train_batch_size"}
    level = logger.level
    logger.setLevel(logging.ERROR)  # its lines (the world size it reads, its notes) are the engine's to say, once
    try:
        DeepSpeedConfig(copy.deepcopy(mine))
    except ValidationError as e:  # a pydantic model's: the key and why
        err = e.errors()[0]
        why = "it reads no such key there" if err["type"] == "extra_forbidden" else choices_once(err["msg"])
        where = ".".join(map(str, err["loc"])) or e.title.rstrip(".")  # a check of the whole section: its name
        raise ConfigError(f"{where} ({label}): DeepSpeed refuses it: {why}") from None
    except (DeepSpeedConfigError, ValueError, AssertionError, TypeError, KeyError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{label}: DeepSpeed refuses it: {why}") from None
    finally:
        logger.setLevel(level)


def _check_sections(ds: dict, label: str) -> None:
    """Top-level keys DeepSpeed reads, none of them one it would leave unused here; the keys of the sections it reads
    key by key; zero_optimization an object, without DeepSpeed's old spellings."""
    for key, value in ds.items():
        if key not in KNOWN_KEYS:
            close = closest(key, sorted(KNOWN_KEYS))
            hint = f"; did you mean `{close}`?" if close else "; an accelerate config file? name it with " \
                "harness launch --config_file" if key in ("compute_environment", "distributed_type") else ""
            raise ConfigError(f"unknown DeepSpeed key `{key}` ({label}){hint}")
        if key in NOT_APPLIED and _on(value):
            raise ConfigError(f"{key} ({label}) would be ignored: {NOT_APPLIED[key]}; remove it")
        if key in MONITORS and _enabled(value):
            raise ConfigError(f"{key}.enabled ({label}): DeepSpeed's monitor would log from the engine beside the "
                              f"harness's own logging; use {MONITORS[key]}, and remove {key} or set its enabled "
                              f"false")
        for name in (value.keys() - PLAIN_SECTIONS.get(key, value.keys())) if isinstance(value, dict) else ():
            close = closest(name, sorted(PLAIN_SECTIONS[key]))
            raise ConfigError(f"{key}.{name} ({label}): DeepSpeed reads no such key there"
                              f"{f'; did you mean `{close}`?' if close else ''} (it takes "
                              f"{', '.join(sorted(PLAIN_SECTIONS[key]))})")
    ckpt = ds.get("checkpoint")
    if ckpt is not None and not isinstance(ckpt, dict):
        raise ConfigError(f"checkpoint ({label}) must be an object")
    if isinstance(ckpt, dict) and ckpt.get("writer") is not None:  # checked on DeepSpeed 0.19
        raise ConfigError(f"checkpoint.writer ({label}): DeepSpeed's writer engines do not run here: they read "
                          f"launcher variables a harness launch does not set (CROSS_SIZE: a KeyError as the engine is "
                          f"built), and a decoupled one would still be writing when the harness names the checkpoint "
                          f"complete and records its checksums; remove it")
    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization ({label}) must be an object")
    for key in OLD_ZERO.keys() & zero.keys():
        raise ConfigError(f"zero_optimization.{key} ({label}) is DeepSpeed's old spelling, which the harness does not "
                          f"read: write zero_optimization.{OLD_ZERO[key]}")


def _on(value: Any) -> bool:
    """Whether a section asks for anything: a value that is not off (None, false, 0, "auto", empty), an object
    with one such value inside unless its `enabled` is false."""
    if isinstance(value, dict):
        return value.get("enabled") is not False and any(_on(v) for v in value.values())
    return value not in (None, False, 0, "auto", "", [])


def _enabled(section: Any) -> bool:
    """A monitor's `enabled` as DeepSpeed's model reads it (pydantic's bool: "yes" and 1 are true, and it is false
    when left out); one it cannot read as a bool is its reader's to refuse (`_deepspeed_reads`)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return isinstance(section, dict) and TypeAdapter(bool).validate_python(section.get("enabled", False))
    except ValidationError:
        return False


def _strategy(ds_file: str | None, given: dict) -> tuple[str, dict]:
    """Where the strategy comes from and what it says (a copy): the DeepSpeed file, else accelerate's settings,
    else the harness's default."""
    if ds_file:
        label, ds = f"ds file {ds_file}", read_json(ds_file)
        if not isinstance(ds.get("zero_optimization", {}), dict):
            raise ConfigError(f"zero_optimization ({label}) must be an object")
        against = accelerate.contradictions(ds, given)
        if against:
            raise ConfigError(f"{label} contradicts the {accelerate.describe(given)}: {'; '.join(against)}; "
                              f"name the strategy in one of them")
    elif wanted := accelerate.strategy(given):
        label, ds = accelerate.describe(given), wanted
    else:
        label, ds = "harness default", DEFAULT_DS
    return label, copy.deepcopy(ds)


def _accumulation(run: Resolved, dp_size: int, micro_batches: int | None, label: str) -> int:
    """Gradient accumulation: the run's, a pipeline's micro-batches per step, or derived from the global batch;
    checked where two of them are given."""
    micro, accum, glob = run.cfg.train.micro_batch_size, run.cfg.train.grad_accum_steps, run.cfg.train.global_batch_size
    if micro_batches is not None:  # the pipeline section names the micro-batches per step: the accumulation
        if run.is_set("train.grad_accum_steps") and accum != micro_batches:
            raise ConfigError(f"pipeline.micro_batches = {micro_batches} ({label}) contradicts "
                              f"{run.describe('train.grad_accum_steps')}; set one of them, or \"auto\"")
        accum = micro_batches
    if glob:  # derive accumulation from the global batch, or check they agree
        derived, rest = divmod(glob, micro * dp_size)
        if rest or not derived:
            raise ConfigError(f"{run.describe('train.global_batch_size')} is not a multiple of "
                              f"{run.describe('train.micro_batch_size')} x data-parallel size {dp_size}")
        if (run.is_set("train.grad_accum_steps") or micro_batches is not None) and derived != accum:
            given = (f"pipeline.micro_batches = {micro_batches} ({label})" if micro_batches is not None
                     else run.describe("train.grad_accum_steps"))
            raise ConfigError(f"micro batch x accumulation x data-parallel size != global batch: {micro} x {accum} x "
                              f"{dp_size} != {glob} ({given}, {run.describe('train.global_batch_size')})")
        accum = derived
    return accum


def _check_combinations(ds: dict, source: dict, run: Resolved, stage: int, offload_opt: bool, offload_par: bool,
                        sections, precision: str, layout, label: str) -> None:
    """Refuse what DeepSpeed would run wrongly or fail on late; allow the optimizers ZeRO did not test."""
    c = run.cfg
    if offload_par and stage != 3:
        raise ConfigError(f"zero_optimization.offload_param ({label}) needs ZeRO stage 3, got stage {stage}")
    if offload_opt and stage == 0:
        raise ConfigError(f"zero_optimization.offload_optimizer ({label}) needs ZeRO stage 1, 2 or 3, got stage 0")
    if isinstance(ds.get("amp"), dict) and ds["amp"].get("enabled"):
        raise ConfigError(f"amp.enabled ({label}): DeepSpeed has removed its Apex AMP integration (0.19 refuses "
                          f"it at start); use bf16.enabled or fp16.enabled")
    for key in ("offload_optimizer", "offload_param"):
        section = ds["zero_optimization"].get(key)
        if offload_device(section) == "nvme" and not section.get("nvme_path"):
            raise ConfigError(f"zero_optimization.{key}.device = \"nvme\" ({label}) needs "
                              f"zero_optimization.{key}.nvme_path: a directory on a fast local NVMe drive")
    untested = (c.optimizer.name != "adamw" or sections.optimizer) and stage > 0
    if untested and ds.get("zero_allow_untested_optimizer") is False:  # its ZeRO would assert at start, on every rank
        which = run.describe("optimizer.name") if c.optimizer.name != "adamw" else "its optimizer section"
        raise ConfigError(f"zero_allow_untested_optimizer = false ({label}) with {which}: DeepSpeed's ZeRO refuses an "
                          f"optimizer outside its tested list at start; remove the key")
    if untested and "zero_allow_untested_optimizer" not in ds:
        # DeepSpeed lists the optimizers it tested with ZeRO (Adam family, Lamb, ...); SGD is not among them, and
        # the harness's tests show its ZeRO-1 losses equal one process's.
        ds["zero_allow_untested_optimizer"] = True
        source["zero_allow_untested_optimizer"] = f"derived: {run.describe('optimizer.name')}"
    if offload_opt and sections.switches.get("torch_adam"):
        raise ConfigError(f"optimizer.params.torch_adam with zero_optimization.offload_optimizer ({label}): the "
                          f"harness steps offloaded states with DeepSpeed's CPU Adam, not torch's; drop one")
    if offload_opt and c.optimizer.name != "adamw":
        raise ConfigError(f"zero_optimization.offload_optimizer ({label}) runs DeepSpeed's CPU Adam, not "
                          f"{run.describe('optimizer.name')}: use optimizer.name = \"adamw\" or a config without "
                          f"offload")
    if layout.pp_size > 1 and stage == 0 and precision == "fp32" and c.train.grad_clip:
        # PipelineEngine with ZeRO-0 in fp32 clips by the norm of the first stage's gradients only
        # (runtime/utils.py clip_grad_norm_ with the pipeline grid): clipping would silently be wrong.
        raise ConfigError(f"pipeline parallelism with ZeRO stage 0 in fp32 ({label}) clips by the first stage's "
                          f"gradient norm only (a DeepSpeed 0.19 bug); use ZeRO stage 1 (configs/ds/pp2_zero1.json),"
                          f" bf16, or {run.describe('train.grad_clip')} -> 0")


def _harness_defaults(ds: dict, source: dict, layout) -> None:
    """What the harness sets where the file is silent: no train_batch_size under tensor parallelism, none of
    DeepSpeed's own step logging or throughput timer."""
    if layout.tp_size > 1 and "train_batch_size" in ds:
        # DeepSpeed checks train_batch_size against the whole world, counting tensor-parallel peers as data
        # parallel; it derives the same value itself from the two keys below, so it is left out.
        del ds["train_batch_size"]
        source.pop("train_batch_size", None)
    for key, value in {"steps_per_print": 10**9, "wall_clock_breakdown": False}.items():
        if key not in ds:  # DeepSpeed's own step logging would interleave with the progress bar
            ds[key] = value
            source[key] = "harness default"
    if "timers" not in ds:  # its throughput timer synchronizes the device twice a step (DeepSpeed PR #5363: 20-25%
        ds["timers"] = {"throughput": {"enabled": False}}  # of a small model's step) for a figure the loop has
        source["timers.throughput.enabled"] = "harness default: it synchronizes the device twice a step"


ZERO_AUTO = {  # zero_optimization keys HF Trainer and accelerate fill from the model's width (hidden x hidden ...)
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def fill_zero_auto(ds: DSResolved, hidden: int) -> None:
    """The zero_optimization values given as "auto", filled from the model's width as HF Trainer fills them
    (transformers/integrations/deepspeed.py, `trainer_config_finalize`)."""
    zero = ds.config.get("zero_optimization", {})
    for key, rule in ZERO_AUTO.items():
        if zero.get(key) == "auto" and not hidden:
            raise ConfigError(f"zero_optimization.{key} = \"auto\" ({ds.origin}): the model's config names no width "
                              f"(hidden_size or d_model) to fill it from; give a value")
        if zero.get(key) == "auto":
            zero[key] = rule(hidden)
            ds.source[f"zero_optimization.{key}"] = f"auto <- the model's width {hidden} (as HF Trainer fills it)"
    left = [key for key, value in zero.items() if value == "auto"]
    if left:  # DeepSpeed would take its own default where the file seems to ask for a value
        raise ConfigError(f"zero_optimization.{left[0]} = \"auto\" ({ds.origin}): nothing fills it (the width fills "
                          f"{', '.join(ZERO_AUTO)}); give a value or remove the key")


def _fill(ds, source, ds_key, value, origin, run_key, label, unit=1):
    current = ds.get(ds_key, "auto")
    if current == "auto":
        ds[ds_key] = value
        source[ds_key] = f"{'auto <- ' if ds_key in source else ''}{run_key} ({origin})"
    elif current != value:
        # the --set that makes them agree, where one does: not where a pipeline's micro-batches set the value, or
        # for a global batch that is no multiple of micro x data-parallel size
        fix = f": --set {run_key}={json.dumps(current)}" if not origin.startswith("pipeline") and \
            isinstance(current, (int, float)) and (unit == 1 or current % unit == 0) else ""
        raise ConfigError(f"{ds_key} = {current!r} ({label}) contradicts {run_key} = {value!r} ({origin}); "
                          f"set it to \"auto\", or make them agree{fix}")


# The types the harness and DeepSpeed must read alike. DeepSpeed's pydantic models coerce strings ("2" -> 2, "false"
# -> False) where plain Python reads them otherwise (bool("false") is True): a value typed otherwise is refused.
TYPES = {"train_batch_size": ("int", "auto"), "train_micro_batch_size_per_gpu": ("int", "auto"),
         "gradient_accumulation_steps": ("int", "auto"), "gradient_clipping": ("number", "auto"),
         "steps_per_print": ("int",), "wall_clock_breakdown": ("bool",), "fp16.enabled": ("bool", "auto"),
         "bf16.enabled": ("bool", "auto"), "bfloat16.enabled": ("bool", "auto"), "fp16.auto_cast": ("bool",),
         "fp16.loss_scale": ("number",), "fp16.initial_scale_power": ("int",), "fp16.loss_scale_window": ("int",),
         "fp16.hysteresis": ("int",), "fp16.min_loss_scale": ("number",), "pipeline.stages": ("int",),
         "pipeline.micro_batches": ("int", "auto"), "pipeline.activation_checkpoint_interval": ("int",),
         "tensor_parallel.autotp_size": ("int",), "sequence_parallel_size": ("int",)}


WORDS = {"int": "an integer", "number": "a number", "bool": "true or false", "auto": "\"auto\""}


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "number" if math.isfinite(value) else "non-finite number"
    return "auto" if value == "auto" else f"{type(value).__name__}"


def _check_types(ds: dict, label: str) -> None:
    """Every value in TYPES is of a type it allows (an int is a number too), finite and not negative."""
    flat = flatten({k: v for k, v in ds.items() if k != "zero_optimization"})
    for key, allowed in TYPES.items():
        if key not in flat:
            continue
        value, kind = flat[key], _kind(flat[key])
        if kind not in allowed and not (kind == "int" and "number" in allowed):
            want = " or ".join(WORDS[a] for a in allowed)
            why = " (DeepSpeed and Python read a string differently: bool(\"false\") is true)" if kind == "str" else ""
            raise ConfigError(f"{key} = {json.dumps(value)} ({label}) must be {want}{why}")
        if kind in ("int", "number") and value < 0:
            raise ConfigError(f"{key} = {value} ({label}) must be >= 0")


def choices_once(message: str) -> str:
    """A pydantic message listing an enum's values, each once: DeepSpeed's ZeRO stage enum has two names for 3, and
    pydantic says "Input should be 0, 1, 2, 3 or 3"; a validator's own message without pydantic's prefix."""
    message = message.removeprefix("Assertion failed, ").removeprefix("Value error, ")
    head, sep, listed = message.partition("Input should be ")
    if not sep:
        return message
    *rest, last = listed.split(" or ")
    values = list(dict.fromkeys([v for part in rest for v in part.split(", ")] + [last]))
    return head + sep + (", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0])


# zero_optimization keys accelerate fills where a DeepSpeed file says "auto": key -> (its setting, its default)
# (accelerate 1.15, utils/dataclasses.py: DeepSpeedPlugin's __post_init__ and deepspeed_config_process)
ACCELERATE_AUTO = {"stage": ("zero_stage", "2"), "stage3_gather_16bit_weights_on_model_save":
                   ("zero3_save_16bit_model", "false")}
ACCELERATE_AUTO_DEVICE = {"offload_optimizer": "offload_optimizer_device", "offload_param": "offload_param_device"}


def _accelerate_auto(zero: dict, given: dict[str, str], source: dict) -> None:
    """The "auto" values accelerate fills in a DeepSpeed file (the stage, offload, the 16-bit save), filled as it
    fills them: from its settings for this launch, else its defaults."""
    def take(name: str, default: str) -> tuple[str, str]:
        why = f"accelerate {name}" if name in given else f"accelerate's default {name} = {default}"
        return given.get(name, default), f"auto <- {why} (as accelerate fills it)"

    for key, (name, default) in ACCELERATE_AUTO.items():
        if zero.get(key) == "auto":
            value, source[f"zero_optimization.{key}"] = take(name, default)
            zero[key] = int(value) if key == "stage" else value.lower() == "true"
    for key, name in ACCELERATE_AUTO_DEVICE.items():
        if isinstance(zero.get(key), dict) and zero[key].get("device") == "auto":
            zero[key]["device"], source[f"zero_optimization.{key}.device"] = take(name, "none")


def _validate_zero(zero: dict, label: str) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    _validate("zero_optimization", zero, DeepSpeedZeroConfig, label)
    stage = zero.get("stage", 0)  # pydantic reads true as 1 and 2.0 as 2; DeepSpeed passes them on
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise ConfigError(f"zero_optimization.stage = {json.dumps(stage)} ({label}) must be 0, 1, 2 or 3")


def _validate_precision(ds: dict, label: str) -> None:
    """The fp16 and bf16 sections' keys, as DeepSpeed's own models check them (a misspelled key, e.g. `loss_scal`,
    would otherwise fail inside DeepSpeed on every rank, or be dropped)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    for name, model in (("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config),
                        ("bfloat16", DeepSpeedBF16Config)):
        if isinstance(ds.get(name), dict):  # "auto" is filled later (`_resolve_precision`)
            _validate(name, {k: v for k, v in ds[name].items() if v != "auto"}, model, label)


def _validate(name: str, section: dict, model, label: str) -> None:
    """`section` checked by DeepSpeed's pydantic `model`; its first error as one line, with a did-you-mean."""
    import deepspeed
    from pydantic import ValidationError

    try:
        checked = model(**section)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join([name, *map(str, err["loc"])])  # (a check of the whole section has no loc)
        hint, message = "", choices_once(err["msg"])
        if err["type"] == "extra_forbidden":
            message = f"DeepSpeed {deepspeed.__version__} reads no such key here"
            close, fields = closest(str(err["loc"][-1]), model.model_fields), list(model.model_fields)
            hint = f"; did you mean `{close}`?" if close else f"; it takes {', '.join(fields)}" if len(fields) < 12 \
                else ""
        raise ConfigError(f"{key} ({label}): {message}{hint}") from None
    for key, value in section.items():  # DeepSpeed read a string as a number or a switch: the harness would not
        if isinstance(value, str) and value != "auto" and not isinstance(getattr(checked, key, value), str):
            kind = _kind(getattr(checked, key))
            raise ConfigError(f"{name}.{key} = {json.dumps(value)} ({label}) must be {WORDS.get(kind, kind)}, not a "
                              f"string")


def offload_device(section: Any) -> str | None:
    return section.get("device", "none") if isinstance(section, dict) else None


def gpu_has_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _resolve_precision(ds: dict, source: dict, label: str, accel: str) -> str:
    if accel not in ("no", "fp16", "bf16"):
        raise ConfigError(f"accelerate mixed_precision = {accel!r} is not supported with DeepSpeed here; "
                          f"use 'no' and choose the precision in the DeepSpeed config")
    if "bfloat16" in ds:  # DeepSpeed's old spelling
        ds.setdefault("bf16", ds.pop("bfloat16"))
        for key in [k for k in source if k.startswith("bfloat16.")]:
            source["bf16." + key.split(".", 1)[1]] = f"{source.pop(key)} (as bfloat16)"
    if accel in ("fp16", "bf16") and accel not in ds:  # accelerate's DeepSpeedPlugin.set_mixed_precision adds it
        other = ds.get("bf16" if accel == "fp16" else "fp16")
        if not (isinstance(other, dict) and other.get("enabled") is True):  # (both on: refused below, as it does)
            ds[accel] = {"enabled": True}
            source[f"{accel}.enabled"] = f"accelerate mixed_precision={accel!r}, where {label} has no {accel} section"
    enabled = {}
    for name in ("fp16", "bf16"):
        section = ds.get(name)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{name} ({label}) must be an object like {{\"enabled\": true}}")
        value = section.get("enabled", False)
        if value == "auto" and accel != "no":  # accelerate's meaning: follow --mixed_precision
            section["enabled"] = value = accel == name
            source[f"{name}.enabled"] = f"auto, filled from accelerate mixed_precision={accel!r}"
        elif value == "auto":  # no precision asked for: bf16 where the GPU has it, else fp32
            bf16_here = gpu_has_bf16()
            section["enabled"] = value = name == "bf16" and bf16_here
            source[f"{name}.enabled"] = f"auto: {'bf16, the default on this GPU' if bf16_here else 'fp32 here'} " \
                                        f"(accelerate mixed_precision='no')"
        enabled[name] = bool(value)
    if enabled.get("fp16") and enabled.get("bf16"):
        raise ConfigError(f"fp16.enabled and bf16.enabled are both true ({label}); choose one")
    precision = "fp16" if enabled.get("fp16") else "bf16" if enabled.get("bf16") else "fp32"
    if accel != "no" and accel != precision:
        raise ConfigError(f"accelerate mixed_precision = {accel!r} (launch config or --mixed_precision) contradicts "
                          f"the DeepSpeed precision {precision!r} ({label}); set mixed_precision to 'no' and let "
                          f"the DeepSpeed config decide, or make them agree")
    return precision


AUTOCAST = {"enabled": True, "dtype": "bfloat16"}


def _autocast(ds: dict, source: dict, precision: str, stage: int, layout: Layout, label: str) -> tuple[bool, str]:
    """bf16 under ZeRO-0 without model parallelism runs as DeepSpeed's `torch_autocast` (fp32 weights and gradients,
    bf16 matrix multiplies, the optimizer stepping the weights directly), not its bf16 wrapper (FP16_Optimizer), which
    casts every gradient to fp32, tests and copies every parameter back one tensor at a time each step: about 600 of
    lm_demo's 1,400 aten ops a step, where a plain PyTorch step of the same model in bf16 autocast runs 750
    (`harness bench proxy`). The model states take the same 16 bytes a parameter either way (4 + 4 + 8 against
    2 + 2 + 4 + 8); gradients are all-reduced in bf16 as the wrapper's were (`communication_data_type`, unless the
    file sets it). A DeepSpeed file naming `torch_autocast` itself keeps what it says (bf16 only: DeepSpeed's fp16
    autocast scales the loss where the loop cannot see it). (autocast, the precision the run trains in)."""
    given = ds.get("torch_autocast")
    if given is not None:
        if not isinstance(given, dict):
            raise ConfigError(f"torch_autocast ({label}) must be an object like {AUTOCAST}")
        if not given.get("enabled"):
            return False, precision
        if precision != "fp32":
            raise ConfigError(f"torch_autocast.enabled with {precision} ({label}): autocast runs over fp32 weights; "
                              f"disable {precision}.enabled, or torch_autocast")
        if given.setdefault("dtype", "bfloat16") not in ("bfloat16", "bf16", "torch.bfloat16"):  # None: fp16 on a GPU
            raise ConfigError(f"torch_autocast.dtype = {given['dtype']!r} ({label}): the harness runs autocast in "
                              f"bfloat16; for fp16 use fp16.enabled (DeepSpeed's loss scaling)")
        source.setdefault("torch_autocast.dtype", "harness default")
        return True, "bf16"
    if precision != "bf16" or stage != 0 or layout.tp_size > 1 or layout.pp_size > 1:
        return False, precision
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": False}
    ds["torch_autocast"] = dict(AUTOCAST)
    why = "harness: ZeRO-0 bf16 as torch autocast over fp32 weights (one fused optimizer step, no per-parameter casts)"
    source["bf16.enabled"] = source["torch_autocast.enabled"] = source["torch_autocast.dtype"] = why
    if "communication_data_type" not in ds:  # fp32 gradients, all-reduced in bf16 as the bf16 wrapper's were
        ds["communication_data_type"] = "bf16"
        source["communication_data_type"] = "harness: gradients all-reduced in bf16, as under DeepSpeed's bf16 wrapper"
    return True, "bf16"


def model_state_bytes(n_params: int, ds: DSResolved, persistent: int = 0) -> dict[str, int]:
    """Bytes of model states (weights, gradients, optimizer state) per rank, after the ZeRO paper (Rajbhandari et al.
    2020, section 3): with mixed precision 2 (16-bit weights) + 2 (16-bit grads) + 4 (fp32 master) + the optimizer's
    state (AdamW's m and v: 8) bytes per parameter; in fp32 4 + 4 + the state, and 4 more under ZeRO 1-3, whose
    optimizer steps an fp32 copy of its partition beside the weights (DeepSpeed 0.19, stage_1_and_2.py and stage3.py;
    as `run.directory.checkpoint_bytes_per_param` counts it). Stage 1 shards the optimizer part, 2 also the gradients, 3
    also the weights, but for its `persistent` parameters (`persistent_params`), held whole on every rank beside
    their shard. Offloaded parts move from "device" to "cpu", where the offloaded optimizer also keeps an fp32
    gradient of its partition. Activations and buffers are not included."""
    # ZeRO partitions over the data x sequence ranks; autocast keeps fp32 weights and gradients
    n, mixed = ds.layout.dp_size * ds.layout.sp_size, ds.precision != "fp32" and not ds.autocast
    s, state = ds.zero_stage, ds.optimizer_state[0]
    w, g, opt = (2, 2, 4 + state) if mixed else (4, 4, state + (4 if s >= 1 else 0))
    weights = w / n if s >= 3 else w
    whole = w * persistent / max(n_params, 1) if s >= 3 else 0.0  # on the device, offloaded parameters or not
    grads = g / n if s >= 2 else g
    optim = opt / n if s >= 1 else opt
    device, cpu = weights + whole + grads + optim, 0.0
    if ds.offload_optimizer:
        device, cpu = device - optim, cpu + optim + 4 / n
    if ds.offload_params:
        device, cpu = device - weights, cpu + weights
    return {"device": int(device * n_params), "cpu": int(cpu * n_params)}


def persistent_params(sizes: list[int], ds: DSResolved) -> int:
    """ZeRO-3's parameters held whole on every rank (`sizes`: each tensor's elements, in the model's order): those of
    at most zero_optimization.stage3_param_persistence_threshold elements (DeepSpeed's default 1e5), while their sum
    stays within stage3_model_persistence_threshold (deepspeed/runtime/zero/parameter_offload.py,
    `mark_persistent_parameters`, DeepSpeed 0.19)."""
    zero = ds.config.get("zero_optimization", {})
    below, cap = (zero.get(f"stage3_{k}_persistence_threshold", default) for k, default in
                  (("param", 100_000), ("model", sys.maxsize)))
    if ds.zero_stage < 3 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (below, cap)):
        return 0  # "auto": filled from the model's width once it is known (fill_zero_auto); 1e5 reads as 100000
    total = 0
    for size in sizes:
        if size <= below and total + size <= cap:
            total += size
    return total
