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


def decoder_blocks(t_lengths: torch.Tensor, s_lengths: torch.Tensor, layers: int, d: int, f: int) -> float:
    """Blocks with causal self-attention, cross-attention over the source, feed-forward; lengths (B,)."""
    t, s = t_lengths.double(), s_lengths.double()
    return float(layers * (self_attention(t, d) + cross_attention(t, s, d) + feed_forward(t, d, f)).sum())
