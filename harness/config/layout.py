"""How the world is split, as the DeepSpeed JSON names it: data x sequence x tensor x pipeline = world size.

Model parallelism is named in the DeepSpeed file:
- `"tensor_parallel": {"autotp_size": N, "partition_config": {"layer_specs": [...]}}`: DeepSpeed's AutoTP
  training, which splits the Linear layers whose names the specs match (column- or row-parallel). A Hugging
  Face model (`model.hf`) may name no specs: DeepSpeed's built-in policy for its family applies.
- `"pipeline": {...}`: the harness's pipeline section (DeepSpeed reads only the checkpointing keys of it):
    stages                           pipeline stages (1 = off)
    partition                        "parameters" (balance parameter counts) or "uniform" (layer counts)
    micro_batches                    micro-batches per optimizer step; "auto" = the run's accumulation steps
    activation_checkpoint_interval   recompute activations every N layers in the backward pass (0 = off)
    use_reentrant                    DeepSpeed's checkpoint variant; false (the default here) handles the
                                     integer token ids that enter the first stage
  plus DeepSpeed's own `pipe_partitioned` / `grad_partitioned`.
- `"sequence_parallel_size": N`: each sequence split over N ranks by positions (Ulysses; `distributed/sequence.py`),
  data parallel over world / N; the harness's own models, and a Hugging Face model of the lm task.
Combinations DeepSpeed 0.19 does not support are refused here, before any process starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .run import ConfigError, Resolved, closest

PIPELINE_KEYS = ("stages", "partition", "micro_batches", "activation_checkpoint_interval", "use_reentrant",
                 "pipe_partitioned", "grad_partitioned")
PARTITIONS = ("parameters", "uniform")


@dataclass(frozen=True)
class Layout:
    """How the world is split: data x tensor x pipeline = world size.

    Rank placement follows DeepSpeed's groups: under tensor parallelism the tensor rank is the inner index
    (rank = dp * tp + tp_rank: ranks 0,1 hold the two halves of one replica); under pipeline parallelism the
    data rank is (rank = stage * dp + dp_rank: stage 0 is ranks 0..dp-1). Both are never on together.
    """
    world_size: int
    dp_size: int
    tp_size: int = 1
    pp_size: int = 1
    sp_size: int = 1                        # sequence parallel (Ulysses): ranks one sequence is split over
    partition: str = "parameters"           # pipeline only
    checkpoint_interval: int = 0            # pipeline only: activation checkpointing every N layers

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's data-parallel rank, tensor-parallel rank and pipeline stage (and sequence rank)."""
        if self.sp_size > 1:  # DeepSpeed's parallel_state_sp: ranks sp*i .. sp*i + sp - 1 split data shard i
            return {"dp_rank": rank // self.sp_size, "tp_rank": 0, "stage": 0, "sp_rank": rank % self.sp_size}
        if self.tp_size > 1:
            return {"dp_rank": rank // self.tp_size, "tp_rank": rank % self.tp_size, "stage": 0}
        if self.pp_size > 1:
            return {"dp_rank": rank % self.dp_size, "tp_rank": 0, "stage": rank // self.dp_size}
        return {"dp_rank": rank, "tp_rank": 0, "stage": 0}

    def describe(self) -> str:
        sequence = f" x sequence {self.sp_size}" if self.sp_size > 1 else ""
        return (f"data {self.dp_size}{sequence} x tensor {self.tp_size} x pipeline {self.pp_size} = world "
                f"{self.world_size}")


def resolve_layout(ds: dict, source: dict, run: Resolved, world_size: int, stage: int,
            label: str) -> tuple[Layout, int | None]:
    """Tensor and pipeline sizes from the DeepSpeed file, checked against the world and the model; and the
    pipeline's micro-batches per step if it names them."""
    c = run.cfg
    tp = _tensor_parallel(ds, label, hf=bool(c.model.hf))
    pp, partition, interval, micro_batches = _pipeline(ds, source, label)
    sp = _whole(ds.get("sequence_parallel_size", 1), 1, "sequence_parallel_size", label)
    if sp > 1:
        _check_sequence_parallel(ds, sp, tp, pp, world_size, stage, run, label)
    if tp > 1 and pp > 1:
        raise ConfigError(f"tensor_parallel.autotp_size = {tp} and pipeline.stages = {pp} ({label}): DeepSpeed 0.19 "
                          f"cannot combine AutoTP with pipeline parallelism (AutoTP replaces the pipeline grid's "
                          f"process groups; training hangs or aborts); choose one")
    if pp > 1 and stage >= 2:
        raise ConfigError(f"pipeline.stages = {pp} with zero_optimization.stage = {stage} ({label}): ZeRO-2 and "
                          f"ZeRO-3 are incompatible with pipeline parallelism in DeepSpeed (PipelineEngine); use "
                          f"stage 0 or 1 (configs/ds/pp2_zero1.json)")
    if world_size % (tp * pp):
        raise ConfigError(f"the world size {world_size} is not a multiple of tensor_parallel.autotp_size {tp} x "
                          f"pipeline.stages {pp} ({label}); launch a multiple of {tp * pp} processes "
                          f"(accelerate launch --num_processes N; harness plan --world-size N)")
    if tp > 1 and not c.model.hf:  # a Hugging Face model's sizes are in its config: checked by the plan
        d_ff = c.model.d_ff or 4 * c.model.d_model
        for key, value in (("model.n_heads", c.model.n_heads), ("model.d_ff", d_ff)):
            if value % tp:
                raise ConfigError(f"tensor_parallel.autotp_size = {tp} ({label}) must divide {key} = {value} "
                                  f"({run.source[key]}): each rank holds {key.split('.')[1]} / {tp}")
    if pp > c.model.n_layers:
        raise ConfigError(f"pipeline.stages = {pp} ({label}) is more than {run.describe('model.n_layers')}: "
                          f"every stage needs at least one Transformer block; use fewer stages")
    layout = Layout(world_size=world_size, dp_size=world_size // (tp * pp * sp), tp_size=tp, pp_size=pp, sp_size=sp,
                    partition=partition, checkpoint_interval=interval)
    return layout, (micro_batches if pp > 1 and micro_batches != "auto" else None)


def _whole(value, lowest: int, key: str, label: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ConfigError(f"{key} = {value!r} ({label}) must be a whole number >= {lowest}")
    return value


def _pipeline(ds: dict, source: dict, label: str) -> tuple[int, str, int, int | str]:
    """The `pipeline` section, checked: stages, partition, activation checkpoint interval, micro-batches."""
    pipe = ds.get("pipeline", {})
    if not isinstance(pipe, dict):
        raise ConfigError(f"pipeline ({label}) must be an object like {{\"stages\": 2}}")
    for key in pipe:
        if key not in PIPELINE_KEYS:
            close = closest(key, PIPELINE_KEYS)
            raise ConfigError(f"unknown pipeline key `pipeline.{key}` ({label})"
                              f"{f'; did you mean `pipeline.{close}`?' if close else ''}; the keys are "
                              f"{', '.join(PIPELINE_KEYS)}")
    pp = _whole(pipe.get("stages", 1), 1, "pipeline.stages", label)
    partition = pipe.get("partition", "parameters")
    if partition not in PARTITIONS:
        raise ConfigError(f"pipeline.partition = {partition!r} ({label}) must be one of {', '.join(PARTITIONS)}")
    interval = _whole(pipe.get("activation_checkpoint_interval", 0), 0, "pipeline.activation_checkpoint_interval",
                      label)
    micro_batches = pipe.get("micro_batches", "auto")
    if micro_batches != "auto" and (not isinstance(micro_batches, int) or isinstance(micro_batches, bool)
                                    or micro_batches < 1):
        raise ConfigError(f"pipeline.micro_batches = {micro_batches!r} ({label}) must be \"auto\" or a whole "
                          f"number >= 1")
    if pp > 1:
        pipe.setdefault("use_reentrant", False)  # reentrant checkpointing needs a float input to the first stage
        source.setdefault("pipeline.use_reentrant", "harness default")
    return pp, partition, interval, micro_batches


def _check_sequence_parallel(ds: dict, sp: int, tp: int, pp: int, world_size: int, stage: int, run: Resolved,
                             label: str) -> None:
    """What Ulysses sequence parallelism needs of the world and the model, before any process starts."""
    c, key = run.cfg, f"sequence_parallel_size = {sp} ({label})"
    if tp > 1 or pp > 1:
        other = "tensor_parallel.autotp_size" if tp > 1 else "pipeline.stages"
        raise ConfigError(f"{key} with {other} = {max(tp, pp)}: the harness splits the world into data x sequence "
                          f"ranks only (DeepSpeed's parallel_state_sp groups); drop one of them")
    if world_size % sp:
        raise ConfigError(f"{key} does not divide the world size {world_size}; launch a multiple of {sp} processes "
                          f"(accelerate launch --num_processes N; harness plan --world-size N)")
    if c.model.hf and c.run.task != "lm":
        raise ConfigError(f"{key} with model.hf = {c.model.hf!r} and run.task = {c.run.task!r}: DeepSpeed's Hugging "
                          f"Face path drops the attention mask, so it takes causal language models without padding "
                          f"(the lm task); train this task's own model, or without sequence parallelism")
    if stage == 3 and (ds.get("zero_optimization") or {}).get("reduce_scatter", True) is False:
        raise ConfigError(f"{key} with zero_optimization.reduce_scatter = false under ZeRO-3 ({label}): DeepSpeed "
                          f"0.19 then divides a bucket's gradients by the data-parallel size or by data x sequence "
                          f"depending on the bucket's size (stage3.py), so no one loss scale is right; remove the key")
    if c.train.compile:
        raise ConfigError(f"{key} with {run.describe('train.compile')}: compiled blocks around Ulysses' "
                          f"all-to-all are not yet checked against one process; set train.compile=false")
    given = ds.get("train_batch_size")
    per_step = c.train.micro_batch_size * c.train.grad_accum_steps
    if isinstance(given, int) and not isinstance(given, bool) and given == per_step * world_size and \
            not c.train.global_batch_size:
        raise ConfigError(f"train_batch_size = {given} ({label}) counts the sequence-parallel ranks: the {sp} ranks "
                          f"that split a sequence read one batch, so it is micro x accumulation x (world / {sp}) "
                          f"= {per_step * world_size // sp}; or leave it \"auto\"")


def _tensor_parallel(ds: dict, label: str, hf: bool = False) -> int:
    """autotp_size (1 = off) from the `tensor_parallel` section, checked with DeepSpeed's own model."""
    section = ds.get("tensor_parallel")
    if section is None:
        return 1
    if not isinstance(section, dict):
        raise ConfigError(f"tensor_parallel ({label}) must be an object like {{\"autotp_size\": 2, ...}}")
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from pydantic import ValidationError

    try:
        TPTrainingConfig(**section)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"tensor_parallel.{'.'.join(str(x) for x in err['loc'])} ({label}): {err['msg']}") from None
    tp = section.get("autotp_size", 0) or 1
    if tp == 1:
        return 1
    specs = layer_specs(ds)
    if not specs and hf:  # DeepSpeed's AutoTP has built-in policies for Hugging Face model families (e.g. Llama)
        return tp
    if not specs:
        raise ConfigError(f"tensor_parallel.autotp_size = {tp} ({label}) needs partition_config.layer_specs: "
                          f"DeepSpeed has no built-in policy for the harness's models (copy them from "
                          f"configs/ds/tp2_zero1.json)")
    for i, spec in enumerate(specs):
        where = f"tensor_parallel.partition_config.layer_specs[{i}]"
        if not isinstance(spec, dict) or spec.get("partition_type") not in ("column", "row"):
            raise ConfigError(f"{where} ({label}) needs \"partition_type\": \"column\" or \"row\"")
        for pattern in spec.get("patterns", []):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"{where}.patterns: {pattern!r} is not a regular expression: {e}") from None
    return tp


def layer_specs(ds: dict) -> list:
    """`tensor_parallel.partition_config.layer_specs` of a DeepSpeed config ([] if it names none)."""
    return ((ds.get("tensor_parallel") or {}).get("partition_config") or {}).get("layer_specs") or []


def tp_split_params(names: list[str], ds: dict) -> dict[str, str]:
    """Parameter name -> "column" or "row" for the parameters AutoTP splits (a column layer's bias is split
    with its weight; a row layer's bias stays whole)."""
    specs = layer_specs(ds)
    out = {}
    for name in names:
        for spec in specs:
            if any(re.match(p, name) for p in spec.get("patterns", [])):
                out[name] = spec["partition_type"]
                bias = name.removesuffix("weight") + "bias"
                if name.endswith("weight") and spec["partition_type"] == "column" and bias in names:
                    out[bias] = "column"
                break
    return out
