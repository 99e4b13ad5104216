"""An encoder-only Transformer over token sequences with padding, and its three heads. No distributed code here.

Embedding -> pre-layer-norm blocks (non-causal self-attention; padded keys masked out) -> final norm -> one head:
- "mlm":      masked-LM logits over the vocabulary, (B, T, vocab);
- "classify": one label per sequence from its pooled non-padding positions, (B, n_out);
- "residue":  one label per position (e.g. 3 secondary-structure states), (B, T, n_out);
- "regress":  one value per sequence from the same pooling, (B, 1).
Pooling (`pooling`) is the mean of the real positions, or "attention": a learned score per position (`pool_score`),
softmax over the real positions, and the weighted sum, which lets the head look at the few positions that matter
(e.g. the four mutated sites of a fitness landscape, where a mean drowns them in 260 identical ones).
With `ridge` (regress only) the model also holds a linear model on one-hot tokens, `ridge_table` (a weight per position
and token id, the intercept on <cls>), and its share `ridge_mix`: buffers, not trained. Training sees the head's
prediction alone; in eval mode the prediction is (1 - ridge_mix) * head + ridge_mix * linear (`protein.blend`).
Each head has its own parameter name (`mlm_head`, `cls_head`, `residue_head`), so weights trained with one
objective load into a model with another by name: the shared encoder is taken and the new head starts fresh.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from . import flops, sequence
from .pipeline import PipeLayer
from .transformer import Block, TransformerConfig, init_weights

HEADS = {"mlm": "mlm_head", "classify": "cls_head", "residue": "residue_head", "regress": "reg_head"}
POOLED = ("classify", "regress")  # heads over the mean of the real positions


class Encoder(nn.Module):
    """Token ids (B, T) and a bool mask (B, T) (True = real token, False = padding) -> the head's output."""

    def __init__(self, cfg: TransformerConfig, head: str, n_out: int, pooling: str = "mean", ridge: bool = False):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head {head!r} is not one of {', '.join(HEADS)}")
        if pooling not in ("mean", "attention"):
            raise ValueError(f"pooling {pooling!r} is not mean or attention")
        self.cfg, self.head = cfg, head
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        setattr(self, HEADS[head], nn.Linear(cfg.d_model, n_out))
        if pooling == "attention" and head in POOLED:
            self.pool_score = nn.Linear(cfg.d_model, 1)
        self.apply(init_weights)
        if ridge:  # a linear model on one-hot tokens to mix with the head's prediction (`protein.blend`)
            if head != "regress":
                raise ValueError(f"a ridge blend is for the regress head, not {head!r}")
            self.register_buffer("ridge_table", torch.zeros(cfg.max_seq_len * cfg.vocab_size))  # (position, id)
            self.register_buffer("ridge_mix", torch.zeros(()))  # its share of the prediction in eval mode

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x, keys = _embed(self, (ids, mask))  # (B, T, C); the mask over every position under sequence parallelism
        for block in self.blocks:
            x, _ = _block(block, (x, keys))
        out = _out(self.head, self, (x, keys))
        if hasattr(self, "ridge_table") and not self.training and self.ridge_mix:  # trained alone, mixed when used
            # the pooled output's rows, over every position under sequence parallelism (less the padding that evened
            # the split, which may run past the table)
            rows = sequence.rows
            ids, mask = rows(sequence.whole(ids))[:, :self.cfg.max_seq_len], rows(keys)[:, :self.cfg.max_seq_len]
            out = out + self.ridge_mix * (self.ridge(ids, mask) - out)
        return out

    def ridge(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The linear model's prediction (B, 1): its weight for each real position's token, summed."""
        cells = ids + torch.arange(ids.shape[1], device=ids.device) * self.cfg.vocab_size  # (B, T)
        return (self.ridge_table[cells] * mask).sum(1, keepdim=True).to(self.ridge_mix.dtype)

    def forward_flops(self, ids: torch.Tensor, mask: torch.Tensor) -> float:
        """Analytic FLOPs of `forward(ids, mask)` over the real (unpadded) positions (see `flops.py`)."""
        c, lengths = self.cfg, mask.sum(1)
        n_out = getattr(self, HEADS[self.head]).out_features
        head = flops.linear(len(ids) if self.head in POOLED else int(lengths.sum()), c.d_model, n_out)
        if hasattr(self, "pool_score"):
            head += flops.linear(int(lengths.sum()), c.d_model, 1)
        return flops.encoder_blocks(lengths, c.n_layers, c.d_model, c.d_ff) + head

    def pipeline_layers(self) -> list[nn.Module]:
        """The same forward as pipeline layers (`pipeline.py`): (ids, mask) -> (x, mask) -> ... -> head output."""
        head = HEADS[self.head]
        return [PipeLayer(_embed, tok_emb=self.tok_emb, pos_emb=self.pos_emb, drop=self.drop),
                *[PipeLayer(lambda layer, inputs: _block(layer.block, inputs), block=b) for b in self.blocks],
                PipeLayer(partial(_out, self.head), ln_f=self.ln_f, **{head: getattr(self, head)},
                          **({"pool_score": self.pool_score} if hasattr(self, "pool_score") else {}))]


# Parts of the forward pass, on the model or on a pipeline layer holding the same modules under the same names.
def _out(kind: str, m, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Final norm and the head of `kind`."""
    x, mask = inputs
    x = m.ln_f(x)  # (B, T, C)
    if kind in POOLED:  # under sequence parallelism: this rank's rows, over every position
        x, mask = sequence.rows_of(x), sequence.rows(mask)
        w = mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        if hasattr(m, "pool_score"):  # softmax of a learned score over the real positions
            w = m.pool_score(x).masked_fill(~mask.unsqueeze(-1), float("-inf")).softmax(1)
        pooled = (x * w).sum(1) / w.sum(1).clamp(min=1e-9)  # (B, C): over real positions only
        return getattr(m, HEADS[kind])(pooled)  # (B, n_out)
    return getattr(m, HEADS[kind])(x)  # (B, T, vocab) or (B, T, n_out)


def _embed(m, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = inputs
    start = sequence.offset(ids.shape[1])  # this rank's first position under sequence parallelism, else 0
    # padding that evens a sequence out for the split may run past the table: masked keys, ignored outputs
    pos = torch.arange(start, start + ids.shape[1], device=ids.device).clamp(max=m.pos_emb.num_embeddings - 1)
    # the mask travels whole (every position's, under sequence parallelism): the keys every block masks
    return m.drop(m.tok_emb(ids) + m.pos_emb(pos)), sequence.whole(mask)  # (B, T, C), (B, T)


def _block(block: Block, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # Keys that are padding are never attended to, so a real position's output does not depend on how much
    # padding follows it. mask[:, None, None, :] is (B, 1, 1, T): broadcast over heads and queries.
    x, mask = inputs
    return block(x, mask=mask[:, None, None, :]), mask
