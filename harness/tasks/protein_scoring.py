"""How a protein run is scored: each sample's outputs as plain Python (`per_sample`), gathered over the ranks into the
field's figures (`field_metrics`, `regression_metrics`).

- classify: accuracy and, for two classes, AUROC of the second class's probability (label 1 = AMP on the default
  data).
- residue: Q3.
- mlm: masked accuracy and perplexity.
- regress: on the data's own scale, Spearman's rho (the field's figure for fitness, e.g. FLIP GB1), Pearson's r, MSE
  and MAE, beside a ridge regression on one-hot residues fitted on the same training split (`ridge_baseline`,
  `ridge_*`; its penalty picked by validation MSE: `ridge_fit`) to show what the Transformer adds. The baseline is
  computed by `harness evaluate`, not during training. With `protein.blend = "ridge"` the fit is part of the model
  too (`load_ridge`), mixed into its prediction at the share `choose_mix` picks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config.run import ConfigError
from ..models.encoder import Encoder
from ..prepare import protein as prep
from ..prepare import read_meta
from .metrics import accuracy, auroc, pearson, q3, regression, ridge, spearman
from .protein_samples import IGNORE

RIDGE_ALPHAS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
RIDGE_MIX = (0.0, 0.25, 0.5, 0.75)  # protein.blend's choices: the encoder keeps a share (1.0 is the baseline alone)
RIDGE_MAX_SIZE = 8000  # the ridge baseline solves a min(rows, features)-square system; beyond this it is skipped


def per_sample(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[tuple]:
    """Per-sample results as plain Python, cheap to gather: (probabilities, label) or (predictions, targets, nll)."""
    if "values" in batch:
        return list(zip(logits.squeeze(-1).tolist(), batch["values"].tolist()))
    if "labels" in batch:
        probs = logits.softmax(-1).cpu()
        return [(p.tolist(), int(y)) for p, y in zip(probs, batch["labels"].cpu())]
    out = []
    nll = F.cross_entropy(logits.transpose(1, 2), batch["targets"], ignore_index=IGNORE, reduction="none")  # (B, T)
    for lg, t, n in zip(logits.cpu(), batch["targets"].cpu(), nll.cpu()):
        keep = t != IGNORE
        out.append((lg[keep].argmax(-1).tolist(), t[keep].tolist(), n[keep].sum().item()))
    return out


def field_metrics(objective: str, outputs: list[tuple]) -> dict[str, float]:
    if objective == "classify":
        probs, labels = [p for p, _ in outputs], [y for _, y in outputs]
        pred = [max(range(len(p)), key=p.__getitem__) for p in probs]
        nll = -sum(math.log(max(p[y], 1e-12)) for p, y in outputs) / len(outputs)
        result = {"accuracy": accuracy(pred, labels), "sequences": float(len(outputs)), "loss": nll}
        if len(probs[0]) == 2 and 0 < sum(labels) < len(labels):
            result["auroc"] = auroc([p[1] for p in probs], labels)
        return result
    pred = [a for p, _, _ in outputs for a in p]
    target = [a for _, t, _ in outputs for a in t]
    n = len(target)
    if objective == "residue":
        return {"q3": q3(pred, target, [1] * n), "residues": float(n)}
    mean_nll = sum(x for _, _, x in outputs) / n
    return {"masked_accuracy": accuracy(pred, target), "perplexity": math.exp(min(mean_nll, 50.0)),
            "masked_residues": float(n)}


def regression_metrics(pred: list[float], target: list[float]) -> dict[str, float]:
    return {"spearman": spearman(pred, target), "pearson": pearson(pred, target), **regression(pred, target),
            "sequences": float(len(target))}


def one_hot(rows, length: int, vocab_size: int) -> torch.Tensor:
    """(n, length * vocab_size) indicators of each position's residue id; positions past a sequence's end stay 0."""
    ids = torch.full((len(rows), length), -1)
    for i, r in enumerate(rows["ids"]):
        r = r[:length]
        ids[i, :len(r)] = torch.as_tensor(r)
    out = torch.zeros(len(rows), length, vocab_size)
    out.scatter_(2, ids.clamp(min=0).unsqueeze(-1), (ids >= 0).float().unsqueeze(-1))
    return out.flatten(1)


@dataclass
class RidgeFit:
    """Ridge regression on one-hot residues: `weights` (length, vocab) per position and residue id (0 for a residue
    constant in training), `intercept`, on the data's own scale; the penalty `alpha` picked by validation MSE."""
    weights: torch.Tensor
    intercept: float
    alpha: float

    def predict(self, rows) -> torch.Tensor:
        length, vocab = self.weights.shape
        return one_hot(rows, length, vocab).double() @ self.weights.flatten() + self.intercept


def ridge_fit(directory: Path) -> RidgeFit | str:
    """The ridge baseline fitted on the training split, its penalty picked from RIDGE_ALPHAS by validation MSE
    (train's own when there is none); a sentence instead when the system is too large to solve."""
    train, val = prep.load(directory, "train"), prep.load(directory, "validation")
    length, vocab = max(len(r) for r in train["ids"]), read_meta(directory)["vocab_size"]
    x = one_hot(train, length, vocab)
    keep = x.std(0) > 0  # a column constant in training carries nothing the intercept does not
    x = x[:, keep]
    if min(x.shape) > RIDGE_MAX_SIZE:
        return f"skipped: {x.shape[0]} rows x {x.shape[1]} features is too large to solve"
    y = torch.tensor(train["value"])
    vx, vy = (one_hot(val, length, vocab)[:, keep], torch.tensor(val["value"])) if len(val) else (x, y)

    fits = dict(zip(RIDGE_ALPHAS, ridge(x, y, RIDGE_ALPHAS)))  # weights of the kept columns, intercept last
    alpha = min(fits, key=lambda a: (vx.double() @ fits[a][:-1] + fits[a][-1] - vy).pow(2).mean().item())
    weights = torch.zeros(length * vocab, dtype=torch.float64)
    weights[keep] = fits[alpha][:-1]
    return RidgeFit(weights.view(length, vocab), fits[alpha][-1].item(), alpha)


@torch.no_grad()
def load_ridge(model: Encoder, directory: Path, stats: tuple[float, float], cls_id: int) -> None:
    """protein.blend = "ridge": the ridge fit on the z-scored targets the model learns, as the model's `ridge_table`
    (residue positions 0.. are the model's 1.., after <cls>, which carries the intercept). A finished run's stored
    data (`harness evaluate --data`) has no training split: its exported weights hold the table."""
    if not len(prep.load(directory, "train")):
        return
    if not len(prep.load(directory, "validation")):
        raise ConfigError("protein.blend = 'ridge' chooses its share (and the ridge penalty) on the validation split, "
                          "which is empty here: give the data validation rows (data.val_fraction, data.val_path)")
    fitted = ridge_fit(directory)
    if isinstance(fitted, str):
        raise ConfigError(f"protein.blend = 'ridge': the ridge fit is {fitted}")
    mean, std = stats
    vocab = model.cfg.vocab_size
    table = torch.zeros(model.cfg.max_seq_len, vocab, dtype=torch.float64)
    length, width = fitted.weights.shape
    table[1:1 + length, :width] = fitted.weights / std
    table[0, cls_id] = (fitted.intercept - mean) / std
    model.ridge_table.copy_(table.flatten())


def choose_mix(net: list[float], linear: list[float], target: list[float]) -> float:
    """The ridge share of RIDGE_MIX whose mix has the highest Spearman on these (validation) rows; ties: the smaller."""
    def score(w: float) -> float:  # a constant prediction has no rank correlation (nan): the worst, not a tie
        rho = spearman([n + w * (r - n) for n, r in zip(net, linear)], target)
        return rho if math.isfinite(rho) else -math.inf

    return max(RIDGE_MIX, key=lambda w: (score(w), -w))


def ridge_baseline(directory: Path, split: str) -> dict[str, float | str]:
    """The ridge fit (`ridge_fit`) scored on `split`: ridge_spearman, ridge_mse, ... and ridge_alpha."""
    fitted = ridge_fit(directory)
    if isinstance(fitted, str):
        return {"ridge_baseline": fitted}
    test = prep.load(directory, split)
    pred = fitted.predict(test)
    return {f"ridge_{k}": v for k, v in regression_metrics(pred.tolist(), test["value"]).items()
            if k != "sequences"} | {"ridge_alpha": fitted.alpha}
