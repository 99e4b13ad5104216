"""The optimizer and the learning-rate schedule: the run file's, or what a DeepSpeed file's sections name."""
from __future__ import annotations

import contextlib
import math
import os
import re
import warnings

import torch
from torch import nn

from ..config.ds_optim import SCHEDULERS, TOTAL
from ..config.run import ConfigError, RunConfig, ScheduleSection


def lr_factor(step: int, total: int, s: ScheduleSection) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warmup, then the chosen decay."""
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return 1.0
    if s.kind == "inverse_sqrt":
        return math.sqrt(max(s.warmup_steps, 1) / (step + 1))
    progress = min((step - s.warmup_steps) / max(total - s.warmup_steps, 1), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if s.kind == "cosine" else 1 - progress
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * shape


def build_optimizer(model: nn.Module, cfg: RunConfig, offload: bool, total_steps: int, sections=None):
    """AdamW or SGD with momentum, without weight decay on biases and norm weights (1-d tensors). AdamW: with ZeRO
    optimizer offload the states live in CPU memory and DeepSpeed's vectorised CPU Adam does the update; on a GPU,
    DeepSpeed's fused Adam does it, and on a CPU torch's fused AdamW. A DeepSpeed file's sections (`sections`,
    config/ds_optim.py) may ask for Adam with L2 decay (`adam_w_mode` false), torch's Adam on a GPU (`torch_adam`)
    and one of DeepSpeed's schedulers instead of the run file's."""
    o, groups = cfg.optimizer, param_groups(model, cfg)
    kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    switches = sections.switches if sections else {}
    decoupled = switches.get("adam_w_mode", True)  # False: Adam with L2 decay, as DeepSpeed's Adam then steps
    torch_adam = torch.optim.AdamW if decoupled else torch.optim.Adam
    if o.name == "sgd":  # offload refused by the plan: DeepSpeed's offload runs its CPU Adam only
        optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    elif offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, adamw_mode=decoupled, **kwargs)
    elif torch.cuda.is_available() and not switches.get("torch_adam"):
        optimizer = _fused_adamw(groups, kwargs, decoupled, torch_adam)
    else:  # one kernel for every parameter, not a loop of them (and no per-parameter step count read on the host)
        optimizer = torch_adam(groups, fused=True, **kwargs)
    return optimizer, make_schedule(optimizer, cfg, total_steps, sections)


def param_groups(model: nn.Module, cfg: RunConfig) -> list[dict]:
    """The trainable parameters in two groups: weight decay on matrices, none on biases and norm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    ndim = lambda p: len(getattr(p, "ds_shape", p.shape))  # noqa: E731 - a ZeRO-3 partitioned parameter is 1-d
    groups = [{"params": [p for p in params if ndim(p) >= 2], "weight_decay": cfg.optimizer.weight_decay},
              {"params": [p for p in params if ndim(p) < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # DeepSpeed drops empty groups; the schedule must see the same


def make_schedule(optimizer, cfg: RunConfig, total_steps: int, sections=None):
    """The run file's schedule over `optimizer`, or DeepSpeed's scheduler class where the DeepSpeed file names one,
    built with its filled parameters as DeepSpeed would build it from the file."""
    if sections and sections.scheduler:
        from deepspeed.runtime import lr_schedules

        kind, given = sections.scheduler["type"], sections.scheduler["params"]
        for key, value in given.items():  # a run sized by train.epochs learns its length only now
            if SCHEDULERS.get(kind, {}).get(key) == TOTAL and isinstance(value, (int, float)) and \
                    value != total_steps and cfg.run.config_wins != "deepspeed":  # a type DeepSpeed checks itself
                raise ConfigError(f"scheduler.params.{key} = {value!r} (DeepSpeed file) vs the run's {total_steps} "
                                  f"steps (train.epochs x steps per epoch): the lr would end "
                                  f"{'early' if value < total_steps else 'late'}; set it to \"auto\", or "
                                  f"run.config_wins = \"deepspeed\" to keep it")
        params = {k: total_steps if v == "auto" else v for k, v in given.items()}
        return getattr(lr_schedules, kind)(optimizer, **params)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg.schedule))


def _fused_adamw(groups: list[dict], kwargs: dict, decoupled: bool, fallback: type) -> torch.optim.Optimizer:
    """DeepSpeed's fused (multi-tensor) AdamW on the GPU; PyTorch's fused AdamW if DeepSpeed's kernel cannot be
    built here (it compiles on first use with the CUDA toolkit's nvcc): `fallback`, AdamW or Adam as `decoupled`."""
    try:
        from deepspeed.ops.adam import FusedAdam

        with deepspeed_arch_list():
            return FusedAdam(groups, adam_w_mode=decoupled, **kwargs)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the other fused kernel
        warnings.warn(f"DeepSpeed's FusedAdam is not available ({str(e).splitlines()[0][:200]}); using "
                      f"torch.optim.AdamW(fused=True)")
        return fallback(groups, fused=True, **kwargs)


@contextlib.contextmanager
def deepspeed_arch_list():
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19's op builder can read it, while a DeepSpeed op loads. It reads each
    entry's minor version as an integer, so an arch-specific entry such as "9.0a" (which Hopper images set) stops
    every JIT build or load with "invalid literal for int() with base 10: '0a'" (deepspeedai/DeepSpeed#8619, open).
    DeepSpeed's ops need no arch-specific instruction: they are built for the plain architecture ("9.0")."""
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    plain = None if old is None else re.sub(r"(\d+\.\d+)[af]\b", r"\1", old)
    if plain != old:
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain
    try:
        yield
    finally:
        if plain != old:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old


def place_schedule(schedule, step: int) -> None:
    """A schedule of another kind than a checkpoint's (the run's [schedule] for a DeepSpeed scheduler section, one
    DeepSpeed scheduler for another), whose state it cannot read, set at the checkpoint's `step` (steps done): a
    schedule's state is its step (`follow_config_lr` then sets the lr there)."""
    if isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        schedule.last_epoch = step  # 0 when built, + 1 a step
        schedule._last_lr = [g["lr"] for g in schedule.optimizer.param_groups]  # the checkpoint's next lr (restored)
    elif hasattr(schedule, "last_batch_iteration"):
        schedule.last_batch_iteration = step - 1  # DeepSpeed's: -1 when built


def group_settings(optimizer) -> list[dict]:
    """The settings of `optimizer`'s groups as this run built them, all but their parameters and the lr (the
    schedule's): what `follow_config_settings` sets again once a checkpoint is loaded."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]


def follow_config_settings(optimizer, built: list[dict]) -> dict:
    """After a resume: the optimizer's settings of the run config (weight decay, betas, eps, momentum), not the
    checkpoint's: torch's load_state_dict takes every group's settings from the checkpoint, so a weight decay or a
    beta changed on resume was silently the saved one. `built`: `group_settings` before the load. Returns the
    checkpoint's value of each that differed (`settings_changed` says which still do once a DeepSpeed scheduler
    has set its momentum or betas at the step)."""
    saved: dict = {}
    for group, mine in zip(optimizer.param_groups, built):
        for key, value in mine.items():
            if key in group and _plain(group[key]) != _plain(value):
                saved.setdefault(key, group[key])
            group[key] = value
    return saved


def settings_changed(optimizer, saved: dict) -> list[str]:
    """"KEY NOW (the checkpoint's run had THEN)" for each of `follow_config_settings`'s that the first group holds
    otherwise than the checkpoint now (OneCycle's momentum, cycled by the step, is the checkpoint's again)."""
    group = optimizer.param_groups[0]
    return [f"{key} {_plain(group[key])} (the checkpoint's run had {_plain(then)})" for key, then in saved.items()
            if key in group and _plain(group[key]) != _plain(then)]


def _plain(value):
    """A setting as a note says it, and as two are compared: 0.1, (0.9, 0.95) (a list and a tuple alike)."""
    return f"({', '.join(f'{v:g}' for v in value)})" if isinstance(value, (tuple, list)) else \
        f"{value:g}" if isinstance(value, float) else repr(value)


def follow_config_lr(schedule, lr: float) -> tuple[float, float] | None:
    """After a resume: the learning rate of the run config, not the checkpoint's. DeepSpeed restores the schedule's
    state, whose base lr is the saved run's (the schedule's shape, a function of the run config, is not saved), and
    the optimizer's lr for the next step. Sets the base lr, and the next step's lr to the run config's schedule at the
    resumed step (another optimizer.lr, train.max_steps or [schedule] changes it); returns the saved base lr and next
    step's lr where either differed, else None. A DeepSpeed scheduler keeps only its step (`last_batch_iteration`)
    and takes its lr from its own section: stepped again at that step, it sets the next lr as its section says (its
    base lr is not saved: the run's `lr` stands in its place)."""
    if not isinstance(schedule, torch.optim.lr_scheduler.LambdaLR):
        if not hasattr(schedule, "last_batch_iteration"):
            return None
        saved_next = schedule.optimizer.param_groups[0]["lr"]  # the optimizer state's, as DeepSpeed restored it
        schedule.step(schedule.last_batch_iteration)  # lr_schedules.py: step(i) sets the lr of step i, not i + 1
        now = schedule.optimizer.param_groups[0]["lr"]
        return None if math.isclose(saved_next, now, rel_tol=1e-6) else (lr, saved_next)
    # the schedule's own state holds the next step's lr (_last_lr); DeepSpeed restores the optimizer's groups' lr too,
    # except where it restores no optimizer state (NVMe offload, ZeRO-1/2 elastic checkpoints)
    saved = schedule.base_lrs[0]
    saved_next = (getattr(schedule, "_last_lr", None) or [schedule.optimizer.param_groups[0]["lr"]])[0]
    factor = schedule.lr_lambdas[0](schedule.last_epoch)
    schedule.base_lrs = [lr] * len(schedule.base_lrs)
    for group in schedule.optimizer.param_groups:
        group["lr"] = lr * factor
    schedule._last_lr = [group["lr"] for group in schedule.optimizer.param_groups]
    if saved == lr and math.isclose(saved_next, lr * factor, rel_tol=1e-6):
        return None
    return saved, saved_next

