"""Fitness prediction from a few hundred variants: cadences that follow the data, a subsample of the training rows,
the encoder mixed with its ridge baseline (protein.blend), `harness bench seeds`, and their bad input."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, Stopped, cli, stop_after
from test_protein import cache, write_fitness  # noqa: F401 - cache: this module's own data cache (autouse)

from harness.bench.seeds import markdown, seeds_of, summarise
from harness.config import cadence
from harness.config.run import ConfigError
from harness.distributed.world import single_world
from harness.prepare import protein as prep
from harness.prepare import read_meta
from harness.tasks import resolve
from harness.tasks.protein import ProteinTask
from harness.tasks.protein_samples import scale
from harness.tasks.protein_scoring import choose_mix, ridge_fit


def config(path, *sets: str):
    return resolve(None, ['run.task="protein"', f"data.path={json.dumps(str(path))}", 'protein.objective="regress"',
                          "data.seq_len=32", "model.d_model=16", "model.n_heads=2", *sets]).cfg


def train(eval_every, save_every=0, patience=0):
    return SimpleNamespace(eval_every=eval_every, save_every=save_every, early_stopping_patience=patience)


def test_cadences_in_steps_epochs_and_counts_per_run():
    describe = lambda key: f"{key} = ..."  # noqa: E731
    assert cadence.resolve(train(200), 7, 140, describe) == cadence.Every(200, 0, 0)
    assert cadence.resolve(train("1 epoch", "2 epochs", "3 epochs"), 7, 140, describe) == cadence.Every(7, 14, 3)
    assert cadence.resolve(train("0.5 epochs", patience=4), 7, 140, describe) == cadence.Every(4, 0, 4)  # 3.5 up
    assert cadence.resolve(train("0.5 epochs"), 5, 140, describe).eval_steps == 3  # 2.5 up, not to even
    assert cadence.resolve(train("20 per run", "5 per run"), 7, 140, describe) == cadence.Every(7, 28, 0)
    assert cadence.resolve(train("20 per run"), 7, 110, describe).eval_steps == 6  # 18 evaluations, not 22
    assert cadence.resolve(train("61 per run"), 3, 60, describe).eval_steps == 1  # more than the steps: each step
    assert cadence.resolve(train("10 steps", patience="25 epochs"), 2, 40, describe).patience == 5  # ceil(50 / 10)
    with pytest.raises(ValueError, match=r'train.eval_every = \.\.\. comes to 0 steps .* give at least "0.333 epochs"'):
        cadence.resolve(train("0.1 epochs"), 3, 60, describe)
    with pytest.raises(ValueError, match=r'train.save_every = \.\.\. comes to 0 steps .* at least "0.333 epochs"'):
        cadence.resolve(train(0, "0.1 epochs"), 3, 60, describe)
    for key, value, message in (("train.eval_every", "2 weeks", 'must be 200 or "0.5 epochs" or "20 per run"'),
                                ("train.eval_every", "1.5 steps", "steps come whole"),
                                ("train.early_stopping_patience", "2 per run", 'must be 5 or "0.5 epochs"'),
                                ("train.save_every", -1, "must be >= 0")):
        with pytest.raises(ValueError, match=message):
            cadence.parse(key, value)


def test_bad_cadences_are_one_line_before_and_at_launch(tmp_path):
    """A malformed cadence is refused as the config is read; one that comes to 0 steps once the data's size is known:
    both one line naming the key, exit 2."""
    path = write_fitness(tmp_path / "fitness.csv", n=200)
    with pytest.raises(ConfigError, match=r"train.eval_every must be .*; got '3 days' \(command line\)"):
        config(path, 'train.eval_every="3 days"')
    with pytest.raises(ConfigError, match="early_stopping_patience .* counts evaluations, but train.eval_every"):
        config(path, 'train.select_best="spearman"', 'train.early_stopping_patience="2 epochs"')
    proc = cli("train", "--set", 'run.task="protein"', "--set", f"data.path={json.dumps(str(path))}", "--set",
               'protein.objective="regress"', "--set", "train.max_steps=4", "--set", 'train.eval_every="0.01 epochs"',
               "--set", f"run.output_dir={json.dumps(str(tmp_path / 'run'))}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (  # 140 training rows, 8 a step
        "harness: error: train.eval_every = '0.01 epochs' (command line) comes to 0 steps in this run (17 steps "
        'per epoch, 4 in all); give at least "0.0588 epochs" (one step)'), proc.stderr[-500:]


def test_subsample_keeps_n_rows_of_train_and_validation_and_the_whole_test_split(tmp_path):
    path = write_fitness(tmp_path / "fitness.csv", n=200)  # 140 train, 20 validation, 40 test
    meta = read_meta(prep.prepare(config(path, "protein.train_subsample=50")))
    kept = {s: sum(meta["counts"][s].get(k, 0) for k in ("ok", "truncated")) for s in ("train", "validation", "test")}
    assert kept["train"] + kept["validation"] == 50 and kept["test"] == 40 and kept["validation"] > 0
    assert kept["train"] + meta["counts"]["train"]["not_sampled"] == 140
    again = read_meta(prep.prepare(config(path, "protein.train_subsample=50", "train.seed=3")))
    assert again["counts"] == meta["counts"]  # train.seed does not move the draw; subsample_seed does
    other = prep.prepare(config(path, "protein.train_subsample=50", "protein.subsample_seed=1"))
    assert prep.load(other, "train")["sequence"] != prep.load(prep.prepare(config(path, "protein.train_subsample=50")),
                                                             "train")["sequence"]
    with pytest.raises(ConfigError, match=r"protein.train_subsample = 500 is more than the 160 training and "
                                          r"validation rows"):
        prep.prepare(config(path, "protein.train_subsample=500"))


def test_a_missing_label_column_is_named(tmp_path):
    path = tmp_path / "unlabelled.csv"
    path.write_text("sequence,fitness\nACDKL,1.0\nMKVLA,2.0\n")
    with pytest.raises(ConfigError, match=r"no column 'label' \(protein.label_field\), which the objective needs; "
                                          r"the header is \['sequence', 'fitness'\]"):
        prep.prepare(config(path))
    jsonl = tmp_path / "unlabelled.jsonl"
    jsonl.write_text('{"sequence": "ACDKL", "fitness": 1.0}\n')
    with pytest.raises(ConfigError, match="no line has the field 'label' \\(protein.label_field\\)"):
        prep.prepare(config(jsonl))
    assert read_meta(prep.prepare(config(path, 'protein.label_field="fitness"')))["counts"]["train"]


def test_the_blend_is_the_ridge_fit_at_share_one_and_the_encoder_at_zero(tmp_path):
    """protein.blend = "ridge": the model's linear part predicts exactly what the ridge baseline predicts (z-scored);
    training sees the encoder alone; the share is chosen on the rows given, ties to the smaller."""
    path = write_fitness(tmp_path / "fitness.csv", n=200)
    cfg = config(path, 'protein.blend="ridge"')
    task = ProteinTask()
    task.check(cfg)
    directory = task.prepare(cfg)
    torch.manual_seed(0)
    model = task.build_model(cfg)
    samples = task.samples(cfg, "test")
    batch = task.collate([samples[i] for i in range(len(samples))])
    mean, std = scale(read_meta(directory))
    fitted = ridge_fit(directory)
    expected = (fitted.predict(prep.load(directory, "test")) - mean) / std
    linear = model.ridge(batch["ids"], batch["mask"]).squeeze(-1).double()
    assert torch.allclose(linear, expected, atol=1e-5)
    model.eval()
    encoder = model(batch["ids"], batch["mask"])
    model.ridge_mix.fill_(1.0)
    assert torch.allclose(model(batch["ids"], batch["mask"]).squeeze(-1).double(), expected, atol=1e-5)
    model.ridge_mix.fill_(0.5)
    assert torch.allclose(model(batch["ids"], batch["mask"]), (encoder + linear.float().unsqueeze(-1)) / 2, atol=1e-6)
    model.train()
    assert torch.equal(model(batch["ids"], batch["mask"]), encoder)  # no dropout here: training sees the encoder only
    # an evaluation in training cut short by a stop signal (the loop's World.scored) leaves the share it found
    asked, world = [], dataclasses.replace(single_world(torch.device("cpu")),
                                          between_batches=lambda i, n: stop_after(0, i, n, asked))
    with pytest.raises(Stopped):
        task.evaluate(model, cfg, "validation", world, in_training=True)
    assert asked and model.ridge_mix.item() == 0.5 and model.training
    assert choose_mix([3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.75  # the encoder has it backwards
    assert choose_mix([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == 0.0
    assert choose_mix([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.0  # a tie: the smaller share
    assert choose_mix([1.0, 1.0, 1.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 0.25  # a constant encoder ranks nothing
    with pytest.raises(ConfigError, match="select by spearman, pearson, mse or mae"):
        task.check(config(path, 'protein.blend="ridge"', 'train.select_best="loss"'))
    with pytest.raises(ConfigError, match="protein.blend = 'ridge' is for objective 'regress'"):
        task.check(config(path, 'protein.blend="ridge"', 'protein.objective="classify"'))


def test_seed_summaries_report_every_seed_against_the_baseline(capsys, tmp_path):
    runs = [{"seed": 0, "spearman": 0.60, "ridge_spearman": 0.55}, {"seed": 1, "spearman": 0.50,
                                                                     "ridge_spearman": 0.55},
            {"seed": 2, "error": "boom"}]
    s = summarise(runs, "spearman", "ridge_spearman")
    assert s["failed"] == 1 and s["above_baseline"] == 1 and s["spearman"]["mean"] == pytest.approx(0.55)
    assert s["spearman"]["sd"] == pytest.approx(0.0707107, abs=1e-6) and s["spearman"]["n"] == 2
    one = summarise([{"mse": 0.2, "ridge_mse": 0.3}], "mse", "ridge_mse")
    assert one["above_baseline"] == 1 and one["mse"]["sd"] is None  # lower is better; one seed has no sd (not 0)
    text = markdown({"metric": "spearman", "baseline": "ridge_spearman", "seeds": [0, 1, 2], "split": "test",
                     "threads_per_process": 1, "run_file": "r.toml", "sets": [],
                     "configs": [{"name": "zero0 x1", "runs": runs, **s}]})
    assert "| zero0 x1 | 0.6000, 0.5000, failed | 0.5500 | 0.0707 | 0.5500 (0.0000) | 1 of 2 |" in text
    assert "1 CPU thread(s) per process" in text
    for bad in ("0,0", "a,b", "-1"):
        with pytest.raises(ConfigError, match="--seeds"):
            seeds_of(bad)
    from harness.cli import main

    with pytest.raises(SystemExit) as stop:  # a flag of the seeds study given to another: argparse's usage line
        main(["bench", "sweep", "--metric", "spearman"])
    assert stop.value.code == 2 and "harness bench sweep: error: unrecognized arguments: --metric" in \
        capsys.readouterr().err
    for args, message in ((["--metric", "accuracy"], "--metric accuracy: task 'lm' reports loss, perplexity"),
                          (["--metric", "perplexity"], "--split test: task 'lm' builds no test split"),
                          (["--metric", "loss", "--baseline", "nosuch"], "--baseline nosuch: task 'lm' reports")):
        code = main(["bench", "seeds", "0,1", "--run", str(ROOT / "configs/runs/lm_demo.toml"), "--out", str(tmp_path),
                     *args])  # refused before any seed trains, not after each one
        assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_bench_seeds_trains_and_scores_every_seed(tmp_path):
    """`harness bench seeds`: each seed of each configuration trained to its end and scored on the test split, the
    report's figures the runs' own eval.json, the thread count stated."""
    import os

    path = write_fitness(tmp_path / "fitness.csv", n=120)
    out = tmp_path / "seeds"
    proc = cli("bench", "seeds", "0,1", "--metric", "spearman", "--baseline", "ridge_spearman", "--threads", "1",
               "--vary", "protein.train_subsample=60", "--out", str(out), *[a for s in (
                   'run.task="protein"', f"data.path={json.dumps(str(path))}", 'protein.objective="regress"',
                   'protein.blend="ridge"', "data.seq_len=32", "model.d_model=16", "model.n_heads=2",
                   "train.max_steps=3") for a in ("--set", s)],
               env={"HARNESS_CACHE": os.environ["HARNESS_CACHE"]}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "seeds.json").read_text())
    assert report["threads_per_process"] == 1 and [c["name"] for c in report["configs"]] == [
        "zero0 x1 protein.train_subsample=60"]
    for c in report["configs"]:
        assert [r["seed"] for r in c["runs"]] == [0, 1] and c["failed"] == 0
        slug = c["name"].replace(" ", "_").replace("=", "_")
        for r in c["runs"]:
            own = json.loads((out / "runs" / f"{slug}-seed{r['seed']}" / "eval.json").read_text())["test"]
            assert r["spearman"] == own["spearman"] and r["ridge_spearman"] == own["ridge_spearman"]
            assert r["sequences"] == 24.0 and "ridge_mix" in r
        assert c["spearman"]["n"] == 2 and c["ridge_spearman"]["sd"] == 0.0  # ridge: no seed in it
    assert "| zero0 x1 protein.train_subsample=60 |" in (out / "seeds.md").read_text()
    # a figure the evaluation does not report stops the study after its first run, not after every seed's
    typo = cli("bench", "seeds", "0,1", "--metric", "spearman", "--baseline", "ridge_spearmann", "--threads", "1",
               "--out", str(tmp_path / "typo"), *[a for s in (
                   'run.task="protein"', f"data.path={json.dumps(str(path))}", 'protein.objective="regress"',
                   "data.seq_len=32", "model.d_model=16", "model.n_heads=2", "train.max_steps=1")
                 for a in ("--set", s)],
               env={"HARNESS_CACHE": os.environ["HARNESS_CACHE"]}, timeout=600)
    assert typo.returncode == 2 and typo.stderr.strip().splitlines()[-1].startswith(
        "harness: error: --baseline ridge_spearmann: the evaluation reports no such figure (it has "), typo.stderr
    assert "[2/2]" not in typo.stdout
