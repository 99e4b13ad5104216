"""Price-series forecasting: a PatchTST-style forecaster predicting the next `horizon` steps of every channel.

The loss is the squared error summed over every predicted value (count = B * horizon * C) on the z-scored scale
(`harness.prepare.prices`: per-channel statistics of the training period). `evaluate` reports, on the same
windows, the model next to two baselines a forecaster must beat to be worth anything:
- persistence: repeat the last observed value for every future step;
- drift: the line through the first and the last look-back values, extrapolated (in the normalised space, i.e.
  a constant growth rate for the log-transformed stocks);
each with MSE and MAE on the normalised scale and on the source's scale (prices), and directional accuracy
(the forecast moves the same way from the last value as the truth) for the model and for drift (persistence
never moves). `harness evaluate` with `prices.periods` = K > 1 (or `--periods K`) also scores K consecutive periods
by forecast origin, each with its own verdict against persistence (`by_period`: rolling origin, the model fixed);
the evaluations during training do not.
`read` takes a new csv for `harness evaluate --data` (`prepare.prices.read_scoring`): z-scored with the run's stored
training statistics, every window of the file scored by the same `evaluate`; the majority direction is the
training split's, kept with the run (meta "train_up_share").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.run import ConfigError, RunConfig, setting
from ..data.batches import eval_batches
from ..models.patch import PatchConfig, PatchTST
from ..prepare import prices as P
from ..prepare import read_meta, store, summary
from . import metrics as M
from .interface import ReadData, TaskData


@dataclass(frozen=True)
class PricesSection:
    lookback: int = setting(96, "past time steps the forecaster sees")
    horizon: int = setting(24, "future time steps it predicts at once")
    patch_len: int = setting(16, "time steps per patch (token)")
    stride: int = setting(8, "steps between patch starts")
    symbols: str = setting("AAPL,IBM,MSFT,GOOG", "embedded stocks only: comma-separated tickers; the series starts on "
                           "the first date every one of them trades")
    columns: str = setting("", "comma-separated channels: for the embedded stocks the price fields taken per symbol "
                           "(empty = `Adj Close`, split- and dividend-adjusted); for a csv/hub source its numeric "
                           "columns (empty = every column but the date)")
    date_column: str = setting("", "csv/hub sources: the column holding the time stamp; empty = `date`/`Date`, else "
                               "the first column")
    transform: str = setting("auto", "applied before z-scoring; auto = log for the embedded stocks, none otherwise",
                             ("auto", "none", "log"))
    train_end: str = setting("", "last date of the training period (inclusive, e.g. 2010-12-31); empty = the source's "
                             "default (stocks: 2010-12-31; ETTh: the standard 8640-row split; csv: 70% of the rows)")
    val_end: str = setting("", "last date of the validation period (inclusive); the test period follows it; empty = "
                           "the source's default (stocks: 2011-12-31; ETTh: row 11519; csv: 80% of the rows)")
    context: str = setting("split", "where validation/test input windows may start: `split` = inside their own split "
                           "(no window touches another split), `previous` = up to `lookback` steps back into the "
                           "preceding split (the standard ETTh1 protocol); targets always stay inside the split",
                           ("split", "previous"))
    head_dropout: float = setting(0.0, "dropout before the flatten head")
    center: str = setting("mean", "per-window normalisation subtracts the window's mean (RevIN) or its last value "
                          "(PatchTST's subtract_last; the untrained model then forecasts "
                          "persistence)", ("mean", "last"))
    periods: int = setting(1, "`harness evaluate`: also score the split in this many consecutive periods by forecast "
                           "origin (rolling origin, the trained model fixed), each against persistence with its own "
                           "verdict; 1 = the whole split only; `--periods K` sets it for one evaluation",
                           bound="> 0", scoring=True)


@dataclass
class Scored:
    """What `evaluate` scores: windows, the statistics that undo their normalisation, the training split's share of
    windows that end up (for the majority-direction baseline) and the protocol line."""
    windows: P.Windows
    norm: dict
    up_share: float
    protocol: str


class PricesTask:
    section, Config = "prices", PricesSection  # the run file's [prices]: the task's settings
    items = "values"  # forecast values: windows x horizon x channels

    def check(self, cfg: RunConfig) -> None:
        p = cfg.task
        if cfg.model.hf:
            raise ConfigError(f"model.hf = {cfg.model.hf!r}: the prices task trains its own patch Transformer on "
                              f"numbers; Hugging Face models go with the lm, translation and protein tasks")
        for key in ("lookback", "horizon", "patch_len", "stride"):
            if getattr(p, key) <= 0:
                raise ConfigError(f"prices.{key} = {getattr(p, key)} must be > 0")
        if p.patch_len > p.lookback:
            raise ConfigError(f"prices.patch_len = {p.patch_len} must be <= prices.lookback = {p.lookback}")
        if not 0.0 <= p.head_dropout < 1.0:
            raise ConfigError(f"prices.head_dropout = {p.head_dropout} must be in [0, 1)")
        if cfg.model.vocab_size:
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: the prices task has no vocabulary; use 0")
        P.check_source(cfg)
        directory = self.prepare(cfg)  # a csv is read in seconds: a split training needs that is too short for one
        for split in ("train", "validation"):  # window is refused here, before a run directory or a rank exists
            P.windows(cfg, directory, split)

    def prepare(self, cfg: RunConfig) -> Path:
        return P.prepare(cfg)

    def store(self, cfg: RunConfig, out: Path) -> None:
        directory = self.prepare(cfg)
        store(directory, out, (), (), P.SCORING_KEYS, {"train_up_share": up_share(P.windows(cfg, directory, "train"))})

    def read(self, cfg: RunConfig, path: Path, stored: Path) -> list[ReadData]:
        windows, counts, f, line = P.read_scoring(cfg, stored, path)
        meta = read_meta(stored)
        return [ReadData(Scored(windows, meta["norm"], meta["train_up_share"], line), counts, [f])]

    def scored(self, cfg: RunConfig, split: str) -> Scored:
        """A prepared split's windows, as `evaluate` scores them."""
        directory = self.prepare(cfg)
        return Scored(P.windows(cfg, directory, split), read_meta(directory)["norm"],
                      up_share(P.windows(cfg, directory, "train")), protocol(cfg, directory, split))

    def build_model(self, cfg: RunConfig) -> PatchTST:
        m, p = cfg.model, cfg.task
        return PatchTST(PatchConfig(lookback=p.lookback, horizon=p.horizon, patch_len=p.patch_len, stride=p.stride,
                                    d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                                    d_ff=m.d_ff or 4 * m.d_model, dropout=m.dropout, head_dropout=p.head_dropout,
                                    center=p.center))

    def build_data(self, cfg: RunConfig) -> TaskData:
        directory = self.prepare(cfg)
        return TaskData(P.windows(cfg, directory, "train"), P.windows(cfg, directory, "validation"),
                        summary(read_meta(directory)))

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([s["x"] for s in samples]),   # (B, L, C)
                "y": torch.stack([s["y"] for s in samples])}   # (B, H, C)

    def sequence_split(self, batch: dict[str, torch.Tensor]) -> dict[str, str]:
        """Sequence parallelism: every rank reads whole windows and keeps its patches (models/patch.py); the
        forecasts, one per window, by rows."""
        return {"y": "rows"}

    def sequence_length(self, cfg: RunConfig) -> tuple[int, tuple[str, ...]]:
        """The positions of every sample (the window's patches) and the keys that set them."""
        p = cfg.task
        return PatchConfig(lookback=p.lookback, patch_len=p.patch_len, stride=p.stride).n_patches, \
            ("prices.lookback", "prices.patch_len", "prices.stride")

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["y"].numel()  # B * horizon * C predicted values

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        return (batch["x"],)

    def loss_from(self, pred: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (pred.float() - batch["y"].float()).pow(2).sum()  # pred (B, H, C)

    def loss(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss_from(model(*self.inputs(batch)), batch)

    def metrics(self, mean_loss: float) -> dict[str, float]:
        return {"loss": mean_loss, "rmse": math.sqrt(max(mean_loss, 0.0))}

    @torch.no_grad()
    def forecast(self, model, data: P.Windows, micro: int, world) -> torch.Tensor:
        """The model's forecasts for every window of `data`, (n, H, C) float32 on CPU, on every rank."""
        batches, steps = eval_batches(len(data), micro, world.dp_rank, world.dp_size)
        was_training = model.training
        model.eval()
        mine = []
        for i in range(steps):  # every rank runs `steps` forwards (ZeRO-3 gathers weights collectively)
            real = i < len(batches)
            idx = batches[i] if real else (batches[-1] if batches else [0])
            x = self.collate([data[j] for j in idx])["x"].to(world.device)
            pred = model(x).float().cpu()  # (b, H, C)
            if real:
                mine.append((idx, pred))
            world.scored(i, steps)  # in training, a stop signal ends it here on every rank
        model.train(was_training)
        out = torch.empty(len(data), data.horizon, data.values.shape[1])
        for part in world.gather(mine):  # sync point: every data-parallel rank's (indices, forecasts)
            for idx, pred in part:
                out[idx] = pred
        return out

    def evaluate(self, model, cfg: RunConfig, split: str, world, in_training: bool = False,
                 data: Scored | None = None) -> dict[str, float | str]:
        scored = self.scored(cfg, split) if data is None else data
        windows = scored.windows
        k = cfg.task.periods if not in_training else 1  # `harness evaluate`'s, not training's
        if k > 1:
            check_periods(len(windows), windows.horizon, k)  # before the forecasts: refused at once
        pred = self.forecast(model, windows, cfg.train.micro_batch_size, world)
        x = torch.stack([windows[i]["x"] for i in range(len(windows))])  # (n, L, C)
        y = torch.stack([windows[i]["y"] for i in range(len(windows))])  # (n, H, C)
        forecasts = {"model": pred, **baselines(x, windows.horizon)}
        periods = by_period(pred, forecasts["persistence"], y, windows, k) if k > 1 else {}
        return score(forecasts, x[:, -1], y, scored.norm) | verdict(pred, forecasts["persistence"], y) \
            | trivial_directions(x[:, -1], y, scored.up_share) \
            | {"windows": len(windows), "protocol": scored.protocol} | periods


def up_share(train: P.Windows) -> float:
    """The share of training windows whose last target is above their last input (ties count as down); 0.5 for
    none."""
    if not len(train):
        return 0.5
    return float(torch.stack([train[i]["y"][-1] > train[i]["x"][-1] for i in range(len(train))]).double().mean())


def baselines(x: torch.Tensor, horizon: int) -> dict[str, torch.Tensor]:
    """Persistence and drift forecasts (n, H, C) from input windows (n, L, C)."""
    last = x[:, -1:]  # (n, 1, C)
    slope = (x[:, -1:] - x[:, :1]) / (x.shape[1] - 1)  # (n, 1, C): per-step change of the line first -> last
    steps = torch.arange(1, horizon + 1, dtype=x.dtype).view(1, -1, 1)  # (1, H, 1)
    return {"persistence": last.expand(-1, horizon, -1), "drift": last + slope * steps}


def score(forecasts: dict[str, torch.Tensor], last: torch.Tensor, y: torch.Tensor, norm: dict) -> dict[str, float]:
    """MSE/MAE (normalised and price scale) for each forecast; directional accuracy for all but persistence.
    Keys: mse, mae, price_mse, price_mae, directional_accuracy for the model; the same prefixed by a baseline."""
    out: dict[str, float] = {}
    y_price = P.to_price(y, norm)
    for name, f in forecasts.items():
        prefix = "" if name == "model" else f"{name}_"
        out |= {f"{prefix}{k}": v for k, v in M.regression(f, y).items()}
        out |= {f"{prefix}price_{k}": v for k, v in M.regression(P.to_price(f, norm), y_price).items()}
        if name != "persistence":
            out[f"{prefix}directional_accuracy"] = M.directional_accuracy(last, f, y)
    return out


def verdict(model: torch.Tensor, reference: torch.Tensor, y: torch.Tensor, name: str = "persistence") -> dict:
    """Who wins on MSE and whether it is more than chance: the skill score, and a 95% moving-block bootstrap interval
    for the mean over windows of (the model's squared error - the reference's), blocks of H windows (windows at
    stride 1 share up to H - 1 targets, so their errors are correlated), in one line."""
    errors = ((model - y) ** 2).flatten(1).mean(1), ((reference - y) ** 2).flatten(1).mean(1)  # (n,) each
    mse, ref_mse = (e.mean().item() for e in errors)  # windows hold equally many values: the mean of the means
    n, horizon = len(y), y.shape[1]
    # the skill is always there (NaN where it is none: train.select_best may name it, and takes NaN as no better)
    if not (math.isfinite(mse) and math.isfinite(ref_mse)):
        return {f"skill_vs_{name}": math.nan, "verdict": f"no verdict: the model's or {name}'s errors are not finite"}
    if ref_mse == 0:  # a flat stretch: persistence is exact, and no share of its MSE can be given
        gain = {f"skill_vs_{name}": 0.0 if mse == 0 else math.nan}
        line = f"{name} is exact on these windows (MSE 0)" + (", and so is the model" if mse == 0 else
                                                             f"; the model's MSE is {mse:.4g}")
    else:
        skill = M.skill(mse, ref_mse)
        gain = {f"skill_vs_{name}": skill}
        line = f"the model beats {name}: its MSE is {_share(skill)} lower" if mse <= ref_mse else \
            f"{name} beats the model: the model's MSE is {_share(mse / ref_mse - 1)} higher"
    if n < MIN_BLOCKS * horizon:  # so few distinct blocks to resample that the interval comes out too narrow
        return gain | {"verdict": f"{line}; too few windows to judge significance ({n}, fewer than {MIN_BLOCKS} "
                                  f"blocks of the horizon, {MIN_BLOCKS} x {horizon})"}
    low, high = M.block_bootstrap_ci(errors[0] - errors[1], block=horizon)
    holds_zero = low <= 0 <= high
    line += (f"; {'not ' if holds_zero else ''}significant (the 95% block-bootstrap interval of the MSE difference, "
             f"[{low:.4g}, {high:.4g}], {'holds' if holds_zero else 'excludes'} 0)")
    return gain | {"mse_difference_ci_low": low, "mse_difference_ci_high": high, "verdict": line}


def _share(x: float) -> str:
    """A relative difference as a percentage, with the digits that tell it from 0 ("0.0%" read as a tie)."""
    return f"{x:.1%}" if abs(x) >= 0.001 or x == 0 else f"{x * 100:.2g}%"


MIN_BLOCKS = 4  # blocks of H windows each rolling-origin period must hold (`by_period`)


def check_periods(n: int, horizon: int, k: int) -> None:
    """Refuse `k` periods of `n` windows where a period would hold fewer than MIN_BLOCKS blocks of `horizon` windows."""
    fits = n // (MIN_BLOCKS * horizon)
    if k > fits:
        advice = f"use at most {fits}" if fits > 1 else "at most 1 fits (the whole split, no periods): lengthen " \
            "the split or shorten the horizon"
        raise ConfigError(f"{k} periods (prices.periods, or evaluate's --periods): {n} windows make periods of fewer "
                          f"than {MIN_BLOCKS} blocks of the horizon ({MIN_BLOCKS} x {horizon} windows), too few for "
                          f"the block bootstrap's verdict; {advice}")


def by_period(model: torch.Tensor, reference: torch.Tensor, y: torch.Tensor, windows: P.Windows, k: int) -> dict:
    """Rolling-origin evaluation with the model fixed (trained once, not refitted as the origin moves): the windows, in
    order of forecast origin, cut into `k` consecutive periods of (nearly) equal counts, each scored against
    persistence with its own MSEs, skill and `verdict`; and how many periods each side wins, and significantly. A
    model that wins overall through one lucky stretch shows it here. Neighbouring periods share the targets of up
    to H - 1 windows at their border. Each period must hold MIN_BLOCKS blocks of H windows: a block bootstrap over
    fewer has too few distinct blocks to resample, and its interval comes out too narrow."""
    n = len(y)
    check_periods(n, y.shape[1], k)
    out, ahead, ahead_sig, behind_sig = {"periods": k}, 0, 0, 0
    for i, idx in enumerate(torch.tensor_split(torch.arange(n), k), 1):
        v = verdict(model[idx], reference[idx], y[idx])
        ahead += v["skill_vs_persistence"] >= 0  # as `verdict` words it: a tie is not persistence's (NaN: not ahead)
        ahead_sig += v.get("mse_difference_ci_high", 1) < 0  # the model's errors significantly smaller
        behind_sig += v.get("mse_difference_ci_low", -1) > 0
        out |= {f"period_{i}_windows": len(idx), f"period_{i}_mse": ((model[idx] - y[idx]) ** 2).mean().item(),
                f"period_{i}_persistence_mse": ((reference[idx] - y[idx]) ** 2).mean().item(),
                f"period_{i}_skill_vs_persistence": v["skill_vs_persistence"],
                f"period_{i}_verdict": f"targets {windows.targets(int(idx[0]), int(idx[-1]))}: {v['verdict']}"}
    out |= {"periods_model_ahead": ahead, "periods_model_ahead_significant": ahead_sig,
            "periods_persistence_ahead_significant": behind_sig,
            "periods_verdict": f"rolling origin over {k} periods (the model fixed): the model beats persistence in "
                               f"{ahead} (significantly in {ahead_sig}), persistence beats it in {k - ahead} "
                               f"(significantly in {behind_sig})"}
    return out


def trivial_directions(last: torch.Tensor, y: torch.Tensor, up_share: float) -> dict[str, float]:
    """The directional accuracy of forecasts that need no model: always up, and always the training split's majority
    direction (`up_share`: its share of windows whose last target is above their last input)."""
    up = M.directional_accuracy(last, last.unsqueeze(1) + 1, y)
    down = M.directional_accuracy(last, last.unsqueeze(1) - 1, y)
    return {"always_up_directional_accuracy": up, "majority_directional_accuracy": up if up_share >= 0.5 else down}


def protocol(cfg: RunConfig, directory: Path, split: str) -> str:
    meta = read_meta(directory)
    s = meta["splits"][split]
    return (f"{split} {s['first'][:10]}..{s['last'][:10]}, {len(meta['channels'])} channels, lookback "
            f"{cfg.task.lookback}, horizon {cfg.task.horizon}, every window (stride 1), inputs inside "
            f"{'the split' if cfg.task.context == 'split' else 'the split or the one before'}, z-scored with "
            f"train statistics{' of log prices' if meta['norm']['transform'] == 'log' else ''}")
