"""`harness plan`: everything resolved, nothing trained. Prints each value with where it came from."""
from __future__ import annotations

import json

import torch

from ..config.ds import model_state_bytes, persistent_params
from ..config.ds_optim import kernel_missing
from ..config.layout import layer_specs, tp_split_params
from ..config.run import all_keys, flatten, warmup_note
from ..distributed.parallel import pipeline_partition
from ..tasks.interface import check_model
from .resolve import Plan

MAX_RANKS_SHOWN = 16
GPU_MEMORY_GIB = {"H100": 80, "H200": 141}  # SXM datasheets: the GPUs the estimates know


def meta_model(plan: Plan) -> torch.nn.Module:
    if hasattr(plan.task, "prepare"):  # the model's vocabulary may come from the prepared data: prepare it for real
        plan.task.prepare(plan.run.cfg)
    with torch.device("meta"):  # shapes only: no memory, no init time
        model = plan.task.build_model(plan.run.cfg)
    check_model(plan.task, model)
    return model


def count_params(plan: Plan) -> int:
    """The whole model's parameter count, from its shapes alone."""
    return sum(p.numel() for p in meta_model(plan).parameters())


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a step under DeepSpeed's 1F1B TrainSchedule: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def parallel_lines(plan: Plan, model: torch.nn.Module) -> tuple[list[str], int]:
    """The layout, what each rank holds, and the most parameters any rank holds."""
    ds, layout = plan.ds, plan.ds.layout
    n = sum(p.numel() for p in model.parameters())
    lines = [f"layout: {layout.describe()}"]
    holds: dict[int, str] = {}
    per_rank = n
    if layout.tp_size > 1 and plan.run.cfg.model.hf and not layer_specs(ds.config):
        lines.append(f"tensor parallel: AutoTP's own policy for {type(model).__name__} splits it {layout.tp_size} "
                     f"ways (its layers are not counted here: the states per rank below are the whole model's, an "
                     f"upper bound)")
    elif layout.tp_size > 1:
        split = tp_split_params([name for name, _ in model.named_parameters()], ds.config)
        sizes = {name: p.numel() for name, p in model.named_parameters()}
        per_rank = sum(v // layout.tp_size if k in split else v for k, v in sizes.items())
        column = sum(1 for v in split.values() if v == "column")
        lines.append(f"tensor parallel: {len(split)} of {len(sizes)} parameter tensors split {layout.tp_size} ways "
                     f"({column} column-parallel, {len(split) - column} row-parallel; "
                     f"{sum(sizes[k] for k in split):,} of {n:,} parameters); the rest (embeddings, norms, heads, "
                     f"row-parallel biases) replicated on every rank")
        for r in range(layout.world_size):
            c = layout.coords(r)
            holds[r] = f"data shard {c['dp_rank']}, tensor slice {c['tp_rank']} of {layout.tp_size}"
    if layout.pp_size > 1:
        parts, names, counts, shared = pipeline_partition(model, layout)
        m = ds.grad_accum_steps
        lines.append(f"pipeline: {len(names)} layers in {layout.pp_size} stages (partition {layout.partition!r}), "
                     f"{m} micro-batches per step; bubble (p-1)/(m+p-1) = ({layout.pp_size}-1)/({m}+"
                     f"{layout.pp_size}-1) = {bubble_fraction(layout.pp_size, m):.1%} of each step idle "
                     f"(DeepSpeed's 1F1B schedule; more micro-batches shrink it)")
        stage_params = []
        for s in range(layout.pp_size):
            a, b = parts[s], parts[s + 1]
            # a shared parameter is held once per stage however often the stage uses it
            stage_params.append(sum(c for c, key in zip(counts[a:b], shared[a:b]) if not key) +
                                sum(model.get_parameter(key).numel() for key in set(shared[a:b]) - {None}))
            lines.append(f"  stage {s}: layers {a}-{b - 1} ({', '.join(names[a:b])}), {stage_params[-1]:,} parameters")
        per_rank = max(stage_params)
        for r in range(layout.world_size):
            c = layout.coords(r)
            holds[r] = f"stage {c['stage']}, data shard {c['dp_rank']}"
    if layout.sp_size > 1:
        lines += sequence_lines(plan, model)
        for r in range(layout.world_size):
            c = layout.coords(r)
            holds[r] = f"data shard {c['dp_rank']}, positions {c['sp_rank']} of {layout.sp_size} of each sequence"
    if holds:
        shown = list(holds.items())[:MAX_RANKS_SHOWN]
        lines += [f"  rank {r}: {what}" for r, what in shown]
        if len(holds) > len(shown):
            lines.append(f"  ... ({len(holds) - len(shown)} more ranks, same pattern)")
    return lines, per_rank


def activation_bytes(plan: Plan, model: torch.nn.Module, positions: int, sp: int) -> float:
    """Activations of one micro-batch on one rank, on paper: Korthikanti et al. (2022) 34 x T x B x d_model bytes per
    layer in 16-bit, doubled in fp32 (no recomputation; d_ff = 4 d_model; attention scores not stored, as in flash
    attention), with activation checkpointing each layer's input (2 x T x B x d_model in 16-bit) plus one layer's 34;
    and the logits with their fp32 copy and gradient for the loss (B x T x vocab x (2 or 4 + 8), a chunk of
    train.loss_chunk positions where set). T is the positions per rank: positions / sp."""
    c, ds = plan.run.cfg, plan.ds
    b = 4 if ds.precision == "fp32" or ds.autocast else 2
    B, T, C, L = c.train.micro_batch_size, positions / sp, c.model.d_model, c.model.n_layers
    per_layer = 34 * T * B * C * b / 2
    blocks = T * B * C * b * L + per_layer if c.train.activation_checkpointing else per_layer * L
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", 0)
    logit_positions = min(c.train.loss_chunk, B * T) if c.train.loss_chunk else B * T
    return blocks + logit_positions * vocab * (b + 8)


def memory_on_paper(plan: Plan, model: torch.nn.Module) -> tuple[int, float, int] | None:
    """(model states per rank, one micro-batch's activations, its positions) on paper, before the CUDA context and the
    allocator's slack: what a launch on GPUs checks against their memory. None outside the estimates' scope: a task
    whose model the formula does not describe (its `activations_on_paper`: not the translation encoder-decoder, with
    two stacks and cross-attention, PatchTST, which folds channels into the batch, protein sites, a plug-in's model),
    a Hugging Face model (its widths are not the run config's), tensor or pipeline parallelism."""
    ds, c = plan.ds, plan.run.cfg
    described = hasattr(plan.task, "activations_on_paper") and plan.task.activations_on_paper(c)
    if not described or ds.layout.tp_size > 1 or ds.layout.pp_size > 1 or c.model.hf:
        return None
    positions = sample_positions(plan)
    states = model_state_bytes(sum(p.numel() for p in model.parameters()), ds, _persistent(model, ds))["device"]
    return states, activation_bytes(plan, model, positions, ds.layout.sp_size), positions


def _persistent(model: torch.nn.Module, ds) -> int:
    """ZeRO-3's whole-held parameters on one rank, by each tensor's size there (a tensor-parallel rank's slice)."""
    tp = ds.layout.tp_size
    split = tp_split_params([n for n, _ in model.named_parameters()], ds.config) if tp > 1 else {}
    return persistent_params([p.numel() // tp if n in split else p.numel() for n, p in model.named_parameters()], ds)


def persistent_count(plan: Plan) -> int:
    """The parameters ZeRO-3 holds whole on every rank (`config.ds.persistent_params`), from the model's shapes."""
    return _persistent(meta_model(plan), plan.ds) if plan.ds.zero_stage >= 3 else 0


def sample_positions(plan: Plan) -> int:
    """The positions of a sample: the task's `sequence_length` where it has one, else data.seq_len."""
    c = plan.run.cfg
    return plan.task.sequence_length(c)[0] if hasattr(plan.task, "sequence_length") else c.data.seq_len


def sequence_lines(plan: Plan, model: torch.nn.Module) -> list[str]:
    """What sequence parallelism splits, the activations per rank with and without it, and the longest sequence that
    fits the GPUs the scaling estimate knows, on paper."""
    ds, c, sp = plan.ds, plan.run.cfg, plan.ds.layout.sp_size
    if c.model.hf:  # the formula below reads the built-in model's widths (model.d_model, n_layers, n_heads)
        return [f"sequence parallel: each sequence split over {sp} ranks by positions (DeepSpeed's Ulysses for "
                f"Hugging Face models: its heads split {sp} ways); activations on paper are the built-in model's "
                f"alone"]
    fixed = sample_positions(plan)
    n_params, persistent = sum(p.numel() for p in model.parameters()), _persistent(model, ds)
    states = model_state_bytes(n_params, ds, persistent)["device"]
    grows = _params_per_position(plan, n_params)  # a position table: the model grows with the sequence too
    sizes = [n for n in (1, 2, 4, 8) if c.model.n_heads % n == 0]
    lines = [f"sequence parallel: each sequence split over {sp} ranks by positions (DeepSpeed Ulysses: an all-to-all "
             f"of q, k, v before each attention and one after it, each rank attending over every position with "
             f"n_heads / {sp} heads); every rank holds the whole model, ZeRO partitions over data x sequence = "
             f"{ds.layout.dp_size * sp} ranks",
             f"activations per rank, one micro-batch of {c.train.micro_batch_size} x {fixed} positions (on paper: "
             f"Korthikanti et al. 34 T B d_model per layer in 16-bit, the loss's logits B T vocab x (2|4 + 8)): "
             + ", ".join(f"SP={n} {size_text(activation_bytes(plan, model, fixed, n))}" for n in sizes)]
    for name, gib in GPU_MEMORY_GIB.items():
        # in steps of 64 x SP positions: the search `harness bench sweep --largest` runs with real tries
        def fits(t: int, n: int) -> bool:
            at = model_state_bytes(n_params + grows * (t - c.data.seq_len), ds, persistent)["device"] if grows \
                else states
            return at + activation_bytes(plan, model, t, n) <= gib * 2**30

        longest = {n: 64 * n * largest_fitting(lambda k, n=n: fits(64 * n * k, n), 1, 2**30) for n in sizes}
        lines.append(f"longest sequence that fits an {name} ({gib} GiB; model states {size_text(states)} per rank at "
                     f"this length{', growing with it' if grows else ''}; {ds.precision} as resolved here), on "
                     f"paper: " + ", ".join(f"SP={n} {longest[n]:,}" for n in sizes))
    return lines + _mask_note(plan)


def _params_per_position(plan: Plan, n_params: int) -> int:
    """Parameters a position of data.seq_len adds (the built-in model's learned position table: d_model), from the
    model built 64 positions longer on the meta device."""
    import dataclasses

    cfg = plan.run.cfg
    longer = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.data.seq_len + 64))
    with torch.device("meta"):
        grown = sum(p.numel() for p in plan.task.build_model(longer).parameters())
    return max(0, grown - n_params) // 64


def _mask_note(plan: Plan) -> list[str]:
    """data.document_mask's attention is not in the formula: its memory grows with T squared, every rank over
    every position (docs/corpora.md has a measurement)."""
    return ["  not counted above: data.document_mask's attention over a (micro-batch, T, T) mask of every position, "
            "on every rank whatever the sequence split; it grows with T squared (a masked kernel, not flash "
            "attention's)"] if plan.run.cfg.data.document_mask else []


def largest_fitting(fits, start: int, cap: int, resolution: float = 0.0) -> int:
    """The largest k in 1..cap with fits(k) (0 if none), for a fits() that is true up to some k and false after:
    grow from `start` until a failure (doubling; by 1 + resolution when a resolution is given), then bisect
    between the last success and the first failure until they are within `resolution` of the success."""
    good, bad, k = 0, cap + 1, start
    while k <= cap:
        if not fits(k):
            bad = k
            break
        good, k = k, max(k + 1, int(k * (1 + resolution))) if resolution else k * 2
    while bad - good > max(1, good * resolution):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def optimizer_section(plan: Plan) -> dict:
    """The optimizer the harness builds, as a DeepSpeed `optimizer` section."""
    o, switches = plan.run.cfg.optimizer, plan.ds.sections.switches
    if plan.ds.sections.optimizer:  # built by DeepSpeed from the file's section
        return plan.ds.sections.optimizer
    if o.name == "sgd":
        return {"type": "SGD", "params": {"lr": o.lr, "momentum": o.momentum, "nesterov": o.nesterov,
                                          "weight_decay": o.weight_decay}}
    return {"type": "AdamW" if switches.get("adam_w_mode", True) else "Adam",
            "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay,
                       "adam_w_mode": switches.get("adam_w_mode", True), "torch_adam": switches.get("torch_adam",
                                                                                                   False)}}


def ds_json(plan: Plan) -> str:
    """`harness plan --ds-json`: the DeepSpeed config in full, "auto" filled, with the optimizer the harness builds and
    DeepSpeed's scheduler where the file names one (the run file's own schedule has no DeepSpeed section; a total
    step count known only once the data is read stays "auto"), for another tool to take."""
    config = {**plan.ds.config, "optimizer": optimizer_section(plan)}
    if plan.ds.loop_clips:  # the loop clips (DeepSpeed's own clipping is off): written as the run clips, so the file
        config["gradient_clipping"] = plan.ds.loop_clips  # reads back as the same run, here and elsewhere
    if plan.ds.sections.scheduler:
        config["scheduler"] = plan.ds.sections.scheduler
    return json.dumps(config, indent=2)


def start_line(plan: Plan, world, model_name: str, n_params: int, flops_method: str, start_step: int,
               max_steps: int, steps_per_epoch: int, cadence: str, threads: int) -> str:
    """The run's start line (rank 0 prints it): task, model, world, strategy, batch, steps, threads, run directory."""
    ds, t = plan.ds, plan.run.cfg.train
    model_parallel = (f", tensor parallel {world.tp_size}" if world.tp_size > 1 else "") + \
        (f", pipeline {world.pp_size} stages" if world.pp_size > 1 else "") + \
        (f", sequence parallel {world.sp_size}" if world.sp_size > 1 else "")
    offload = (" optimizer-offload" if ds.offload_optimizer else "") + (" param-offload" if ds.offload_params else "")
    return (f"harness: task {plan.run.cfg.run.task}, {model_name} of {n_params:,} parameters "
            f"(FLOPs: {flops_method}) | world {world.world_size} "
            f"(data parallel {world.dp_size}{model_parallel}) | ZeRO-{ds.zero_stage} {ds.precision}"
            f"{' (autocast)' if ds.autocast else ''}{offload} (strategy: {ds.origin}) | "
            f"global batch {ds.global_batch_size} = {t.micro_batch_size} x {ds.grad_accum_steps} x {world.dp_size} | "
            f"steps {start_step}->{max_steps} ({steps_per_epoch} per epoch; {cadence}) | "
            f"CPU threads {threads} | run dir {plan.run_dir}")


def build_report(build_peaks: list[dict], n_params: int) -> str:
    """What building the model took at its peak on each rank, against the whole model's fp32 weights."""
    def mib(key: str) -> str:
        return " / ".join(f"{p[key] / 2**20:,.1f}" for p in build_peaks) + " MiB"

    ranks = "rank 0" if len(build_peaks) == 1 else "ranks " + "/".join(map(str, range(len(build_peaks))))
    device = f"; of tensors on the GPU {mib('device')}" if build_peaks[0]["device"] is not None else ""
    return (f"model built: at its peak it took {mib('host')} of host memory (resident set, an upper bound){device} "
            f"on {ranks}; the whole model's fp32 weights are {4 * n_params / 2**20:,.1f} MiB")


def _memory_line(plan: Plan, model: torch.nn.Module) -> list[str]:
    paper = memory_on_paper(plan, model)
    if paper is None:
        return []
    states, acts, positions = paper
    recompute = "checkpointed" if plan.run.cfg.train.activation_checkpointing else "no recomputation"
    auto = plan.ds.source.get("bf16.enabled", "").startswith("auto:") and plan.ds.precision != "bf16"
    here = f" in {plan.ds.precision} as this host resolves it (an \"auto\" file trains in bf16 on a GPU that has it; " \
        f"--gpus-per-node estimates that)" if auto else ""
    return [f"on a GPU, on paper{here}: model states {size_text(states)} + activations {size_text(acts)} of one "
            f"micro-batch of {plan.run.cfg.train.micro_batch_size} x {positions} positions ({recompute}) = "
            f"{size_text(states + acts)} per rank, before the CUDA context (a launch on GPUs refuses more than they "
            f"hold)", *_mask_note(plan)]


def render(plan: Plan) -> str:
    run, ds = plan.run, plan.ds
    lines = ["# run config (defaults < run file < command line)"]
    for key, value in flatten(run.cfg.to_dict()).items():
        lines.append(f"{key:32} = {json.dumps(value):24} # {run.source[key]}")
    lines.append("")
    lines.append(f"# DeepSpeed config (as passed to deepspeed.initialize), the strategy from the {ds.origin}")
    for key, value in flatten(ds.config).items():
        lines.append(f"{key:48} = {json.dumps(value):14} # {ds.source.get(key, 'DeepSpeed default')}")
    sched = ds.sections.scheduler
    builder = "DeepSpeed" if ds.sections.optimizer else "the harness"
    schedule = f"DeepSpeed {sched['type']}" if sched else \
        f"the harness's schedule.kind = {run.cfg.schedule.kind!r} ({run.source['schedule.kind']})"
    lines.append(f"# optimizer and schedule: {optimizer_section(plan)['type']} (built by {builder}), {schedule}")
    if why := kernel_missing(ds.sections.optimizer, ds.offload_optimizer):
        lines.append(f"# note: DeepSpeed cannot train it on this machine: {why}; a run started here is refused")
    for key, value in flatten({"scheduler": sched} if sched else {}).items():
        lines.append(f"{key:48} = {json.dumps(value):14} # {ds.sections.source.get(key, 'ds file')}")
    lines += [f"# {note}" for note in ds.sections.notes()]
    if not sched and (note := warmup_note(run, run.cfg.train.max_steps)):
        lines.append(f"# {note}")
    model = meta_model(plan)
    n = sum(p.numel() for p in model.parameters())
    layout_lines, per_rank = parallel_lines(plan, model)
    persistent = _persistent(model, ds)
    mem = model_state_bytes(per_rank, ds, persistent)
    state, optimizer = ds.optimizer_state
    whole = f"; ZeRO-3 holds {persistent:,} of them whole on every rank (stage3_param_persistence_threshold)" \
        if persistent else ""
    lines += [
        "",
        f"world size {ds.layout.world_size} (data parallel {ds.layout.dp_size}"
        f"{f', sequence parallel {ds.layout.sp_size}' if ds.layout.sp_size > 1 else ''}); ZeRO stage {ds.zero_stage}, "
        f"{ds.precision}{' (torch autocast over fp32 weights)' if ds.autocast else ''}, "
        f"optimizer offload {'on' if ds.offload_optimizer else 'off'}, "
        f"parameter offload {'on' if ds.offload_params else 'off'}",
        *layout_lines,
        f"global batch {ds.global_batch_size} = micro {run.cfg.train.micro_batch_size} x accumulation "
        f"{ds.grad_accum_steps} x data parallel {ds.layout.dp_size}",
        f"model: {n:,} parameters" + (f", at most {per_rank:,} on one rank" if per_rank != n else ""),
        f"model states per rank (weights, gradients, {optimizer} state of {state:g} bytes a parameter; activations "
        f"not included): device {size_text(mem['device'])}, CPU {size_text(mem['cpu'])}{whole}",
        *_memory_line(plan, model),
        f"run directory: {plan.run_dir}",
    ]
    if hasattr(plan.task, "describe_data"):  # a prepared corpus: its size, a step's tokens, the epochs covered
        line = plan.task.describe_data(run.cfg, ds.global_batch_size)
        lines += [line] if line else []
    return "\n".join(lines)


def render_keys() -> str:
    from ..tasks import PLUGIN_HINT, TASKS, task_data, task_sections

    own = {key: (f, f" ({task} only)") for task, cls in task_data().items()
           for key, f in all_keys({"data": cls}).items() if key not in all_keys()}  # a task's own [data] keys
    lines = []
    for key, (f, owner) in {**{k: (f, "") for k, f in {**all_keys(), **all_keys(task_sections())}.items()},
                            **own}.items():  # the core sections, then each task's
        choices = f.metadata["choices"]
        extra = f" (one of {', '.join(choices)})" if choices else ""
        extra += " [evaluate/translate --set]" if f.metadata.get("scoring") else ""
        lines.append(f"{key:30} {json.dumps(f.default):10} {f.metadata['help']}{extra}{owner}")
    lines += ["", f"run.task: the built-in tasks are {', '.join(TASKS)}; {PLUGIN_HINT}. A plug-in task's own keys "
              f"go in the [task] section (its Config dataclass)."]
    return "\n".join(lines)
