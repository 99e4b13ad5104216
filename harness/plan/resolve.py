"""The plan of a run: the run config, the DeepSpeed config and the task, resolved together and checked for the world
it will run on, before any process starts (`make_plan`). Everything after it (`harness plan`, `harness launch`'s
checks, training) reads the same `Plan`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.ds import SHIPPED, DSResolved, ds_path, fill_zero_auto, resolve_ds
from ..config.layout import layer_specs, tp_split_params
from ..config.run import ConfigError, Resolved, check_training_length
from ..distributed.world import accelerate_mixed_precision, launched_world_size
from ..models.hf import load_config
from ..models.transformer import Attention, Block, recomputable
from ..tasks import Task, get_task, resolve
from ..tasks.interface import check_metrics


@dataclass(frozen=True)
class Plan:
    run: Resolved
    ds: DSResolved
    task: Task
    run_dir: Path


def ds_file_arg(ds_file: str | None) -> str | None:
    """--ds (a path, or a name in configs/ds), else the DeepSpeed file named in the accelerate launch config
    (deepspeed_config_file)."""
    if ds_file is not None and not str(ds_file).strip():  # an unset $DS: not the harness default, silently
        raise ConfigError("--ds is empty: name a DeepSpeed file or one of configs/ds (e.g. zero2), or leave --ds out "
                          "for the harness default (ZeRO-0, fp32)")
    ds_file = ds_path(ds_file) if ds_file else None
    shipped = Path(ds_file or "").name
    if ds_file and not Path(ds_file).exists() and shipped.endswith(".json") and (SHIPPED / shipped).is_file():
        # configs/ds/zero2.json typed from outside the repository: its name works from anywhere
        raise ConfigError(f"{ds_file}: DeepSpeed config not found (from {Path.cwd()}); did you mean --ds "
                          f"{shipped.removesuffix('.json')}, the project's configs/ds/{shipped}")
    from_accelerate = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if ds_file and from_accelerate and Path(ds_file).resolve() != Path(from_accelerate).resolve():
        raise ConfigError(f"--ds {ds_file} contradicts the accelerate launch config's deepspeed_config_file "
                          f"{from_accelerate}; name one")
    return ds_file or from_accelerate


def make_plan(run_file: str | None, overrides: list[str], ds_file: str | None, world_size: int | None = None,
              accel_precision: str | None = None) -> Plan:
    run = resolve(run_file, overrides)
    check_training_length(run.cfg)
    task = get_task(run.cfg.run.task)
    task.check(run.cfg)
    check_selection(run, task)
    check_tracker(run)
    if run.cfg.train.loss_chunk and not hasattr(task, "loss_chunk"):
        raise ConfigError(f"{run.describe('train.loss_chunk')}: task {run.cfg.run.task!r} computes its loss whole "
                          f"(the chunked loss is the lm task's); set it to 0")
    if run.cfg.data.bucket and not hasattr(task, "lengths"):
        raise ConfigError(f"{run.describe('data.bucket')}: task {run.cfg.run.task!r} has samples of one length; "
                          f"bucketing them changes nothing, set it to 0")
    if run.buckets and not hasattr(task, "pad_values"):
        raise ConfigError(f"{run.describe('data.length_buckets')}: task {run.cfg.run.task!r} does not say how to pad "
                          f"its batches (pad_values()); its samples are of one length, so remove the key")
    if run.cfg.train.compile:
        from ..distributed.compile import check_compile

        why = check_compile("cuda" if torch.cuda.is_available() else "cpu")
        if why:
            raise ConfigError(f"{run.describe('train.compile')}: {why}; set it to false")
    ds_args = (ds_file_arg(ds_file), world_size or launched_world_size(), accel_precision or accelerate_mixed_precision())
    ds = resolve_ds(run, *ds_args)
    if ds.sections.adopt:  # the DeepSpeed file's explicit optimizer and schedule values, where the run keeps defaults
        run, first = run.adopting(ds.sections.adopt), ds.sections
        ds = resolve_ds(run, *ds_args)
        ds.sections.keep_notes(first)  # what the file overrode is said from the first pass: now the values agree
    if any(v == "auto" for v in ds.config.get("zero_optimization", {}).values()):
        hf = load_config(run.cfg) if run.cfg.model.hf else None
        fill_zero_auto(ds, (getattr(hf, "hidden_size", None) or getattr(hf, "d_model", None)) if hf else
                       run.cfg.model.d_model)
    if run.cfg.train.activation_checkpointing and ds.layout.pp_size > 1:
        raise ConfigError(f"{run.describe('train.activation_checkpointing')} with a pipeline: set "
                          f"pipeline.activation_checkpoint_interval in the DeepSpeed config instead")
    if run.cfg.train.activation_checkpointing:
        check_recomputable(run, task)
    if run.cfg.train.compile and ds.zero_stage == 3:
        raise ConfigError(f"{run.describe('train.compile')} with ZeRO-3: DeepSpeed gathers each layer's parameters "
                          f"in module hooks that torch.compile does not trace (torch.compiler.disable), so no block "
                          f"compiles whole; use ZeRO-0/1/2 or set train.compile=false")
    if hasattr(task, "check_layout"):  # what the task's own settings need of the layout
        task.check_layout(run.cfg, ds.layout)
    if hasattr(task, "check_batch"):  # else the ranks find out, once started
        task.check_batch(run.cfg, ds.global_batch_size)
    if ds.layout.pp_size > 1 or ds.layout.tp_size > 1:
        check_model_parallel(run, ds, task)
    if ds.layout.sp_size > 1:
        check_sequence_parallel(run, ds, task)
    return Plan(run, ds, task, Path(run.cfg.run.output_dir))


def check_selection(run: Resolved, task: Task) -> None:
    """`train.select_best` names a metric the validation evaluation reports: known before launch for a task whose
    metrics all come from the loss; a task with a field evaluation (`evaluate`) is checked at its first one."""
    name, reported = run.cfg.train.select_best, loss_metric_names(task)
    if name and reported and metric_key(name) not in reported:
        raise ConfigError(f"{run.describe('train.select_best')}: task {run.cfg.run.task!r} reports "
                          f"{', '.join(reported)} at each evaluation (val_loss is loss)")


def loss_metric_names(task: Task) -> list[str] | None:
    """The figures an evaluation of `task` reports where they all come from the mean loss; None for a task with a
    field evaluation of its own (`evaluate`), whose figures are known once it has run."""
    if hasattr(task, "evaluate"):
        return None
    metrics = task.metrics(1.0)
    check_metrics(task, metrics)  # e.g. None: one line before launch, not an AttributeError
    return list(dict.fromkeys(["loss", *(k for k, v in metrics.items() if not isinstance(v, str))]))


def check_tracker(run: Resolved) -> None:
    """A W&B project name W&B refuses (its rules, wandb_settings.validate_project, wandb 0.19-0.31): refused before
    launch, not by the tracker once the run started (which then went on without it). Checked where a run starts,
    not where a finished run's config is read."""
    project = run.cfg.logging.project
    if run.cfg.logging.backend == "wandb" and (not project.strip() or len(project) > 128 or
                                               set(project) & set("/\\#?%:")):
        raise ConfigError(f"{run.describe('logging.project')} is not a W&B project name (1-128 characters, none of "
                          f"/ \\ # ? % :)")


def check_recomputable(run: Resolved, task: Task) -> None:
    """train.activation_checkpointing on a model with nothing it recomputes (a plug-in's own layers): refused here,
    on the model's meta-device twin, not by every rank once launched."""
    from ..distributed.parallel import nothing_to_recompute

    with torch.device("meta"):
        model = task.build_model(run.cfg)
    if recomputable(model) == ([], []):
        raise ConfigError(nothing_to_recompute(model))


def check_model_parallel(run: Resolved, ds: DSResolved, task: Task) -> None:
    """What a pipeline or tensor parallelism needs from the task's model, checked on its meta-device twin: a
    pipeline its `pipeline_layers()`, tensor parallelism parameters that the config's layer specs match."""
    with torch.device("meta"):
        model = task.build_model(run.cfg)
    if ds.layout.tp_size > 1 and run.cfg.model.hf:
        check_hf_tensor_parallel(run, ds.layout.tp_size, load_config(run.cfg), model)
    if ds.layout.pp_size > 1 and not hasattr(model, "pipeline_layers"):
        raise ConfigError(f"{run.describe('run.task')}: its model ({type(model).__name__}) has no pipeline_layers(), "
                          f"which a pipeline needs (the list of layers it cuts into stages; see "
                          f"harness/models/pipeline.py); use a DeepSpeed config without a pipeline section")
    if ds.layout.pp_size > 1:
        check_stages(model, ds.layout)
    if ds.layout.pp_size > 1 and hasattr(model, "ridge_table"):  # models/encoder.py: mixed at the output
        raise ConfigError(f"{run.describe('protein.blend')}: the linear part reads the token ids, which a pipeline's "
                          f"last stage does not see; use a DeepSpeed config without a pipeline section")
    if ds.layout.tp_size > 1 and (layer_specs(ds.config) or not run.cfg.model.hf) and \
            not tp_split_params([n for n, _ in model.named_parameters()], ds.config):
        raise ConfigError(f"tensor_parallel.partition_config.layer_specs match no parameter of {run.describe('run.task')}'s "
                          f"model ({type(model).__name__}); the harness's own models name them blocks.N.attn.q_proj.weight, "
                          f"... (see configs/ds/tp2_*.json): write layer specs for this model's names")




def check_stages(model: torch.nn.Module, layout) -> None:
    """Every pipeline stage of a model built of Transformer blocks holds one. A stage of embeddings alone (the
    "parameters" partition, where a long position table outweighs the blocks) left its ranks in other collectives
    than the rest at the first step: a hang until train.collective_timeout_s."""
    from ..distributed.parallel import pipeline_partition

    layers = model.pipeline_layers()
    holds = [isinstance(layer, torch.nn.Module) and any(isinstance(m, Block) for m in layer.modules())
             for layer in layers]  # (a tied layer's second use, SharedUse, holds no module of its own)
    if not any(holds):  # a plug-in's own layers: not judged
        return
    parts, names, _, _ = pipeline_partition(model, layout)
    for s in range(layout.pp_size):
        a, b = parts[s], parts[s + 1]
        if not any(holds[a:b]):
            raise ConfigError(f"pipeline: the {layout.partition!r} partition gives stage {s} layers {a}-{b - 1} "
                              f"({', '.join(names[a:b]) or 'none'}) and no Transformer block, and its ranks would hang "
                              f"at the first step; set \"partition\": \"uniform\" in the DeepSpeed file's pipeline "
                              f"section, or use fewer stages")


def check_sequence_parallel(run: Resolved, ds: DSResolved, task: Task) -> None:
    """What sequence parallelism needs of the task (how its batches split) and its model (attention the harness
    splits: `models/transformer.py`'s), checked on the model's meta-device twin."""
    sp, name = ds.layout.sp_size, run.describe("run.task")
    key = f"sequence_parallel_size = {sp} ({ds.origin})"
    if not hasattr(task, "sequence_split"):
        raise ConfigError(f"{key}: {name} does not say how its batches split over positions (sequence_split(); see "
                          f"harness/tasks/lm.py); train without sequence parallelism")
    if hasattr(task, "sequence_length"):
        n, keys = task.sequence_length(run.cfg)
        if n % sp:
            raise ConfigError(f"{key} must divide the {n} positions of each sample "
                              f"({', '.join(run.describe(k) for k in keys)}): each rank holds n / {sp} of them")
    if run.cfg.model.hf:  # DeepSpeed's HF path (distributed/sequence.py, hf_ulysses): the heads split
        config = load_config(run.cfg).get_text_config()
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if isinstance(heads, int) and heads % sp:
            raise ConfigError(f"{key} must divide num_attention_heads = {heads} of {run.describe('model.hf')}")
        if isinstance(kv, int) and kv % sp and sp % kv:  # DeepSpeed splits the key/value heads or replicates them
            raise ConfigError(f"{key} and num_key_value_heads = {kv} of {run.describe('model.hf')}: one must divide "
                              f"the other")
        return
    with torch.device("meta"):
        model = task.build_model(run.cfg)
    heads = {m.q_proj.out_features // m.head_dim for m in model.modules() if isinstance(m, Attention)}
    if not heads:
        raise ConfigError(f"{key}: {name}'s model ({type(model).__name__}) has no attention the harness can split "
                          f"(harness.models.transformer.Attention); train without sequence parallelism")
    if bad := sorted(h for h in heads if h % sp):  # (asked of the model: a plug-in's may have heads of its own)
        what = run.describe("model.n_heads") if heads == {run.cfg.model.n_heads} else f"its attention's {bad[0]} heads"
        raise ConfigError(f"{key} must divide {what}: each rank attends with n_heads / {sp} heads over the whole "
                          f"sequence")


def check_hf_tensor_parallel(run: Resolved, tp: int, config, model: torch.nn.Module | None = None) -> None:
    """Each tensor-parallel rank holds 1/tp of a Hugging Face model's heads and MLP width: tp must divide them. The
    vocabulary need not divide: AutoTP splits the output layer's rows unevenly (257 on 2 ranks: 129 and 128) and the
    export gathers them so (`distributed.parallel._tp_full`); each rank needs one row at least."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp:
            raise ConfigError(f"tensor_parallel.autotp_size = {tp} must divide {key} = {value} of "
                              f"{run.describe('model.hf')}: each rank holds {key} / {tp}")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab < tp:
        raise ConfigError(f"tensor_parallel.autotp_size = {tp} is more than vocab_size = {vocab} of "
                          f"{run.describe('model.hf')}: each rank holds a share of the output layer's rows")
    base = _base_model_class(config)
    if base is not None:
        from deepspeed.module_inject.auto_tp import AutoTP

        if not AutoTP.supported(f": {base}"):  # DeepSpeed's own list, read as it reads a model's repr
            raise ConfigError(f"tensor_parallel.autotp_size = {tp}: DeepSpeed's AutoTP does not support "
                              f"{config.model_type!r} models ({run.describe('model.hf')}; it has a kernel-injection "
                              f"policy for them instead); train it without tensor parallelism")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = model.get_output_embeddings() if model is not None and hasattr(model, "get_output_embeddings") else True
    if getattr(text, "tie_word_embeddings", False) and head is not None:  # AutoTP (DeepSpeed 0.19) then leaves the
        # logits split by rank; a class without an output layer over the vocabulary (a classifier) ties nothing
        raise ConfigError(f"tensor_parallel.autotp_size = {tp}: {run.describe('model.hf')} ties its output layer to "
                          f"its input embeddings (tie_word_embeddings = true), which DeepSpeed's AutoTP does not "
                          f"split as one (each rank's logits cover its share of the vocabulary); train it without "
                          f"tensor parallelism, or save it untied (tie_word_embeddings = false, its own lm_head)")


def _base_model_class(config) -> str | None:
    """The name of a config's base model class (GPT2Model for a GPT-2 config), as AutoTP reads it; None if unknown."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    except ImportError:
        return None
    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    return name if isinstance(name, str) and name.endswith("Model") else None


def metric_key(name: str) -> str:
    """The key in an evaluation's metrics: `val_loss` is the validation loss, reported as `loss`."""
    return "loss" if name == "val_loss" else name
