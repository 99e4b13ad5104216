"""Price / time-series data: read a source, clean it, split it chronologically, z-score it, cut windows.

Sources (`data.path`), all read through Hugging Face `datasets`:
- empty: the embedded default, daily quotes of AAPL, IBM, MSFT and GOOG (2000-03 to 2013-03) from the
  `bokeh_sampledata` package (`_data/stocks.csv.gz`, long format: Ticker,Date,Open,...,Adj Close). One channel
  per (symbol, field) of `prices.symbols` x `prices.columns` (default `Adj Close`, so stock splits are not jumps),
  log-transformed; the series starts on GOOG's first day (2004-08-19), when every symbol trades.
  Split: train up to 2010-12-31, validation 2011, test 2012-01-01 to 2013-03-01, the same dates for every channel.
- a directory such as `../shared/data/ett` (its ETTh1.csv[.gz]) or an `ETTh*.csv[.gz]` file: the standard split,
  rows 0-8639 / 8640-11519 / 11520-14399 (later rows unused), no transform.
- a user's csv (a date column and numeric columns) or `hub:NAME` (its train split, same layout): split by
  `prices.train_end` / `prices.val_end`, else 70% / 10% / 20% of the rows in time order.

Cleaning, counted per split by date in meta.json ("counts"):
- a row whose date does not parse is `malformed` (listed under the pseudo-split `unused`);
- a repeated date keeps its first row; later ones are `duplicate`;
- a row with a value that is not a finite number (or not > 0 under the log transform) is `malformed`, with an
  empty value `missing`; such rows are dropped (the series closes the gap, as trading calendars do);
- rows before the first date on which every channel has a value are `before_start`, rows after the
  standard ETTh test period `after_test`; both are listed under `unused`;
- rows out of date order are sorted and counted (meta "cleaning.unsorted").
Normalisation: a z-score per channel whose mean and std are fitted on the TRAINING rows only (meta "norm").

Windows: a sample is `x` = `lookback` steps and `y` = the next `horizon` steps, (L, C) and (H, C), one per
target start (stride 1). Targets always lie inside their split. With `prices.context = "split"` the input lies
inside the split too, so no window touches two splits; with `"previous"` (the standard ETTh1 protocol)
validation/test inputs may reach up to `lookback` steps back into the preceding split.

New data for `harness evaluate --data` (`read_scoring`): a csv (or a directory holding one) in the run's layout, the
run's channels (the embedded stocks' long Ticker,Date,... layout for a stocks run), cleaned by the rules above,
z-scored with the run's stored training statistics (never re-fitted); every window of the file is scored, inputs
and targets inside it.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ..config.run import ConfigError, RunConfig
from ..data import rows as data
from . import load_split, package_file, prepared, read_meta, save_split

VERSION = 2  # bump when the preparation changes: the cache key includes it (2: one date format a column)
SPLITS = ("train", "validation", "test")
STOCKS = ("bokeh_sampledata", "_data/stocks.csv.gz")
ETT_ROWS = (8640, 2880, 2880)  # the standard 12/4/4-month split of the hourly ETT sets
DEFAULT_DATES = {"stocks": ("2010-12-31", "2011-12-31")}
CSV_FRACTIONS = (0.7, 0.1)  # train, validation; the rest is test
SCORING_KEYS = ("channels", "norm")  # meta.json values that scoring depends on (kept in RUN/data/)


def source_kind(path: str) -> str:
    """stocks (the embedded default), ett, csv or hub."""
    if not path:
        return "stocks"
    if path.startswith("hub:"):
        return "hub"
    return "ett" if resolve_path(path).name.startswith("ETTh") else "csv"


def resolve_path(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("ETTh1.csv*")) or sorted(p.glob("*.csv*"))
        if len(found) != 1 and not (found and found[0].name.startswith("ETTh1")):
            raise ConfigError(f"{path}: a directory; expected ETTh1.csv[.gz] or one csv in it, "
                              f"found {[f.name for f in found]}")
        return found[0]
    return p


def check_source(cfg: RunConfig) -> None:
    """Preflight: the source exists and the settings make sense (ConfigError otherwise)."""
    path, p = cfg.data.path, cfg.task
    if path and not path.startswith("hub:"):
        f = resolve_path(path)
        if not f.is_file():
            raise ConfigError(f"{path}: data.path not found")
        if not f.name.lower().removesuffix(".gz").endswith(".csv"):
            raise ConfigError(f"{path}: the prices task reads csv files (a date column and numeric columns)")
    elif not path:
        package_file(*STOCKS)
    for key in ("train_end", "val_end"):
        value = getattr(p, key)
        if value and _dates([value], iso=True)[0] is None:
            raise ConfigError(f"prices.{key} = {value!r} is not an ISO 8601 date (e.g. 2010-12-31)")
    if bool(p.train_end) != bool(p.val_end):
        raise ConfigError("set both prices.train_end and prices.val_end, or neither")
    if p.train_end and _dates([p.train_end], iso=True)[0] >= _dates([p.val_end], iso=True)[0]:
        raise ConfigError(f"prices.train_end = {p.train_end!r} must come before prices.val_end = {p.val_end!r}")


def settings(cfg: RunConfig) -> dict:
    """Everything the prepared data depends on (the cache key); windows are cut at load time."""
    p, path = cfg.task, cfg.data.path
    kind = source_kind(path)
    ident: dict = {"path": path}
    if kind == "stocks":
        ident = {"package": "/".join(STOCKS), "symbols": p.symbols}
    elif kind in ("csv", "ett"):
        f = resolve_path(path)
        if not f.is_file():  # a run's data moved since it trained, or a relative path read from elsewhere
            raise ConfigError(f"{path}: data.path not found (relative paths are read from the working directory)")
        ident = {"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
    return {"version": VERSION, "kind": kind, **ident, "columns": p.columns, "date_column": p.date_column,
            "transform": transform_of(cfg), "train_end": p.train_end, "val_end": p.val_end}


def transform_of(cfg: RunConfig) -> str:
    t = cfg.task.transform
    return ("log" if source_kind(cfg.data.path) == "stocks" else "none") if t == "auto" else t


def prepare(cfg: RunConfig) -> Path:
    s = settings(cfg)
    return prepared("prices", s, lambda tmp: build(tmp, cfg, s))


# ---------------------------------------------------------------- reading

def _load(kind: str, path: str):
    import datasets
    import pandas as pd

    try:
        if kind == "hub":
            return datasets.load_dataset(path[4:], split="train").to_pandas()
        if not path:
            return datasets.load_dataset("csv", data_files=str(package_file(*STOCKS)), split="train").to_pandas()
        # a user's file is read line by line: undecodable bytes become U+FFFD (not a number: malformed) and a line
        # with the wrong number of fields is an undated row (malformed), instead of a refused file
        records = data.parse_records(str(resolve_path(path)), "csv")
        if all(r is data.MALFORMED for r in records):
            raise ConfigError(f"{path}: no row with as many fields as its header ({len(records)} lines after it); "
                              f"fields are separated by commas, decimals marked by a point")
        return pd.DataFrame.from_records([{} if r is data.MALFORMED else r for r in records])
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        what = "the hub data set" if kind == "hub" else "csv data"
        raise ConfigError(f"{path or 'embedded stocks'}: cannot load {what}: {str(e).splitlines()[0]}") from None


def read_table(cfg: RunConfig, kind: str, path: str | None = None) -> tuple[list, dict[str, list], int]:
    """The source (or `path`, in its layout) as (dates, parsed once: None where a value is not one; {channel: raw
    values}; rows out of date order), one entry per wide row."""
    path = cfg.data.path if path is None else path
    df = _load(kind, path)
    names = [c.strip() for c in cfg.task.columns.split(",") if c.strip()]
    if kind == "stocks":
        raw, columns, unsorted = _from_long(df, [s.strip() for s in cfg.task.symbols.split(",") if s.strip()],
                                            names or ["Adj Close"], path or "embedded stocks")
        return _dates(raw), columns, unsorted
    if cfg.task.symbols != type(cfg.task)().symbols:  # (it picks tickers of the embedded stocks' long table)
        raise ConfigError(f"{path}: prices.symbols chooses among the embedded stocks; a file's series are its columns "
                          f"(prices.columns), one row per date")
    date_col = cfg.task.date_column or next((c for c in ("date", "Date") if c in df.columns), df.columns[0])
    names = names or [c for c in df.columns if c != date_col]
    missing = [c for c in [date_col, *names] if c not in df.columns]
    if missing or not names:
        raise ConfigError(f"{path}: no column(s) {missing or 'to forecast'} (prices.date_column, "
                          f"prices.columns); columns are {list(df.columns)}")
    dates = list(df[date_col])
    parsed = _dates(dates)
    if dates and sum(d is not None for d in parsed) < len(dates) / 2:
        raise ConfigError(f"{path}: column {date_col!r} (prices.date_column) holds no dates ("
                          f"{sum(d is not None for d in parsed)} of {len(dates)} values read as one; the first: "
                          f"{dates[0]!r}); name the column of dates with prices.date_column")
    known = [d for d in parsed if d is not None]
    if len(known) >= 4 and len(set(known)) <= len(known) / 2:  # a long layout: its first row of each date alone kept
        raise ConfigError(f"{path}: its {len(known)} rows hold {len(set(known))} dates: one row per series and date (a "
                          f"long layout)? The prices task reads one row per date and a column per series: pivot it "
                          f"first, e.g. pandas df.pivot(index=DATE, columns=SYMBOL, values=PRICE).to_csv(...)")
    return parsed, {c: list(df[c]) for c in names}, _unsorted(parsed)


def _from_long(df, symbols: list[str], fields: list[str], source: str) -> tuple[list, dict[str, list], int]:
    """Ticker,Date,<fields> lines -> one wide row per (date, k-th line of a ticker on that date)."""
    bad = [f for f in ["Ticker", "Date", *fields] if f not in df.columns]
    absent = sorted(set(symbols) - set(df["Ticker"])) if not bad else []
    if bad or absent or not symbols:
        raise ConfigError(f"{source}: no column(s) {bad} or symbol(s) {absent} (prices.columns, "
                          f"prices.symbols); columns {list(df.columns)}, symbols {sorted(set(df.get('Ticker', [])))}")
    df = df[df["Ticker"].isin(symbols)].copy()
    unsorted = sum(_unsorted(_dates(list(g["Date"]))) for _, g in df.groupby("Ticker", sort=False))
    df["k"] = df.groupby(["Ticker", "Date"]).cumcount()  # a repeated (ticker, date) line becomes its own row
    wide = df.set_index(["Date", "k", "Ticker"])[fields].unstack("Ticker")  # rows (date, k), columns (field, ticker)
    columns = {f"{t} {f}": [None if _isnan(v) else v for v in wide[(f, t)]] for t in symbols for f in fields}
    return [d for d, _ in wide.index], columns, unsorted


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _dates(raw: list, iso: bool = False) -> list:
    """Parsed time stamps (numpy datetime64, UTC where the file gives offsets) or None where a value is not a date.
    One format for the whole column (value by value, 01/02 and 13/02 were read as two formats, and the series
    reordered): ISO 8601; else the format pandas guesses from the first values, month first or day first; else, only
    where it reads more values than either (a weekday in the date, date-only rows among timed ones), each value
    as it comes. Offsets that change within the file (daylight saving) are taken to UTC. `iso`: ISO 8601 only."""
    import warnings

    import pandas as pd
    from pandas.tseries.api import guess_datetime_format

    text = pd.Series([str(v).strip() if v is not None else "" for v in raw], dtype=object)
    text = text.where(~text.isin(data.NA_STRINGS), "")
    present = int((text != "").sum())

    def parse(**how):
        with warnings.catch_warnings():  # pandas' notes that it fell back to dateutil
            warnings.simplefilter("ignore")
            try:
                return pd.to_datetime(text, errors="coerce", utc=True, **how)
            except (ValueError, TypeError):
                return None

    best = parse(format="ISO8601")
    if not iso and (best is None or int(best.notna().sum()) < present):
        samples = [v for v in text if v][:20]
        for dayfirst in (False, True):
            fmt = next((f for v in samples if (f := guess_datetime_format(v, dayfirst=dayfirst))), None)
            found = parse(format=fmt) if fmt else None
            if found is not None and (best is None or found.notna().sum() > best.notna().sum()):
                best = found
        mixed = parse(format="mixed")
        if mixed is not None and (best is None or mixed.notna().sum() > best.notna().sum()):
            best = mixed
    if best is None:
        return [None] * len(raw)
    stamps = best.dt.tz_localize(None).to_numpy(dtype="datetime64[s]")
    return [None if np.isnat(d) else d for d in stamps]


def _unsorted(dates: list) -> int:
    """Rows dated before some earlier row of the file."""
    latest, n = None, 0
    for d in dates:
        if d is None:
            continue
        if latest is not None and d < latest:
            n += 1
        latest = d if latest is None or d > latest else latest
    return n


def _number(v, log: bool) -> tuple[float | None, str]:
    if v is None or _isnan(v) or (isinstance(v, str) and v.strip() in data.NA_STRINGS):
        return None, "missing"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None, "malformed"
    if not math.isfinite(x) or (log and x <= 0):
        return None, "malformed"
    return (math.log(x) if log else x), "ok"


# ---------------------------------------------------------------- cleaning and splitting

def clean(dates: list, columns: dict[str, list], log: bool, source: str = "") -> tuple[list, np.ndarray, list[tuple]]:
    """Kept rows sorted by date: (dates, values (N, C) after the transform, [(date or None, status)] for all rows);
    `dates` as `read_table` parsed them."""
    names = list(columns)
    seen, status, rows = set(), [], []
    for i, d in enumerate(dates):
        if d is None:
            status.append((None, "malformed"))
            continue
        if d in seen:
            status.append((d, "duplicate"))
            continue
        seen.add(d)
        parsed = [_number(columns[c][i], log) for c in names]
        worst = next((s for s in ("malformed", "missing") if any(st == s for _, st in parsed)), "ok")
        status.append((d, worst))
        rows.append((d, [x for x, _ in parsed]))
    rows.sort(key=lambda r: r[0])
    # The series starts when every channel has a value (GOOG's first day for the stocks).
    starts = [next((d for d, v in rows if v[c] is not None), None) for c in range(len(names))]
    if any(s is None for s in starts):
        raise ConfigError(f"{source or 'the data'}: channel(s) {[n for n, s in zip(names, starts) if s is None]} have "
                          f"no numeric value (a text column? name the ones to forecast with prices.columns)")
    start = max(starts)
    status = [(d, "before_start" if d is not None and d < start and st in ("ok", "missing") else st)
              for d, st in status]
    kept = [(d, v) for d, v in rows if d >= start and all(x is not None for x in v)]
    return [d for d, _ in kept], np.array([v for _, v in kept], dtype=np.float64).reshape(len(kept), len(names)), \
        status


def boundaries(kind: str, cfg: RunConfig, dates: list) -> tuple[np.datetime64, np.datetime64, np.datetime64 | None]:
    """Last dates of train and validation, and of test (None = the end of the data)."""
    p = cfg.task
    if p.train_end:
        return _dates([p.train_end], iso=True)[0] + _day_end(p.train_end), \
            _dates([p.val_end], iso=True)[0] + _day_end(p.val_end), None
    if kind == "stocks":
        a, b = DEFAULT_DATES["stocks"]
        return _dates([a])[0] + _day_end(a), _dates([b])[0] + _day_end(b), None
    n = len(dates)
    if kind == "ett":
        ends = np.cumsum(ETT_ROWS)
        if n < ends[-1]:
            raise ConfigError(f"{cfg.data.path}: the standard ETTh split needs {ends[-1]} rows, found {n} (a file "
                              f"named ETTh* is split as ETTh1 is); set prices.train_end and prices.val_end to split "
                              f"yours")
        return dates[ends[0] - 1], dates[ends[1] - 1], dates[ends[2] - 1]
    n_train, n_val = round(n * CSV_FRACTIONS[0]), round(n * sum(CSV_FRACTIONS))
    if n_train < 1 or n_val <= n_train or n_val >= n:
        raise ConfigError(f"{cfg.data.path}: {n} usable rows are too few to split 70/10/20")
    return dates[n_train - 1], dates[n_val - 1], None


def _day_end(text: str) -> np.timedelta64:
    """A bare date (2010-12-31) includes the whole day."""
    return np.timedelta64(86399, "s") if len(text.strip()) <= 10 else np.timedelta64(0, "s")


def split_of(d, ends) -> str:
    if d is None:
        return "unused"
    train_end, val_end, test_end = ends
    return "train" if d <= train_end else "validation" if d <= val_end else \
        "test" if test_end is None or d <= test_end else "unused"


def build(tmp: Path, cfg: RunConfig, s: dict) -> dict:
    import datasets

    kind = s["kind"]
    parsed, columns, unsorted = read_table(cfg, kind)
    source = cfg.data.path or "embedded stocks"
    dates, values, status = clean(parsed, columns, log=s["transform"] == "log", source=source)
    # ETTh's standard split counts the file's hours, not the rows kept: a dropped row must not move its dates
    ends = boundaries(kind, cfg, sorted({d for d in parsed if d is not None}) if kind == "ett" else dates)
    counts: dict[str, Counter] = {name: Counter() for name in SPLITS}
    for d, st in status:
        where = split_of(d, ends)
        if where == "unused" and st == "ok":
            st = "after_test"
        counts.setdefault(where, Counter())[st] += 1
    which = np.array([split_of(d, ends) for d in dates])
    train = values[which == "train"]
    if len(train) < 2:
        raise ConfigError(f"{source}: {len(train)} training rows; check prices.train_end")
    with np.errstate(over="ignore"):  # an overflow is refused by name (`z_scores`), not warned of by numpy
        mean, std = train.mean(0), train.std(0)
    std = np.where(std > 0, std, 1.0)  # a constant channel stays centred instead of dividing by zero
    z = z_scores(values, mean, std, dates, list(columns), source)
    if unsorted:
        print(f"note: {source}: {unsorted} row(s) out of date order, sorted by date", flush=True)
    splits = {}
    for name in SPLITS:
        rows = np.flatnonzero(which == name)
        ds = datasets.Dataset.from_dict({"date": [str(dates[i]) for i in rows], "values": z[rows].tolist()})
        save_split(tmp, name, ds)
        splits[name] = {"rows": len(rows), "first": str(dates[rows[0]]) if len(rows) else None,
                        "last": str(dates[rows[-1]]) if len(rows) else None}
    return {"counts": {k: dict(v) for k, v in counts.items()}, "channels": list(columns),
            "norm": {"transform": s["transform"], "mean": mean.tolist(), "std": std.tolist()},
            "splits": splits, "cleaning": {"unsorted": unsorted}}


def _seen(meta: dict, dates: list, starts: range) -> str:
    """'; N of M windows forecast dates the run trained or validated on': new data that is not new."""
    last = meta["splits"]["validation"]["last"] or meta["splits"]["train"]["last"]
    seen = sum(dates[t] <= np.datetime64(last) for t in starts) if last else 0
    return f"; {seen} of {len(starts)} windows forecast dates the run trained or validated on (to {last[:10]})" \
        if seen else ""


def z_scores(values: np.ndarray, mean: np.ndarray, std: np.ndarray, dates: list, names: list[str],
             source: str) -> np.ndarray:
    """(values - mean) / std. A value so large that the training statistics overflow or its z-score does not fit in
    float32 would erase its channel or turn every forecast and metric to NaN: refused, naming it."""
    with np.errstate(over="ignore"):
        z = (values - mean) / std
    bad = ~(np.isfinite(mean) & np.isfinite(std)) | ~(np.abs(z) <= np.finfo(np.float32).max).all(0)  # (NaN: bad)
    if bad.any():
        c = int(np.flatnonzero(bad)[0])
        row = int(np.argmax(np.abs(values[:, c])))
        raise ConfigError(f"{source}: channel {names[c]!r} holds {values[row, c]:.4g} at {str(dates[row])[:19]}, "
                          f"too large to scale (its z-score or the training rows' statistics overflow); fix or drop "
                          f"that row")
    return z


# ---------------------------------------------------------------- windows

def to_price(z: torch.Tensor, norm: dict) -> torch.Tensor:
    """Normalised values (..., C) back to the source's scale (prices, for the stocks)."""
    mean = torch.tensor(norm["mean"], dtype=torch.float64)
    std = torch.tensor(norm["std"], dtype=torch.float64)
    x = z.double() * std + mean
    return x.exp() if norm["transform"] == "log" else x


def series(directory: Path) -> tuple[torch.Tensor, dict[str, tuple[int, int]], list[str]]:
    """All kept rows in time order, (N, C) float32, each split's row range [a, b), and each row's date."""
    parts, bounds, dates, at = [], {}, [], 0
    for name in SPLITS:
        ds = load_split(directory, name)
        rows = torch.tensor(np.asarray(ds["values"], dtype=np.float32).reshape(len(ds), -1))
        parts.append(rows)
        dates += ds["date"]
        bounds[name] = (at, at + len(rows))
        at += len(rows)
    return torch.cat(parts), bounds, dates


def target_starts(bounds: tuple[int, int], lookback: int, horizon: int, context: str) -> range:
    """First target step of every window of a split: targets in [a, b); inputs from `a` (split) or from row 0."""
    a, b = bounds
    first = a + lookback if context == "split" or a == 0 else max(a, lookback)
    return range(first, b - horizon + 1)


class Windows(torch.utils.data.Dataset):
    """Sample i: {"x": (lookback, C), "y": (horizon, C)} of normalised values; `dates`: each row's date, where
    known (`targets` names a run of windows by them)."""

    def __init__(self, values: torch.Tensor, starts: range, lookback: int, horizon: int,
                 dates: list[str] | None = None):
        self.values, self.starts, self.lookback, self.horizon, self.dates = values, starts, lookback, horizon, dates

    def targets(self, first: int, last: int) -> str:
        """The dates that windows `first`..`last` forecast (their rows where no dates are known)."""
        a, b = self.starts[first], self.starts[last] + self.horizon - 1
        return f"{self.dates[a][:10]}..{self.dates[b][:10]}" if self.dates else f"rows {a}..{b}"

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        t = self.starts[i]
        return {"x": self.values[t - self.lookback:t], "y": self.values[t:t + self.horizon]}


def windows(cfg: RunConfig, directory: Path, split: str) -> Windows:
    p = cfg.task
    values, bounds, dates = series(directory)
    starts = target_starts(bounds[split], p.lookback, p.horizon, p.context)
    if len(starts) == 0:
        a, b = bounds[split]
        raise ConfigError(f"the {split} split has {b - a} rows, too few for one window of lookback {p.lookback} + "
                          f"horizon {p.horizon} (prices.context = {p.context!r}); shorten them or move the dates")
    return Windows(values, starts, p.lookback, p.horizon, dates)


def norm_of(directory: Path) -> dict:
    return read_meta(directory)["norm"]


def read_scoring(cfg: RunConfig, stored: Path, path: Path) -> tuple[Windows, dict[str, int], Path, str]:
    """New data for `harness evaluate --data`: (every window of the file, z-scored with the stored statistics; the
    count of every row status; the file read; the protocol line)."""
    from dataclasses import replace

    meta, p = read_meta(stored), cfg.task
    f = resolve_path(str(path))
    if not f.is_file():
        raise ConfigError(f"{path}: not found")
    if not f.name.lower().removesuffix(".gz").endswith(".csv"):
        raise ConfigError(f"{path}: the prices task reads csv files (a date column and the run's channels)")
    stocks = source_kind(cfg.data.path) == "stocks"
    if not stocks:  # exactly the run's channels, in its order
        cfg = replace(cfg, task=replace(p, columns=",".join(meta["channels"])))
    parsed, columns, _ = read_table(cfg, "stocks" if stocks else "csv", str(f))
    if list(columns) != meta["channels"]:
        raise ConfigError(f"{path}: its channels are {list(columns)}; the run forecasts {meta['channels']}")
    norm = meta["norm"]
    dates, values, status = clean(parsed, columns, log=norm["transform"] == "log", source=str(path))
    z = torch.tensor(z_scores(values, np.array(norm["mean"]), np.array(norm["std"]), dates, meta["channels"],
                              str(path)), dtype=torch.float32)
    starts = range(p.lookback, len(z) - p.horizon + 1)
    if len(starts) == 0:
        raise ConfigError(f"{path}: {len(z)} usable rows, too few for one window of lookback {p.lookback} + horizon "
                          f"{p.horizon}")
    protocol = (f"{f.name} {str(dates[0])[:10]}..{str(dates[-1])[:10]}, {len(meta['channels'])} channels, lookback "
                f"{p.lookback}, horizon {p.horizon}, every window (stride 1) inside the file, z-scored with the run's "
                f"train statistics{' of log prices' if norm['transform'] == 'log' else ''}{_seen(meta, dates, starts)}")
    return Windows(z, starts, p.lookback, p.horizon, [str(d) for d in dates]), \
        dict(Counter(st for _, st in status)), f, protocol
