"""Parallelism applied to a plain model: the one module that hands models to DeepSpeed and gets them back.

- Data parallel, ZeRO 0-3, offload, precision: `deepspeed.initialize` with the resolved config.
- Tensor parallel: the same call; DeepSpeed's AutoTP replaces the Linear layers that the config's layer specs
  match (by the models' naming convention, see `models/transformer.py`) with column- or row-parallel ones, in
  place, so the optimizer built before still holds the right parameters. Embeddings, norms and output heads
  stay whole on every rank (replicated): they are small next to the blocks at the sizes AutoTP pays off, and a
  whole head keeps every task's loss code unchanged.
- Pipeline: the model's `pipeline_layers()` (the same modules, so the same initial weights as one process)
  become a `deepspeed.pipe.PipelineModule` whose loss is the task's summed loss times a scale that the loop
  sets before each batch; a shared parameter becomes a tied layer.

`full_state_dict` undoes all of it: the full fp32 (master) weights under the plain model's names.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import warnings
from pathlib import Path

import torch
from torch import nn

from ..config.run import ConfigError
from ..models.pipeline import SharedUse
from . import ds_patches
from .memory import allocation_peak, freed_blocks_returned
from .sequence import hf_ulysses, ulysses
from .world import World, all_gather_objects, barrier


def _build_model(plan, world: World, weights: Path | None = None):
    """The task's plain model (with `weights` loaded: model.init_from's safetensors file, whole, under its names),
    checkpointed, compiled and cut into pipeline stages as the plan says, and what building it took on this rank."""
    cfg = plan.run.cfg
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    partitioned = bool(cfg.model.hf and plan.ds.zero_stage == 3 and cfg.model.zero_init)
    with allocation_peak(world.device) as built:
        if partitioned:
            from .zero3 import zero_init

            with zero_init(plan.ds.config), freed_blocks_returned():
                model = plan.task.build_model(cfg)
        else:
            model = plan.task.build_model(cfg)
        if weights is not None:  # before any split, cast or wrapper: the plain model's names (model.hf is refused)
            _load(model, weights)
    if partitioned and world.is_main:
        loading = getattr(model, "harness_loading", None)  # pretrained weights: how they came in (models/hf.py, distributed/zero3.py)
        print(f"{type(model).__name__} built partitioned over the ranks (ZeRO-3: deepspeed.zero.Init through "
              f"transformers' HfDeepSpeedConfig){f'; weights: {loading}' if loading else ''}")
    if not partitioned and (plan.ds.precision == "fp32" or plan.ds.autocast):
        # fp32 weights, as the config says: a Hugging Face checkpoint saved in bf16 loads as bf16 (transformers'
        # dtype "auto"), and DeepSpeed casts a model only for its 16-bit wrappers; stepped in bf16, small updates
        # would be lost with no fp32 copy to keep them
        model = model.float()
    if cfg.train.activation_checkpointing:
        checkpoint_blocks(model)
    if cfg.train.compile:  # torchtitan's order: checkpointing, then compile, then sharding (ZeRO below)
        from .compile import compile_blocks

        compile_blocks(model, plan.run.buckets, lambda line: world.is_main and print(line, flush=True))
    if plan.ds.layout.pp_size > 1:  # what pipeline parallelism needs of the model: checked by make_plan
        model = pipeline_module(model, plan)
    return model, built


def _load(model: nn.Module, path: Path) -> None:
    """Copy a safetensors file's tensors into the model's of the same names, one at a time: no second copy of the
    model in memory (checked to fit before; a module used twice is saved under one name, and takes it)."""
    from safetensors import safe_open

    with torch.no_grad(), safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        for name, tensor in model.state_dict().items():
            if name in names:
                tensor.copy_(f.get_tensor(name))


def build_engine(plan, world: World, total_steps: int, weights: Path | None = None):
    """The plain model (`weights` loaded), AdamW and the schedule, handed to DeepSpeed with the resolved config."""
    import deepspeed

    from .optim import build_optimizer, make_schedule, param_groups

    cfg, layout = plan.run.cfg, plan.ds.layout
    model, built = _build_model(plan, world, weights)
    ds_patches.import_muon_lazily()
    sections = plan.ds.sections
    # Sequence parallel: DeepSpeed's Ulysses groups as the mpu (made by world.init_world), so ZeRO partitions and
    # reduces over data x sequence ranks (runtime/sequence_parallel/parallel_state_sp.py)
    mpu = {"mpu": importlib.import_module("deepspeed.runtime.sequence_parallel.parallel_state_sp")} \
        if layout.sp_size > 1 else {}
    if sections.optimizer:  # one of DeepSpeed's other optimizers (or torch's, by name): DeepSpeed builds it
        engine, _, _, schedule = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg),
            lr_scheduler=lambda opt: make_schedule(opt, cfg, total_steps, sections),
            config={**plan.ds.config, "optimizer": sections.optimizer}, **mpu)
    else:
        optimizer, schedule = build_optimizer(model, cfg, plan.ds.offload_optimizer, total_steps, sections)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                               config=plan.ds.config, **mpu)
    _check_groups(engine, world)
    engine.harness_build_peak = built  # read by the loop: what building it took on this rank
    engine.harness_split = ulysses(world, plan.ds.zero_stage)  # sequence parallel: the loop splits batches by it
    if engine.harness_split:  # the weights are drawn; now each rank of a sequence group draws its own dropout masks
        torch.manual_seed(cfg.train.seed + 7919 * world.sp_rank)  # (one stream would repeat a mask in every chunk)
    if plan.ds.zero_stage == 0 and layout.dp_size == 1 and layout.pp_size == 1 and layout.sp_size == 1:
        # A lone replica has nothing to average: skip DeepSpeed's gradient all-reduce (a flatten, a collective
        # over one rank and a copy back every step). ZeRO-1/2/3 need their reduce path to fill their partitions.
        engine.enable_backward_allreduce = False
    ds_patches.fewer_step_syncs(engine, layout.tp_size)
    cast = input_cast(plan.ds, engine.module)
    if cast:
        engine.module.register_forward_pre_hook(cast)
    if torch.cuda.is_available() and hasattr(plan.task, "padding"):
        # Padded batches of varying length: cuDNN's attention builds a new plan for every (batch, length) shape it
        # meets, 0.1 to 3 s each, on the host (the multi-second steps of the first GPU suite's translation model);
        # FlashAttention and the memory-efficient kernel need none. See modelscope/FunASR#3704.
        torch.backends.cuda.enable_cudnn_sdp(False)
    # Last, so that `release` (registered once this returns) undoes it: a Hugging Face model's attention function,
    # wrapped process-wide in transformers' table
    engine.harness_undo = hf_ulysses(engine.module, world) if layout.sp_size > 1 and cfg.model.hf else None
    return engine, schedule


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # a plan's precision


def input_cast(ds, module: torch.nn.Module):
    """The forward pre-hook that casts `module`'s floating-point inputs to its 16-bit dtype, or None where none is
    due: DeepSpeed's bf16 and fp16 hold the weights in 16 bits but pass the inputs on as they come (only fp16's
    `auto_cast` casts them), so a task whose positional inputs are fp32 features fails its first matmul. None under
    fp32 or autocast, under a pipeline (its stages take their inputs inside DeepSpeed's schedule, past a hook on the
    whole model), and for a model that sets `casts_own_inputs` (it takes them as they come)."""
    if ds.precision not in ("bf16", "fp16") or ds.autocast or ds.layout.pp_size > 1 or \
            getattr(module, "casts_own_inputs", False):
        return None
    return _float_inputs_as(DTYPES[ds.precision])


def _float_inputs_as(dtype: torch.dtype):
    """Integer inputs (token ids) are left alone."""
    def cast(module, args):
        if any(torch.is_tensor(a) and a.is_floating_point() and a.dtype != dtype for a in args):
            return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return None
    return cast


def release(engine) -> None:
    """Let go of what `build_engine` made. DeepSpeed's gradient hooks hold the model, its optimizer and through them
    every process group in reference cycles that pass through C++, which the collector cannot see; engine.destroy
    removes the hooks, so `world.close_world` can free the groups (and join their threads) while the interpreter is
    still whole. Never raises: it runs on the way out of a failed run too, where the first error is the one to see."""
    undo = getattr(engine, "harness_undo", None)
    if undo:
        undo()
    try:
        engine.destroy()
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"DeepSpeed's engine.destroy failed ({type(e).__name__}: {e}); its process groups live until "
                      f"the process ends")


def nothing_to_recompute(model: nn.Module) -> str:
    return (f"train.activation_checkpointing = true: {type(model).__name__} has nothing to recompute (the harness's "
            f"own Transformer blocks, or a Hugging Face model that checkpoints its layers); it would train as without "
            f"it: leave it out")


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute every Transformer block's activations in backward instead of keeping them (non-reentrant
    checkpointing: integer inputs and ZeRO-3's parameter hooks are fine with it); a Hugging Face model's layers by
    its own gradient checkpointing. A model with neither is refused (the setting did nothing for it)."""
    from torch.utils.checkpoint import checkpoint

    from ..models.transformer import recomputable

    def wrap(forward):
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():  # evaluation and decoding: nothing to save memory on
                return forward(*args, **kwargs)
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run

    blocks, hf_models = recomputable(model)
    for module in blocks:
        module.forward = wrap(module.forward)
    for hf_model in hf_models:  # its own layers (transformers 5 names it activation checkpointing; 4, gradient)
        enable = getattr(hf_model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not blocks and not hf_models:  # refused before launch too (plan.resolve)
        raise ConfigError(nothing_to_recompute(model))


# --- pipeline ----------------------------------------------------------------------------------------------------

class PipelineLoss:
    """The pipeline's loss_fn: the task's summed loss over a micro-batch, times `scale`.

    DeepSpeed averages a pipeline's micro-batch losses over the accumulation steps and the data-parallel ranks;
    the loop sets scale = dp x accumulation / (global item count), so the gradient is that of sum / count, as
    in every other strategy. `labels` is the whole batch (its tensors in key order), rebuilt into a dict."""

    def __init__(self, task):
        self.task, self.keys, self.scale = task, (), 1.0

    def __call__(self, outputs, labels) -> torch.Tensor:
        return self.task.loss_from(outputs, dict(zip(self.keys, labels))) * self.scale


class _Shared(nn.Module):
    """One copy of a shared parameter on a stage that uses it (a DeepSpeed tied layer)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


def pipeline_module(model: nn.Module, plan):
    """`model`'s pipeline layers as a PipelineModule with the plan's stages, partition and checkpointing.

    Every rank builds the whole plain model first (so the weights equal a 1-process run's), then keeps its
    stage's layers on the device; `plain_names` maps each local parameter to its name in the plain model."""
    from deepspeed.pipe import PipelineModule, TiedLayerSpec

    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    layers = []
    for layer in model.pipeline_layers():
        if isinstance(layer, SharedUse):
            layers.append(TiedLayerSpec(layer.key, _Shared, tuple(params[layer.key].shape), tied_weight_attr=["weight"],
                                        forward_fn=lambda mod, x, fn=layer.fn: fn(mod.weight, x, mod.training)))
        else:
            layers.append(layer)
    layout = plan.ds.layout
    rng = torch.get_rng_state()  # building tied layers draws random init: keep the stream a 1-process run has
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints the partition; `harness plan` shows it
        pipe = PipelineModule(layers=layers, num_stages=layout.pp_size, loss_fn=PipelineLoss(plan.task),
                              partition_method=layout.partition,
                              activation_checkpoint_interval=layout.checkpoint_interval,
                              dynamic_shape=True)  # batches differ in length from one micro-batch to the next
    torch.set_rng_state(rng)
    planned = pipeline_partition(model, layout)[0]
    if list(pipe.parts) != planned:  # what `harness plan` showed is what runs
        raise RuntimeError(f"DeepSpeed partitioned the pipeline as {list(pipe.parts)}, the plan as {planned}")
    plain_names = {}
    for name, p in pipe.named_parameters():
        if name.startswith("tied_modules."):  # tied_modules.<key>.weight: a fresh copy, given the plain value
            key = name.split(".")[1]
            with torch.no_grad():
                p.copy_(params[key])
            plain_names[name] = key
        else:
            plain_names[name] = names[id(p)]
    pipe.plain_names = plain_names
    pipe.plain_param_count = len(params)
    return pipe


def pipeline_partition(model: nn.Module, layout) -> tuple[list[int], list[str], list[int], list[str | None]]:
    """Stage boundaries as DeepSpeed's PipelineModule computes them (parts[s]:parts[s+1] are stage s's layers),
    and per layer: its name (its modules in the plain model), its parameter count, its shared parameter's key."""
    from deepspeed.runtime import utils as ds_utils

    module_names = {id(m): n for n, m in model.named_modules()}
    params = dict(model.named_parameters())
    names, counts, shared = [], [], []
    for layer in model.pipeline_layers():
        if isinstance(layer, SharedUse):  # a tied layer counts its parameter at every use, as DeepSpeed does
            names.append(f"{layer.key} (shared)")
            counts.append(params[layer.key].numel())
            shared.append(layer.key)
        else:
            names.append("+".join(module_names[id(m)] for m in layer.children()))
            counts.append(sum(p.numel() for p in layer.parameters()))
            shared.append(None)
    if layout.partition == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(counts), num_parts=layout.pp_size)
    else:
        parts = ds_utils.partition_balanced(weights=counts, num_parts=layout.pp_size)
    return [int(p) for p in parts], names, counts, shared


def pipeline_batch(engine, task, batch: dict[str, torch.Tensor]) -> tuple:
    """(inputs, labels) for one micro-batch: the first stage reads the inputs, the last the labels."""
    inputs = task.inputs(batch)
    engine.module.loss_fn.keys = tuple(sorted(batch))
    return (inputs[0] if len(inputs) == 1 else inputs), tuple(batch[k] for k in sorted(batch))


def pipeline_step(engine, task, micro_batches: list[dict[str, torch.Tensor]], scale: torch.Tensor) -> torch.Tensor:
    """One optimizer step through the pipeline schedule; the step's loss (sum / global count), on every rank."""
    engine.module.loss_fn.scale = scale
    return engine.train_batch(data_iter=iter([pipeline_batch(engine, task, b) for b in micro_batches]))


def pipeline_loss_sum(engine, task, batch: dict[str, torch.Tensor], real: bool) -> torch.Tensor:
    """The summed loss of one evaluation batch, averaged over the data-parallel ranks (DeepSpeed's eval_batch);
    a batch run only to keep ranks in step (`real` false) counts zero."""
    engine.module.loss_fn.scale = 1.0 if real else 0.0
    out = engine.eval_batch(data_iter=iter([pipeline_batch(engine, task, batch)]), num_micro_batches=1)
    return out.reshape(())


# --- consolidation -----------------------------------------------------------------------------------------------

def state_names(model: torch.nn.Module) -> set[str]:
    """The names `full_state_dict` gives a model's weights and persistent buffers: a module used twice (weights
    shared by reusing a layer) once, under its first name, where `state_dict()` names it twice."""
    return {f"{name_m}.{n}" if name_m else n for name_m, module in model.named_modules()
            for n in [*(p for p, _ in module.named_parameters(recurse=False)),
                      *(b for b, _ in module.named_buffers(recurse=False)
                        if b not in module._non_persistent_buffers_set)]}


def full_state_dict(engine, world: World, everywhere: bool = False) -> dict[str, torch.Tensor] | None:
    """The full fp32 (master) weights and the buffers, under the plain model's names, on rank 0 (on every rank
    with `everywhere`). Collective: every rank calls it."""
    if world.pp_size > 1:
        mine = {engine.module.plain_names[n]: _full_fp32(p) for n, p in engine.module.named_parameters()}
        full = {}
        for part in all_gather_objects(mine if world.dp_rank == 0 else {}):  # sync point: one copy per stage
            full.update(part)
        if len(full) != engine.module.plain_param_count:
            raise RuntimeError(f"pipeline consolidation found {len(full)} of {engine.module.plain_param_count} "
                               f"parameters")
    else:
        full = {name: _tp_full(module, pname, p, world)
                for name_m, module in engine.module.named_modules()
                for pname, p in module.named_parameters(recurse=False)
                for name in [f"{name_m}.{pname}" if name_m else pname]}
        full.update({name: buf.detach().cpu()  # persistent buffers: what load_state_dict expects (not e.g. a
                     for name_m, module in engine.module.named_modules()  # rotary table recomputed at build)
                     for bname, buf in module.named_buffers(recurse=False)
                     if bname not in module._non_persistent_buffers_set
                     for name in [f"{name_m}.{bname}" if name_m else bname]})
    barrier()
    return full if everywhere or world.is_main else None


def _fp32(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 master value (on the device) of a parameter, whole over ZeRO's data-parallel shards."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)  # collective under ZeRO; None without a DeepSpeed master copy
    return (param if full is None else full).detach().float()


def _full_fp32(param: torch.nn.Parameter) -> torch.Tensor:
    return _fp32(param).cpu()


def _tp_full(module: nn.Module, pname: str, param, world: World) -> torch.Tensor:
    """A parameter's fp32 value; a tensor-parallel shard is all-gathered along its split dimension."""
    if world.tp_size == 1:
        return _full_fp32(param)
    local = _fp32(param)
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from deepspeed.utils import groups

    dim = 1 if isinstance(module, LinearAllreduce) and pname == "weight" else \
        0 if isinstance(module, LinearLayer) and not isinstance(module, LinearAllreduce) else None
    if dim is None:  # replicated (embeddings, norms, heads, a row layer's bias)
        return local.cpu()
    # shards may be uneven: AutoTP splits a size the group does not divide (a vocabulary of 257 on 2 ranks: 129 and
    # 128; deepspeed/module_inject/tp_shard.py, get_shard_size), and all_gather needs one shape: pad to the largest
    group = groups.get_tensor_model_parallel_group()
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(world.tp_size)]
    torch.distributed.all_gather(sizes, torch.tensor([local.shape[dim]], device=local.device), group=group)
    sizes = [int(n) for n in sizes]
    pad = [0, 0] * (local.dim() - 1 - dim) + [0, max(sizes) - local.shape[dim]]
    padded = torch.nn.functional.pad(local, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in range(world.tp_size)]
    torch.distributed.all_gather(parts, padded, group=group)  # sync
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim).cpu()


def _check_groups(engine, world: World) -> None:
    """The data shards the loop reads must be the ones DeepSpeed averages gradients over."""
    if world.pp_size > 1:
        got = {"dp_rank": engine.grid.data_parallel_id, "stage": engine.stage_id}
    elif world.sp_size > 1:
        from deepspeed.utils import groups

        got = {"sp_rank": groups._get_sequence_parallel_rank()}
    elif world.tp_size > 1:
        from deepspeed.utils import groups

        got = {"dp_rank": groups.get_data_parallel_rank(), "tp_rank": groups.get_tensor_model_parallel_rank()}
    else:
        return
    want = {k: getattr(world, k) for k in got}
    if got != want:
        raise RuntimeError(f"rank {world.rank}: DeepSpeed placed it at {got}, the harness at {want}")
