"""What this machine can run: the precision, the DeepSpeed ops (NVMe offload's async_io, the optimizer's kernel,
ZeRO++'s quantizer) and the GPU memory a run asks for, checked by `startup.preflight` before any process starts (and
by `harness bench` and `harness launch`).
"""
from __future__ import annotations

import os
import shutil

from ..config.run import ConfigError
from ..distributed import ds_patches
from ..distributed.world import quiet_deepspeed
from ..plan.resolve import Plan


CPU_FP16_ENV = "HARNESS_CPU_FP16"


def check_precision(precision: str) -> None:
    """Refuse a precision DeepSpeed's accelerator does not support; fp16 on a CPU without it only where opted in
    (CPU_FP16_ENV), which tells DeepSpeed it is supported (`ds_patches.claim_cpu_fp16`)."""
    quiet_deepspeed()
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if precision == "fp16" and not acc.is_fp16_supported():
        opted = os.environ.get(CPU_FP16_ENV) == "1" and acc.device_name() == "cpu"
        if opted and not ds_patches.claim_cpu_fp16(acc):
            raise ConfigError(f"fp16 is not supported on this cpu (DeepSpeed's check), and {CPU_FP16_ENV}=1 steps "
                              f"aside on DeepSpeed {ds_patches.version()} (the line above says why); use a bf16 or "
                              f"fp32 config")
        if not opted:
            raise ConfigError(f"fp16 is not supported on this {acc.device_name()} (DeepSpeed's check); use a bf16 "
                              f"or fp32 config, or set {CPU_FP16_ENV}=1 to run fp16 slowly on a CPU for testing")
    if precision == "bf16" and not acc.is_bf16_supported():
        raise ConfigError(f"bf16 is not supported on this {acc.device_name()}; use an fp16 or fp32 config")


def check_nvme(ds) -> None:
    """NVMe offload reads and writes through DeepSpeed's async_io op, which needs libaio at build time: without it
    the ranks fail at start, each with its traceback."""
    from ..config.ds import offload_device

    zero = ds.config["zero_optimization"]
    if "nvme" not in (offload_device(zero.get(k)) for k in ("offload_optimizer", "offload_param")):
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    made = get_accelerator().create_op_builder("AsyncIOBuilder")
    if not installed_ops.get("async_io") and (made is None or not made.is_compatible(verbose=False)):
        raise ConfigError(f"NVMe offload ({ds.origin}) needs DeepSpeed's async_io op, which this machine cannot "
                          f"build (`ds_report` says why; usually libaio is missing: libaio-dev); offload to \"cpu\"")


# ZeRO++'s quantized communication, which loads DeepSpeed's quantizer kernel (0.19: partition_parameters.CUDAQuantizer
# for weights, coalesced_collectives.all_to_all_quant_reduce for gradients); its hpZ partitioning needs no kernel
ZEROPP_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


def check_kernel(ds) -> None:
    """The optimizer DeepSpeed builds from the file's section runs a kernel this machine can build (`harness plan`
    only notes it: a plan may be for other machines)."""
    from ..config.ds_optim import kernel_missing

    if why := kernel_missing(ds.sections.optimizer, ds.offload_optimizer):
        raise ConfigError(f"optimizer.type = {ds.sections.optimizer['type']!r} ({ds.origin}): DeepSpeed cannot train "
                          f"it here: {why}")


def check_zeropp(ds) -> None:
    """ZeRO++'s quantized weights and gradients (ZeRO-3) on an accelerator without a build of DeepSpeed's quantizer
    kernel (the CPU's): every rank fails as the engine is built or at the first backward, each with its traceback."""
    asked = [k for k in ZEROPP_QUANTIZED if ds.config["zero_optimization"].get(k)]
    if not asked or ds.zero_stage != 3:  # ZeRO 1-2 do not read them
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    acc = get_accelerator()
    made = acc.create_op_builder("QuantizerBuilder")  # the CPU's is DeepSpeed's NotImplementedBuilder
    if not installed_ops.get("quantizer") and (made is None or type(made).__name__ == "NotImplementedBuilder"
                                               or not made.is_compatible(verbose=False)):
        raise ConfigError(f"zero_optimization.{asked[0]} ({ds.origin}): ZeRO++'s quantized communication needs "
                          f"DeepSpeed's quantizer kernel, which has no build for the {acc.device_name()} accelerator; "
                          f"remove {' and '.join(asked)} (zero_hpz_partition_size runs without it)")


FIT_CHECK_ENV = "HARNESS_FIT_CHECK"  # "0": no refusal on paper (`harness bench` tries sizes for real)


def device_memory_bytes() -> list[int]:
    """The memory of each GPU this process may use, from nvidia-smi (CUDA_VISIBLE_DEVICES applied): no CUDA context
    in this process, which stays alive beside the ranks under `harness launch`. [] without nvidia-smi."""
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    sizes = {}
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            sizes[int(index)] = int(float(mib) * 2**20)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        return [sizes[int(v)] for v in visible.split(",") if v.strip() and int(v) in sizes]
    return list(sizes.values())


def check_fits(plan: Plan, model, capacity: int) -> str | None:
    """The problem, if one micro-batch of `model` (its meta-device twin) does not fit a GPU of `capacity` bytes on
    paper: the model states per rank
    (`config.ds.model_state_bytes`, after the ZeRO paper) and one micro-batch's activations (`plan.render.
    activation_bytes`, after Korthikanti et al.) together, before the CUDA context and the allocator's slack; None
    outside the estimates' scope (`plan.render.memory_on_paper`)."""
    from ..plan.render import memory_on_paper, size_text

    ds, c, paper = plan.ds, plan.run.cfg, memory_on_paper(plan, model)
    if paper is None or sum(paper[:2]) <= capacity:
        return None
    states, acts, positions = paper
    return (f"{plan.run.describe('train.micro_batch_size')} of {positions} positions does not fit one GPU of "
            f"{size_text(capacity)} on paper: model states {size_text(states)} per rank ({ds.precision}, "
            f"ZeRO-{ds.zero_stage}) "
            f"+ activations {size_text(acts)} of one micro-batch "
            f"({'checkpointed' if c.train.activation_checkpointing else 'no recomputation'}); "
            f"lower train.micro_batch_size (raise train.grad_accum_steps to keep the global batch), set "
            f"train.activation_checkpointing=true, or shard more (ZeRO-3, sequence_parallel_size); `harness plan` "
            f"shows the figures")
