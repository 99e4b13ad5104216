"""Encoder-decoder Transformer for translation. No distributed code here: parallelism is applied from outside.

- Pre-layer-norm blocks from `transformer.py` (`Block` for the encoder, `Block(cross=True)` for the decoder),
  fused attention (SDPA), so tensor-parallel specs match the same names (`attn.*`, `cross_attn.*`, `mlp.*`).
- One shared embedding matrix `embed` (V, C) for source tokens, target tokens and the output projection (the
  joint vocabulary makes this natural). It is a parameter of this top-level module and used only in this
  module's forward, so ZeRO-3 gathers it there. Inputs are scaled by sqrt(C) (Vaswani et al.), init std C^-0.5.
- Init: Xavier-uniform linear weights, not the GPT-style std 0.02 of `transformer.init_weights`: at a width of a
  few hundred, 0.02 leaves attention nearly uniform at the start, and cross-attention alignment is found several
  times later (a 2-layer, 64-wide model learned to copy 8 tokens in ~150 steps with Xavier, ~700 with 0.02).
- Positions are sinusoidal, computed on the fly: no length limit, no parameters, nothing stored (so the
  exported state dict holds only learned weights).
- Padding: the encoder and the cross-attention mask padded source positions; the decoder is causal, and as
  targets are right-padded, no real target position ever sees a pad. Padding therefore never changes the
  outputs at real positions.

Every use goes through the top-level call (ZeRO-3 gathers parameters in module hooks), selected by keywords:
    model(src, tgt_in)                                  -> logits (B, T, V)          teacher forcing
    model(src, tgt_in, keep)                            -> logits (B, T, V)          keep: the real target tokens
    model(src=src)                                      -> (memory (B, S, C), src_mask (B, S))   encode once
    model(tgt_in=tok, memory=m, src_mask=s, cache=c)    -> (logits (B, 1, V), cache) one decoder step
The step's `cache` (None on the first step) is {"self": [(k, v)] per layer, (B, nh, t, hs) growing by one
position a step, reordered by beam search; "cross": [(k, v)] per layer over the memory, computed once}.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import flops, sequence
from .pipeline import PipeLayer, SharedUse
from .transformer import Attention, Block, TransformerConfig


@dataclass(frozen=True)
class Seq2SeqConfig:
    vocab_size: int
    d_model: int = 256
    n_layers: int = 3
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.1
    pad_id: int = 0


def sinusoid(start: int, length: int, dim: int, device) -> torch.Tensor:
    """Positions start..start+length-1 -> (length, dim): sin on even, cos on odd channels."""
    pos = torch.arange(start, start + length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim, device=device)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


class Seq2Seq(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.cfg = cfg
        layer = TransformerConfig(vocab_size=cfg.vocab_size, max_seq_len=0, d_model=cfg.d_model,
                                  n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff, dropout=cfg.dropout)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))  # shared: source, target, output
        self.encoder = nn.ModuleList(Block(layer) for _ in range(cfg.n_layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model)
        self.decoder = nn.ModuleList(Block(layer, cross=True) for _ in range(cfg.n_layers))
        self.dec_norm = nn.LayerNorm(cfg.d_model)
        for m in self.modules():  # Xavier-uniform linears, zero biases (Vaswani et al.; nn.Transformer)
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.embed, std=cfg.d_model ** -0.5)

    def _embed(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        return embed_tokens(self.embed, ids, start, self.cfg.dropout, self.training)

    def forward(self, src: torch.Tensor | None = None, tgt_in: torch.Tensor | None = None,
                keep: torch.Tensor | None = None, *, memory: torch.Tensor | None = None,
                src_mask: torch.Tensor | None = None, cache: dict | None = None):
        if memory is None:
            memory, src_mask = self._encode(src)
            if tgt_in is None:
                return memory, src_mask
            return self._decode(tgt_in, memory, src_mask, keep)
        return self._step(tgt_in, memory, src_mask, cache)

    def forward_flops(self, src: torch.Tensor, tgt_in: torch.Tensor, keep: torch.Tensor) -> float:
        """Analytic FLOPs of teacher forcing, `forward(src, tgt_in, keep)`, over real tokens (see `flops.py`)."""
        c = self.cfg
        s, t = (src != c.pad_id).sum(1), keep.sum(1)  # (B,) source and target lengths
        return flops.encoder_blocks(s, c.n_layers, c.d_model, c.d_ff) + \
            flops.decoder_blocks(t, s, c.n_layers, c.d_model, c.d_ff) + \
            flops.linear(int(t.sum()), c.d_model, c.vocab_size)

    def pipeline_layers(self) -> list:
        """Teacher forcing, `model(src, tgt_in, keep)`, as pipeline layers (`pipeline.py`). Between stages flow
        (x, src_mask, tgt_in, keep) through the encoder, (memory, src_mask, y, keep) through the decoder, then
        (y, keep); the one embedding matrix is a shared parameter used three times (source, target, output)."""
        p, pad, last = self.cfg.dropout, self.cfg.pad_id, len(self.decoder) - 1

        def source(weight, inputs, training):
            src, tgt_in, keep = inputs
            return embed_tokens(weight, src, 0, p, training), src != pad, tgt_in, keep

        def encode(layer, inputs):
            x, src_mask, tgt_in, keep = inputs
            return layer.block(x, mask=src_mask[:, None, None, :]), src_mask, tgt_in, keep

        def target(weight, inputs, training):
            x, src_mask, tgt_in, keep = inputs
            return x, src_mask, embed_tokens(weight, tgt_in, 0, p, training), keep

        def decode(i):
            def run(layer, inputs):
                memory, src_mask, y, keep = inputs
                y = layer.block(y, causal=True, memory=memory, memory_mask=src_mask[:, None, None, :])
                return (y, keep) if i == last else (memory, src_mask, y, keep)  # the memory's last use
            return run

        def output(weight, inputs, training):
            y, keep = inputs
            return F.linear(y, weight)  # (B, T, V): the loss reads the kept positions (see `_decode`)

        return [SharedUse("embed", source),
                *[PipeLayer(encode, block=b) for b in self.encoder],
                PipeLayer(lambda layer, inputs: (layer.norm(inputs[0]), *inputs[1:]), norm=self.enc_norm),
                SharedUse("embed", target),
                *[PipeLayer(decode(i), block=b) for i, b in enumerate(self.decoder)],
                PipeLayer(lambda layer, inputs: (layer.norm(inputs[0]), inputs[1]), norm=self.dec_norm),
                SharedUse("embed", output)]

    def _encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src_mask = src != self.cfg.pad_id  # (B, S), True = real token
        attend = sequence.whole(src_mask)[:, None, None, :]  # (B, 1, 1, S): every query may attend to real keys only
        x = self._embed(src, sequence.offset(src.shape[1]))  # (B, S, C); sequence parallel: this rank's positions
        for block in self.encoder:
            x = block(x, mask=attend)
        return self.enc_norm(x), src_mask

    def _decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                keep: torch.Tensor | None) -> torch.Tensor:
        x = self._embed(tgt_in, sequence.offset(tgt_in.shape[1]))  # (B, T, C)
        attend = sequence.whole(src_mask)[:, None, None, :]
        for block in self.decoder:
            x = block(x, causal=True, memory=memory, memory_mask=attend)
        # Every position, padding too: gathering the N positions the loss reads (x[keep]) would spare the padding's
        # share of the (C x V) projection but waits for the device (a boolean mask's nonzero) every micro-batch; the
        # loss ignores the padding instead (tasks/translation.py), and bucketed batches hold little of it.
        return F.linear(self.dec_norm(x), self.embed)  # (B, T, V)

    def _step(self, tok: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: dict | None):
        """One decoder position for tok (B, 1) given the cached keys/values of the earlier positions.

        Same arithmetic as `Block.forward` in eval mode, split so keys/values are computed once per position
        (each submodule is still called as a module, so ZeRO-3 gathers its weights).
        """
        if cache is None:
            cache = {"self": [None] * len(self.decoder),
                     "cross": [(_heads(b.cross_attn, b.cross_attn.k_proj(memory)),
                                _heads(b.cross_attn, b.cross_attn.v_proj(memory))) for b in self.decoder]}
        start = 0 if cache["self"][0] is None else cache["self"][0][0].shape[2]
        x = self._embed(tok, start)  # (B, 1, C)
        attend = src_mask[:, None, None, :]
        new_self = []
        for block, past, (kc, vc) in zip(self.decoder, cache["self"], cache["cross"]):
            a, h = block.attn, block.ln1(x)
            k, v = _heads(a, a.k_proj(h)), _heads(a, a.v_proj(h))  # (B, nh, 1, hs)
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # (B, nh, t, hs)
            new_self.append((k, v))
            x = x + _attend(a, h, k, v, None)  # the prefix is all real tokens: no mask, no causality needed
            c = block.cross_attn
            x = x + _attend(c, block.ln_cross(x), kc, vc, attend)
            x = x + block.mlp(block.ln2(x))
        logits = F.linear(self.dec_norm(x), self.embed)  # (B, 1, V)
        return logits, {"self": new_self, "cross": cache["cross"]}


def embed_tokens(weight: torch.Tensor, ids: torch.Tensor, start: int, dropout: float, training: bool) -> torch.Tensor:
    """(B, T) -> (B, T, C): token embedding scaled by sqrt(C) plus sinusoidal positions from `start`, dropout."""
    C = weight.shape[1]
    x = F.embedding(ids, weight) * math.sqrt(C)
    return F.dropout(x + sinusoid(start, ids.shape[1], C, ids.device).to(x.dtype), dropout, training)


def _heads(attn: Attention, t: torch.Tensor) -> torch.Tensor:
    """(B, T, C) -> (B, nh, T, hs)"""
    return t.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)


def _attend(attn: Attention, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    q = _heads(attn, attn.q_proj(h))  # (B, nh, 1, hs)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.out_proj(y.transpose(1, 2).flatten(2))  # (B, 1, C)
