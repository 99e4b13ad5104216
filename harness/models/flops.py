"""Analytic FLOPs of the models' forward passes, for model FLOPs utilisation (MFU).

Counted: every matrix multiply, 2 FLOPs per multiply-add. Not counted: norms, softmax, activations, dropout,
embedding lookups (a few percent at most). With d the width, f the feed-forward width, V the vocabulary:
- a linear layer (in -> out) over n positions:            2 n in out
- self-attention over t positions, per layer:             2 t (4 d^2)   q, k, v, out projections
                                                         + 4 t^2 d      scores Q K^T and the weighted sum A V
  (all t^2 pairs, also under a causal mask, as PaLM's MFU counts them: the kernels compute them too)
- the feed-forward block over t positions:                2 t (2 d f)
- cross-attention, t target over s source positions:      2 t (2 d^2) + 2 s (2 d^2) + 4 t s d
A training step costs 3x the forward FLOPs (the backward pass computes gradients for activations and for
weights, each as costly as the forward); activation recomputation is not counted (it is not model work).
Lengths are each sequence's real length, not the padded one: padding is work the hardware does for nothing,
reported separately as the padding fraction.
"""
from __future__ import annotations

import torch

TRAIN_FACTOR = 3  # forward + backward (2x forward)


def linear(n, d_in: int, d_out: int):
    return 2 * n * d_in * d_out


def self_attention(t, d: int):
    """t: positions (a tensor of lengths, summed by the caller, or a number); attention pairs per sequence t^2."""
    return linear(t, d, 4 * d) + 4 * t * t * d


def cross_attention(t, s, d: int):
    return linear(t, d, 2 * d) + linear(s, d, 2 * d) + 4 * t * s * d


def feed_forward(t, d: int, f: int):
    return linear(t, d, f) + linear(t, f, d)


def encoder_blocks(lengths: torch.Tensor, layers: int, d: int, f: int) -> float:
    """Pre-LN blocks with self-attention over each sequence's own length; lengths (B,)."""
    t = lengths.double()
    return float(layers * (self_attention(t, d) + feed_forward(t, d, f)).sum())


def uniform_blocks(batch: int, length: int, layers: int, d: int, f: int) -> float:
    """`encoder_blocks` for `batch` sequences all of `length` positions (causal or not), in Python numbers: no
    tensor work for the host to do on every step."""
    return float(batch * layers * (self_attention(length, d) + feed_forward(length, d, f)))


def decoder_blocks(t_lengths: torch.Tensor, s_lengths: torch.Tensor, layers: int, d: int, f: int) -> float:
    """Blocks with causal self-attention, cross-attention over the source, feed-forward; lengths (B,)."""
    t, s = t_lengths.double(), s_lengths.double()
    return float(layers * (self_attention(t, d) + cross_attention(t, s, d) + feed_forward(t, d, f)).sum())


class ForwardFlops:
    """FLOPs of one forward pass over a batch, for the logged TFLOP/s and MFU: the model's own analytic
    `forward_flops(*inputs)` where it has one; else counted by torch's FlopCounterMode on a forward pass of the
    meta-device model (no memory, no compute), once per input shape; else, for a model whose forward needs real
    values, 2 N per item (N parameters: the 6 N per item of a training step). `method` says which one is in use."""

    def __init__(self, meta_model: torch.nn.Module):
        self.model = meta_model
        self.method = "analytic" if hasattr(meta_model, "forward_flops") else "counted"
        self.n_params = sum(p.numel() for p in meta_model.parameters())
        self.cache: dict[tuple, float] = {}

    def __call__(self, inputs: tuple, items: int) -> float:
        if self.method == "analytic":
            return self.model.forward_flops(*inputs)
        if self.method == "counted":
            key = tuple((tuple(x.shape), x.dtype) if torch.is_tensor(x) else repr(x) for x in inputs)
            if key not in self.cache:
                try:
                    self.cache[key] = _count(self.model, inputs)
                except Exception:  # noqa: BLE001 - a forward that reads values (e.g. .item()) cannot run on meta
                    self.method = "6N per item"
            if self.method == "counted":
                return self.cache[key]
        return 2.0 * self.n_params * items


def _count(model: torch.nn.Module, inputs: tuple) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    meta = tuple(x.to("meta") if torch.is_tensor(x) else x for x in inputs)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*meta)
    return float(counter.get_total_flops())
