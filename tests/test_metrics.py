"""The field metrics against values computed by hand, and the prepared-data cache every case study uses."""
from __future__ import annotations

import json
import math

import pytest
import torch

from harness.tasks import metrics
from harness.config.run import ConfigError, to_toml
from harness.tasks import resolve
from harness.prepare import package_file, prepared, read_meta, summary


def test_bleu_brevity_penalty_by_hand():
    # Every n-gram of the 5-word hypothesis is in the 6-word reference: precisions are 1, so BLEU is the
    # brevity penalty exp(1 - 6/5).
    out = metrics.bleu_chrf(["the cat sat on the"], ["the cat sat on the mat"])
    assert out["bleu"] == pytest.approx(100 * math.exp(1 - 6 / 5), rel=1e-6)
    assert metrics.bleu_chrf(["a b c d e"], ["a b c d e"])["chrf"] == pytest.approx(100.0)
    assert out["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    with pytest.raises(ValueError):
        metrics.bleu_chrf(["one"], ["one", "two"])


def test_auroc_counts_ties_half():
    # positives 0.35, 0.8; negatives 0.1, 0.35: pairs (0.35>0.1) 1, (0.35=0.35) 1/2, (0.8>both) 2 -> 3.5 / 4
    assert metrics.auroc([0.1, 0.35, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.875)
    assert metrics.auroc([0.9, 0.1], [0, 1]) == 0.0
    with pytest.raises(ValueError):
        metrics.auroc([0.1, 0.2], [1, 1])


def test_accuracy_and_q3_skip_unresolved_residues():
    assert metrics.accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    # the last residue is wrong but unresolved (mask 0): 2 right of 3 resolved
    assert metrics.q3([[0, 1, 2, 1]], [[0, 1, 1, 2]], [[1, 1, 1, 0]]) == pytest.approx(2 / 3)


def test_regression_and_direction_by_hand():
    assert metrics.regression([1.0, 2.0, 4.0], [0.0, 4.0, 4.0]) == pytest.approx({"mse": 5 / 3, "mae": 1.0})
    # last value 1; truth goes to 3 then 0.5; forecast goes to 2 (right way) then 1.5 (wrong way)
    assert metrics.directional_accuracy([[1.0]], [[[2.0], [1.5]]], [[[3.0], [0.5]]]) == 0.5


def test_rank_correlations_by_hand():
    # x ranks 4, 1, 2.5, 2.5, 5 (the tie shares ranks 2 and 3); y ranks 1, 2, 3, 4.5, 4.5; both centred on 3:
    # sum of products 2.25, sums of squares 9.5 and 9.5 -> 2.25 / 9.5
    assert metrics.ranks([3, 1, 2, 2, 5]).tolist() == [4, 1, 2.5, 2.5, 5]
    assert metrics.spearman([3, 1, 2, 2, 5], [1, 2, 3, 4, 4]) == pytest.approx(2.25 / 9.5)
    assert metrics.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # 1 / sqrt(2 * 2)
    assert metrics.spearman([1, 2, 3], [1, 4, 100]) == pytest.approx(1.0)  # monotone, not linear
    assert math.isnan(metrics.pearson([1, 1, 1], [1, 2, 3]))


def test_ridge_by_hand_in_both_forms():
    # one feature 0, 1, 2 and targets 1, 3, 2: centred x -1, 0, 1 and y -1, 1, 0 -> w = 1 / (2 + alpha),
    # intercept 2 - w
    w, = metrics.ridge([[0.0], [1.0], [2.0]], [1.0, 3.0, 2.0], alphas=[1.0])
    assert w.tolist() == pytest.approx([1 / 3, 5 / 3])
    # more features than rows: the dual form, which must equal the primal one
    x = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]])
    y = torch.tensor([1.0, -1.0])
    xc, yc = (x - x.mean(0)).double(), (y - y.mean()).double()
    primal = torch.linalg.solve(xc.T @ xc + 0.5 * torch.eye(3, dtype=torch.float64), xc.T @ yc)
    assert metrics.ridge(x, y, alphas=[0.5])[0][:3].tolist() == pytest.approx(primal.tolist())


def test_prepared_builds_once_and_keys_on_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path))
    calls = []

    def build(directory):
        calls.append(directory)
        (directory / "train.txt").write_text("x")
        return {"counts": {"train": {"ok": 3, "empty": 1}}}

    a = prepared("demo", {"v": 1}, build)
    assert prepared("demo", {"v": 1}, build) == a and len(calls) == 1  # reused
    assert (a / "train.txt").read_text() == "x" and read_meta(a)["settings"] == {"v": 1}
    assert "train: 3 rows kept of 4 (1 empty" in summary(read_meta(a)).line()
    assert prepared("demo", {"v": 2}, build) != a and len(calls) == 2  # a changed setting prepares anew

    def broken(directory):
        (directory / "half").write_text("x")
        raise RuntimeError("source vanished")

    with pytest.raises(RuntimeError):
        prepared("demo", {"v": 3}, broken)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "prepared").iterdir()) == ["demo", "demo"]  # no debris


def test_package_file_names_the_extra_when_missing():
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[data\]"'):
        package_file("harness", "no/such/file.db")
    assert package_file("harness", "cli.py").name == "cli.py"


def test_task_sections_belong_to_their_task(tmp_path):
    with pytest.raises(ConfigError, match=r"\[prices\] keys belong to run.task = 'prices'"):
        resolve(None, ["train.max_steps=1", "prices.horizon=12"])
    cfg = resolve(None, ["train.max_steps=1", 'run.task="prices"', "prices.horizon=12"]).cfg
    assert cfg.task.horizon == 12 and "translation" not in cfg.to_dict() and cfg.to_dict()["prices"]["horizon"] == 12
    # the saved config of an lm run carries no other task's section, so it resolves again
    saved = tmp_path / "config.toml"
    saved.write_text(to_toml(resolve(None, ["train.max_steps=1"]).cfg))
    assert resolve(str(saved)).cfg.run.task == "lm" and "[prices]" not in saved.read_text()
    assert json.dumps(cfg.to_dict())  # serialisable for the trackers


def test_auroc_by_ranks_equals_every_pair_compared_and_scales():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (300,), generator=g).float()  # many ties
    labels = torch.rand(300, generator=g) < 0.3
    pos, neg = scores[labels], scores[~labels]
    pairs = ((pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum())
    assert metrics.auroc(scores, labels) == pytest.approx((pairs / (len(pos) * len(neg))).item(), abs=1e-12)
    big = torch.rand(200_000, generator=g)  # positives x negatives would be 10^10 comparisons
    assert metrics.auroc(big, big > 0.5) == 1.0


def test_the_run_directory_s_config_reads_back_whatever_its_strings_hold(tmp_path):
    import tomllib

    odd = "tab\there, bell \x07, quote \" and backslash \\ and a newline\nand unicode é"
    cfg = resolve(None, ["train.max_steps=1", f"run.name={json.dumps(odd)}", "train.grad_clip=0.5",
                         'data.length_buckets="32,64,128"']).cfg
    text = to_toml(cfg)
    assert tomllib.loads(text) == cfg.to_dict()  # every field, as it was
    (tmp_path / "config.toml").write_text(text)
    assert resolve(str(tmp_path / "config.toml")).cfg == cfg


def test_the_evaluate_table_keeps_its_columns_whatever_the_metric_names():
    """Metric names shorter than the header's "metric" had shifted the rows left of it."""
    from harness.eval.evaluate import render_table

    for scores in ({"r": 0.5, "mse": 1.25}, {"a_long_metric_name": 2.0}):
        table = render_table("test", {**scores, "signature": "x"}).splitlines()
        assert len({len(line) for line in table[:-1]}) == 1 and table[-1] == "signature: x", table


def test_eval_json_is_strict_json_with_a_metric_that_is_not_a_number_as_null(tmp_path):
    """Spearman's rho of constant predictions is NaN: eval.json held a bare NaN, which only Python's reader takes."""
    from harness.eval.evaluate import RESULTS, _record

    _record(tmp_path, {"test": {"spearman": math.nan, "mse": 1.5, "signature": "x"}})
    _record(tmp_path, {"more.csv": {"pearson": -math.inf}})

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    assert json.loads((tmp_path / RESULTS).read_text(), parse_constant=refuse) == {
        "test": {"spearman": None, "mse": 1.5, "signature": "x"}, "more.csv": {"pearson": None}}
