"""Hugging Face models built partitioned over the ZeRO-3 ranks: `zero_init` (transformers' `HfDeepSpeedConfig`
around the build), and the loader it hands `models/hf.py` for pretrained safetensors weights, with which each rank
reads only its own share of every parameter (`load_partitioned`)."""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch import nn

from ..models.hf import PARTITIONED_LOADER, from_config, weight_files
from .world import all_gather_objects


@contextlib.contextmanager
def zero_init(ds_config: dict):
    """Build a Hugging Face model already partitioned over the ZeRO-3 ranks: transformers reads the DeepSpeed
    config from `HfDeepSpeedConfig` (kept alive for the build) and constructs and loads inside
    `deepspeed.zero.Init`, each rank keeping its shard."""
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds a weak reference: it must stay alive
    token = PARTITIONED_LOADER.set(load_partitioned)
    try:
        yield
    finally:
        PARTITIONED_LOADER.reset(token)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


@contextlib.contextmanager
def _weights_left_empty():
    """transformers' `from_config` under ZeRO-3 initialises each module gathered whole (`initialize_weights_zero3`):
    work thrown away where every weight is read from a checkpoint next. Skipped for such a build."""
    import transformers.integrations.deepspeed as integration

    real = integration.initialize_weights_zero3
    integration.initialize_weights_zero3 = lambda model: None
    try:
        yield
    finally:
        integration.initialize_weights_zero3 = real


def _flat_range(f, key: str, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of checkpoint tensor `key` flattened, reading only the rows that hold them."""
    part = f.get_slice(key)
    shape = part.get_shape()
    if not shape:
        return f.get_tensor(key).reshape(-1)[start:end]
    row = math.prod(shape[1:])
    first, last = start // row, -(-end // row)
    rows = part[first:last].reshape(-1)
    return rows[start - first * row:end - first * row]


def load_partitioned(cls, config, source: str, trust_remote_code: bool = False) -> tuple[nn.Module | None, str]:
    """Under ZeRO-3 (inside `zero_init`): the model built partitioned with no initialisation (`deepspeed.zero.Init`
    holds a module's parameters whole only while building it), then each rank copies its own share of every
    parameter from the checkpoint's safetensors files, reading only the rows that hold it, with no collective:
    after the build no rank holds more than its share and one parameter's rows. transformers' own loader has rank 0
    read the whole checkpoint and scatter it, module by module. (model, how it was loaded), or (None, why not): a
    checkpoint that is not safetensors, whose names, shapes or dtypes are not the model's own (every parameter and
    persistent buffer), one transformers converts, or a partitioning this cannot write into (hpZ's secondary
    copies, parameters offloaded to NVMe) is left to transformers (which renames, converts and initialises). The
    ranks agree before each collective step, so a rank missing a file cannot leave the others waiting."""
    from safetensors import safe_open

    def agreed(why: str | None) -> str | None:  # the first rank's reason to fall back, on every rank
        return next((w for w in all_gather_objects(why) if w), None)

    files = weight_files(source)
    why = agreed(None if files else "no safetensors weights (in the directory, or in the hub id's snapshot in the "
                                    "cache)")
    if why:
        return None, why
    headers = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                headers[key] = (tuple(part.get_shape()), part.get_dtype())
    with _weights_left_empty():
        model = from_config(cls, config, trust_remote_code)
    own = model.state_dict(keep_vars=True)  # name -> parameter or persistent buffer; tied weights under each name
    why = agreed(_unloadable(model, own, headers))
    if why:
        del model, own
        return None, why
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    t = own[key]
                    if hasattr(t, "ds_tensor"):  # a ZeRO-3 parameter: this rank's slice of it, flattened and padded
                        size = t.ds_tensor.ds_numel
                        start = size * torch.distributed.get_rank(group=t.ds_process_group)
                        end = min(start + size, t.ds_numel)
                        if start < end:
                            t.ds_tensor[:end - start].copy_(_flat_range(f, key, start, end))
                    else:  # buffers are whole on every rank
                        t.copy_(f.get_tensor(key))
    from transformers import GenerationConfig

    local = Path(source).is_dir()
    if getattr(model, "generation_config", None) is not None and \
            (not local or (Path(source) / "generation_config.json").is_file()):
        try:  # what from_pretrained reads beside the weights: the checkpoint's decoding defaults
            model.generation_config = GenerationConfig.from_pretrained(source)
        except (OSError, ValueError):
            pass  # none there: the config's defaults, as from_pretrained keeps them
    return model, f"each rank read its own share of {len(files)} safetensors file(s)"


def _unloadable(model: nn.Module, own: dict[str, torch.Tensor], headers: dict[str, tuple]) -> str | None:
    """Why the partitioned loader cannot fill `model` (its state dict `own`, kept tensors) from checkpoint tensors
    `headers` ({name: (shape, dtype)}), or None."""
    from deepspeed.runtime.zero.partition_parameters import OffloadDeviceEnum

    try:
        from transformers.conversion_mapping import (
            WeightConverter,
            get_model_conversion_mapping,
        )
        if any(isinstance(c, WeightConverter) for c in get_model_conversion_mapping(model)):
            return "transformers converts this model's checkpoint tensors"
    except ImportError:  # an older transformers: no conversions
        pass
    loaded = set()
    for key, (shape, dtype) in headers.items():
        t = own.get(key)
        if t is None:
            return f"the checkpoint's {key!r} is not one of the model's names"
        ours = tuple(getattr(t, "ds_shape", t.shape))  # a partitioned parameter's whole shape
        if ours != shape or _SAFETENSORS_DTYPES.get(dtype) != t.dtype:
            return f"{key!r} is {dtype} {list(shape)} in the checkpoint, {t.dtype} {list(ours)} in the model"
        if hasattr(t, "ds_tensor") and (getattr(t, "ds_secondary_tensor", None) is not None or
                                        getattr(t.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme or
                                        t.ds_tensor.numel() != t.ds_tensor.ds_numel):
            return "its parameters are partitioned in a way the partitioned loader does not write (hpZ or NVMe)"
        loaded.add(id(t))
    missing = [k for k, t in own.items() if id(t) not in loaded]
    return f"the checkpoint has no {missing[0]!r}" if missing else None


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}
