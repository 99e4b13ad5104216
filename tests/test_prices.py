"""The price-forecasting case study: preparation (chronological splits, windows inside their split, train-only
normalisation, cleaning counts), the PatchTST-style model, the baselines and metrics, and a 2-process run."""
from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch

from harness.config.run import ConfigError
from harness.tasks import resolve
from harness.models.patch import PatchConfig, PatchTST
from harness.prepare import prices as P
from harness.prepare import read_meta
from harness.tasks.prices import PricesTask, baselines, by_period, score, trivial_directions, verdict

from conftest import bare_copy, cli, harness


@pytest.fixture(scope="session", autouse=True)
def cache(tmp_path_factory):
    """Prepared data goes to a fresh cache for the session (the subprocess runs get it through the environment)."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", str(path))
        yield path


def cfg_for(path: str = "", *sets: str):
    return resolve(None, ['run.task="prices"', "train.max_steps=1", f"data.path={json.dumps(path)}", *sets]).cfg


def write_series(path, n: int = 400, channels: int = 3, seed: int = 0, extra_rows: list[str] = ()):
    """Hourly sums of sines plus noise, one csv column per channel; `extra_rows` are appended as written."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)[:, None]
    values = 10 + np.sin(2 * np.pi * t / (12 + 5 * np.arange(channels))) * (1 + np.arange(channels)) \
        + 0.05 * rng.standard_normal((n, channels))
    dates = np.datetime64("2020-01-01T00") + np.arange(n).astype("timedelta64[h]")
    lines = ["date," + ",".join(f"c{i}" for i in range(channels))]
    lines += [f"{str(d).replace('T', ' ')}:00:00," + ",".join(f"{v:.6f}" for v in row) for d, row in zip(dates, values)]
    path.write_text("\n".join([*lines, *extra_rows]) + "\n")
    return path


@pytest.fixture(scope="session")
def series_csv(tmp_path_factory):
    return write_series(tmp_path_factory.mktemp("prices") / "series.csv", n=600)


@pytest.fixture(scope="session")
def stocks():
    cfg = cfg_for("")
    return cfg, P.prepare(cfg)


def test_stocks_split_chronologically_on_the_same_dates(stocks):
    cfg, directory = stocks
    meta = read_meta(directory)
    s = meta["splits"]
    assert meta["channels"] == ["AAPL Adj Close", "IBM Adj Close", "MSFT Adj Close", "GOOG Adj Close"]
    assert s["train"]["first"] >= "2004-08-19" and s["train"]["last"] <= "2010-12-31T23"
    assert "2011-01-01" <= s["validation"]["first"] and s["validation"]["last"] <= "2011-12-31T23"
    assert "2012-01-01" <= s["test"]["first"]
    dates = [d for name in P.SPLITS for d in P.load_split(directory, name)["date"]]
    assert dates == sorted(dates) and len(set(dates)) == len(dates)
    values, bounds, _ = P.series(directory)
    assert values.shape == (len(dates), 4) and torch.isfinite(values).all()
    # rows before GOOG's first day are counted, not silently lost
    assert meta["counts"]["train"]["before_start"] > 0 and meta["counts"]["train"]["ok"] == s["train"]["rows"]


def test_stocks_normalisation_uses_training_rows_only(stocks):
    import pandas as pd

    cfg, directory = stocks
    raw = pd.read_csv(P.package_file(*P.STOCKS))
    aapl = raw[(raw.Ticker == "AAPL") & (raw.Date >= "2004-08-19") & (raw.Date <= "2010-12-31")]["Adj Close"]
    norm = read_meta(directory)["norm"]
    assert norm["transform"] == "log"
    assert norm["mean"][0] == pytest.approx(np.log(aapl).mean(), rel=1e-9)
    assert norm["std"][0] == pytest.approx(np.log(aapl).std(ddof=0), rel=1e-9)
    values, bounds, _ = P.series(directory)
    a, b = bounds["train"]
    assert values[a:b].mean(0).abs().max() < 1e-4 and values[b:].mean(0).abs().max() > 0.5  # prices rose after 2010
    # back to prices: the first training row of AAPL is its adjusted close on 2004-08-19
    assert P.to_price(values[0], norm)[0].item() == pytest.approx(aapl.iloc[0], rel=1e-5)


def test_csv_normalisation_fitted_on_train_rows(series_csv):
    cfg = cfg_for(str(series_csv))
    directory = P.prepare(cfg)
    meta = read_meta(directory)
    assert [meta["splits"][s]["rows"] for s in P.SPLITS] == [420, 60, 120]  # 70/10/20 in time order
    raw = np.loadtxt(series_csv, delimiter=",", skiprows=1, usecols=(1, 2, 3))
    assert meta["norm"]["mean"] == pytest.approx(raw[:420].mean(0).tolist(), rel=1e-9)
    assert meta["norm"]["std"] == pytest.approx(raw[:420].std(0).tolist(), rel=1e-9)
    assert meta["norm"]["mean"] != pytest.approx(raw.mean(0).tolist(), rel=1e-6)


@pytest.mark.parametrize("context", ["split", "previous"])
def test_windows_stay_inside_their_split(tmp_path, context):
    """Each value encodes its row number, so the rows a window reads can be checked against the split bounds."""
    n, lookback, horizon = 200, 12, 5
    rows = ["date,row"] + [f"{np.datetime64('2021-01-01T00:00:00') + np.timedelta64(i, 'h')},{i}" for i in range(n)]
    (tmp_path / "rows.csv").write_text("\n".join(rows) + "\n")
    cfg = cfg_for(str(tmp_path / "rows.csv"), f"prices.lookback={lookback}", f"prices.horizon={horizon}",
                  f'prices.context="{context}"')
    directory = P.prepare(cfg)
    norm, (_, bounds, _) = read_meta(directory)["norm"], P.series(directory)
    for split in P.SPLITS:
        a, b = bounds[split]
        w = P.windows(cfg, directory, split)
        reach = 0 if split == "train" or context == "split" else lookback
        assert len(w) == (b - a) - horizon + 1 - (lookback - reach)
        for i in range(len(w)):
            x = P.to_price(w[i]["x"], norm).round().long().flatten()
            y = P.to_price(w[i]["y"], norm).round().long().flatten()
            assert y.min() >= a and y.max() < b, (split, i)
            assert x.min() >= a - reach and x.max() == y.min() - 1
            assert torch.equal(torch.cat([x, y]), torch.arange(x.min(), y.max() + 1))


def test_malformed_rows_are_counted(tmp_path):
    extra = ["2020-01-10 05:00:00,1.0,2.0,3.0",          # a date already seen: duplicate
             "not a date,1.0,2.0,3.0",                     # malformed date
             "2020-01-30 00:00:00,abc,2.0,3.0",            # non-numeric value: malformed
             "2020-01-30 01:00:00,,2.0,3.0",               # missing value
             "2019-12-31 23:00:00,10.0,10.0,10.0",         # before the first row: unsorted, kept
             "2020-01-30 02:00:00,1.0,2.0",                # a field short: malformed (undated, unused)
             "2020-01-30 03:00:00,1.0,2.0,\ufffd",          # undecodable byte (written as 0xff): malformed
             "2020-01-30 04:00:00,1.0,NA,3.0"]             # missing too (pandas' NA strings)
    path = write_series(tmp_path / "dirty.csv", n=500, extra_rows=extra)
    path.write_bytes(path.read_bytes().replace("\ufffd".encode(), b"\xff"))
    directory = P.prepare(cfg_for(str(path)))
    meta = read_meta(directory)
    total = {}
    for counts in meta["counts"].values():
        for status, k in counts.items():
            total[status] = total.get(status, 0) + k
    assert total == {"ok": 501, "duplicate": 1, "malformed": 4, "missing": 2}
    assert meta["counts"]["unused"] == {"malformed": 2}  # the undated rows belong to no split
    assert meta["cleaning"]["unsorted"] == 2  # the repeated date and the 2019 row come after later dates
    assert sum(s["rows"] for s in meta["splits"].values()) == 501
    assert meta["splits"]["train"]["first"].startswith("2019-12-31T23")


def test_a_long_layout_or_stock_symbols_on_a_file_are_refused_and_a_sort_is_said(tmp_path, capsys):
    """A file of one row per symbol and date had become its first symbol's series (the others' rows "duplicate"),
    and prices.symbols on it was passed over; rows sorted by date are said at prepare, not in meta.json alone."""
    lines = write_series(tmp_path / "wide.csv", n=200, channels=1).read_text().splitlines()
    (tmp_path / "long.csv").write_text("date,ticker,close\n" + "".join(
        f"{line.split(',')[0]},{t},{line.split(',')[1]}\n" for line in lines[1:] for t in ("AAA", "BBB")))
    with pytest.raises(ConfigError, match=r"its 400 rows hold 200 dates: one row per series and date \(a long "
                                          r"layout\)\? .* pivot it first"):
        P.read_table(cfg_for(str(tmp_path / "long.csv"), 'prices.columns="close"'), "csv")
    with pytest.raises(ConfigError, match="prices.symbols chooses among the embedded stocks"):
        P.read_table(cfg_for(str(tmp_path / "wide.csv"), 'prices.symbols="AAA,BBB"'), "csv")
    (tmp_path / "reversed.csv").write_text("\n".join([lines[0], *reversed(lines[1:])]) + "\n")
    capsys.readouterr()
    P.prepare(cfg_for(str(tmp_path / "reversed.csv")))
    assert f"note: {tmp_path / 'reversed.csv'}: 199 row(s) out of date order, sorted by date" in capsys.readouterr().out


def test_a_date_column_is_read_in_one_format(tmp_path):
    """Day-first dates read as one format (value by value, 01/02 was read month first and 13/02 day first, and the
    series reordered); offsets that change within the file (daylight saving) no traceback; a column of no dates is
    named as such, not as channels without numbers."""
    path = write_series(tmp_path / "iso.csv", n=400)
    iso = P.clean(*P.read_table(cfg_for(str(path)), "csv")[:2], log=False)
    lines = path.read_text().splitlines()
    day_first = [lines[0]] + [f"{d[8:10]}/{d[5:7]}/{d[:4]} {d[11:]},{rest}" for d, rest in
                              (line.split(",", 1) for line in lines[1:])]
    (tmp_path / "dmy.csv").write_text("\n".join(day_first) + "\n")
    parsed, columns, unsorted = P.read_table(cfg_for(str(tmp_path / "dmy.csv")), "csv")
    dmy = P.clean(parsed, columns, log=False)
    assert unsorted == 0 and dmy[0] == iso[0] and np.array_equal(dmy[1], iso[1])
    import pandas as pd

    local = pd.date_range("2020-03-20", periods=400, tz="Europe/Berlin")  # +01:00, then +02:00 from March 29
    (tmp_path / "tz.csv").write_text("date,a\n" + "".join(f"{d},{i}\n" for i, d in
                                                          enumerate(local.strftime("%Y-%m-%dT%H:%M:%S%z"))))
    dates, values, _ = P.clean(*P.read_table(cfg_for(str(tmp_path / "tz.csv")), "csv")[:2], log=False)
    assert len(dates) == 400 and dates == sorted(dates) and values[:, 0].tolist() == list(range(400))
    (tmp_path / "steps.csv").write_text("t,a\n" + "".join(f"{i},{i}\n" for i in range(50)))
    with pytest.raises(ConfigError, match=r"column 't' \(prices.date_column\) holds no dates \(0 of 50 values"):
        P.read_table(cfg_for(str(tmp_path / "steps.csv")), "csv")
    # a first value that is no date (pandas then parsed value by value); a weekday in the date (only the Mondays
    # matched the format guessed)
    assert P._dates(["NA", "01/02/2020", "13/02/2020"])[1:] == [np.datetime64("2020-02-01"),
                                                                np.datetime64("2020-02-13")]
    days = pd.date_range("2020-01-01", periods=30)
    assert P._dates(list(days.strftime("%a, %d %b %Y"))) == list(days.to_numpy(dtype="datetime64[s]"))


def test_bad_settings_fail_before_training(series_csv, tmp_path):
    task = PricesTask()
    # a split too short for one window: refused by the check `harness plan` and every launch run first
    with pytest.raises(ConfigError, match="the validation split has 10 rows, too few for one window"):
        task.check(cfg_for(str(write_series(tmp_path / "short.csv", n=100)), "prices.patch_len=4", "prices.lookback=8",
                           "prices.horizon=4"))
    big = write_series(tmp_path / "big.csv", n=400)  # one training value past float64's squares: it erased c1
    big.write_text(big.read_text().replace(big.read_text().splitlines()[7].split(",")[2], "1e200", 1))
    with pytest.raises(ConfigError, match=r"channel 'c1' holds 1e\+200 at 2020-01-01T06:00:00, too large to scale"):
        P.prepare(cfg_for(str(big)))
    # ETTh's standard split is the file's first 8640 hours, then 2880 and 2880: rows dropped for an empty cell do not
    # move it (it counted the rows kept)
    ett = write_series(tmp_path / "ETTh1.csv", n=14400, channels=1)
    lines = ett.read_text().splitlines()
    ett.write_text("\n".join(line.split(",")[0] + "," if i in (5, 6, 7) else line for i, line in enumerate(lines))
                   + "\n")
    splits = read_meta(P.prepare(cfg_for(str(ett))))["splits"]
    assert [splits[s]["first"][:13] for s in P.SPLITS] == ["2020-01-01T00", "2020-12-26T00", "2021-04-25T00"]
    assert [splits[s]["rows"] for s in P.SPLITS] == [8637, 2880, 2880]
    with pytest.raises(ConfigError, match="patch_len"):
        task.check(cfg_for(str(series_csv), "prices.lookback=8", "prices.patch_len=16"))
    with pytest.raises(ConfigError, match="both"):
        task.check(cfg_for(str(series_csv), 'prices.train_end="2020-01-05"'))
    with pytest.raises(ConfigError, match="not found"):
        task.check(cfg_for(str(series_csv) + ".missing"))
    with pytest.raises(ConfigError, match=r"prices.periods = 0 \(command line\) must be > 0"):  # (its bound)
        task.check(cfg_for(str(series_csv), "prices.periods=0"))
    with pytest.raises(ConfigError, match="too few"):
        P.windows(cfg_for(str(series_csv), "prices.lookback=64", "prices.horizon=16"), P.prepare(cfg_for(
            str(series_csv), "prices.lookback=64", "prices.horizon=16")), "validation")


@pytest.mark.parametrize("lookback,patch_len,stride", [(96, 16, 8), (50, 7, 3), (16, 16, 4)])
def test_model_output_shape(lookback, patch_len, stride):
    cfg = PatchConfig(lookback=lookback, horizon=11, patch_len=patch_len, stride=stride, d_model=16, n_heads=2,
                      d_ff=32)
    model = PatchTST(cfg)
    assert model(torch.randn(3, lookback, 5)).shape == (3, 11, 5)
    assert model.embed.pos_emb.num_embeddings == cfg.n_patches == (lookback - patch_len) // stride + 2
    with torch.device("meta"):
        assert PatchTST(cfg)(torch.randn(2, lookback, 1)).shape == (2, 11, 1)


@pytest.mark.parametrize("center", ["mean", "last"])
def test_instance_normalisation_scales_and_shifts_the_forecast(center):
    torch.manual_seed(0)
    model = PatchTST(PatchConfig(lookback=32, horizon=8, patch_len=8, stride=4, d_model=16, n_heads=2, d_ff=32,
                                 center=center)).eval()
    torch.nn.init.normal_(model.head.proj.weight, std=0.1)  # the zero-initialised head would forecast a constant
    x = torch.randn(4, 32, 3).cumsum(1)
    base = model(x)
    assert base.std() > 0.1
    torch.testing.assert_close(model(2.5 * x + 7.0), 2.5 * base + 7.0, rtol=1e-4, atol=1e-4)
    # channels are independent: one channel's forecast does not depend on the others
    y = x.clone()
    y[..., 1:] = torch.randn(4, 32, 2)
    torch.testing.assert_close(model(y)[..., 0], base[..., 0])


def test_untrained_last_centred_model_forecasts_persistence():
    model = PatchTST(PatchConfig(lookback=32, horizon=8, patch_len=8, stride=4, d_model=16, n_heads=2, d_ff=32,
                                 center="last"))
    x = torch.randn(2, 32, 3).cumsum(1)
    torch.testing.assert_close(model(x), baselines(x, 8)["persistence"])


def test_baselines_and_metrics_on_a_hand_made_series():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)  # one window, one channel
    y = torch.tensor([5.0, 7.0]).view(1, 2, 1)
    b = baselines(x, 2)
    assert b["persistence"].flatten().tolist() == [4.0, 4.0]
    assert b["drift"].flatten().tolist() == [5.0, 6.0]  # slope (4 - 1) / 3
    model = torch.tensor([3.0, 8.0]).view(1, 2, 1)
    identity = {"transform": "none", "mean": [0.0], "std": [1.0]}
    m = score({"model": model, **b}, x[:, -1], y, identity)
    assert m["persistence_mse"] == pytest.approx((1 + 9) / 2) and m["persistence_mae"] == pytest.approx(2.0)
    assert m["drift_mse"] == pytest.approx(0.5) and m["drift_mae"] == pytest.approx(0.5)
    assert m["mse"] == pytest.approx((4 + 1) / 2) and m["mae"] == pytest.approx(1.5)
    assert m["directional_accuracy"] == pytest.approx(0.5) and m["drift_directional_accuracy"] == 1.0
    assert "persistence_directional_accuracy" not in m and m["price_mse"] == m["mse"]
    # log prices, z-scored: the price scale is exp(z * std + mean)
    norm = {"transform": "log", "mean": [1.0], "std": [0.5]}
    price = lambda z: math.exp(z * 0.5 + 1.0)  # noqa: E731
    m = score({"model": model, **b}, x[:, -1], y, norm)
    want = ((price(4) - price(5)) ** 2 + (price(4) - price(7)) ** 2) / 2
    assert m["persistence_price_mse"] == pytest.approx(want, rel=1e-9)
    assert m["drift_price_mae"] == pytest.approx(abs(price(6) - price(7)) / 2, rel=1e-9)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    """A 2-process ZeRO-2 run on its own copy of the series (a test may change that copy) and the copy."""
    root = tmp_path_factory.mktemp("trained")
    data = write_series(root / "series.csv", n=600)
    run = harness(root / "run", data, nproc=2, ds="zero2.json", env={"HARNESS_CACHE": str(cache)},
                  sets=['run.task="prices"', "prices.lookback=32", "prices.horizon=8", "prices.patch_len=8",
                        "prices.stride=4", "train.max_steps=10", "train.micro_batch_size=8", "schedule.warmup_steps=1"])
    return run, data


def test_two_process_zero2_run_lowers_the_loss_and_evaluates(trained, cache):
    run = trained[0]
    losses = run.losses
    assert len(losses) == 10 and losses[10] < 0.7 * losses[1], losses
    final = run.evals[-1]
    assert final["step"] == 10
    for key in ("loss", "mse", "mae", "price_mse", "persistence_mse", "drift_mse", "directional_accuracy",
                "drift_directional_accuracy"):
        assert math.isfinite(final[key]), key
    assert final["mse"] == pytest.approx(final["loss"], rel=1e-4)  # the same windows, the same squared errors
    # the exported model evaluates on the test split in one process
    proc = cli("evaluate", "--run-dir", str(run.dir), "--split", "test", env={"HARNESS_CACHE": str(cache)},
               timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    test = json.loads((run.dir / "eval.json").read_text())["test"]
    assert test["windows"] == 120 - 8 + 1 - 32 and test["mse"] < test["persistence_mse"]
    assert "persistence_mse" in proc.stdout and re.search(rf"\| windows +\| +{test['windows']} \|", proc.stdout)  # a count
    assert test["skill_vs_persistence"] == pytest.approx(1 - test["mse"] / test["persistence_mse"])
    assert test["verdict"].startswith("the model beats persistence") and "verdict: the model beats" in proc.stdout
    assert test["mse_difference_ci_low"] <= test["mse"] - test["persistence_mse"] <= test["mse_difference_ci_high"]
    assert 0 <= test["always_up_directional_accuracy"] <= 1 and "majority_directional_accuracy" in test
    assert "periods" not in test  # prices.periods = 1: the whole split only
    # rolling origin: the same windows in 2 periods (41 and 40), dated, which together make the whole split's MSE
    proc = cli("evaluate", "--run-dir", str(run.dir), "--split", "test", "--periods", "2",
               env={"HARNESS_CACHE": str(cache)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    periods = json.loads((run.dir / "eval.json").read_text())["test"]
    assert periods["mse"] == pytest.approx(test["mse"]) and periods["periods"] == 2
    assert [periods[f"period_{i}_windows"] for i in (1, 2)] == [41, 40]
    assert (41 * periods["period_1_mse"] + 40 * periods["period_2_mse"]) / 81 == pytest.approx(test["mse"], rel=1e-5)
    assert re.match(r"targets \d{4}-\d\d-\d\d\.\.\d{4}-\d\d-\d\d: ", periods["period_2_verdict"])
    assert "periods_verdict: rolling origin over 2 periods" in proc.stdout
    for bad, message in (("0", "--periods 0: must be >= 1"), ("3", "use at most 2")):  # 81 windows, 4 x 8 a period
        proc = cli("evaluate", "--run-dir", str(run.dir), "--split", "test", "--periods", bad,
                   env={"HARNESS_CACHE": str(cache)}, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_evaluate_data_z_scores_with_the_run_s_statistics(trained, tmp_path, capsys, one_thread):
    """`harness evaluate --data` on a csv of the test period scores what `--split test` scores; once the training
    rows change, `--split` refuses (statistics re-fitted) and `--data` gives the same figures as before."""
    import hashlib

    from harness.cli import main
    from harness.eval.evaluate import evaluate_data, evaluate_run

    run, data = trained
    split = evaluate_run(run.dir, "test")
    original = data.read_text()
    header, *rows = original.splitlines()
    held_out = tmp_path / "2020-01-21.csv"  # the test split's 120 rows (70/10/20 of 600), a file of its own
    held_out.write_text("\n".join([header, *rows[480:]]) + "\n")
    got = evaluate_data(run.dir, held_out)["2020-01-21.csv"]
    assert {k: got[k] for k in split if k != "protocol"} == {k: v for k, v in split.items() if k != "protocol"}
    assert got["rows_kept"] == 120 and got["rows_skipped"] == 0 and "inside the file" in got["protocol"]
    assert got["data_sha256"] == hashlib.sha256(held_out.read_bytes()).hexdigest()
    try:  # the training rows change after the run: statistics fitted now would differ
        scaled = [",".join([r.split(",")[0], *(str(2 * float(v) + 1) for v in r.split(",")[1:])]) for r in rows[:420]]
        data.write_text("\n".join([header, *scaled, *rows[420:]]) + "\n")
        with pytest.raises(ConfigError, match="differs from what the run was trained with .* in meta.json norm"):
            evaluate_run(run.dir, "test")
        capsys.readouterr()
        assert main(["evaluate", "--run-dir", str(run.dir), "--data", str(held_out), "--name", "again"]) == 0
        assert re.search(r"\| metric +\| +again \|", capsys.readouterr().out)
        again = json.loads((run.dir / "eval.json").read_text())["again"]
        assert again == got
    finally:
        data.write_text(original)
    other = tmp_path / "other.csv"
    other.write_text(held_out.read_text().replace("c0", "x0", 1))
    bare = bare_copy(run.dir, tmp_path / "bare")
    older = tmp_path / "older"  # trained when the flatten head had a LayerNorm: its weights hold head.ln.*
    shutil.copytree(run.dir, older)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(older / "model.safetensors"))
    save_file({**weights, "head.ln.weight": torch.ones(4), "head.ln.bias": torch.zeros(4)},
              str(older / "model.safetensors"))
    for run_dir, path, message in ((run.dir, tmp_path / "missing.csv", "missing.csv: not found"),
                                   (run.dir, tmp_path, "expected ETTh1.csv[.gz] or one csv in it"),
                                   (run.dir, other, "no column(s) ['c0']"),
                                   (bare, held_out, "holds no stored tokenizer and statistics"),
                                   (older, held_out, "only in the run: head.ln.bias, head.ln.weight; only in the "
                                                     "model: none): it was trained by another version")):
        assert main(["evaluate", "--run-dir", str(run_dir), "--data", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    seen = evaluate_data(run.dir, data)["series.csv"]["protocol"]  # the run's own file: said, not scored as new
    assert seen.endswith("; 448 of 561 windows forecast dates the run trained or validated on (to 2020-01-20)")
    assert "trained or validated on" not in got["protocol"]
    # a value too large to z-score: refused by name, not metrics of NaN and a "significant" verdict
    huge = tmp_path / "huge.csv"
    huge.write_text(held_out.read_text().replace(rows[500].split(",")[1], "1e300", 1))
    assert main(["evaluate", "--run-dir", str(run.dir), "--data", str(huge)]) == 2
    assert "channel 'c0' holds 1e+300 at 2020-01-21T20:00:00, too large to scale" in capsys.readouterr().err
    # 11 windows (lookback 32, horizon 8) are fewer than 4 blocks of 8: a winner, and no claim of significance (the
    # interval of one block's resamples was a point, "significant")
    short = tmp_path / "short.csv"
    short.write_text("\n".join([header, *rows[480:530]]) + "\n")
    few = evaluate_data(run.dir, short)["short.csv"]
    assert few["windows"] == 11 and "mse_difference_ci_low" not in few and \
        few["verdict"].endswith("; too few windows to judge significance (11, fewer than 4 blocks of the horizon, "
                                "4 x 8)")
    flat = tmp_path / "flat.csv"  # persistence is exact: no share of its zero MSE (it divided by zero)
    flat.write_text("\n".join([header, *(f"{r.split(',')[0]},1.0,2.0,3.0" for r in rows[480:])]) + "\n")
    assert evaluate_data(run.dir, flat)["flat.csv"]["verdict"].startswith("persistence is exact on these windows "
                                                                          "(MSE 0); the model's MSE is ")
    data.rename(data.with_suffix(".moved"))  # the run's data moved: one line, not a traceback
    try:
        assert main(["evaluate", "--run-dir", str(run.dir), "--split", "test"]) == 2
        assert "series.csv: data.path not found" in capsys.readouterr().err
    finally:
        data.with_suffix(".moved").rename(data)


def test_skill_bootstrap_and_verdict_by_hand():
    from harness.tasks.metrics import block_bootstrap_ci, skill

    assert skill(0.5, 1.0) == 0.5 and skill(2.0, 1.0) == -1.0
    # [0, 1] resampled in blocks of 1: means 0, 0.5, 1 with chances 1/4, 1/2, 1/4, so the 95% interval is [0, 1]
    assert block_bootstrap_ci([0.0, 1.0], block=1) == (0.0, 1.0)
    assert block_bootstrap_ci([3.0] * 10, block=4) == (3.0, 3.0)
    assert block_bootstrap_ci([0.0, 1.0, 5.0], block=3) == pytest.approx((2.0, 2.0))  # one block: the series itself
    # 40 windows, horizon 2: the model is off by 0.1 everywhere, persistence by 1 -> clearly better
    y = torch.zeros(40, 2, 1)
    out = verdict(y + 0.1, y + 1.0, y)
    assert out["skill_vs_persistence"] == pytest.approx(0.99)
    assert out["verdict"].startswith("the model beats persistence: its MSE is 99.0% lower; significant")
    # the model is better on half the windows and worse on the other half, by the same amounts: a tie
    errors = torch.tensor([0.5, 1.5] * 20).view(40, 1, 1).expand(40, 2, 1)
    tie = verdict(y + errors, y + errors.flip(0), y)
    assert tie["skill_vs_persistence"] == pytest.approx(0.0) and "not significant" in tie["verdict"]
    nan = verdict(y * float("nan"), y + 1.0, y)  # (it said NaN% higher, significant)
    assert nan["verdict"] == "no verdict: the model's or persistence's errors are not finite"
    assert math.isnan(nan["skill_vs_persistence"]) and "mse_difference_ci_low" not in nan  # a key select_best reads
    # trivial directions: last 0, truth up, up, down over a horizon of 3
    last, truth = torch.zeros(1, 1), torch.tensor([1.0, 2.0, -1.0]).view(1, 3, 1)
    assert trivial_directions(last, truth, up_share=0.8) == {"always_up_directional_accuracy": pytest.approx(2 / 3),
                                                             "majority_directional_accuracy": pytest.approx(2 / 3)}
    assert trivial_directions(last, truth, up_share=0.3)["majority_directional_accuracy"] == pytest.approx(1 / 3)
    # a small difference keeps the digits that tell it from a tie ("0.0% lower")
    from harness.tasks.prices import _share

    assert [_share(x) for x in (0.25, 0.0004, 0.0, -0.000031)] == ["25.0%", "0.04%", "0.0%", "-0.0031%"]


def test_rolling_origin_periods_score_each_stretch_of_windows_by_hand():
    """`by_period`: 16 windows (horizon 2) in 2 periods of 8 (4 blocks of 2 each, the least allowed). In the first the
    model is off by 0.1 and persistence by 0.2 (MSE 0.01 vs 0.04: skill 0.75); in the second the model by 0.3 and
    persistence by 0.1 (0.09 vs 0.01). The errors are constant, so each period's interval is a point and both
    verdicts are significant."""
    from harness.prepare.prices import Windows

    y = torch.zeros(16, 2, 1)
    model = torch.tensor([0.1] * 8 + [0.3] * 8).view(16, 1, 1).expand(16, 2, 1)
    reference = torch.tensor([0.2] * 8 + [0.1] * 8).view(16, 1, 1).expand(16, 2, 1)
    dates = [f"2020-01-{d:02d}" for d in range(1, 21)]  # rows 0-19; window i forecasts rows 3 + i and 4 + i
    windows = Windows(torch.zeros(20, 1), range(3, 19), lookback=3, horizon=2, dates=dates)
    out = by_period(model, reference, y, windows, 2)
    assert out["periods"] == 2 and out["period_1_windows"] == out["period_2_windows"] == 8
    assert (out["period_1_mse"], out["period_1_persistence_mse"]) == pytest.approx((0.01, 0.04))
    assert (out["period_2_mse"], out["period_2_persistence_mse"]) == pytest.approx((0.09, 0.01))
    assert out["period_1_skill_vs_persistence"] == pytest.approx(0.75)
    assert out["period_2_skill_vs_persistence"] == pytest.approx(-8.0)
    assert out["period_1_verdict"].startswith("targets 2020-01-04..2020-01-12: the model beats persistence: its MSE "
                                              "is 75.0% lower; significant")
    assert out["period_2_verdict"].startswith("targets 2020-01-12..2020-01-20: persistence beats the model: the "
                                              "model's MSE is 800.0% higher; significant")
    assert (out["periods_model_ahead"], out["periods_model_ahead_significant"],
            out["periods_persistence_ahead_significant"]) == (1, 1, 1)
    assert out["periods_verdict"] == ("rolling origin over 2 periods (the model fixed): the model beats persistence "
                                      "in 1 (significantly in 1), persistence beats it in 1 (significantly in 1)")
    # 3 periods of 16 windows would hold fewer than 4 blocks of the horizon each: refused, saying how many fit
    with pytest.raises(ConfigError, match="use at most 2"):
        by_period(model, reference, y, windows, 3)
    from harness.tasks.prices import check_periods

    with pytest.raises(ConfigError, match=r"172 windows .* at most 1 fits \(the whole split, no periods\)"):
        check_periods(172, 24, 2)  # prices_cpu's test split: 172 windows, 4 x 24 a period
    assert Windows(torch.zeros(20, 1), range(3, 19), 3, 2).targets(0, 15) == "rows 3..19"  # no dates: the rows
