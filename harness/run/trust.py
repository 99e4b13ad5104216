"""What a file from elsewhere may do: nothing but be read as data, unless the user says they trust it.

A pickled checkpoint can run any code when it is loaded, and a run directory names code to import (a plug-in task,
a Hugging Face model's own code). A run directory copied from a colleague, a shared bucket or a download is
therefore read this way:

- Checkpoints (the harness's own reads and every `torch.load` DeepSpeed makes while loading one) are read with
  `weights_only=True`, PyTorch's restricted unpickler, with exactly the types the harness's checkpoints hold beyond
  tensors and containers allow-listed (`SAFE_GLOBALS`, found by `torch.serialization.
  get_unsafe_globals_in_checkpoint` over a checkpoint of every strategy: ZeRO 0-3, offload, tensor and pipeline
  parallel, bf16, fp16 and its loss scaler, DeepSpeed's universal conversion, the RNG states). Anything else is
  refused in one line naming the type and the file; `--trust-checkpoint` loads it anyway.
- A run directory's config.toml may name a plug-in task (imported, so run) or `model.trust_remote_code` (a Hugging
  Face model's own code, run): `harness evaluate`, `translate`, `export` and `load_model` refuse either unless the
  user names the task (`--task`, the API's `task=`) or passes `--trust-run-dir`. Everything else they read is
  safetensors, JSON, TOML, a SentencePiece model and Arrow files: data.

The user's choice is set once per command (`trusting`) and read where the files are (`checkpoint_reads`,
`check_run_dir`).
"""
from __future__ import annotations

import contextlib
import contextvars
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.run import ConfigError, one_line


@dataclass(frozen=True)
class Trust:
    checkpoint: bool = False   # --trust-checkpoint: unpickle checkpoints with anything in them
    run_dir: bool = False      # --trust-run-dir: import the plug-in and run the model code a run directory names
    task: str | None = None    # --task: the plug-in task the user names for a run directory


TRUST: contextvars.ContextVar[Trust] = contextvars.ContextVar("harness_trust", default=Trust())


@contextlib.contextmanager
def trusting(**choices: Any):
    """Within: the user's choices (`Trust`'s fields) for the files this command reads."""
    token = TRUST.set(Trust(**choices))
    try:
        yield
    finally:
        TRUST.reset(token)


def safe_globals() -> list:
    """The types besides tensors and containers that the harness's checkpoints hold, and nothing else: DeepSpeed's
    ZeRO stage (an enum), its loss scalers' state (fp16, and bf16 ZeRO-1/2 keep one), its optimizer-state fragment
    addresses (two integers), and numpy's arrays in the RNG state (the three numpy globals PyTorch's own
    documentation allow-lists for weights_only)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.float64, np.int64)]  # the dtypes RNG states hold
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, _reconstruct, np.ndarray, np.dtype, *dtypes]


UNSAFE = re.compile(r"(?:Unsupported global: GLOBAL|Unsupported operand \d+ for|GLOBAL) ?([\w.]+)")


@contextlib.contextmanager
def checkpoint_reads():
    """Within: every `torch.load` (the harness's and DeepSpeed's, which passes weights_only=False) reads weights only,
    with `safe_globals()` allowed, unless the user trusts checkpoints (`--trust-checkpoint`). A refused file raises
    ConfigError naming the type and the file (nothing in it ran)."""
    if TRUST.get().checkpoint:
        yield
        return
    real, allowed = torch.load, safe_globals()

    def load(f, *args, weights_only: Any = None, **kwargs):
        try:
            with torch.serialization.safe_globals(allowed):
                return real(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            found = UNSAFE.search(str(e))
            what = found.group(1) if found else one_line(e, 120)
            raise ConfigError(f"{f}: holds {what}, which no checkpoint of the harness holds, and loading it would run "
                              f"code; if you trust where it came from, pass --trust-checkpoint") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def check_run_dir(run_dir: Path, raw: dict[str, Any]) -> None:
    """Before a run directory's config.toml (`raw`, parsed, not resolved) is resolved, which imports the task it
    names: refuse a plug-in task the user did not name and model code the user did not trust."""
    from ..tasks.registry import is_plugin_name, moved_plugin, plugin_path

    trust = TRUST.get()
    if trust.run_dir:
        return
    task = raw.get("run", {}).get("task", "")
    if is_plugin_name(task) and (trust.task is None or plugin_path(trust.task) != task) and \
            not moved_plugin(task, trust.task):
        named = f" (you named {trust.task!r})" if trust.task else ""
        raise ConfigError(f"{run_dir}/config.toml names the plug-in task {task!r}, code that importing it would "
                          f"run{named}; name it yourself with --task {task!r} (the API: task=) or pass "
                          f"--trust-run-dir, if you trust where the run directory came from")
    if raw.get("model", {}).get("trust_remote_code") is True:
        raise ConfigError(f"{run_dir}/config.toml sets model.trust_remote_code = true: its Hugging Face model runs "
                          f"code of its own; pass --trust-run-dir if you trust where the run directory came from")
