"""An encoder-only Transformer over token sequences with padding, and its three heads. No distributed code here.

Embedding -> pre-layer-norm blocks (non-causal self-attention; padded keys masked out) -> final norm -> one head:
- "mlm":      masked-LM logits over the vocabulary, (B, T, vocab);
- "classify": one label per sequence from the mean of its non-padding positions, (B, n_out);
- "residue":  one label per position (e.g. 3 secondary-structure states), (B, T, n_out).
Each head has its own parameter name (`mlm_head`, `cls_head`, `residue_head`), so weights trained with one
objective load into a model with another by name: the shared encoder is taken and the new head starts fresh.
"""
from __future__ import annotations

import torch
from torch import nn

from .transformer import Block, TransformerConfig, init_weights

HEADS = {"mlm": "mlm_head", "classify": "cls_head", "residue": "residue_head"}


class Encoder(nn.Module):
    """Token ids (B, T) and a bool mask (B, T) (True = real token, False = padding) -> the head's output."""

    def __init__(self, cfg: TransformerConfig, head: str, n_out: int):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head {head!r} is not one of {', '.join(HEADS)}")
        self.cfg, self.head = cfg, head
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        setattr(self, HEADS[head], nn.Linear(cfg.d_model, n_out))
        self.apply(init_weights)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(pos))  # (B, T, C)
        # Keys that are padding are never attended to, so a real position's output does not depend on how much
        # padding follows it. (B, 1, 1, T): broadcast over heads and queries.
        attn_mask = mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask=attn_mask)
        x = self.ln_f(x)  # (B, T, C)
        if self.head == "classify":
            m = mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
            pooled = (x * m).sum(1) / m.sum(1).clamp(min=1)  # (B, C): mean over real positions only
            return self.cls_head(pooled)  # (B, n_out)
        return getattr(self, HEADS[self.head])(x)  # (B, T, vocab) or (B, T, n_out)
