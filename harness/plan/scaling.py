"""Scaling beyond one machine, on paper: per-GPU memory and step time of the resolved strategy on G x N GPUs.

`harness plan --gpus-per-node G --nodes N --interconnect NAME [--profile bench.json]` prints this; nothing is
measured here except what a `harness bench` profile brings. Every assumption is printed as an "assume:" line.

The world W = G N is split as data x tensor x pipeline (dp = W / (tp pp)); the plan's micro batch B and
accumulation m are kept, so the global batch B m dp grows with dp. Per GPU per optimizer step, a ring moves
    all-reduce      2 (n-1)/n S        reduce-scatter, all-gather   (n-1)/n S        (S: full buffer, n ranks)
Data parallel over dp ranks, Psi' = Psi / (tp pp) parameters per model-parallel rank, b bytes per element:
    ZeRO 0, 1, 2: 2 (dp-1)/dp Psi' b per pass (2: reduce-scatter grads + all-gather params)   (ZeRO paper:
    ZeRO 3:       3 (dp-1)/dp Psi' b per pass (all-gather in forward and backward, reduce-scatter)  2 vs 3 Psi)
    DeepSpeed reduces at the accumulation boundary for stages 0, 1 (one pass per step) but in every
    micro-batch for stage 2 (m reduce-scatters + one all-gather) and stage 3 (m passes).
Tensor parallel (Megatron): per layer and micro-batch, 2 all-reduces of (B, seq, d_model) forward + 2 backward.
Pipeline: compute x (m + p - 1) / m (1F1B bubble), plus a (B, seq, d_model) send per micro-batch per stage
    boundary forward and one backward.
Offload: the interconnect volume is unchanged; PCIe carries the GPU's gradient shard to the CPU and the
    updated parameter shard back, 2 Psi'/dp b per step (plus 2 m Psi'/dp b with parameter offload).
Time of a transfer = bytes / (efficiency x per-GPU bandwidth of the slowest link the group crosses).
Compute: a profile's single-GPU step scaled to the planned samples per GPU, else 6 Psi tokens / (MFU x peak).
Step time: upper bound without overlap; lower bound with the data-parallel traffic hidden behind backward.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.ds import DSResolved, model_state_bytes
from ..config.layout import Layout
from ..config.run import ConfigError, parse_override, read_file
from .render import GPU_MEMORY_GIB, persistent_count

if TYPE_CHECKING:
    from .resolve import Plan

# Dense (no sparsity) peak TFLOP/s per GPU, from the vendors' datasheets, by a substring of the device name.
# fp32 is the plain (non-tensor-core) rate: PyTorch does not use TF32 for matmuls unless told to.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},   # SXM5 (H100 80GB HBM3)
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}


@dataclass(frozen=True)
class Link:
    bytes_per_s: float      # nominal, per GPU, one direction
    source: str


# Sources: NVIDIA H100/A100 datasheets (NVLink 900/600 GB/s bidirectional), PCI-SIG (16/32 GT/s x16 lanes,
# 128b/130b), InfiniBand NDR/HDR line rates; DGX H100/A100 give every GPU its own 400/200 Gb/s NIC.
LINKS = {
    "nvlink4": Link(450e9, "H100 SXM NVLink 4: 18 links x 25 GB/s"),
    "nvlink3": Link(300e9, "A100 SXM NVLink 3: 12 links x 25 GB/s"),
    "pcie5": Link(63e9, "PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130"),
    "pcie4": Link(31.5e9, "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130"),
    "ib-ndr400": Link(50e9, "InfiniBand NDR 400 Gb/s, one NIC per GPU (DGX H100)"),
    "ib-hdr200": Link(25e9, "InfiniBand HDR 200 Gb/s, one NIC per GPU (DGX A100)"),
    "ethernet-100g": Link(12.5e9, "100 Gb/s Ethernet, one port per GPU (one port per node: divide by G)"),
}
EFFICIENCY = 0.8            # achieved / nominal bandwidth for large messages (NCCL bus bandwidth is typically 75-90%)
HOST_LINK = "pcie5"         # GPU <-> CPU for offload: H100's host interface


@dataclass(frozen=True)
class GPU:
    flops_16bit: float      # dense bf16/fp16 tensor-core FLOP/s
    flops_fp32: float       # plain fp32 (PyTorch keeps fp32 matmuls off TF32 by default)
    memory: int             # bytes


def _gpu(name: str, memory_gib: int) -> GPU:  # the peak rates are bench's datasheet table
    return GPU(PEAK_TFLOPS[name]["bf16"] * 1e12, PEAK_TFLOPS[name]["fp32"] * 1e12, memory_gib * 2**30)


GPUS = {name: _gpu(name, gib) for name, gib in GPU_MEMORY_GIB.items()}
DEFAULT_GPU = "H100"


def collective_bytes(kind: str, n: int, size_bytes: float) -> float:
    """Bytes one rank sends in a ring collective over n ranks on a buffer of size_bytes (the full buffer)."""
    if kind == "all-reduce":
        return 2 * (n - 1) / n * size_bytes
    if kind in ("reduce-scatter", "all-gather"):
        return (n - 1) / n * size_bytes
    if kind == "p2p":
        return float(size_bytes) if n > 1 else 0.0
    raise ValueError(f"unknown collective {kind!r}")


def zero_volume_bytes(stage: int, n_dp: int, params: float, bytes_per_elem: int) -> float:
    """One pass of ZeRO's data-parallel traffic per GPU (the paper's 2 Psi for stages 0-2, 3 Psi for stage 3)."""
    size = params * bytes_per_elem
    if stage in (0, 1, 2):  # all-reduce; stage 2 as reduce-scatter + all-gather, the same bytes
        return collective_bytes("all-reduce", n_dp, size)
    if stage == 3:  # all-gather (forward), all-gather (backward), reduce-scatter (gradients)
        return 2 * collective_bytes("all-gather", n_dp, size) + collective_bytes("reduce-scatter", n_dp, size)
    raise ValueError(f"ZeRO stage {stage} is not 0-3")


def zero_step_bytes(stage: int, n_dp: int, params: float, bytes_per_elem: int, micro_batches: int) -> float:
    """Per optimizer step as DeepSpeed issues it: stages >= 2 communicate in every micro-batch."""
    one = zero_volume_bytes(stage, n_dp, params, bytes_per_elem)
    if stage == 2:  # m reduce-scatters of gradients, one all-gather of the updated parameters
        return (micro_batches + 1) / 2 * one
    return micro_batches * one if stage == 3 else one


def tp_step_bytes(tp: int, layers: int, micro_batches: int, activation_bytes: float) -> float:
    """Megatron tensor parallel: 4 all-reduces (2 forward, 2 backward) of one (B, seq, d_model) per layer."""
    return 4 * layers * micro_batches * collective_bytes("all-reduce", tp, activation_bytes)


def bubble_factor(stages: int, micro_batches: int) -> float:
    """1F1B: m micro-batches through p stages take m + p - 1 slots instead of m."""
    return (micro_batches + stages - 1) / micro_batches


def parse_interconnect(name: str) -> tuple[str, str]:
    """"INTER" (intra-node is nvlink4) or "INTRA:INTER" -> (intra, inter) preset names."""
    intra, _, inter = name.rpartition(":")
    intra = intra or "nvlink4"
    for n in (intra, inter):
        if n not in LINKS:
            raise ConfigError(f"--interconnect {name}: unknown link {n!r}; the presets are {', '.join(LINKS)} "
                              f"(give INTER, or INTRA:INTER such as pcie4:ethernet-100g)")
    return intra, inter


@dataclass(frozen=True)
class Profile:
    step_s: float           # median seconds per optimizer step on one process
    samples: int            # samples per step there
    micro: int              # samples per forward there
    seq: int | None         # tokens per sample there, when the entry's `sets` name data.seq_len
    params: int
    peak_mem: int
    precision: str
    device: str
    name: str
    activations: int = 0    # measured: the first micro-batch's saved activations (a CPU's peak holds the process)


def read_profile(path: str | Path, precision: str, run=None) -> Profile:
    """The single-process "ok" entry of a `harness bench` file, preferring one whose compared values (its `sets`,
    e.g. train.activation_checkpointing=true) are the run's (`run`, a Resolved), then the plan's precision."""
    data = read_file(path, "bench profile", json.loads, json.JSONDecodeError, "JSON")
    configs = data.get("configs")
    if not isinstance(configs, list):
        raise ConfigError(f"{path}: not a bench.json from `harness bench` (no `configs` list)")
    ok = [c for c in configs if isinstance(c, dict) and c.get("nproc") == 1 and c.get("status") == "ok"]
    if not ok:
        raise ConfigError(f"{path}: no entry with \"nproc\": 1 and \"status\": \"ok\"; bench one process first")
    e = min(ok, key=lambda c: (not _agrees(c, run), c.get("precision") != precision))  # (the first, of equals)
    try:  # the entry's micro batch and length, else the bench's own run-config overrides "section.key=value"
        sets = dict(str(x).split("=", 1) for x in e.get("sets", []) if "=" in str(x))
        samples = int(e["global_batch"])
        seq = e.get("seq_len", sets.get("data.seq_len"))
        p = Profile(float(e["step_s"]["median"]), samples,
                    int(e.get("micro_batch", sets.get("train.micro_batch_size", samples))),
                    int(seq) if seq is not None else None, int(e["params"]),
                    int(e.get("peak_mem_bytes") or 0), str(e.get("precision", "?")),
                    str((data.get("device") or {}).get("name", "unknown device")), str(e.get("name", "")),
                    int(e.get("activation_bytes") or 0))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(f"{path}: the nproc=1 entry lacks step_s.median, global_batch or params ({err!r})") from None
    if min(p.step_s, p.samples, p.micro, p.params, p.seq or 1) <= 0:
        raise ConfigError(f"{path}: the nproc=1 entry has a non-positive step time, batch or parameter count")
    return p


def _agrees(entry: dict, run) -> bool:
    """Whether each value a bench entry was measured with (its "section.key=value" sets) is the run's own."""
    if run is None:
        return True
    for item in entry.get("sets") or []:
        try:  # read as --set reads it (a bare word is a string)
            key, want = parse_override(str(item))
            have = run.value(key)
        except (ConfigError, ValueError, AttributeError):  # not section.key=value, a key of another task
            return False
        if key in ("data.seq_len", "train.micro_batch_size"):  # the estimate scales the profile by these
            continue
        if have != (tuple(want) if isinstance(have, tuple) and isinstance(want, list) else want):
            return False
    return True


def offload_bytes(shard: float, bytes_per_elem: int, micro_batches: int, optimizer: bool, params: bool) -> float:
    """PCIe bytes per GPU per step for a GPU owning `shard` parameters: gradients out and updated parameters back
    (optimizer offload), plus fetching the parameters for each micro-batch's forward and backward (parameter
    offload, stage 3)."""
    return 2 * shard * bytes_per_elem * (optimizer + micro_batches * params)


def _placement(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """Whether any data-parallel group, tensor-parallel group or pipeline spans nodes (node = rank // G), from
    the layout's own rank placement."""
    nodes: dict[tuple, set[int]] = {}
    for r in range(layout.world_size):
        c = layout.coords(r)
        for key in (("dp", c["tp_rank"], c["stage"]), ("tp", c["dp_rank"], c["stage"]), ("pp", c["dp_rank"])):
            nodes.setdefault(key, set()).add(r // gpus_per_node)
    return {kind: any(len(v) > 1 for k, v in nodes.items() if k[0] == kind) for kind in ("dp", "tp", "pp")}


def _states(n_params: float, ds: DSResolved, layout: Layout, persistent: float = 0, **change) -> dict[str, int]:
    """model_state_bytes for `layout`'s data-parallel size (it shards over ds.layout.dp_size)."""
    return model_state_bytes(int(n_params), dataclasses.replace(ds, layout=layout, **change), int(persistent))


def target_precision(ds: DSResolved, gpu: str | None) -> tuple[str, str]:
    """The precision the target GPU trains this DeepSpeed file in, and why. A file whose bf16.enabled is "auto"
    (with accelerate's mixed_precision "no") trains in bf16 on a GPU that has it, whatever this host resolved it
    to: planning an H100 run on a CPU host must not estimate it in fp32."""
    auto = ds.source.get("bf16.enabled", "").startswith("auto:")
    if gpu and auto:
        return "bf16", (f"the DeepSpeed file leaves it \"auto\", which is bf16 on {gpu}"
                        + (f" (this host resolved it to {ds.precision})" if ds.precision != "bf16" else ""))
    if gpu is None and auto:
        return ds.precision, "the DeepSpeed file leaves it \"auto\" and the target GPU is unknown: as on this host"
    return ds.precision, "as the DeepSpeed file or accelerate's mixed_precision pins it"


@dataclass(frozen=True)
class Scaling:
    """The estimate for one strategy on G x N GPUs; seconds and bytes are per GPU per optimizer step."""
    layout: Layout
    spans: dict[str, bool]      # "dp"/"tp"/"pp" -> the group crosses nodes
    volume: dict[str, float]    # bytes sent: "data parallel", "tensor parallel", "pipeline sends", "offload PCIe"
    seconds: dict[str, float]   # the same transfers in seconds
    compute_s: float            # including the pipeline bubble
    lower_s: float              # data-parallel traffic hidden behind compute
    upper_s: float              # nothing overlapped
    states: dict[str, int]      # model_state_bytes: "device", "cpu"
    activations: float
    gpu: str | None             # a GPUS key, None if unknown
    one_gpu_s: float            # the same micro batch and accumulation on one GPU
    one_gpu_mem: float
    assumptions: list[str]


def _check_world(G: int, nodes: int, mfu: float, tp: int, pp: int, sp: int = 1) -> None:
    world = G * nodes
    if G < 1 or nodes < 1 or not 0 < mfu <= 1:
        raise ConfigError(f"--gpus-per-node {G} and --nodes {nodes} must be at least 1, the MFU {mfu} in (0, 1]")
    if sp > 1:  # its all-to-all and split activations are not in the model: figures of a world that is not there
        raise ConfigError(f"--gpus-per-node: the estimate on paper does not model sequence parallelism "
                          f"(sequence_parallel_size = {sp}); plan it without --gpus-per-node (the plan's own sequence "
                          f"lines say what it splits), or estimate the layout without it")
    if world % (tp * pp):
        raise ConfigError(f"{G} GPUs x {nodes} nodes = {world} is not a multiple of tensor parallel {tp} x pipeline "
                          f"{pp} (the plan's strategy)")
    if G % tp:
        raise ConfigError(f"tensor-parallel size {tp} must divide --gpus-per-node {G}: its per-layer all-reduces "
                          f"need the intra-node link, so a tensor-parallel group must fit inside one node")


def _link_assumptions(ds, intra: str, inter: str, nodes: int, b: int, b_act: int, m: int, share: float) -> list[str]:
    """The estimate's assumptions about the links, the collectives and the volumes they carry."""
    return [f"links at {EFFICIENCY:.0%} of nominal per GPU per direction, latency ignored: intra-node {intra} "
            f"{LINKS[intra].bytes_per_s / 1e9:g} GB/s ({LINKS[intra].source}), inter-node {inter} "
            f"{LINKS[inter].bytes_per_s / 1e9:g} GB/s ({LINKS[inter].source}){' (unused: one node)' * (nodes == 1)}",
            "ring collectives; a group that spans nodes runs at the inter-node bandwidth per GPU (hierarchical and "
            "tree algorithms ignored)",
            f"gradients and parameters communicated in {b} bytes, activations in {b_act} (training precision "
            f"{ds.precision}, communication_data_type {ds.config.get('communication_data_type', 'unset')})",
            f"ZeRO-{ds.zero_stage} data-parallel volume per pass " + ("3 (dp-1)/dp Psi b (ZeRO paper: 1.5x data "
            "parallel)" if ds.zero_stage == 3 else "2 (dp-1)/dp Psi b (ZeRO paper: as data parallel)") + "; " +
            ("one pass per step (reduced at the accumulation boundary)" if ds.zero_stage < 2 else
             f"gradients reduced in each of the {m} micro-batch(es) (DeepSpeed, stage >= 2)"),
            f"model-parallel shares split evenly: Psi / (tp pp) = {share:,.0f} parameters per rank (replicated "
            f"embeddings and norms ignored)"]


def _activations(profile, n_params: int, ds, micro: int, seq_ratio: float, positions_bytes: float,
                 checkpointing: int, assumptions: list[str], recomputed_layers: int = 0) -> float:
    """One GPU's activation bytes of a micro-batch on one model-parallel rank before the split: from the profile's
    peak memory where it is usable, else Korthikanti et al.'s count (`recomputed_layers`: train.activation_
    checkpointing's, which keeps each layer's input and one layer's whole at a time); says which in `assumptions`."""
    if profile and profile.params == n_params and profile.activations > 0:
        assumptions.append(f"activations from the profile: {profile.activations / 2**30:.3g} GiB measured for micro "
                           f"batch {profile.micro} scaled to {micro} and by seq, split by (10 + 24/tp)/34 and "
                           f"min(p, m)/p")
        return profile.activations * micro / profile.micro * seq_ratio
    own = profile.peak_mem - _states(n_params, ds, Layout(1, 1), precision=profile.precision)["device"] \
        if profile and profile.params == n_params and "cpu" not in profile.device.lower() else 0
    if own > 0:  # a GPU's peak: the CUDA allocator's, the process's own memory apart
        assumptions.append(f"activations from the profile: peak memory {profile.peak_mem / 2**30:.2f} GiB minus its "
                           f"model states, for micro batch {profile.micro} (its train.micro_batch_size, else its "
                           f"global batch) scaled to {micro} and by seq, split by (10 + 24/tp)/34 and min(p, m)/p")
        return own * micro / profile.micro * seq_ratio
    if recomputed_layers:  # as `render.activation_bytes` counts it for one GPU
        assumptions.append("activations with train.activation_checkpointing: each layer's input (2 x seq x B x "
                           "d_model bytes in 16-bit) and one layer's 34 recomputed at a time (Korthikanti et al. "
                           "2022, d_ff = 4 d_model, logits ignored)" + (" because the profile's model differs or its "
                                                                       "peak memory is unusable" if profile else ""))
        return positions_bytes + 34 * positions_bytes / 2 / recomputed_layers
    assumptions.append("activations 34 x seq x B x d_model x layers bytes in 16-bit, doubled in fp32 (Korthikanti et "
                       "al. 2022, no recomputation, d_ff = 4 d_model, attention scores not stored, logits ignored)"
                       + (" because the profile's model differs or its peak memory is unusable" if profile else "")
                       + ("; an upper bound with activation checkpointing on" if checkpointing else ""))
    return 34 * positions_bytes / 2


def _model_parallel_assumptions(ds, tp: int, pp: int, m: int, intra: str) -> list[str]:
    A = []
    if tp > 1:
        A.append(f"tensor parallel: 4 all-reduces of (B, seq, d_model) per layer and micro-batch (Megatron), inside "
                 f"a node over {intra}")
    if pp > 1:
        A.append(f"pipeline: compute x (m+p-1)/m = {bubble_factor(pp, m):.3g} (1F1B bubble); one (B, seq, d_model) "
                 f"send per micro-batch forward and one backward, on the critical path")
    if ds.offload_optimizer or ds.offload_params:
        A.append(f"offload leaves the interconnect volume unchanged; PCIe ({LINKS[HOST_LINK].source}) carries each "
                 f"GPU's gradient shard out and parameter shard back over its own link (one GPU moves dp times "
                 f"more, so scaling can look superlinear); the CPU optimizer's time is not modelled")
    return A


def _compute_time(profile: Profile | None, profile_path, n_params: int, B: int, m: int, seq: int, seq_ratio: float,
                  mfu: float, peak: float, gpu: str | None, b_act: int, precision: str, A: list[str]):
    """One GPU's compute per step before the bubble, as a function of the model split; its assumption goes to A."""
    if profile:
        A.append(f"compute from the profile {profile_path} ({profile.name or 'nproc 1'}): {profile.step_s:.4g} s for "
                 f"{profile.samples} samples of a {profile.params:,}-parameter model ({profile.precision}, one process "
                 f"on {profile.device}), scaled linearly to {B * m} samples, {n_params:,} parameters and "
                 + (f"seq {seq} from its {profile.seq}" if profile.seq else f"its seq taken as data.seq_len = {seq}")
                 + ", split evenly over tp x pp; the target GPUs are taken to be the same kind")
        if profile.precision != precision:
            A.append(f"the profile ran in {profile.precision}, the plan in {precision}: its time is used as is")
        return lambda model_split: (profile.step_s * (B * m * seq_ratio / profile.samples)
                                    * (n_params / profile.params) / model_split)
    A.append(f"compute from 6 x params x tokens FLOPs (attention FLOPs ignored), tokens per sample = data.seq_len "
             f"= {seq}, at MFU {mfu:.0%} of {gpu} SXM dense {'fp32' if b_act == 4 else '16-bit'} {peak / 1e12:g} "
             f"TFLOP/s")
    return lambda model_split: 6 * n_params * B * m * seq / (mfu * peak) / model_split  # 6N FLOPs per token


def _traffic(ds: DSResolved, layout: Layout, spans: dict[str, bool], share: float, b: int, act_bytes: float,
             n_layers: int, intra: str, inter: str) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes each GPU moves a step, by kind, and the seconds they take on the slowest link their group crosses."""
    dp, tp, pp, m = layout.dp_size, layout.tp_size, layout.pp_size, ds.grad_accum_steps
    volume = {"data parallel": zero_step_bytes(ds.zero_stage, dp, share, b, m),
              "tensor parallel": tp_step_bytes(tp, n_layers // pp, m, act_bytes),
              "pipeline sends": 2 * m * collective_bytes("p2p", pp, act_bytes),
              "offload PCIe": offload_bytes(share / dp, b, m, ds.offload_optimizer, ds.offload_params)}
    link = {"data parallel": inter if spans["dp"] else intra, "tensor parallel": intra,
            "pipeline sends": inter if spans["pp"] else intra, "offload PCIe": HOST_LINK}
    return volume, {k: v / (LINKS[link[k]].bytes_per_s * EFFICIENCY) for k, v in volume.items()}


def _overlap_window(ds: DSResolved, pp: int, m: int, compute: float) -> tuple[float, str]:
    """How much compute the data-parallel traffic can hide behind (backward = 2/3 of it), and where that is."""
    backward = 2 / 3 * compute
    if pp > 1:
        return 0.0, "nothing with a pipeline (reduced after the flush)"
    if ds.zero_stage < 2:
        return backward / m, "the last micro-batch's backward at stage 0-1"
    if ds.zero_stage == 2:
        return backward, "every micro-batch's backward at stage 2"
    return compute, "forward and backward at stage 3 (prefetched all-gathers)"


def widths(c) -> tuple[int, int]:
    """The model's width and depth: a Hugging Face model's from its config (the run config's model.d_model and
    model.n_layers are the built-in model's)."""
    if not c.model.hf:
        return c.model.d_model, c.model.n_layers
    from ..models.hf import load_config

    text = load_config(c).get_text_config()
    return int(getattr(text, "hidden_size", 0) or getattr(text, "d_model", 0) or c.model.d_model), \
        int(getattr(text, "num_hidden_layers", 0) or getattr(text, "num_layers", 0) or c.model.n_layers)


def estimate(plan: Plan, n_params: int, gpus_per_node: int, nodes: int, interconnect: str,
             profile_path: str | Path | None = None, mfu: float = 0.40) -> Scaling:
    """The plan's strategy (ZeRO stage, offload, precision, tp, pp, micro batch, accumulation) on G x N GPUs."""
    ds, c = plan.ds, plan.run.cfg
    tp, pp, G, world = ds.layout.tp_size, ds.layout.pp_size, gpus_per_node, gpus_per_node * nodes
    _check_world(G, nodes, mfu, tp, pp, ds.layout.sp_size)
    intra, inter = parse_interconnect(interconnect)
    layout = dataclasses.replace(ds.layout, world_size=world, dp_size=world // (tp * pp))
    h, layers = widths(c)
    dp, m, B, seq = layout.dp_size, ds.grad_accum_steps, c.train.micro_batch_size, c.data.seq_len
    spans = _placement(layout, G)
    profile = read_profile(profile_path, ds.precision, plan.run) if profile_path else None
    gpu = DEFAULT_GPU if not profile else next((k for k in GPUS if k in profile.device), None)
    precision, why = target_precision(ds, gpu)
    if precision != ds.precision:  # the estimate is of the target GPU's run, not of this host's
        ds = dataclasses.replace(ds, precision=precision)
        profile = read_profile(profile_path, precision, plan.run) if profile_path else None
    b_act = 4 if ds.precision == "fp32" else 2     # activations travel in the training dtype
    b = 4 if b_act == 4 or ds.config.get("communication_data_type") == "fp32" else 2   # gradients, parameters
    peak = (GPUS[gpu].flops_fp32 if b_act == 4 else GPUS[gpu].flops_16bit) if gpu else 0.0
    share = n_params / (tp * pp)                    # parameters per model-parallel rank
    whole = persistent_count(plan)                  # ZeRO-3's held whole on a tensor-parallel rank (its stages'
    # taken as holding equal shares)
    act_bytes = B * seq * h * b_act                 # one (B, seq, d_model) activation
    A = [f"world {world} = {G} GPUs per node x {nodes} nodes; the plan's micro batch {B} and accumulation {m} are "
         f"kept, so the global batch grows with data parallelism to {B * m * dp}",
         f"training precision {precision}: {why}", *_link_assumptions(ds, intra, inter, nodes, b, b_act, m, share)]
    A += _model_parallel_assumptions(ds, tp, pp, m, intra)
    seq_ratio = seq / profile.seq if profile and profile.seq else 1.0
    compute_s = _compute_time(profile, profile_path, n_params, B, m, seq, seq_ratio, mfu, peak, gpu, b_act,
                              ds.precision, A)
    volume, seconds = _traffic(ds, layout, spans, share, b, act_bytes, layers, intra, inter)
    # Lower bound: the data-parallel traffic hides behind the compute it is issued during.
    window, where = _overlap_window(ds, pp, m, compute_s(tp * pp))
    A.append(f"step time from no overlap (upper) to data-parallel traffic hidden behind {where} (lower); backward is "
             f"2/3 of compute; tensor-parallel, pipeline and PCIe transfers never overlap")
    compute = compute_s(tp * pp) * bubble_factor(pp, m)
    rest = compute + seconds["tensor parallel"] + seconds["pipeline sends"] + seconds["offload PCIe"]

    # Activations: Korthikanti et al. sbh(10 + 24/t) bytes per layer in 16-bit; 1F1B keeps min(p, m) micro-batches
    # of L/p layers on the first stage.
    split = (10 + 24 / tp) / 34 * min(pp, m) / pp
    one_act = _activations(profile, n_params, ds, B, seq_ratio, seq * B * h * layers * b_act,
                           layout.checkpoint_interval, A, layers if c.train.activation_checkpointing else 0)
    A.append(f"GPU memory {GPUS[gpu].memory / 2**30:g} GiB ({gpu})" if gpu else
             f"GPU memory unknown for {profile.device} (known: {', '.join(GPUS)})")
    host_bw = LINKS[HOST_LINK].bytes_per_s * EFFICIENCY
    one_gpu_s = compute_s(1) + offload_bytes(n_params, b, m, ds.offload_optimizer, ds.offload_params) / host_bw
    return Scaling(layout, spans, volume, seconds, compute, rest + max(0.0, seconds["data parallel"] - window),
                   rest + seconds["data parallel"], _states(share, ds, layout, whole / pp),
                   one_act * split, gpu, one_gpu_s, _states(n_params, ds, Layout(1, 1), whole)["device"] + one_act, A)


def _fmt(x: float, unit: str) -> str:
    if unit == "s":
        return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"
    if unit == "GiB":
        return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"
    if unit == "GB":
        return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def render_scaling(plan: Plan, n_params: int, gpus_per_node: int, nodes: int, interconnect: str,
                   profile_path: str | Path | None = None, mfu: float = 0.40) -> list[str]:
    """Lines for `harness plan`: assumptions, layout, communication, memory, step time, throughput, speedup."""
    s = estimate(plan, n_params, gpus_per_node, nodes, interconnect, profile_path, mfu)
    B, m, seq, world = plan.run.cfg.train.micro_batch_size, plan.ds.grad_accum_steps, plan.run.cfg.data.seq_len, \
        s.layout.world_size
    samples = B * m * s.layout.dp_size          # the global batch
    total, cap = s.states["device"] + s.activations, GPUS[s.gpu].memory if s.gpu else None
    speed = (s.layout.dp_size * s.one_gpu_s / s.upper_s, s.layout.dp_size * s.one_gpu_s / s.lower_s)
    return [
        f"# scaling on paper: {nodes} node(s) x {gpus_per_node} GPUs = {world} GPUs over {interconnect}",
        *(f"assume: {a}" for a in s.assumptions),
        f"layout: {s.layout.describe()}; data-parallel groups {'span nodes' if s.spans['dp'] else 'inside a node'}"
        + (f", pipeline stages {'across nodes' if s.spans['pp'] else 'inside a node'}" if s.layout.pp_size > 1 else ""),
        "communication per GPU per step: " + (", ".join(f"{k} {_fmt(v, 'GB')} -> {_fmt(s.seconds[k], 's')}"
                                                        for k, v in s.volume.items() if v) or "none"),
        f"memory per GPU: model states {_fmt(s.states['device'], 'GiB')} + activations {_fmt(s.activations, 'GiB')} "
        f"= {_fmt(total, 'GiB')}" + (f" of {_fmt(cap, 'GiB')}: {'fits' if total <= cap else 'DOES NOT FIT'}" if cap
                                      else "") + (f"; CPU {_fmt(s.states['cpu'], 'GiB')}" if s.states["cpu"] else ""),
        f"step time: {_fmt(s.lower_s, 's')} to {_fmt(s.upper_s, 's')} (compute {_fmt(s.compute_s, 's')})",
        f"throughput: {_fmt(samples / s.upper_s, '')} to {_fmt(samples / s.lower_s, '')} samples/s, "
        f"{_fmt(samples * seq / s.upper_s, '')} to {_fmt(samples * seq / s.lower_s, '')} tokens/s "
        f"(global batch {samples})",
        f"speedup vs 1 GPU ({_fmt(s.one_gpu_s, 's')} per {B * m} samples"
        + (f"; it would need {_fmt(s.one_gpu_mem, 'GiB')}, so hypothetical" if cap and s.one_gpu_mem > cap else "")
        + f"): {speed[0]:.3g}x to {speed[1]:.3g}x, scaling efficiency {speed[0] / world:.0%} to {speed[1] / world:.0%}",
    ]
