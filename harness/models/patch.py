"""PatchTST-style forecaster (Nie et al., 2023): an encoder-only Transformer over patches of one series.

Channel-independent: each of the C channels of a window is forecast on its own by the same weights (the channels
are folded into the batch). Each input window is normalised per series, RevIN without affine weights: minus its
own mean (or its last value with `center="last"`, PatchTST's `subtract_last`), over its own std; the forecast is
mapped back with them, so shifting or scaling an input window shifts or scales its forecast the same way.
The series is cut into patches of `patch_len` steps every `stride` steps (after repeating the last value `stride`
times, as PatchTST does), each patch is a token, and a flatten head maps all tokens to the next `horizon` steps
at once. No distributed code here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from . import flops, sequence
from .pipeline import PipeLayer
from .transformer import Block, TransformerConfig, init_weights


@dataclass(frozen=True)
class PatchConfig:
    lookback: int = 96
    horizon: int = 24
    patch_len: int = 16
    stride: int = 8
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    dropout: float = 0.0
    head_dropout: float = 0.0
    center: str = "mean"  # instance normalisation subtracts the window's "mean" (RevIN) or its "last" value
    eps: float = 1e-5  # added to the variance of each window (RevIN)

    @property
    def n_patches(self) -> int:
        return (self.lookback - self.patch_len) // self.stride + 2  # +1 for the padded tail patch

    def check(self) -> None:
        if not 0 < self.patch_len <= self.lookback or self.stride <= 0:
            raise ValueError(f"need 0 < patch_len <= lookback and stride > 0; got patch_len {self.patch_len}, "
                             f"lookback {self.lookback}, stride {self.stride}")
        if self.center not in ("mean", "last"):
            raise ValueError(f"center must be 'mean' or 'last', got {self.center!r}")


class PatchEmbedding(nn.Module):
    """Patches (B*C, N, P) -> tokens (B*C, N, d): a linear map of each patch plus a learned position per patch."""

    def __init__(self, cfg: PatchConfig):
        super().__init__()
        self.value = nn.Linear(cfg.patch_len, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.n_patches, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        patches = sequence.own_positions(patches)  # sequence parallel: this rank's patches (every rank cuts them all)
        start = sequence.offset(patches.shape[1])
        pos = torch.arange(start, start + patches.shape[1], device=patches.device)
        return self.drop(self.value(patches) + self.pos_emb(pos))  # (B*C, N, d)


class FlattenHead(nn.Module):
    """All tokens of a series -> its next `horizon` values: (B*C, N, d) -> (B*C, H). No norm before it (PatchTST's
    has none either): a LayerNorm per token would divide out each patch's amplitude, which the forecast needs (on
    ETTh1 removing it took validation MSE from 0.703 to 0.696 in the former 4-epoch recipe)."""

    def __init__(self, cfg: PatchConfig):
        super().__init__()
        self.drop = nn.Dropout(cfg.head_dropout)
        self.proj = nn.Linear(cfg.n_patches * cfg.d_model, cfg.horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.drop(x.flatten(1)))


class PatchTST(nn.Module):
    """Input windows (B, lookback, C) -> forecasts (B, horizon, C), on the inputs' scale."""

    casts_own_inputs = True  # it normalises each window in fp32 first (`forward`): the engine passes them as they are

    def __init__(self, cfg: PatchConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        block_cfg = TransformerConfig(vocab_size=0, max_seq_len=cfg.n_patches, d_model=cfg.d_model,
                                      n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff, dropout=cfg.dropout)
        self.embed = PatchEmbedding(cfg)
        self.blocks = nn.ModuleList(Block(block_cfg) for _ in range(cfg.n_layers))
        self.head = FlattenHead(cfg)
        self.apply(init_weights)
        # A zero head forecasts the centre itself: the window's mean, or (center="last") persistence, which the
        # model then learns to correct.
        nn.init.zeros_(self.head.proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, centre, std = _patches(self.cfg, self, x)
        for block in self.blocks:
            h = block(h)  # non-causal: every patch sees every other
        return _forecast(self.cfg, self, (h, centre, std))

    def forward_flops(self, x: torch.Tensor) -> float:
        """Analytic FLOPs of `forward(x)` (see `flops.py`): B*C series of n_patches tokens each."""
        c, series = self.cfg, x.shape[0] * x.shape[2]
        tokens = series * c.n_patches
        return flops.linear(tokens, c.patch_len, c.d_model) + \
            flops.uniform_blocks(series, c.n_patches, c.n_layers, c.d_model, c.d_ff) + \
            flops.linear(series, c.n_patches * c.d_model, c.horizon)

    def pipeline_layers(self) -> list[nn.Module]:
        """The same forward as pipeline layers (`pipeline.py`): x -> (tokens, centre, std) -> ... -> forecast."""
        return [PipeLayer(partial(_pipeline_patches, self.cfg), embed=self.embed),
                *[PipeLayer(lambda layer, inputs: (layer.block(inputs[0]), *inputs[1:]), block=b)
                  for b in self.blocks],
                PipeLayer(partial(_forecast, self.cfg), head=self.head)]


# Parts of the forward pass, on the model or on a pipeline layer holding the same modules under the same names.
def _patches(cfg: PatchConfig, m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows (B, L, C) -> patch tokens (B*C, N, d) and each window's centre and scale (B, 1, C)."""
    B, L, C = x.shape
    # Instance normalisation in float32 whatever the engine's precision: (B, 1, C) statistics per window.
    x = x.float()
    centre = x[:, -1:] if cfg.center == "last" else x.mean(1, keepdim=True)
    std = (x.var(1, keepdim=True, unbiased=False) + cfg.eps).sqrt()
    z = ((x - centre) / std).transpose(1, 2).reshape(B * C, L)  # (B*C, L): channels become independent series
    z = torch.cat([z, z[:, -1:].expand(-1, cfg.stride)], dim=1)  # (B*C, L + stride): repeat the last value
    patches = z.unfold(1, cfg.patch_len, cfg.stride)  # (B*C, N, P)
    return m.embed(patches.to(m.embed.value.weight.dtype)), centre, std  # tokens in the weights' dtype (bf16/fp16)


def _pipeline_patches(cfg: PatchConfig, m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_patches` for a pipeline's first stage: the window statistics are constants of the input, but every float
    tensor sent to the next stage must take part in backward, so they go as leaves that accept a gradient."""
    h, centre, std = _patches(cfg, m, x)  # sent as they are in memory: the last value's slice must be copied
    return h, centre.detach().contiguous().requires_grad_(), std.detach().contiguous().requires_grad_()


def _forecast(cfg: PatchConfig, m, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Tokens (B*C, N, d) -> forecasts (B, H, C) on the inputs' scale."""
    h, centre, std = inputs
    if sequence.current() is not None:  # sequence parallel: this rank's windows, over every patch
        h, centre, std = _own_windows(h, centre, std)
    B, C = centre.shape[0], centre.shape[2]
    y = m.head(h).float()  # (B*C, H)
    y = y.view(B, C, cfg.horizon).transpose(1, 2)  # (B, H, C)
    return y * std + centre  # undo the instance normalisation


def _own_windows(h: torch.Tensor, centre: torch.Tensor, std: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tokens (B*C, N_local, d) and statistics (B, 1, C) -> this rank's windows' tokens over every patch and their
    statistics: the flatten head maps all patches of a window at once."""
    B, C = centre.shape[0], centre.shape[2]
    d = h.shape[-1]
    by_window = h.unflatten(0, (B, C)).transpose(1, 2).flatten(2)  # (B, N_local, C*d): positions on dim 1
    h = sequence.rows_of(by_window).unflatten(2, (C, d)).transpose(1, 2).flatten(0, 1)  # (B_own*C, N, d)
    return h, sequence.rows(centre), sequence.rows(std)
