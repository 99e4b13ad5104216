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
    `forward_flops(*inputs)` where it has one; for a Hugging Face Transformer, the same count from its config over the
    batch's real positions (`hf_forward_flops`: transformers' forward reads values, so it cannot run on the meta
    device); else counted by torch's FlopCounterMode on a forward pass of the meta-device model (no memory, no
    compute), once per input shape; else, for a model whose forward needs real values, estimated as 2 N per item (N
    parameters: the 6 N per item of a training step). `method` says which one is in use: the start line and every
    metrics record say it, "estimated: ..." once a count has failed."""

    def __init__(self, meta_model: torch.nn.Module):
        from .hf import is_hf

        self.model = meta_model
        self.hf = hf_shape(meta_model) if not hasattr(meta_model, "forward_flops") and is_hf(meta_model) else None
        self.method = "analytic" if hasattr(meta_model, "forward_flops") else \
            "analytic (Hugging Face config)" if self.hf else "counted"
        self.n_params = sum(p.numel() for p in meta_model.parameters())
        self.cache: dict[tuple, float] = {}

    def __call__(self, inputs: tuple, items: int) -> float:
        if self.method == "analytic":
            return self.model.forward_flops(*inputs)
        if self.hf is not None:
            if _token_ids(inputs):
                return hf_forward_flops(self.hf, inputs)
            self.hf, self.method = None, "counted"  # called otherwise: counted on the meta device as any model
        if self.method == "counted":
            key = tuple((tuple(x.shape), x.dtype) if torch.is_tensor(x) else repr(x) for x in inputs)
            if key not in self.cache:
                try:
                    self.cache[key] = _count(self.model, inputs)
                except Exception:  # noqa: BLE001 - a forward that reads values (e.g. .item()) cannot run on meta
                    self.method = "estimated: 6N per item (the meta-device count failed)"
            if self.method == "counted":
                return self.cache[key]
        return 2.0 * self.n_params * items


def hf_shape(model: torch.nn.Module) -> dict | None:
    """What the FLOPs of a Hugging Face Transformer depend on, read from its config and parameter names (None where
    the config does not name a width, a depth and heads): width d, feed-forward width f (gated: three matrices,
    as Llama's gate/up/down or T5's wi_0/wi_1/wo), heads h of dim dh and key/value heads kv, encoder and decoder
    layers, vocabulary V, and the head: "lm" (every output position to V), "mlm" (ESM/BERT: a d x d dense, then V),
    "tokens" (every position to the labels; also Llama's sequence classifier, which scores every position and keeps
    the last), "sequence" (one position per sequence: a d x d dense, then the labels; ESM's and RoBERTa's head)."""
    c = getattr(model, "config", None)
    d = getattr(c, "hidden_size", None) or getattr(c, "d_model", None)
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "num_heads", None)
    layers = getattr(c, "num_hidden_layers", None) or getattr(c, "num_layers", None)
    if not (d and heads and layers):
        return None
    names = [n for n, _ in model.named_parameters()]
    kind = type(model).__name__
    head = ("sequence" if kind.endswith("ForSequenceClassification") and any("classifier.dense." in n for n in names)
            else "tokens" if kind.endswith(("ForTokenClassification", "ForSequenceClassification")) else
            "mlm" if kind.endswith("ForMaskedLM") and any(".dense." in n and "lm_head" in n for n in names) else "lm")
    dh = getattr(c, "head_dim", None) or getattr(c, "d_kv", None) or d // heads
    return {"d": d, "f": getattr(c, "intermediate_size", None) or getattr(c, "d_ff", None) or 4 * d,
            "gated": any(n.endswith(("gate_proj.weight", "wi_0.weight")) for n in names),
            "h": heads, "kv": getattr(c, "num_key_value_heads", None) or heads, "dh": dh,
            "encoder_layers": layers if c.is_encoder_decoder else 0,
            "decoder_layers": (getattr(c, "num_decoder_layers", None) or layers) if c.is_encoder_decoder else layers,
            "V": getattr(c, "vocab_size", 0),
            "labels": getattr(c, "num_labels", 2), "head": head, "pad": getattr(c, "pad_token_id", None)}


def _token_ids(inputs: tuple) -> bool:
    """Whether a Hugging Face model is called as the tasks call it: token ids (B, T) first (else: counted)."""
    return bool(inputs) and torch.is_tensor(inputs[0]) and inputs[0].dim() == 2 and \
        not torch.is_floating_point(inputs[0])


def hf_forward_flops(s: dict, inputs: tuple) -> float:
    """Analytic FLOPs of a forward pass of the model `hf_shape` describes, over the real positions of `inputs` (the
    tasks call `model(input_ids[, attention_mask[, decoder_input_ids]])`): per layer q and o projections over h x dh,
    k and v over kv x dh, all position pairs of attention (4 t^2 h dh; cross-attention 4 t s h dh, its k and v over
    the source), the feed-forward (2 or 3 d x f matrices), and the head."""
    ids = inputs[0]
    mask = inputs[1] if len(inputs) > 1 and inputs[1] is not None else torch.ones_like(ids, dtype=torch.bool)
    src = mask.sum(1).double()  # (B,) real positions of each sequence
    q, kv = s["h"] * s["dh"], s["kv"] * s["dh"]
    d, f = s["d"], s["f"]
    mlp = lambda t: (3 if s["gated"] else 2) * linear(t, d, f)  # noqa: E731

    def attend(t, k):  # t queries over k keys: projections and every pair
        return linear(t, d, q) + linear(t, q, d) + 2 * linear(k, d, kv) + 4 * t * k * q

    if s["encoder_layers"]:  # encoder-decoder: the target's real positions (its first is the start token, often pad)
        real = inputs[2] != s["pad"] if s["pad"] is not None else torch.ones_like(inputs[2], dtype=torch.bool)
        real[:, 0] = True
        tgt = real.sum(1).double()
        total = s["encoder_layers"] * (attend(src, src) + mlp(src))
        total = total + s["decoder_layers"] * (attend(tgt, tgt) + attend(tgt, src) + mlp(tgt))
        out, rows = tgt, float(tgt.sum())
    else:
        total = s["decoder_layers"] * (attend(src, src) + mlp(src))
        out, rows = src, float(src.sum())
    head = {"lm": linear(rows, d, s["V"]), "mlm": linear(rows, d, d) + linear(rows, d, s["V"]),
            "tokens": linear(rows, d, s["labels"]),
            "sequence": linear(len(out), d, d) + linear(len(out), d, s["labels"])}[s["head"]]
    return float(total.sum()) + head


def _count(model: torch.nn.Module, inputs: tuple) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    meta = tuple(x.to("meta") if torch.is_tensor(x) else x for x in inputs)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*meta)
    return float(counter.get_total_flops())
