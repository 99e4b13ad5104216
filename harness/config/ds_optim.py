"""A DeepSpeed file's `optimizer` and `scheduler` sections, taken as HF Trainer and accelerate users keep them.

- "auto" is filled from the run file, as HF Trainer fills it from its training arguments: the optimizer's lr, betas,
  eps, weight_decay (SGD: momentum, nesterov); the scheduler's peak and minimum lr, warmup and total steps.
- An explicit value where the run file keeps its default is adopted: the run trains with it, and `harness plan`
  says it came from the DeepSpeed file. An explicit value that contradicts a run-file value the user set is refused,
  every mismatch in one line (key, JSON value, run-file value and where it came from), as HF Trainer refuses them.
- The optimizer the section names is built by the harness as DeepSpeed would build it: Adam (decoupled weight decay
  unless `adam_w_mode` is false: Adam with L2), AdamW, SGD; `torch_adam` takes torch's implementation instead of
  DeepSpeed's fused kernel. DeepSpeed's other optimizers (Adagrad, Lamb, Lion, MuAdam, ...) and torch.optim classes
  by name are built by DeepSpeed from the section, where this machine can build them (refused in one line
  otherwise); the harness's parameter groups (no decay on biases and norms) and schedule go with them. The
  scheduler is DeepSpeed's own class (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), built with the
  filled parameters (`distributed/optim.py`), so its curve is DeepSpeed's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .run import ConfigError, Resolved

# optimizer.type (lower case) -> (the run's optimizer.name, adam_w_mode's default); DeepSpeed's names
OPTIMIZERS = {"adam": ("adamw", True), "adamw": ("adamw", True), "sgd": ("sgd", None)}
NOT_BUILT = ("muon",)  # DeepSpeed's Muon tags parameters itself and splits them in two optimizers: not taken here
# what fills "auto" in the params of an optimizer DeepSpeed builds (its others, or a torch.optim class by name)
FILLABLE = {"lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay", "betas": "optimizer.beta1/beta2",
            "eps": "optimizer.eps", "momentum": "optimizer.momentum"}
ADAM_PARAMS = {"lr": "optimizer.lr", "betas": "optimizer.beta1/beta2", "eps": "optimizer.eps",
               "weight_decay": "optimizer.weight_decay"}
SGD_PARAMS = {"lr": "optimizer.lr", "momentum": "optimizer.momentum", "nesterov": "optimizer.nesterov",
              "weight_decay": "optimizer.weight_decay"}
SWITCHES = ("adam_w_mode", "torch_adam")  # DeepSpeed's own switches of its Adam, honoured

TOTAL = "the run's total steps (train.max_steps, or train.epochs x steps per epoch)"
# scheduler type -> {param: the run key that fills "auto" (TOTAL: filled when the engine is built), or None}
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": "0", "warmup_max_lr": "optimizer.lr", "warmup_num_steps": "schedule.warmup_steps",
                 "warmup_type": None},
    "WarmupDecayLR": {"warmup_min_lr": "0", "warmup_max_lr": "optimizer.lr",
                      "warmup_num_steps": "schedule.warmup_steps", "total_num_steps": TOTAL, "warmup_type": None},
    "WarmupCosineLR": {"warmup_min_ratio": "0", "warmup_num_steps": "schedule.warmup_steps",
                       "cos_min_ratio": "schedule.min_lr_ratio", "total_num_steps": TOTAL, "warmup_type": None},
    "OneCycle": {"cycle_max_lr": "optimizer.lr", **{k: None for k in (
        "cycle_min_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
        "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
        "decay_mom_rate")}},
    "LRRangeTest": {"lr_range_test_min_lr": "optimizer.lr", **{k: None for k in (
        "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase")}},
}


@dataclass
class Sections:
    """What the two sections resolved to: the run keys to adopt, the harness's optimizer switches, DeepSpeed's
    scheduler (type and filled parameters; a total still "auto" where only the data can tell it) and the sources
    of the filled values."""
    adopt: dict[str, tuple[Any, str]] = field(default_factory=dict)  # run key -> (value, where it came from)
    switches: dict[str, bool] = field(default_factory=dict)          # adam_w_mode, torch_adam
    scheduler: dict[str, Any] | None = None                          # {"type": ..., "params": {...}}
    optimizer: dict[str, Any] | None = None  # an optimizer section DeepSpeed builds (not Adam, AdamW, SGD), filled
    source: dict[str, str] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    overridden: list[str] = field(default_factory=list)  # run keys you set that the file's values replace
    unused: list[str] = field(default_factory=list)      # run keys you set that the file's scheduler does not read

    def keep_notes(self, first: "Sections") -> None:
        self.overridden = list(dict.fromkeys([*first.overridden, *self.overridden]))
        self.unused = list(dict.fromkeys([*first.unused, *self.unused]))

    def notes(self) -> list[str]:
        """The plan's and the start's lines on what the DeepSpeed file took from the run config."""
        return [f"{what}: {'; '.join(keys)}" for what, keys in (
            ("run keys the DeepSpeed settings override (run.config_wins = \"deepspeed\")", self.overridden),
            ("run keys the DeepSpeed scheduler does not use", self.unused)) if keys]

    def take(self, key: str, value: Any, run: Resolved, run_key: str, label: str) -> Any:
        """A section's `key` against the run's `run_key`: "auto" is the run's value; an explicit one is adopted
        where the run keeps its default, refused where the user set another."""
        mine = _run_value(run, run_key)
        if value == "auto":
            self.source[key] = f"auto <- {run_key} ({_run_source(run, run_key)})"
            return mine
        if value == mine:
            return value
        if any(run.is_set(k) for k in _run_keys(run_key)) and run.cfg.run.config_wins != "deepspeed":
            self.mismatches.append(f"{key} = {value!r} vs {run_key} = {mine!r} ({_run_source(run, run_key)})")
        else:
            if any(run.is_set(k) for k in _run_keys(run_key)):
                self.overridden.append(f"{run_key} = {mine!r} ({_run_source(run, run_key)}) -> {key} = {value!r}")
            for k, v in zip(_run_keys(run_key), value if run_key == "optimizer.beta1/beta2" else [value]):
                self.adopt[k] = (v, f"{key} ({label})")
        return value


def _run_keys(run_key: str) -> list[str]:
    return ["optimizer.beta1", "optimizer.beta2"] if run_key == "optimizer.beta1/beta2" else [run_key]


def _run_value(run: Resolved, run_key: str) -> Any:
    values = [getattr(getattr(run.cfg, k.split(".")[0]), k.split(".")[1]) for k in _run_keys(run_key)]
    return values if run_key == "optimizer.beta1/beta2" else values[0]


def _run_source(run: Resolved, run_key: str) -> str:
    sources = list(dict.fromkeys(run.source[k] for k in _run_keys(run_key)))  # beta1's and beta2's, where they differ
    return sources[0] if len(sources) == 1 else "; ".join(f"{k}: {run.source[k]}" for k in _run_keys(run_key))


def resolve_sections(ds: dict, run: Resolved, label: str, offload: bool, stage: int,
                     others: list[tuple[str, Any, str, str]] = ()) -> Sections:
    """Take `optimizer` and `scheduler` out of `ds` (the harness builds both), checked and filled, for a run at ZeRO
    `stage` with or without optimizer `offload`; `others`: more values from outside the run file, (key, value, run
    key, where from), taken the same way (accelerate's)."""
    out = Sections()
    for key, value, run_key, where in others:
        out.take(key, value, run, run_key, where)
    if "optimizer" in ds:
        _optimizer(ds.pop("optimizer"), run, label, out, offload, stage)
    if "scheduler" in ds:
        _scheduler(ds.pop("scheduler"), run, label, out)
    if out.mismatches:
        raise ConfigError(f"the DeepSpeed settings ({', '.join(dict.fromkeys([label, *(o[3] for o in others)]))}) "
                          f"contradict the run config: {'; '.join(out.mismatches)}; set each to \"auto\", make them "
                          f"agree, drop the run-file value (--unset KEY), or set run.config_wins = \"deepspeed\"")
    return out


def _optimizer(opt: Any, run: Resolved, label: str, out: Sections, offload: bool, stage: int) -> None:
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        raise ConfigError(f"optimizer ({label}) must be an object with a \"type\", e.g. {{\"type\": \"AdamW\", "
                          f"\"params\": {{\"lr\": \"auto\"}}}}")
    kind = opt["type"].lower()
    if kind not in OPTIMIZERS:
        _deepspeed_builds(opt, run, label, out, offload, stage)
        return
    name, adam_w = OPTIMIZERS[kind]
    out.take("optimizer.type", name, run, "optimizer.name", label)
    params = opt.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"optimizer.params ({label}) must be an object")
    names = SGD_PARAMS if name == "sgd" else ADAM_PARAMS
    for key, value in params.items():
        if key in SWITCHES and name == "adamw":
            if not isinstance(value, bool):
                raise ConfigError(f"optimizer.params.{key} = {value!r} ({label}) must be true or false")
            out.switches[key] = value
            continue
        if key not in names:
            known = ", ".join([*names, *(SWITCHES if name == "adamw" else ())])
            raise ConfigError(f"optimizer.params.{key} ({label}) is not a parameter the harness honours for "
                              f"{opt['type']} ({known}); remove it")
        if key == "betas" and value != "auto" and (not isinstance(value, list) or len(value) != 2):
            raise ConfigError(f"optimizer.params.betas = {value!r} ({label}) must be two numbers or \"auto\"")
        out.take(f"optimizer.params.{key}", value, run, names[key], label)
    if kind == "adamw":
        out.switches["adam_w_mode"] = True  # DeepSpeed: AdamW is always decoupled
    elif adam_w is not None:
        out.switches.setdefault("adam_w_mode", adam_w)


def _deepspeed_builds(opt: dict, run: Resolved, label: str, out: Sections, offload: bool, stage: int) -> None:
    """An optimizer DeepSpeed builds itself from the section (deepspeed/runtime/engine.py,
    `_configure_basic_optimizer`): one of its own (Adagrad, Lamb, Lion, MuAdam, ...) or any torch.optim class by
    name, where this machine can build it; "auto" parameters filled from the run file."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    kind, name = opt["type"].lower(), opt["type"]
    torch_class = getattr(torch.optim, name, None)
    if kind in NOT_BUILT or (kind not in DEEPSPEED_OPTIMIZERS and not (
            isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer))):
        has = "is one of DeepSpeed's optimizers the harness does not build" if kind in NOT_BUILT else \
            "is not an optimizer DeepSpeed has (its own, or a torch.optim class by name)"
        raise ConfigError(f"optimizer.type = {name!r} ({label}) {has}")
    why = _cannot_build(kind, offload, stage)
    if why:
        raise ConfigError(f"optimizer.type = {name!r} ({label}): DeepSpeed cannot train it here: {why}")
    params = dict(opt.get("params", {}))
    if torch_class is not None and kind not in DEEPSPEED_OPTIMIZERS:  # torch's class takes what its signature says
        import inspect

        takes = set(inspect.signature(torch_class).parameters) - {"self", "params"}
        unknown = sorted(set(params) - takes)
        if unknown:
            raise ConfigError(f"optimizer.params.{unknown[0]} ({label}) is not a parameter of torch.optim.{name} "
                              f"({', '.join(sorted(takes))})")
    for key, value in params.items():
        if key in FILLABLE:
            params[key] = out.take(f"optimizer.params.{key}", value, run, FILLABLE[key], label)
        elif value == "auto":
            raise ConfigError(f"optimizer.params.{key} = \"auto\" ({label}): nothing in the run config fills it for "
                              f"{name}; give a value")
    params.setdefault("lr", run.cfg.optimizer.lr)
    out.optimizer = {"type": name, "params": params}


# bytes of state per parameter (fp32) of DeepSpeed's own optimizers: Adam's m and v, Lion's and Adagrad's one buffer
DEEPSPEED_STATE = {"adagrad": 4, "lamb": 8, "muadam": 8, "muadamw": 8, "lion": 4}


def state_bytes(sections: Sections, optimizer, stage: int) -> tuple[float, str]:
    """The optimizer's state in bytes per parameter and its name, for the memory on paper: AdamW's m and v, SGD's
    momentum, DeepSpeed's own by kind; a torch.optim class stepped once with the section's parameters (RMSprop's
    momentum and centred buffers) on a flat weight, as ZeRO 1-3 hand it their partitions, and its state counted: at
    ZeRO-0 an upper bound for one that factors 2-D weights (Adafactor); AdamW's where it cannot be stepped so
    (LBFGS)."""
    import torch

    if sections.optimizer is None:  # the harness's own
        return (8.0, "AdamW") if optimizer.name == "adamw" else (4.0 if optimizer.momentum else 0.0, "SGD")
    name, params = sections.optimizer["type"], dict(sections.optimizer.get("params", {}))
    if name.lower() == "musgd":
        return 4.0 if params.get("momentum") else 0.0, name
    if name.lower() in DEEPSPEED_STATE:
        return float(DEEPSPEED_STATE[name.lower()]), name
    weight = torch.nn.Parameter(torch.zeros(256))
    weight.grad = torch.full_like(weight, 0.1)
    # stepped here on the CPU: a GPU's implementation switches (capturable, fused, ...) change no state it keeps
    params = {k: v for k, v in params.items() if k not in ("capturable", "fused", "foreach", "differentiable")}
    try:
        stepped = getattr(torch.optim, name)([weight], **params)
        stepped.step()
    except Exception:  # noqa: BLE001 - whatever the class refuses in this probe, the plan still stands on paper
        return 8.0, f"{name} (counted as AdamW's)"
    held = sum(t.element_size() * t.numel() for t in stepped.state[weight].values()
               if torch.is_tensor(t) and t.numel() > 1)
    factored = stage == 0 and name.lower() == "adafactor"
    return held / weight.numel(), f"{name} (at most: it factors 2-D weights)" if factored else name


def _cannot_build(kind: str, offload: bool, stage: int) -> str | None:
    """Why DeepSpeed cannot build its optimizer `kind` (a package not installed, a combination it fails on), or None;
    a kernel this machine cannot build: `kernel_missing`."""
    import importlib.util

    if kind == "adagrad" and stage in (1, 2, 3) and not offload:
        # torch.optim.Adagrad under ZeRO: IndexError in stage_1_and_2.py `_get_flat_partition_unpadded` (and in
        # stage 3) at the first step with DeepSpeed 0.19.8; with optimizer offload its CPU Adagrad trains
        return f"torch's Adagrad under ZeRO-{stage} fails inside DeepSpeed at its first step; use ZeRO-0, or " \
               f"zero_optimization.offload_optimizer (DeepSpeed's CPU Adagrad)"
    if kind.startswith("mu") and importlib.util.find_spec("mup") is None:
        return "its mu-P optimizers need the `mup` package (pip install mup)"
    return None


BUILDERS = {("lamb", False): "FusedLambBuilder", ("lamb", True): "FusedLambBuilder",
            ("lion", False): "FusedLionBuilder", ("lion", True): "CPULionBuilder",
            ("adagrad", True): "CPUAdagradBuilder"}  # DeepSpeed's kernels its optimizers run, by (kind, offload)


def kernel_missing(section: dict | None, offload: bool) -> str | None:
    """Why this machine's accelerator cannot build the kernel the optimizer DeepSpeed builds from `section` runs, or
    None: a fact of this machine, checked where a run starts (a plan may be for other machines)."""
    builder = BUILDERS.get((section["type"].lower(), offload)) if section else None
    if builder is None:
        return None
    from deepspeed.accelerator import get_accelerator

    made = get_accelerator().create_op_builder(builder)  # this accelerator's builder of the kernel, if it has one
    if made is None or type(made).__name__ == "NotImplementedBuilder" or not made.is_compatible(verbose=False):
        return (f"its kernel ({builder}) has no build for the {get_accelerator().device_name()} accelerator "
                f"(the fused ones need a GPU)")
    return None


def _scheduler(section: Any, run: Resolved, label: str, out: Sections) -> None:
    if not isinstance(section, dict) or section.get("type") not in SCHEDULERS:
        given = section.get("type") if isinstance(section, dict) else section
        raise ConfigError(f"scheduler.type = {given!r} ({label}) is not a DeepSpeed scheduler: "
                          f"{', '.join(SCHEDULERS)}")
    kind, known = section["type"], SCHEDULERS[section["type"]]
    if run.is_set("schedule.kind") and run.cfg.run.config_wins != "deepspeed":
        raise ConfigError(f"scheduler ({label}) runs DeepSpeed's {kind}, but {run.describe('schedule.kind')} names "
                          f"the harness's own: remove the key (--unset schedule.kind), or set run.config_wins = "
                          f"\"deepspeed\" to take the file's")
    if run.is_set("schedule.kind"):
        out.overridden.append(f"{run.describe('schedule.kind')} -> DeepSpeed's {kind}")
    given = section.get("params", {}) if isinstance(section.get("params"), dict) else {}
    read = {k for key in given if known.get(key) for k in _run_keys(known[key])}  # a parameter left out: its default
    out.unused += [run.describe(k) for k in ("schedule.warmup_steps", "schedule.min_lr_ratio")
                   if run.is_set(k) and k not in read]
    params = dict(section.get("params", {}))
    for key, value in params.items():
        if key not in known:
            raise ConfigError(f"scheduler.params.{key} ({label}) is not a parameter of DeepSpeed's {kind} "
                              f"({', '.join(known)})")
        fills = known[key]
        if fills == TOTAL:
            if value == "auto" and run.cfg.train.max_steps:
                params[key] = run.cfg.train.max_steps
                out.source[f"scheduler.params.{key}"] = f"auto <- {run.describe('train.max_steps')}"
            elif value == "auto":
                out.source[f"scheduler.params.{key}"] = f"auto <- {TOTAL}, once the data is read"
            elif run.cfg.train.max_steps and value != run.cfg.train.max_steps:  # the lr would end early or late
                theirs = f"scheduler.params.{key} = {value!r} vs {run.describe('train.max_steps')}"
                if run.cfg.run.config_wins == "deepspeed":
                    out.overridden.append(f"{theirs}: the schedule's length, not the run's")
                else:
                    out.mismatches.append(theirs)
            continue
        if fills is None or fills == "0":
            if value == "auto" and fills is None:
                raise ConfigError(f"scheduler.params.{key} = \"auto\" ({label}): nothing in the run config fills it "
                                  f"for {kind}; give a value")
            if value == "auto":
                params[key] = 0.0
                out.source[f"scheduler.params.{key}"] = "auto <- 0"
            continue
        params[key] = out.take(f"scheduler.params.{key}", value, run, fills, label)
    for key, fills in known.items():  # DeepSpeed's class has no default for the total: the run's
        if key not in params and fills == TOTAL:
            params[key] = run.cfg.train.max_steps or "auto"
            out.source[f"scheduler.params.{key}"] = f"not given: {TOTAL}"
    steps = params.get("warmup_num_steps")
    if isinstance(steps, int) and steps < 1:
        raise ConfigError(f"scheduler.params.warmup_num_steps = {steps} ({label}; "
                          f"{out.source.get('scheduler.params.warmup_num_steps', 'given')}): DeepSpeed's {kind} "
                          f"refuses fewer than one warmup step (ValueError), and warms up over 2 at least; set "
                          f"schedule.warmup_steps or the parameter")
    out.scheduler = {"type": kind, "params": params}
