"""Sequence parallelism (DeepSpeed Ulysses): each sequence split over `sequence_parallel_size` ranks by positions.

The process groups are DeepSpeed's own (`deepspeed.runtime.sequence_parallel.parallel_state_sp`, the ALST recipe's
`mpu`): ranks sp*i .. sp*i + sp - 1 split one data shard's sequences, and ZeRO partitions and reduces over the whole
world. Attention is Ulysses' (deepspeed/sequence/layer.py, `DistributedAttention`): an all-to-all (DeepSpeed's own
differentiable one, `_dim_zero_all_to_all`) turns each rank's positions of every head into every position of its
heads, the attention runs whole, and a second all-to-all turns it back. The models' side of it is
`models/sequence.py`; this module provides the split (`Ulysses`) and cuts a batch (`Ulysses.batch`): the keys a task
names as positions are chunked (padded to a multiple of the size with the task's own padding values first), the keys
it names as rows (one value per sequence) are split by rows, the rest stay whole.

Normalisation (checked against one process in tests/test_sequence.py): every rank's loss is the sum over its own
positions (or rows), the loop divides by the global count; DeepSpeed sums the gradients over the sequence ranks and
averages over the data ranks under ZeRO 0-2 (stage_1_and_2.py divides by dp x sp / sp), but averages over both
under ZeRO-3 (its reduce-scatter path, `__avg_scatter_grads`; `reduce_scatter: false` is refused, config/layout.py),
so there the loss is multiplied by the size (`loss_factor`).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

POSITIONS, ROWS = "positions", "rows"


class _RowsOf(torch.autograd.Function):
    """(B, T_local, ...) on each rank -> this rank's rows over every position (B_own, T, ...). Backward: each rank's
    gradient for its rows, summed over the ranks, gives each its positions' gradient for every row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, split: "Ulysses") -> torch.Tensor:
        ctx.split, ctx.shape = split, x.shape
        full = split.whole(x.detach())
        ctx.rows = _row_range(full.shape[0], split.rank, split.size)
        return full[ctx.rows[0]:ctx.rows[1]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split, (B, T_local) = ctx.split, ctx.shape[:2]
        full = grad.new_zeros((B, T_local * split.size, *ctx.shape[2:]))
        full[ctx.rows[0]:ctx.rows[1]] = grad
        dist.all_reduce(full, group=split.group)
        return full[:, split.rank * T_local:(split.rank + 1) * T_local].contiguous(), None


def _all_to_all(group, x: torch.Tensor) -> torch.Tensor:
    """x (size, ...): x[i] goes to rank i, and the result's [i] came from rank i; differentiable (the gradient goes
    back the same way) and traceable by torch.compile: DeepSpeed's operator."""
    from deepspeed.sequence.layer import _dim_zero_all_to_all

    return _dim_zero_all_to_all(group, x)


def _row_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [start, end) of rank's share of n (torch.tensor_split's: the first n % size ranks hold one more)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class Ulysses:
    """The split of this rank's sequences over its sequence-parallel group (`models.sequence.Split`)."""

    def __init__(self, group, rank: int, size: int, zero_stage: int):
        from deepspeed.sequence.layer import register_all_to_all_group

        register_all_to_all_group(group)  # DeepSpeed's all-to-all finds its group by name
        self.group, self.rank, self.size = group, rank, size
        self.loss_factor = size if zero_stage == 3 else 1  # see the module's docstring

    # --- the models' hooks ---
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core) -> torch.Tensor:
        """q, k, v (B, nh, T_local, hs) -> core over every position of nh / size heads -> (B, nh, T_local, hs)."""
        return self._heads_to_positions_back(core(*(self._positions(t) for t in (q, k, v))))

    def _positions(self, t: torch.Tensor) -> torch.Tensor:
        """(B, nh, T_local, hs) -> (B, nh / size, T, hs): send head group i to rank i, receive its positions."""
        B, nh, T, hs = t.shape
        parts = t.view(B, self.size, nh // self.size, T, hs).transpose(0, 1)  # (size, B, nh/size, T_local, hs)
        got = _all_to_all(self.group, parts)  # [j]: rank j's positions of my head group
        return got.permute(1, 2, 0, 3, 4).reshape(B, nh // self.size, self.size * T, hs)

    def _heads_to_positions_back(self, y: torch.Tensor) -> torch.Tensor:
        """(B, nh / size, T, hs) -> (B, nh, T_local, hs): the inverse of `_positions`."""
        B, h, T, hs = y.shape
        parts = y.view(B, h, self.size, T // self.size, hs).permute(2, 0, 1, 3, 4)  # (size, B, h, T_local, hs)
        got = _all_to_all(self.group, parts)  # [j]: head group j of my positions
        return got.transpose(0, 1).reshape(B, h * self.size, T // self.size, hs)

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, T_local, ...) joined along positions, no gradient."""
        send = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool collectives
        parts = [torch.empty_like(send) for _ in range(self.size)]
        dist.all_gather(parts, send.contiguous(), group=self.group)
        full = torch.cat(parts, 1)
        return full.bool() if t.dtype == torch.bool else full

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        return _RowsOf.apply(x, self)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        start, end = _row_range(t.shape[0], self.rank, self.size)
        return t[start:end]

    # --- the loop's side ---
    def batch(self, task, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a batch every rank of the group read whole (see the module's docstring)."""
        keys = task.sequence_split(batch)
        pads = task.pad_values() if hasattr(task, "pad_values") else {}
        out = {}
        for key, t in batch.items():
            how = keys.get(key)
            if how == ROWS:
                t = self.rows(t)
            elif how == POSITIONS:
                short = -t.shape[1] % self.size
                if short:
                    if key not in pads:
                        raise ValueError(f"batch key {key!r}: {t.shape[1]} positions do not split over "
                                         f"sequence_parallel_size {self.size}, and the task gives no padding value "
                                         f"for it (pad_values)")
                    t = torch.cat([t, t.new_full((t.shape[0], short, *t.shape[2:]), pads[key])], 1)
                t = t.chunk(self.size, 1)[self.rank]
            out[key] = t
        return out


def hf_ulysses(model, world) -> Callable[[], None]:
    """A Hugging Face model's attention split the same way, by DeepSpeed's HF Ulysses class (runtime/sequence_parallel/
    ulysses_sp.py, `UlyssesSPAttentionHF`), put around the attention function the model uses in transformers' table
    (e.g. "sdpa") as its `register_with_transformers` does, with two differences: the groups are the ones
    `world.init_world` made, and one instance per batch size (DeepSpeed's fixes the batch size, and a validation set's
    last batch is smaller). Like DeepSpeed's wrapper it drops the model's attention mask (the causal mask follows the
    gathered position ids; a padding mask would be lost: only the lm task takes it). Returns what undoes the wrapping
    (the table is process-wide)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    kind, config = model.config._attn_implementation, model.config.get_text_config()
    if kind not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise RuntimeError(f"sequence parallelism with a Hugging Face model needs attn_implementation sdpa or flash "
                           f"attention (DeepSpeed's UlyssesSPAttentionHF); this model uses {kind!r}")
    core, group = ALL_ATTENTION_FUNCTIONS[kind], parallel_state_sp.get_sequence_parallel_group()
    by_batch: dict[int, UlyssesSPAttentionHF] = {}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        batch = query.shape[0]
        if batch not in by_batch:
            by_batch[batch] = UlyssesSPAttentionHF(
                attn=core, batch_size=batch, attn_head_count=config.num_attention_heads,
                attn_head_size=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                kv_head_count=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                num_hidden_layers=config.num_hidden_layers,
                process_group=group, seq_length_is_variable=True)
            by_batch[batch].core_attn_implementation = kind
        return by_batch[batch](module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[kind] = attention

    def undo() -> None:
        ALL_ATTENTION_FUNCTIONS[kind] = core
    return undo


def ulysses(world, zero_stage: int) -> Ulysses | None:
    """The split for this rank (None without sequence parallelism). The groups are made by `world.init_world`."""
    if world.sp_size == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return Ulysses(parallel_state_sp.get_sequence_parallel_group(), world.sp_rank, world.sp_size, zero_stage)
