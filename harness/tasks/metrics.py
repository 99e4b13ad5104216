"""The metrics each field reports, as pure functions over whole evaluation sets (gathered from every rank).

- translation: sacreBLEU's corpus BLEU and chrF, with the signatures that make them comparable across papers;
- protein: accuracy, AUROC (the Mann-Whitney statistic, ties counted half), Q3 (per-residue accuracy over
  resolved residues only), Spearman's rho and Pearson's r for fitness regression, and ridge regression (the
  baseline fitness models are compared with);
- forecasting: MSE, MAE and directional accuracy (did the forecast move the right way from the last value); the
  skill score against a reference forecast and a moving-block bootstrap interval, to say whether a difference
  between two forecasts is more than chance.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _t(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


def bleu_chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float | str]:
    """Corpus BLEU and chrF of detokenized hypotheses against one reference each (sacreBLEU defaults)."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    bleu, chrf = BLEU(), CHRF()
    b, c = bleu.corpus_score(list(hyps), [list(refs)]), chrf.corpus_score(list(hyps), [list(refs)])
    return {"bleu": b.score, "chrf": c.score, "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}


def accuracy(pred, labels) -> float:
    pred, labels = _t(pred), _t(labels)
    return (pred == labels).double().mean().item()


def auroc(scores, labels) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    scores, labels = _t(scores), _t(labels).bool()
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if not n_pos or not n_neg:
        raise ValueError("AUROC needs both positive and negative labels")
    # Mann-Whitney U from the ranks (ties averaged, so a tie counts half): O(n log n) time and O(n) memory, where
    # comparing every positive with every negative takes positives x negatives (100k sequences: ~20 GB)
    u = ranks(scores)[labels].double().sum() - n_pos * (n_pos + 1) / 2
    return (u / (n_pos * n_neg)).item()


def q3(pred, labels, mask) -> float:
    """3-state secondary-structure accuracy over residues whose mask is 1 (resolved)."""
    pred, labels, mask = _t(pred), _t(labels), _t(mask).bool()
    if not mask.any():
        raise ValueError("Q3 needs at least one resolved residue")
    return (pred[mask] == labels[mask]).double().mean().item()


def pearson(x, y) -> float:
    """Pearson's correlation coefficient; nan when either side is constant."""
    x, y = _t(x), _t(y)
    x, y = x - x.mean(), y - y.mean()
    denominator = (x.pow(2).sum() * y.pow(2).sum()).sqrt()
    return (x * y).sum().div(denominator).item() if denominator > 0 else float("nan")


def ranks(x) -> torch.Tensor:
    """1-based ranks, ties given the mean of the ranks they span (as scipy.stats.rankdata's 'average')."""
    x = _t(x)
    order = torch.argsort(x, stable=True)
    ordinal = torch.empty_like(x)
    ordinal[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    _, group, counts = torch.unique(x, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, group, ordinal)
    return (sums / counts)[group]


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks (ties averaged)."""
    return pearson(ranks(x), ranks(y))


def ridge(features, target, alphas: Sequence[float]) -> list[torch.Tensor]:
    """Ridge regression weights (intercept last, not penalised) for features (n, d), one vector per penalty alpha:
    argmin |Xw + b - y|^2 + alpha |w|^2, solved in float64 on centred data, in the primal (d x d) or dual (n x n)
    form, the smaller; the Gram matrix is formed once for every alpha."""
    x, y = _t(features), _t(target)
    mx, my = x.mean(0), y.mean()
    xc, yc = x - mx, y - my
    primal = x.shape[1] <= x.shape[0]
    gram = xc.T @ xc if primal else xc @ xc.T
    eye = torch.eye(len(gram), dtype=torch.float64)
    out = []
    for alpha in alphas:
        w = torch.linalg.solve(gram + alpha * eye, xc.T @ yc) if primal else \
            xc.T @ torch.linalg.solve(gram + alpha * eye, yc)
        out.append(torch.cat([w, (my - mx @ w).reshape(1)]))
    return out


def regression(pred, target) -> dict[str, float]:
    err = _t(pred) - _t(target)
    return {"mse": err.pow(2).mean().item(), "mae": err.abs().mean().item()}


def directional_accuracy(last, pred, target) -> float:
    """Share of forecast values moving the same way from the last observed value as the truth does.

    `last` (B, C) broadcasts over the horizon of `pred` and `target` (B, H, C); a zero true move counts as a
    miss unless the forecast is flat too.
    """
    last, pred, target = _t(last), _t(pred), _t(target)
    if last.dim() == pred.dim() - 1:
        last = last.unsqueeze(-2)  # (B, 1, C)
    return (torch.sign(pred - last) == torch.sign(target - last)).double().mean().item()


def skill(mse: float, reference_mse: float) -> float:
    """1 - MSE / MSE_reference: above 0 the forecast beats the reference (e.g. persistence), 1 is perfect."""
    return 1.0 - mse / reference_mse if reference_mse > 0 else float("nan")


def block_bootstrap_ci(values, block: int, resamples: int = 2000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile interval for the mean of a serially correlated series by the moving-block bootstrap (Kuensch
    1989): each resample joins ceil(n / block) runs of `block` consecutive values, their starts drawn uniformly
    with replacement, cut to n values. `block` = 1 is the ordinary bootstrap. Deterministic for a seed."""
    v = _t(values).flatten()
    n = len(v)
    block = max(1, min(block, n))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - block + 1, (resamples, -(-n // block)), generator=g)
    index = (starts[..., None] + torch.arange(block)).flatten(1)[:, :n]  # (resamples, n)
    means = v[index].mean(1)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(means, q).tolist()
    return low, high
