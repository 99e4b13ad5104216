"""The protein case study: data preparation, vocabulary, encoder heads, loss masking, MLM masking, training."""
from __future__ import annotations

import dataclasses
import json
import zipfile
from collections import Counter

import pytest
import torch

from harness.config.run import ConfigError
from harness.tasks import resolve
from harness.eval.evaluate import evaluate_run
from harness.models.encoder import Encoder
from harness.models.transformer import TransformerConfig
from harness.prepare import read_meta
from harness.prepare import protein as prep
from harness.tasks.protein import ProteinTask
from harness.tasks.protein_samples import IGNORE

from conftest import Stopped, harness, stop_after

SPLITS = ("train", "validation", "test")


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """Prepared data of this module (and of its training run) in a fresh cache, shared by the module's tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_CACHE", str(tmp_path_factory.mktemp("harness_cache")))
    yield
    mp.undo()


def config(*sets: str, path: str = ""):
    return resolve(None, ['run.task="protein"', f"data.path={json.dumps(path)}", *sets]).cfg


def totals(meta: dict) -> Counter:
    return sum((Counter(meta["counts"][s]) for s in SPLITS), Counter())


@pytest.fixture(scope="module")
def default_dir():
    cfg = config("data.val_fraction=0.1", "data.seq_len=200")
    ProteinTask().check(cfg)
    return prep.prepare(cfg)


def test_default_data_splits_are_disjoint_and_counted(default_dir):
    meta = read_meta(default_dir)
    assert meta["first_line"] == {"rows": 5200, "names": ["UniProt", "AMP"]}  # the count line, not a row
    counts = totals(meta)
    assert sum(counts.values()) == 5200 and counts["duplicate"] > 0 and counts["conflict"] > 0
    assert meta["classes"] == ["0", "1"]
    splits = {s: prep.load(default_dir, s) for s in SPLITS}
    seqs = {s: set(d["sequence"]) for s, d in splits.items()}
    for s, d in splits.items():
        assert len(seqs[s]) == len(d) == meta["counts"][s]["ok"] + meta["counts"][s].get("truncated", 0)
    assert not (seqs["train"] & seqs["validation"] or seqs["train"] & seqs["test"] or seqs["validation"] & seqs["test"])
    n = {s: len(d) for s, d in splits.items()}
    assert abs(n["test"] / sum(n.values()) - 0.1) < 0.01 and abs(n["validation"] / sum(n.values()) - 0.1) < 0.01
    for d in splits.values():  # stratified: both classes in every split, in about the source's proportion
        assert 0.4 < sum(d["label"]) / len(d) < 0.6


def test_malformed_rows_are_counted(tmp_path):
    rows = ["ACDEFGHIKL, 1", "MKVLAAGG, 0", "AC1DE, 1", "GLWSK,", "WWWWW, 1, 3", " , 0", "MNPQRSTVWYAC, 1",
            "mkvlaagg, 0", "PPPPP, 1", "PPPPP, 0"]
    path = tmp_path / "amp.csv"
    path.write_text(f"{len(rows)},1,neg,pos\n" + "\n".join(rows) + "\n")
    directory = prep.prepare(config("data.seq_len=10", path=str(path)))
    meta = read_meta(directory)
    assert totals(meta) == Counter(ok=2, truncated=1, malformed=3, empty=1, duplicate=1, conflict=2)
    kept = [s for split in SPLITS for s in prep.load(directory, split)["sequence"]]
    assert sorted(kept) == ["ACDEFGHIKL", "MKVLAAGG", "MNPQRSTVWY"]
    path.write_text(f"{len(rows) + 1},1,neg,pos\n" + "\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match="announces 11 rows but 10 follow"):
        prep.prepare(config("data.seq_len=10", path=str(path)))
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"sequence": "ACDK", "label": "pos"}\nnot json\n{"sequence": 5, "label": "neg"}\n'
                     '{"sequence": "GGKL", "label": "neg"}\n')
    meta = read_meta(prep.prepare(config(path=str(jsonl))))
    assert totals(meta) == Counter(ok=2, malformed=2) and meta["classes"] == ["neg", "pos"]
    fasta = tmp_path / "mine.fasta"  # undecodable bytes in a sequence or a label: that record is malformed
    fasta.write_bytes(b">a label=pos\nACDK\n>b label=neg\nGG\xffKL\n>c label=n\xe9g\nMKVL\n>d label=neg\nWWYY\n")
    meta = read_meta(prep.prepare(config(path=str(fasta))))
    assert totals(meta) == Counter(ok=2, malformed=2) and meta["classes"] == ["neg", "pos"]
    # As editors and other tools leave files: a byte-order mark (it hid the first record, or the csv's first column),
    # text before the first header (dropped unseen), a translated ORF's stop "*" (which `prepare --input` drops)
    fasta.write_bytes(b"\xef\xbb\xbf>a label=pos\r\nACDK*\r\n>b label=neg\r\nGGKL\r\n")
    directory = prep.prepare(config(path=str(fasta)))
    kept = [s for split in SPLITS for s in prep.load(directory, split)["sequence"]]
    assert totals(read_meta(directory)) == Counter(ok=2) and sorted(kept) == ["ACDK", "GGKL"]
    fasta.write_bytes(b"MKVL\n>a label=pos\nACDK\n>b label=neg\nGGKL\n")
    assert totals(read_meta(prep.prepare(config(path=str(fasta))))) == Counter(ok=2, malformed=1)
    csv = tmp_path / "excel.csv"
    csv.write_bytes(b"\xef\xbb\xbfsequence,label\r\nACDK,pos\r\nGGKL,neg\r\n")
    assert totals(read_meta(prep.prepare(config(path=str(csv))))) == Counter(ok=2)
    residue = tmp_path / "states.csv"  # a trailing space after the states: one state too many, every row refused
    residue.write_text("sequence,label\nACDKLM,CCHHEE \nGGKLWW,HHHCCC\t\n")
    assert totals(read_meta(prep.prepare(config('protein.objective="residue"', path=str(residue))))) == Counter(ok=2)


def write_fitness(path, n: int = 0, seed: int = 0):
    """A FLIP-format fitness csv (sequence,target,set,validation). With n: n random sequences (every 10th a
    validation row, every 5th a test row) whose fitness is 10 x their share of W plus noise, something a mean-pooled
    encoder can learn. Without: six hand-written rows for the reader's rules."""
    import random

    if n:
        rng = random.Random(seed)
        rows = []
        for i in range(n):
            seq = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWYWWW") for _ in range(rng.randint(12, 30)))
            rows.append((seq, 10 * seq.count("W") / len(seq) + rng.gauss(0, 0.1),
                         "test" if i % 5 == 0 else "train", "True" if i % 10 == 1 else "False"))
    else:  # t2 twice (its values averaged), t3 without a number, t4 not a number, a validation and a test row
        rows = [("ACDKL", 1.0, "train", "False"), ("MKVLA", 2.0, "train", "False"), ("MKVLA", 4.0, "train", "False"),
                ("GGSSA", "", "train", "False"), ("PQRST", "high", "train", "False"), ("WWKLA", 0.5, "train", "True"),
                ("YYKLA", 0.25, "test", "False")]
    path.write_text("sequence,target,set,validation\n" + "".join(f"{q},{v},{st},{va}\n" for q, v, st, va in rows))
    return path


def test_fitness_csv_keeps_flip_splits_and_averages_repeats(tmp_path):
    path = write_fitness(tmp_path / "fitness.csv")
    directory = prep.prepare(config('protein.objective="regress"', path=str(path)))
    meta = read_meta(directory)
    assert meta["counts"]["train"] == {"ok": 2, "duplicate": 1, "malformed": 2} and meta["labels"] == "value"
    assert [prep.load(directory, s)["sequence"] for s in SPLITS] == [["ACDKL", "MKVLA"], ["WWKLA"], ["YYKLA"]]
    assert prep.load(directory, "train")["value"] == [1.0, 3.0]  # MKVLA: the mean of 2 and 4
    from harness.prepare.protein_sources import _read_csv  # new variants to score, FLIP's label column alone

    (tmp_path / "new.csv").write_text("sequence,target\nACDKL,1.5\n")
    assert _read_csv(tmp_path / "new.csv", "sequence", "label", labelled=True)[0] == [("ACDKL", "1.5", None, "")]
    assert meta["values"] == {"mean": 2.0, "std": 1.0}  # of the training values 1 and 3
    samples = ProteinTask().samples(config('protein.objective="regress"', path=str(path)), "test")
    assert samples[0]["value"].item() == pytest.approx((0.25 - 2.0) / 1.0)  # z-scored with train's statistics
    with pytest.raises(ConfigError, match="look like measurements .* use protein.objective = 'regress'"):
        prep.prepare(config('protein.label_field="target"', path=str(write_fitness(tmp_path / "f.csv", n=40))))
    # a missing label ("NA", as pandas writes it) is no class of its own, and hides no measurements
    measured = write_fitness(tmp_path / "na.csv", n=40)
    measured.write_text(measured.read_text().replace("\n", "\nNAKLMW,NA,train,False\n", 1))
    with pytest.raises(ConfigError, match="look like measurements"):
        prep.prepare(config('protein.label_field="target"', path=str(measured)))
    flags = write_fitness(tmp_path / "flags.csv", n=40)  # R writes TRUE/FALSE
    flags.write_text(flags.read_text().replace(",True\n", ",TRUE\n"))
    upper = read_meta(prep.prepare(config('protein.objective="regress"', path=str(flags))))
    same = read_meta(prep.prepare(config('protein.objective="regress"', path=str(write_fitness(tmp_path / "g.csv",
                                                                                               n=40)))))
    assert upper["counts"] == same["counts"] and sum(upper["counts"]["validation"].values()) == 4
    with pytest.raises(ConfigError, match="needs a number per sequence"):
        ProteinTask().check(config('protein.objective="regress"'))


def test_two_process_regression_learns_beside_its_ridge_baseline(tmp_path, one_thread):
    path, out = write_fitness(tmp_path / "fitness.csv", n=800), tmp_path / "run"
    run = harness(out, "", nproc=2, ds="zero2.json", sets=[
        'run.task="protein"', f"data.path={json.dumps(str(path))}", 'protein.objective="regress"',
        "data.seq_len=32", "train.micro_batch_size=16", "train.max_steps=30", "model.d_model=32",
        "schedule.warmup_steps=3", "optimizer.lr=3e-3", "train.seed=0"])
    losses = [run.losses[s] for s in sorted(run.losses)]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert {"spearman", "pearson", "mse", "mae"} <= run.evals[-1].keys() and run.evals[-1]["sequences"] == 80
    test = evaluate_run(out, "test")  # one process: the model's figures beside the ridge baseline's
    assert test["sequences"] == 160 and test["spearman"] > 0.7, test
    assert {"ridge_spearman", "ridge_pearson", "ridge_mse", "ridge_alpha"} <= test.keys()
    # `harness evaluate --data`, with the stored vocabulary and value statistics: the FLIP csv gives its test rows, a
    # plain csv of those rows every row; both score what the split scores, and still do once the training data changed.
    from harness.eval.evaluate import evaluate_data

    lines = path.read_text().splitlines()
    held_out = tmp_path / "held_out.csv"
    held_out.write_text("sequence,label\n" + "".join(",".join(x.split(",")[:2]) + "\n" for x in lines[1:]
                                                     if ",test," in x) + "AC1D,0.5\n")  # the last: malformed
    figures = ("spearman", "pearson", "mse", "mae", "sequences")
    flip = evaluate_data(out, path)["fitness.csv"]
    assert flip["rows_kept"] == 160 and flip["skipped"] == "not_test 640" and "ridge_mse" not in flip
    write_fitness(path, n=800, seed=1)
    with pytest.raises(ConfigError, match="differs from what the run was trained with"):
        evaluate_run(out, "test")
    plain = evaluate_data(out, held_out)["held_out.csv"]
    assert plain["rows_kept"] == 160 and plain["skipped"] == "malformed 1"
    assert {k: flip[k] for k in figures} == {k: plain[k] for k in figures} == {k: test[k] for k in figures}


def test_a_mutational_library_is_read_at_the_sites_where_its_training_sequences_differ(tmp_path):
    """protein.sites = "varying": the model's samples hold the residues at the columns where the training sequences
    differ (0-based 2 and 6 here), nothing is cut at data.seq_len, a sequence of another length is dropped and one
    that differs elsewhere is kept and counted; new data for `evaluate --data` is read at the stored sites."""
    from harness.prepare import store

    ref = "MKVLAGWDE"
    rows = [(ref[:2] + a + ref[3:6] + b + ref[7:], float(i), "train", "False")
            for i, (a, b) in enumerate(["VW", "AW", "VF", "AF", "CY"])]
    rows += [("MKAL" + "AGWDE", 9.0, "train", "True"),  # validation: site 2 is A
             ("MKCLAGFDE", 1.5, "test", "False"),       # ok
             ("AKVLAGWDE", 2.5, "test", "False"),       # differs at column 0, outside the sites: off_site
             ("MKVLAGWD", 3.5, "test", "False")]        # one residue short: other_length
    path = tmp_path / "library.csv"
    path.write_text("sequence,target,set,validation\n" + "".join(f"{q},{v},{st},{va}\n" for q, v, st, va in rows))
    cfg = config('protein.objective="regress"', 'protein.sites="varying"', "data.seq_len=4", "model.d_model=16",
                 "model.n_heads=2", path=str(path))
    task = ProteinTask()
    task.check(cfg)
    directory = prep.prepare(cfg)
    meta = read_meta(directory)
    assert meta["sites"] == {"length": 9, "columns": [2, 6], "reference": rows[0][0]}
    assert meta["counts"]["train"] == {"ok": 5} and meta["counts"]["test"] == {"ok": 1, "off_site": 1,
                                                                               "other_length": 1}
    tok = prep.tokenizer(directory)
    assert prep.load(directory, "train")["ids"] == prep.encode(tok, ["VW", "AW", "VF", "AF", "CY"])
    assert prep.load(directory, "test")["sequence"] == ["MKCLAGFDE", "AKVLAGWDE"]  # kept whole, read at the sites
    assert [len(task.samples(cfg, "test")[i]["ids"]) for i in range(2)] == [3, 3]  # <cls> and two sites
    assert task.build_model(cfg).pos_emb.num_embeddings == 3
    assert "1 differing outside protein.sites" in task.build_data(cfg).summary.line()
    stored = store(directory, tmp_path / "data", prep.STORED, prep.COMPARED, prep.SCORING_KEYS)
    new = tmp_path / "new.csv"
    new.write_text("sequence,label\nMKALAGYDE,1\nMKVLAGWDEK,2\n")
    scored, counts, _ = prep.read_scoring(config('protein.objective="regress"', path=str(path)), stored, new)
    assert counts == {"ok": 1, "other_length": 1} and scored["ids"] == prep.encode(tok, ["AY"])
    for sets, message in ((['protein.objective="mlm"'], "is for classify and regress"),
                          (['protein.objective="regress"', 'protein.init_from="elsewhere"'], "is for classify and")):
        with pytest.raises(ConfigError, match=message):
            task.check(config('protein.sites="varying"', *sets, path=str(path)))
    source = tmp_path / "gb1_run"  # a finished run that read the sites: its positions are not residue positions
    source.mkdir()
    (source / "config.toml").write_text('[run]\ntask = "protein"\n[protein]\nobjective = "regress"\n'
                                        'sites = "varying"\n')
    (source / "model.safetensors").write_text("")
    with pytest.raises(ConfigError, match="that run read only the sites"):
        task.check(config('protein.objective="regress"', f"protein.init_from={json.dumps(str(source))}",
                          path=str(path)))
    path.write_text(path.read_text() + "MKVLAGWDEE,4.0,train,False\n")
    with pytest.raises(ConfigError, match="needs training sequences of one length .* 2 lengths, 9 to 10 residues"):
        prep.prepare(cfg)


def write_flip(directory):
    """A FLIP-style splits.zip: t1 train (ends unresolved), t2 train, v1 validation, x1 test, x2 a test copy of
    t1 (leak), x3 a test chain whose states do not match its length (malformed)."""
    recs = [("t1", "train", "False", "ACDEFGHIK", "CCHHHEECC", "011111110"),
            ("t2", "train", "False", "MKVLA", "CHHHC", "11111"),
            ("v1", "train", "True", "GGSSAW", "CEEEEC", "111111"),
            ("x1", "test", "False", "PQRSTY", "CCHHCC", "111111"),
            ("x2", "test", "False", "ACDEFGHIK", "CCHHHEECC", "111111111"),
            ("x3", "test", "False", "WYWYW", "CCC", "11111")]
    files = {"sequences.fasta": "".join(f">{n}\n{s}\n" for n, _, _, s, _, _ in recs),
             "sampled.fasta": "".join(f">{n} SET={st} VALIDATION={v}\n{ss}\n" for n, st, v, _, ss, _ in recs),
             "mask.fasta": "".join(f">{n}\n{m}\n" for n, _, _, _, _, m in recs)}
    directory.mkdir()
    with zipfile.ZipFile(directory / "splits.zip", "w") as z:
        for name, text in files.items():
            z.writestr(f"splits/{name}", text)
    return directory


def test_flip_archive_gives_three_splits_with_resolved_residues(tmp_path, capsys):
    cfg = config('protein.objective="residue"', "data.seq_len=64", path=str(write_flip(tmp_path / "flip")))
    ProteinTask().check(cfg)
    capsys.readouterr()
    directory = prep.prepare(cfg)
    # residues training never holds read as <unk>: counted and said (they had been silent)
    assert "residues the training split never holds read as <unk>: validation 3 (S, W); test 6 (P, Q, R, S, T, Y)" \
        in capsys.readouterr().out
    meta = read_meta(directory)
    assert meta["counts"] == {"train": {"ok": 2}, "validation": {"ok": 1}, "test": {"ok": 1, "leak": 1, "malformed": 1}}
    train = prep.load(directory, "train")
    assert train["sequence"] == ["ACDEFGHIK", "MKVLA"]
    assert train["states"][0] == [IGNORE, 0, 1, 1, 1, 2, 2, 0, IGNORE]  # C=0 H=1 E=2, unresolved ignored
    assert prep.load(directory, "test")["sequence"] == ["PQRSTY"]
    with pytest.raises(ConfigError, match="objective = 'residue'"):
        ProteinTask().check(config(path=str(tmp_path / "flip")))  # classify on per-residue data


def test_q3_scores_every_residue_of_chains_longer_than_seq_len(tmp_path):
    # seq_len 4: t1 (9 residues) and t2 (5) are cut for training; the 6-residue test chain PQRSTY is kept whole and
    # scored in windows of 4 (residues 0-3 and 2-5, owning 0-2 and 3-5)
    cfg = config('protein.objective="residue"', "data.seq_len=4", "model.d_model=16", "model.n_heads=2",
                 path=str(write_flip(tmp_path / "flip")))
    directory = prep.prepare(cfg)
    assert read_meta(directory)["counts"]["test"]["whole"] == 1 and read_meta(directory)["counts"]["train"] == {
        "truncated": 2}
    task = ProteinTask()
    test = task.samples(cfg, "test")
    assert len(test) == 2 and [len(test[i]["ids"]) for i in range(2)] == [5, 5]  # <cls> + 4 residues each
    owned = [t for i in range(2) for t in test[i]["targets"].tolist() if t != IGNORE]
    assert owned == prep.load(directory, "test")["states"][0] == [0, 0, 1, 1, 0, 0]  # each residue once, in order
    from harness.distributed.world import single_world

    torch.manual_seed(0)
    model = task.build_model(cfg)  # positions for 4 residues and <cls> only
    metrics = task.evaluate(model, cfg, "test", single_world(torch.device("cpu")))
    assert metrics["residues"] == 6 and metrics["chains_in_windows"] == 1
    asked = []  # in training, the loop's `between_batches` (World.scored) after each batch: a stop signal ends it
    world = dataclasses.replace(single_world(torch.device("cpu")), between_batches=lambda i, n: stop_after(0, i, n,
                                                                                                          asked))
    one_a_batch = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1))
    with pytest.raises(Stopped):
        task.evaluate(model, one_a_batch, "test", world)
    assert asked == [(0, 2)]


def test_scoring_data_is_read_with_the_stored_vocabulary_and_classes(default_dir, tmp_path, capsys):
    """`harness evaluate --data`'s reader on a run's stored artefacts: a class the run does not know and a FLIP
    directory's rows outside its test set are counted, not scored; residue ids are the stored vocabulary's, and
    residues it never learned (read as <unk>) are counted and said."""
    from harness.prepare import store

    cfg = config("data.val_fraction=0.1", "data.seq_len=200")
    stored = store(default_dir, tmp_path / "data", prep.STORED, prep.COMPARED, prep.SCORING_KEYS)
    tsv = tmp_path / "new.tsv"
    tsv.write_text("sequence\tlabel\nACDKLW\t1\nMKVLAG\t0\nGGSSAW\t7\nAC1D\t1\n")
    rows, counts, files = prep.read_scoring(cfg, stored, tsv)
    assert counts == {"ok": 2, "unknown_class": 1, "malformed": 1} and files == [tsv]
    assert rows["label"] == [1, 0] and rows["ids"][0] == prep.encode(prep.tokenizer(default_dir), ["ACDKLW"])[0]
    assert "read as <unk>" not in capsys.readouterr().out
    unusual = tmp_path / "unusual.tsv"
    unusual.write_text("sequence\tlabel\nACDXKLWX\t1\nMKVLAGB\t0\n")
    rows, counts, _ = prep.read_scoring(cfg, stored, unusual)
    assert counts == {"ok": 2} and rows["ids"][0][3] == prep.tokenizer(default_dir).unk_id
    assert (f"note: --data {unusual}: residues the training split never holds read as <unk>: data 3 (B, X)"
            in capsys.readouterr().out)
    fitness = tmp_path / "fitness.tsv"  # measurements, not classes: refused (it had scored the rows valued "0")
    fitness.write_text("sequence\tlabel\nACDKLW\t1.25\nMKVLAG\t0\nGGSSAW\t0.37\n")
    with pytest.raises(ConfigError, match=r"its labels are measurements \(e\.g\. 1\.25\), not this run's classes"):
        prep.read_scoring(cfg, stored, fitness)
    flip = write_flip(tmp_path / "flip")
    residue = config('protein.objective="residue"', "data.seq_len=64", path=str(flip))
    stored = store(prep.prepare(residue), tmp_path / "flip_data", prep.STORED, prep.COMPARED, prep.SCORING_KEYS)
    rows, counts, _ = prep.read_scoring(residue, stored, flip)  # its test rows; no leak rule (x2 is a copy of t1)
    assert counts == {"ok": 2, "malformed": 1, "not_test": 3} and rows["sequence"] == ["PQRSTY", "ACDEFGHIK"]
    # no residue resolved: one line (Q3's ValueError was a traceback after the model had run)
    unresolved = tmp_path / "unresolved.csv"
    unresolved.write_text("sequence,label,resolved\nACDEFG,CCHHEE,000000\nKLMN,CHHC,0000\n")
    with pytest.raises(ConfigError, match=r"no residue of its 2 sample\(s\) is resolved .*Q3 has nothing to score"):
        ProteinTask().read(residue, unresolved, stored)


def test_residue_vocabulary_round_trip(default_dir):
    tok = prep.tokenizer(default_dir)
    test = prep.load(default_dir, "test")
    for seq, ids in zip(test["sequence"], test["ids"]):
        assert len(ids) == len(seq) and tok.decode(ids) == seq  # one id per residue
    specials = {tok.piece_id("<mask>"), tok.piece_id("<cls>"), tok.pad_id}
    assert len(specials) == 3 and not specials & {i for ids in test["ids"] for i in ids}


def test_model_shapes_for_every_head():
    cfg = TransformerConfig(vocab_size=26, max_seq_len=20, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    ids, mask = torch.randint(4, 26, (3, 20)), torch.ones(3, 20, dtype=torch.bool)
    assert Encoder(cfg, "mlm", 26)(ids, mask).shape == (3, 20, 26)
    assert Encoder(cfg, "classify", 2)(ids, mask).shape == (3, 2)
    assert Encoder(cfg, "residue", 3)(ids, mask).shape == (3, 20, 3)
    assert Encoder(cfg, "regress", 1)(ids, mask).shape == (3, 1)
    assert Encoder(cfg, "regress", 1, "attention")(ids, mask).shape == (3, 1)
    with torch.device("meta"):  # `harness plan` builds the model without memory
        model = ProteinTask().build_model(config("data.val_fraction=0.1", "data.seq_len=200", "model.d_model=32"))
    assert next(model.parameters()).is_meta and model.cls_head.out_features == 2


@pytest.mark.parametrize("objective", ["classify", "residue", "regress"])
def test_padding_never_changes_the_loss(objective, tmp_path):
    path = {"classify": "", "residue": lambda: write_flip(tmp_path / "flip"),
            "regress": lambda: write_fitness(tmp_path / "fitness.csv", n=40)}[objective]
    cfg = config(f"protein.objective={json.dumps(objective)}", "data.val_fraction=0.1", "data.seq_len=200",
                 "model.d_model=32", "model.n_heads=2", 'protein.pooling="attention"' if objective == "regress"
                 else 'protein.pooling="mean"', path=str(path()) if path else "")
    task = ProteinTask()
    torch.manual_seed(0)
    model = task.build_model(cfg).double().eval()
    samples = task.build_data(cfg).train
    picked = [samples[i] for i in range(min(4, len(samples)))]
    batch = task.collate(picked)
    padded = {k: torch.nn.functional.pad(v, (0, 7), value=fill) if v.dim() == 2 else v
              for (k, v), fill in zip(batch.items(), (0, False, IGNORE))}
    alone = sum(task.loss(model, task.collate([s])) for s in picked)
    together, extra = task.loss(model, batch), task.loss(model, padded)
    # the loss casts logits to float32: equal to float32 precision
    assert torch.allclose(together, alone, rtol=1e-6) and torch.allclose(extra, alone, rtol=1e-6)
    assert task.count(padded) == task.count(batch) == sum(task.count(task.collate([s])) for s in picked)
    # the mask is what makes this true: attending to the padding changes the loss
    unmasked = dict(padded, mask=torch.ones_like(padded["mask"]))
    assert not torch.allclose(task.loss(model, unmasked), alone, rtol=1e-4)


def test_masking_is_a_pure_function_of_seed_and_index(default_dir):
    task = ProteinTask()
    cfg = config('protein.objective="mlm"', "data.val_fraction=0.1", "data.seq_len=200", "protein.mask_variants=3")
    rank0, rank1 = task.samples(cfg, "train", train=True), task.samples(cfg, "train", train=True)
    n = rank0.n
    assert len(rank0) == 3 * n
    for i in (0, 5, n + 5):
        a, b = rank0[i], rank1[i]  # two processes (or a resumed run) asking for the same sample
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["targets"], b["targets"])
    assert not torch.equal(rank0[5]["targets"], rank0[n + 5]["targets"])  # another copy, another mask
    other_seed = task.samples(config('protein.objective="mlm"', "data.val_fraction=0.1", "data.seq_len=200",
                                     "train.seed=1"), "train", train=True)
    assert any(not torch.equal(rank0[i]["targets"], other_seed[i]["targets"]) for i in range(5))
    cls, mask_id = rank0.vocab.cls_id, rank0.vocab.mask_id
    kinds, original = Counter(), prep.load(default_dir, "train")["ids"]
    for i in range(400):
        s, seq = rank0[i], torch.tensor(original[i % n])
        chosen = s["targets"] != IGNORE
        assert s["ids"][0] == cls and not chosen[0] and chosen.sum() == max(1, round(0.15 * len(seq)))
        assert torch.equal(s["targets"][1:][chosen[1:]], seq[chosen[1:]])
        assert torch.equal(s["ids"][1:][~chosen[1:]], seq[~chosen[1:]])  # only chosen residues change
        got = s["ids"][chosen]
        kinds.update(mask=int((got == mask_id).sum()), same=int((got == s["targets"][chosen]).sum()))
    total = sum(int((rank0[i]["targets"] != IGNORE).sum()) for i in range(400))
    assert 0.75 < kinds["mask"] / total < 0.85 and 0.07 < kinds["same"] / total < 0.16  # 80/10/10 (+ random hits)
    val_a, val_b = task.samples(cfg, "validation"), task.samples(config('protein.objective="mlm"', "train.seed=7",
                                                                        "data.val_fraction=0.1", "data.seq_len=200"),
                                                                 "validation")
    assert all(torch.equal(val_a[i]["targets"], val_b[i]["targets"]) for i in range(20))  # fixed eval masking


def test_two_process_zero2_classification_learns(tmp_path):
    out = tmp_path / "run"
    run = harness(out, "", nproc=2, ds="zero2.json", sets=[
        'run.task="protein"', "data.seq_len=200", "train.micro_batch_size=16", "train.max_steps=24",
        "model.d_model=32", "schedule.warmup_steps=3", "train.seed=0"])
    losses = [run.losses[s] for s in sorted(run.losses)]
    assert len(losses) == 24 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses
    final = run.evals[-1]
    assert {"accuracy", "auroc", "loss"} <= final.keys() and final["sequences"] == 462
    assert final["accuracy"] > 0.6 and final["auroc"] > 0.6, final
    test = evaluate_run(out, "test")  # one process, the exported model
    assert test["sequences"] == 462 and test["auroc"] > 0.6
    # the trained encoder starts an mlm model: shared weights by name, the new head fresh
    from harness.tasks.protein_init_from import init_from

    cfg = config('protein.objective="mlm"', "data.val_fraction=0.1", "data.seq_len=200", "model.d_model=32",
                 "model.n_heads=2")
    model = ProteinTask().build_model(cfg)
    loaded, fresh = init_from(model, cfg, out)
    assert loaded == ["tok_emb", "pos_emb", "blocks.*", "ln_f"] and fresh == ["mlm_head"]
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(model.blocks[1].mlp.fc_in.weight, exported["blocks.1.mlp.fc_in.weight"])
    # a finished run rebuilt from its stored data (harness evaluate, load_model) reads nothing of its init_from
    # source, whose own data may be gone (that failed with a traceback): its export replaces those weights
    from harness.prepare import stored

    task = ProteinTask()
    task.prepared = stored(out)
    rebuilt = task.build_model(config("data.val_fraction=0.1", "data.seq_len=200", "model.d_model=32",
                                      f"protein.init_from={json.dumps(str(out))}"))
    assert not torch.equal(rebuilt.blocks[1].mlp.fc_in.weight, exported["blocks.1.mlp.fc_in.weight"])
