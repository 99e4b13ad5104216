"""Pre-layer-norm Transformer layers shared by every model, and the decoder-only LM.
No distributed code here: parallelism is applied from outside.

Module names follow one convention that tensor-parallel layer specs match on:
`attn.q_proj`, `attn.k_proj`, `attn.v_proj` (column-parallel), `attn.out_proj` (row-parallel),
`mlp.fc_in` (column-parallel), `mlp.fc_out` (row-parallel); cross-attention is `cross_attn.*`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import flops, sequence
from .pipeline import PipeLayer


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    max_seq_len: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    dropout: float = 0.0


class Attention(nn.Module):
    """Multi-head attention over `x` (self-attention) or over `kv` (cross-attention), fused by SDPA. Under sequence
    parallelism `x`, `kv` hold this rank's positions and `mask` covers every key (`sequence.py`)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        self.head_dim, self.dropout = d_model // n_heads, dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        """x (B, T, C), kv (B, S, C) or None; mask bool, broadcastable to (B, nh, T, S), True = may attend."""
        kv = x if kv is None else kv
        # (B, T, C) -> (B, nh, T, hs); the head count comes from the weight, so a column-split q_proj
        # (tensor parallel) simply sees fewer local heads.
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        k, v = (p(kv).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        dropout = self.dropout if self.training else 0.0

        def core(q, k, v, mask=mask, causal=causal):  # over every position (sequence parallel: after the all-to-all)
            if causal and mask is not None:  # SDPA takes one or the other: fold causality into the mask
                T, S = q.shape[-2], k.shape[-2]
                mask, causal = mask & torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T), False
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
        y = sequence.attend(q, k, v, core)
        return self.out_proj(y.transpose(1, 2).flatten(2))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-layer-norm block: self-attention, optional cross-attention over `memory` (a decoder), feed-forward."""

    def __init__(self, cfg: TransformerConfig, cross: bool = False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn, self.mlp = Attention(cfg.d_model, cfg.n_heads, cfg.dropout), MLP(cfg)
        if cross:
            self.ln_cross = nn.LayerNorm(cfg.d_model)
            self.cross_attn = Attention(cfg.d_model, cfg.n_heads, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False,
                memory: torch.Tensor | None = None, memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask=mask, causal=causal))
        if memory is not None:
            x = x + self.drop(self.cross_attn(self.ln_cross(x), kv=memory, mask=memory_mask))
        return x + self.drop(self.mlp(self.ln2(x)))


def init_weights(m: nn.Module) -> None:
    """GPT-2 style: normal(0, 0.02) weights, zero biases; LayerNorms keep their defaults."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class TransformerLM(nn.Module):
    """Decoder-only language model: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(init_weights)

    def forward(self, ids: torch.Tensor, documents: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                chunk: int = 0) -> torch.Tensor:
        """Logits (B, T, vocab); with `documents` (B, T: each position's document, packed data), attention stays
        inside each document and positions count from its start; with `targets` (B, T) the summed cross-entropy
        instead, computed `chunk` positions at a time (0: at once) so that the logits never exist whole."""
        every = None if documents is None else sequence.whole(documents)  # over all positions (sequence parallel)
        x = _embed(self, ids, every)  # (B, T, C)
        mask = None if every is None else (every[:, :, None] == every[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
        for block in self.blocks:
            x = block(x, mask=mask, causal=True)
        if targets is None:
            return _head(self, x)  # (B, T, vocab)
        return chunked_loss(lambda h: _head(self, h), x, targets, chunk)

    def forward_flops(self, ids: torch.Tensor, documents: torch.Tensor | None = None) -> float:
        """Analytic FLOPs of `forward(ids)` (see `flops.py`); a document mask computes every pair all the same."""
        c, (B, T) = self.cfg, ids.shape
        return flops.uniform_blocks(B, T, c.n_layers, c.d_model, c.d_ff) + flops.linear(B * T, c.d_model, c.vocab_size)

    def pipeline_layers(self) -> list[nn.Module]:
        """The same forward as pipeline layers (`pipeline.py`): ids -> x (B, T, C) -> ... -> logits."""
        return [PipeLayer(_embed, tok_emb=self.tok_emb, pos_emb=self.pos_emb, drop=self.drop),
                *[PipeLayer(lambda layer, x: layer.block(x, causal=True), block=b) for b in self.blocks],
                PipeLayer(_head, ln_f=self.ln_f, head=self.head)]


def recomputable(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """What train.activation_checkpointing recomputes in `model`: the harness's own Transformer blocks, and the
    outermost Hugging Face models (a plug-in's backbone too) that checkpoint their own layers."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    hf, inside = [], set()
    for m in model.modules():  # outer modules first: one inside a model taken is that model's
        if id(m) not in inside and getattr(m, "supports_gradient_checkpointing", False):
            hf.append(m)
            inside.update(id(x) for x in m.modules())
    return blocks, hf


def chunked_loss(head, x: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The summed cross-entropy of head(x) (B, T, vocab) against targets (B, T), over `chunk` positions at a time (0:
    all): in training each chunk is checkpointed, so its logits and their fp32 copy live only while it is computed,
    in the forward pass and again in the backward (Liger's and ALST's tiled loss; one more head matmul per chunk)."""
    flat, t = x.flatten(0, 1), targets.flatten()
    chunk = chunk or len(flat)
    if chunk >= len(flat) or not torch.is_grad_enabled():
        return sum(_chunk_loss(head, flat[i:i + chunk], t[i:i + chunk]) for i in range(0, len(flat), chunk))
    from torch.utils.checkpoint import checkpoint

    return sum(checkpoint(_chunk_loss, head, flat[i:i + chunk], t[i:i + chunk], use_reentrant=False)
               for i in range(0, len(flat), chunk))


def _chunk_loss(head, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), t, reduction="sum")


# Parts of the forward pass, on the model or on a pipeline layer holding the same modules under the same names.
def _embed(m, ids: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """`documents`: of every position (B, T), whole under sequence parallelism."""
    if documents is not None:  # each position counted from its document's start
        pos = sequence.own_positions(document_positions(documents))
    else:
        start = sequence.offset(ids.shape[1])  # this rank's first position under sequence parallelism, else 0
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
    return m.drop(m.tok_emb(ids) + m.pos_emb(pos))  # (B, T, C)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) documents of packed positions -> each position's place in its document."""
    at = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return at - torch.where(starts, at, 0).cummax(1).values


def _head(m, x: torch.Tensor) -> torch.Tensor:
    return m.head(m.ln_f(x))  # (B, T, vocab)
