"""Every change the harness makes to DeepSpeed's behaviour, in one place, each behind a fence: applied only where the
installed DeepSpeed is a version it was checked on (CHECKED) and the code it relies on is there (its `relies`
function, read from DeepSpeed's own modules); elsewhere DeepSpeed's own code runs and rank 0 says so once. Never an
error: a DeepSpeed this file does not know trains as DeepSpeed trains.

- `fewer_step_syncs`: one host wait in the optimizer step instead of 2-6 (the inf/NaN check the norm check repeats).
- `import_muon_lazily`: DeepSpeed's Muon module imported without compiling at import.
- `fix_universal_conversion` and `after_universal_load`: a checkpoint converted to DeepSpeed's universal format loads
  into another ZeRO stage, with each param group's hyperparameters and each state's own step.
- `writes_that_fail_in_step`: a checkpoint write that fails on some ranks only is reported, not a hang in
  save_checkpoint's last barrier.
- `forget_groups`: DeepSpeed's process-wide memory of the process groups cleared, so a process can train again.
- `claim_cpu_fp16`: DeepSpeed's CPU accelerator told fp16 is supported, where the user opted in (HARNESS_CPU_FP16).

Not here: `run/trust.py`'s weights-only `torch.load`, a safety measure that wraps torch (what DeepSpeed loads with)
on any version, and the harness's reads of DeepSpeed's state that change nothing.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

CHECKED = ("0.19.8",)  # the DeepSpeed versions each patch below was read against and tested on
_said: set[str] = set()


def version() -> str:
    import deepspeed

    return deepspeed.__version__


def fence(patch: str, relies: Callable[[], list[str]]) -> bool:
    """Whether `patch` applies to the installed DeepSpeed; where not, rank 0 says why, once a process."""
    have = version()
    if have not in CHECKED:
        why = f"DeepSpeed {have} is not a version it was checked on ({', '.join(CHECKED)})"
    else:
        missing = relies()
        why = f"DeepSpeed {have} lacks what it relies on: {'; '.join(missing)}" if missing else None
    if why and patch not in _said and os.environ.get("RANK", "0") == "0":
        _said.add(patch)
        print(f"harness: {patch} left out ({why}): DeepSpeed's own code runs", flush=True)
    return why is None


def _lacks(obj: Any, attr: str, params: tuple[str, ...] | None = None, calls: str | None = None) -> list[str]:
    """What of `obj.attr` is not as a patch expects: the attribute, its parameters, a name its source calls."""
    where = f"{getattr(obj, '__name__', obj)}.{attr}"
    fn = getattr(obj, attr, None)
    if fn is None:
        return [where]
    # the function a decorator wraps (DeepSpeed's instrument_w_nvtx keeps it in its closure, without __wrapped__)
    fn = inspect.unwrap(fn)
    fn = next((c.cell_contents for c in fn.__closure__ or () if inspect.isfunction(c.cell_contents)
               and c.cell_contents.__name__ == attr), fn)
    if params is not None and tuple(inspect.signature(fn).parameters) != params:
        return [f"{where}{params}"]
    if calls is not None and calls not in inspect.getsource(fn):
        return [f"{where} calling {calls}"]
    return []


# --- the optimizer step ------------------------------------------------------------------------------------------

def _step_relies() -> list[str]:
    """Each wrapper's step checks the gradient norm with is_invalid_grad_norm after the check removed, and the
    replaced methods keep their signatures."""
    from deepspeed.runtime import utils
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return [*_lacks(utils, "is_invalid_grad_norm"),
            *_lacks(utils.CheckOverflow, "has_overflow", ("self", "params", "has_moe_params")),
            *_lacks(utils.CheckOverflow, "check", ("self", "param_groups")),
            *_lacks(utils.CheckOverflow, "has_overflow_serial", ("self", "params")),
            *_lacks(FP16_Optimizer, "step", calls="is_invalid_grad_norm"),
            *_lacks(FP16_UnfusedOptimizer, "step", calls="is_invalid_grad_norm"),
            *_lacks(DeepSpeedZeroOptimizer, "has_overflow", ("self", "partition_gradients")),
            *_lacks(DeepSpeedZeroOptimizer, "unscale_and_clip_grads", ("self", "grad_groups_flat", "total_norm")),
            *_lacks(DeepSpeedZeroOptimizer, "step", calls="is_invalid_grad_norm"),
            *_lacks(DeepSpeedZeroOptimizer_Stage3, "has_overflow", ("self", "partition_gradients")),
            *_lacks(DeepSpeedZeroOptimizer_Stage3, "step", calls="is_invalid_grad_norm")]


def fewer_step_syncs(engine, tp_size: int) -> None:
    """Fewer host waits in DeepSpeed's optimizer step, the same updates. Each wrapper first asks the device whether
    any gradient holds an inf or NaN (an all-reduce over the ranks and an `.item()`; ZeRO-0's FP16_Optimizer before
    that one `.item()` per parameter tensor), then computes the global gradient norm and skips the update just the
    same when the norm is not finite (`is_invalid_grad_norm`): a gradient with an inf or NaN has no finite norm, over
    the same ranks, so the first answer was always the second's, and the first question is asked no more. ZeRO-1/2's
    clipping also stops reading the norm on the host to test it again: the clip coefficient stays on the device,
    computed as DeepSpeed computes it. Left: one host read a step, the norm check that decides whether to skip.

    Nothing changes where the norm does not see every gradient the first check saw: tensor parallelism (the norm
    counts a replicated parameter on one rank of the group, and DeepSpeed's unfused fp16 wrapper drops every
    gradient of ranks > 0 from it: it tests the gradients, not the parameters, for the tensor-parallel mark), MoE
    layers (their expert groups), Muon (ZeRO-3 applies it between the two checks) and where DeepSpeed skips the norm
    (its legacy fused steps, a ZeRO step without a norm, CPU offload); there the FP16 wrappers' check still asks once,
    not once per tensor (`_one_sync_serial_check`)."""
    if not fence("fewer_step_syncs", _step_relies):
        return
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    _one_sync_serial_check(optimizer)  # where the first check is still asked: once, not once per tensor
    if tp_size > 1 or engine.has_moe_layers or "muon" in type(getattr(optimizer, "optimizer", None)).__name__.lower():
        return
    if isinstance(optimizer, FP16_Optimizer) and not optimizer.fused_adam_legacy:
        optimizer.overflow_checker.has_overflow = lambda params, has_moe_params=None: False
    elif isinstance(optimizer, FP16_UnfusedOptimizer) and not optimizer.fused_lamb_legacy:
        optimizer.overflow_checker.check = lambda param_groups=None: False
    elif isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.compute_grad_norm and not optimizer.cpu_offload:
        optimizer.has_overflow = lambda partition_gradients=True: False  # called only where the norm check follows
        optimizer.unscale_and_clip_grads = functools.partial(_unscale_and_clip_on_device, optimizer)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and not optimizer.offload_optimizer:
        optimizer.has_overflow = lambda partition_gradients=True: False  # its only caller is the step's check


def _one_sync_serial_check(optimizer) -> None:
    """DeepSpeed's FP16 wrappers test the gradients for inf/NaN one tensor at a time, each answer taken to the host
    (deepspeed/runtime/utils.py, `CheckOverflow.has_overflow_serial`): the same answer from one multi-tensor norm and
    one sync (a gradient with an inf or NaN has a non-finite norm, a finite one a finite fp32 norm)."""
    checker = getattr(optimizer, "overflow_checker", None)
    if checker is None or not hasattr(checker, "has_overflow_serial"):
        return

    def has_overflow_serial(params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return not bool(torch.stack(norms).isfinite().all())

    checker.has_overflow_serial = has_overflow_serial


def _unscale_and_clip_on_device(zero, grad_groups_flat, total_norm) -> None:
    """DeepSpeedZeroOptimizer.unscale_and_clip_grads (stage_1_and_2.py) without reading the norm on the host: an
    invalid norm (inf, NaN, or DeepSpeed's -1 for them) clips as an infinite one, as DeepSpeed's does."""
    if zero.clip_grad == 0.0 and zero.loss_scale == 1.0:
        return
    combined_scale = zero.loss_scale
    if zero.clip_grad > 0.0:
        valid = torch.isfinite(total_norm) & (total_norm >= 0)
        norm = torch.where(valid, total_norm, torch.full_like(total_norm, float("inf")))
        combined_scale = torch.clamp(((norm / zero.loss_scale) + 1e-6) / zero.clip_grad, min=1.0) * zero.loss_scale
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined_scale)


# --- Muon's import -----------------------------------------------------------------------------------------------

MUON = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_lazily() -> None:
    """DeepSpeed's ZeRO code imports its Muon optimizer module on every run (the ZeRO optimizer check at start-up, the
    gradient partitioning of ZeRO-1/2 each step: deepspeed/runtime/zero/utils.py, stage_1_and_2.py), and that module
    applies `torch.compile` to three functions at import, which imports torch._inductor: about 2 s of CPU on every
    rank, for an optimizer the harness never builds. Imported first here with `torch.compile` deferred to each
    function's first call, Muon still works and a run that does not use it does not pay for it."""
    if MUON in sys.modules or not fence("import_muon_lazily", lambda: [] if importlib.util.find_spec(MUON)
                                        else [MUON]):
        return
    real = torch.compile

    def deferred(model=None, **kwargs):
        if model is None:  # @torch.compile(...) with options
            return lambda fn: deferred(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)
        return call

    torch.compile = deferred
    try:
        importlib.import_module(MUON)
    finally:
        torch.compile = real


# --- universal checkpoints -----------------------------------------------------------------------------------------

def _universal_relies() -> list[str]:
    from deepspeed.checkpoint import ds_to_universal, universal_checkpoint
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return [*_lacks(ds_to_universal, "main"), *_lacks(universal_checkpoint, "load_hp_checkpoint_state"),
            *_lacks(DeepSpeedZeroOptimizer_Stage3, "load_hp_checkpoint_state_from_checkpoint_dir_stage3")]


def fix_universal_conversion(work: Path, source: Path) -> None:
    """A checkpoint `ds_to_universal` just converted (into `work`, from `source`) made loadable by either ZeRO
    stage's loader (`_both_stages`, `_shaped`)."""
    if not fence("fix_universal_conversion", _universal_relies):
        return
    _both_stages(work / "zero" / "optimizer_state.pt")
    if any(source.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):  # a ZeRO-3 checkpoint
        _shaped(work / "zero", source)


def _both_stages(path: Path) -> None:
    """ds_to_universal writes the optimizer's global state as the source's stage has it; ZeRO-3's loader wants the
    step and param groups under optimizer_state_dict (stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3),
    ZeRO-1/2's at the top: give it both, so a checkpoint of either stage loads into the other."""
    sd = torch.load(path)
    inner = sd.get("optimizer_state_dict")
    if inner is None:
        steps = list(path.parent.glob("*/step.pt"))
        step = torch.load(steps[0]) if steps else 0
        sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": sd["param_groups"]}
    else:
        sd.setdefault("param_groups", inner["param_groups"])
    if not sd.get("ds_version"):  # ZeRO-1/2's loader asserts it; ZeRO-3's state has none
        sd["ds_version"] = version()
    torch.save(sd, path)


def _shaped(zero: Path, source: Path) -> None:
    """ds_to_universal writes a ZeRO-3 checkpoint's state of each parameter as flat tensors and no step; ZeRO-1/2's
    loader (universal_checkpoint.load_hp_checkpoint_state) reads {"param": a tensor of the parameter's shape} and
    a step.pt, and fails on the flat ones ("too many indices for tensor of dimension 1"). Give it those (ZeRO-3's
    loader reads either form), the shapes from the source's model states."""
    shapes: dict[str, Any] = {}
    for states in source.glob("zero_pp_rank_0_mp_rank_*_model_states.pt"):
        for group in torch.load(states)["param_shapes"]:
            shapes.update(group)
    step = torch.load(zero / "optimizer_state.pt")["optimizer_state_dict"]["state"][0]["step"]
    for name, shape in shapes.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            file = zero / name / f"{key}.pt"
            flat = torch.load(file)
            if torch.is_tensor(flat):
                torch.save({"param": flat.view(shape), "cat_dim": 0}, file)
        if not (zero / name / "step.pt").exists():
            torch.save(torch.as_tensor(step).clone(), zero / name / "step.pt")


def after_universal_load(engine, path: Path) -> None:
    """Undo two things DeepSpeed's universal loader for ZeRO-3 (deepspeedai/DeepSpeed#5475) leaves wrong, both in
    stage3.py's load_hp_checkpoint_state_from_checkpoint_dir_stage3: every param group gets the first one's
    hyperparameters ("the hyperparameters of each parameter should be the same", which would decay the biases and
    norms), and every sub-group's AdamW state gets the same `step` tensor, which the optimizer then increments in
    place once per sub-group each step: the bias correction runs ahead, and the losses drift. Each param group's own
    values as saved; each state its own step."""
    if not fence("after_universal_load", _universal_relies):
        return
    saved = torch.load(path / "zero" / "optimizer_state.pt")["param_groups"]
    inner = engine.optimizer.optimizer
    if len(saved) == len(inner.param_groups):
        for group, old in zip(inner.param_groups, saved):
            group.update({k: v for k, v in old.items() if k != "params"})
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


# --- a checkpoint write that fails on some ranks -------------------------------------------------------------------

def _save_relies() -> list[str]:
    """save_checkpoint's writes go through the checkpoint engine's `save` and the recovery script's copy, and it ends
    with a barrier every rank must reach."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    return [*_lacks(DeepSpeedEngine, "save_checkpoint", calls="dist.barrier()"),
            *_lacks(DeepSpeedEngine, "_save_checkpoint", calls="self.checkpoint_engine.save("),
            *_lacks(DeepSpeedEngine, "_save_zero_checkpoint", calls="self._copy_recovery_script("),
            *_lacks(DeepSpeedEngine, "_copy_recovery_script", ("self", "save_path")),
            *_lacks(TorchCheckpointEngine, "save", ("self", "state_dict", "path"))]


@contextmanager
def writes_that_fail_in_step(engine, failures: list):
    """Within it, a write of DeepSpeed's save_checkpoint that fails (a full disk) is put in `failures` instead of
    raised, and the rank writes nothing more but goes on through the save in step with the others. Raised, it skipped
    save_checkpoint's last barrier while the ranks whose writes succeeded waited in it: a hang until the collective
    timeout (30 minutes by default), then a line blaming a healthy rank. Under ZeRO-0 rank 0 writes all the weights
    and the optimizer, the others a few KB: a nearly full disk fails rank 0 alone. The caller reports `failures`."""
    if not fence("writes_that_fail_in_step", _save_relies):
        yield
        return

    def guarded(write):
        @functools.wraps(write)
        def call(*args, **kwargs):
            if failures:
                return None
            try:
                return write(*args, **kwargs)
            except (OSError, RuntimeError) as e:  # a full disk: OSError, or torch.save's "file write failed"
                failures.append(e)
                return None
        return call

    targets = ((engine.checkpoint_engine, "save"), (engine, "_copy_recovery_script"))
    for obj, name in targets:
        setattr(obj, name, guarded(getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name in targets:
            vars(obj).pop(name, None)  # the class's own method again


# --- process groups ------------------------------------------------------------------------------------------------

def _groups_relies() -> list[str]:
    import deepspeed.comm.comm as ds_comm
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return [*(["deepspeed.comm.comm.cdb"] if not hasattr(ds_comm, "cdb") else []),
            *_lacks(parallel_state_sp, "_release_sequence_parallel_groups")]


def forget_groups() -> None:
    """DeepSpeed's process-wide memory of the process groups cleared (its communication backend, the sequence-
    parallel groups, the cached groups of deepspeed.utils.groups), so that a process that closed its process group
    can train again: otherwise DeepSpeed claims groups that no longer exist. Without it, a second run in the same
    process (a notebook cell run twice) stops with DeepSpeed's error."""
    if not fence("forget_groups", _groups_relies):
        return
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    ds_comm.cdb = None
    parallel_state_sp._release_sequence_parallel_groups()
    for name, value in list(vars(ds_groups).items()):  # its cached groups (world, data, model, tensor, expert)
        if name.startswith("_") and name.isupper() and isinstance(value, dict):
            value.clear()
        elif (name.startswith("_") and name.isupper() and isinstance(value, dist.ProcessGroup)) or \
                name in ("mesh_device", "mpu"):
            setattr(ds_groups, name, None)


# --- fp16 on a CPU -------------------------------------------------------------------------------------------------

def claim_cpu_fp16(accelerator) -> bool:
    """DeepSpeed's CPU accelerator answers that fp16 is supported, as the user asked (`run.machine.CPU_FP16_ENV`):
    fp16 math runs on any CPU, only slowly, where DeepSpeed refuses it without native fp16 kernels. Whether it did."""
    if not fence("claim_cpu_fp16", lambda: _lacks(type(accelerator), "is_fp16_supported", ("self",))):
        return False
    accelerator.is_fp16_supported = lambda: True
    return True
