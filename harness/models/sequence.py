"""Where a model does something else when its sequences are split over ranks (sequence parallelism), and nothing
else. No distributed code here: `distributed/sequence.py` provides the split (DeepSpeed Ulysses) and makes it current
around a forward pass; without one every function below is the identity, and a model runs as it always has.

Under a split each rank holds one contiguous chunk of every sequence's positions (B, T / N, C), and a model
- numbers its positions from `offset` (its chunk's first position), not from 0;
- attends through `attend`: the all-to-all gives each rank all T positions of a slice of the heads, so the
  attention itself (causal or masked) is the one-process computation;
- masks keys with `whole(mask)`: the key padding of all T positions;
- pools, or maps all positions to one output, with `rows_of`: all positions of its own rows of the batch
  (`rows`), whose loss it then sums; the split batch's per-sequence labels are those rows too.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch


class Split(Protocol):
    rank: int   # this rank's chunk of the positions
    size: int   # ranks a sequence is split over

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core: Callable) -> torch.Tensor: ...

    def whole(self, t: torch.Tensor) -> torch.Tensor: ...

    def rows_of(self, x: torch.Tensor) -> torch.Tensor: ...

    def rows(self, t: torch.Tensor) -> torch.Tensor: ...


_current: Split | None = None


def current() -> Split | None:
    return _current


@contextlib.contextmanager
def split_over(split: Split | None):
    """Forward passes inside run split by `split` (None: not split)."""
    global _current
    before, _current = _current, split
    try:
        yield
    finally:
        _current = before


def offset(local_len: int) -> int:
    """The first position of this rank's chunk of `local_len` positions."""
    return 0 if _current is None else _current.rank * local_len


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core: Callable) -> torch.Tensor:
    """core(q, k, v) on (B, nh, T, hs) over every position: q, k, v and the result hold this rank's positions."""
    return core(q, k, v) if _current is None else _current.attend(q, k, v, core)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A (B, T_local, ...) tensor with no gradient (a padding mask, token ids) over all positions (B, T, ...)."""
    return t if _current is None else _current.whole(t)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """Activations (B, T_local, C) -> this rank's rows over all positions (B_own, T, C); gradients flow back to the
    ranks that computed each position."""
    return x if _current is None else _current.rows_of(x)


def rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows (dim 0) of a tensor every rank holds whole."""
    return t if _current is None else _current.rows(t)


def own_positions(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's chunk along `dim` of a tensor every rank holds whole (e.g. patch tokens made from the input)."""
    return t if _current is None else t.chunk(_current.size, dim)[_current.rank]
