"""Translation case study: data preparation, tokenizer, model, loss, decoding, and a 2-process ZeRO-2 run."""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import math
import os
import pty
import random
import re
import signal
import subprocess

import pytest
import torch

from conftest import ROOT, Stopped, _env, assert_losses_close, bare_copy, cli, ds_variant, harness, python, stop_after
from harness.config.run import ConfigError
from harness.tasks import resolve
from harness.models.decoding import beam_search, greedy
from harness.models.seq2seq import Seq2Seq, Seq2SeqConfig
from harness.prepare import read_meta
from harness.prepare import translation as prep
from harness.tasks.translation import TranslationTask

BIBLE_PAIRS = 31_102  # verses of the King James Bible, every one also in Louis Segond (the figure)


def cfg_for(path: str = "", *sets: str):
    return resolve(None, ['run.task="translation"', "train.max_steps=1", f"data.path={json.dumps(path)}",
                          *sets]).cfg


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", str(tmp_path_factory.mktemp("harness_cache")))
        yield


@pytest.fixture(scope="module")
def bible():
    return prep.prepare(cfg_for("", "model.vocab_size=1000"))


# A made-up language pair: each English word has one "French" word, adjectives follow their noun.
LEXICON = {"the": "le", "a": "un", "cat": "chat", "dog": "chien", "man": "homme", "child": "enfant",
           "sees": "voit", "eats": "mange", "likes": "aime", "follows": "suit", "big": "grand", "small": "petit",
           "red": "rouge", "old": "vieux", "and": "et", "bread": "pain", "house": "maison", "river": "fleuve"}
NOUNS, ADJS = ["cat", "dog", "man", "child", "bread", "house", "river"], ["big", "small", "red", "old"]


def toy_pair(rng: random.Random) -> tuple[str, str]:
    def phrase():
        det, adj, noun = rng.choice(["the", "a"]), rng.choice(ADJS + [""]), rng.choice(NOUNS)
        return [det, adj, noun] if adj else [det, noun], [LEXICON[det], LEXICON[noun]] + ([LEXICON[adj]] if adj else [])
    (s1, t1), (s2, t2) = phrase(), phrase()
    verb = rng.choice(["sees", "eats", "likes", "follows"])
    return " ".join(s1 + [verb] + s2) + ".", " ".join(t1 + [LEXICON[verb]] + t2) + "."


def write_toy_dir(root, test: int = 60):
    """A Multi30k-shaped directory of line-aligned, gzipped files."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for name, n in (("train", 1200), ("val", 60), ("test_2016_toy", test)):
        pairs = [toy_pair(rng) for _ in range(n)]
        for lang, side in (("en", 0), ("fr", 1)):
            with gzip.open(root / f"{name}.{lang}.gz", "wt") as f:
                f.write("\n".join(p[side] for p in pairs) + "\n")
    return root


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return write_toy_dir(tmp_path_factory.mktemp("toy"))


def tiny_model(vocab: int = 40, seed: int = 0) -> Seq2Seq:
    torch.manual_seed(seed)
    return Seq2Seq(Seq2SeqConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)).eval()


# --- data --------------------------------------------------------------------------------------------------------

def test_bible_pairs_and_held_out_books(bible):
    counts = read_meta(bible)["counts"]
    assert sum(n for split in counts.values() for n in split.values()) == BIBLE_PAIRS
    splits = {s: prep.load(bible, s) for s in prep.SPLITS}
    books = {s: {int(k.split(":")[0]) for k in ds["key"]} for s, ds in splits.items()}
    assert books["validation"] == {prep.BIBLE_BOOKS["validation"]} and books["test"] == {prep.BIBLE_BOOKS["test"]}
    assert not books["train"] & set(prep.BIBLE_BOOKS.values())  # no held-out book's verse in train
    held_out = {prep._norm(s) for s in [*splits["validation"]["src"], *splits["test"]["src"]]}
    assert not held_out & {prep._norm(s) for s in splits["train"]["src"]}  # nor any of their sentences
    assert counts["validation"].get("ok", 0) + counts["validation"].get("truncated", 0) == len(splits["validation"])
    first = splits["validation"][0]  # Mark 1:1 in both Bibles, Segond's verse markers stripped
    assert first["key"] == "41:1:1" and first["src"].startswith("The beginning of the gospel")
    assert first["tgt"].startswith("Commencement de l'Évangile")
    assert not any(re.search(r"\(\d+:\d+\)|\[", t) for t in splits["train"]["tgt"])  # Psalm 9:1 had "(9:1)"


def test_tokenizer_round_trip(bible):
    tok, rows = prep.tokenizer(bible), prep.load(bible, "test")
    assert tok.vocab_size <= 1000 and read_meta(bible)["vocab_size"] == tok.vocab_size
    for row in rows.select(range(0, len(rows), 97)):
        for text in (row["src"], row["tgt"]):
            assert tok.decode(tok.encode(text)) == text
    assert rows[0]["tgt_ids"][0] == tok.bos_id and rows[0]["tgt_ids"][-1] == tok.eos_id
    assert rows[0]["src_ids"][-1] == tok.eos_id


def test_user_file_rules_are_counted(tmp_path):
    rows = [{"en": f"the cat number {i} sleeps.", "fr": f"le chat numéro {i} dort."} for i in range(40)]
    rows += [{"en": "   ", "fr": "vide"},                    # empty
             {"en": "no target here"},                      # malformed: missing side
             {"en": 7, "fr": "sept"},                       # malformed: not a string
             {"en": "x" * 300, "fr": "trop long"},          # too_long: over data.max_row_chars
             {"en": "the dog barks.", "fr": "le chien aboie."}]  # leak: also in validation
    train, val = tmp_path / "train.jsonl", tmp_path / "val.tsv"
    train.write_bytes(("\n".join(json.dumps(r) for r in rows) + "\n").encode()
                      + b'{"en": "cut off\n'                          # malformed: the line does not parse
                      + b'{"en": "bad \xff bytes", "fr": "octets"}\n')  # undecodable
    val.write_bytes('en\tfr\nthe dog barks.\tle chien aboie.\n"quoted" words.\t« mots » cités.\n'.encode()
                    + b"one\ttwo\tthree\n")                            # malformed: too many fields
    cfg = cfg_for(str(train), f"data.val_path={json.dumps(str(val))}", "data.max_row_chars=200",
                  "model.vocab_size=60")
    directory = prep.prepare(cfg)
    counts = read_meta(directory)["counts"]
    assert counts["train"] == {"ok": 40, "empty": 1, "malformed": 3, "too_long": 1, "leak": 1, "undecodable": 1}
    assert counts["validation"] == {"ok": 2, "malformed": 1} and "test" not in counts
    assert prep.load(directory, "validation")["src"][1] == '"quoted" words.'  # tsv: quotes are text
    with pytest.raises(ConfigError, match="no 'test' split"):
        prep.load(directory, "test")
    held_out = [prep.load(prep.prepare(cfg_for(str(train), "model.vocab_size=60", f"train.seed={seed}")),
                          "validation")["src"] for seed in (0, 1)]
    assert held_out[0] == held_out[1]  # data.val_fraction's draw: every seed of a study validates on the same pairs
    with pytest.raises(ConfigError, match="model.vocab_size = 32: SentencePiece cannot train"):
        prep.prepare(cfg_for(str(train), "model.vocab_size=32"))  # fewer pieces than characters
    with pytest.raises(ConfigError, match="needs columns 'en' and 'de'"):
        prep.prepare(cfg_for(str(train), "translation.target_lang=\"de\"", "model.vocab_size=60"))
    (tmp_path / "one.jsonl").write_text(json.dumps(rows[0]) + "\n")  # no pair to spare (a datasets traceback)
    with pytest.raises(ConfigError, match=r"1 pair\(s\) read: too few to hold out a validation split"):
        prep.prepare(cfg_for(str(tmp_path / "one.jsonl"), "model.vocab_size=60"))


def test_nothing_to_translate_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """Blank standard input, or a blank sentence among others, is refused before the run is read (the beam search
    of no tokens used to end in a reshape traceback; an empty sentence was translated into a made-up one)."""
    import io

    from harness.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    assert main(["translate", "--run-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("harness: error: nothing to translate: give the sentences as "
                                               "arguments, or one per line on standard input")
    assert main(["translate", "--run-dir", str(tmp_path), "In the beginning.", " "]) == 2
    assert "sentence 2 of 2 is empty" in capsys.readouterr().err


def test_directory_source(toy_dir, tmp_path):
    cfg = cfg_for(str(toy_dir), 'translation.target_lang="fr"', "model.vocab_size=64")
    directory = prep.prepare(cfg)
    counts = read_meta(directory)["counts"]
    assert counts["validation"] == {"ok": 60} and counts["test"] == {"ok": 60}
    assert sum(counts["train"].values()) == 1200 and counts["train"]["leak"] > 0  # toy sentences repeat
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("train.en", "train.fr", "val.en", "val.fr", "test.en", "test.fr"):
        (bad / name).write_text("one\ntwo\n" if name != "val.fr" else "one\n")
    with pytest.raises(ConfigError, match="line i of one must translate line i"):
        prep.prepare(cfg_for(str(bad), "model.vocab_size=40"))
    with pytest.raises(ConfigError, match="need exactly one train file for language 'de'"):
        TranslationTask().check(cfg_for(str(toy_dir), 'translation.source_lang="de"'))


def test_files_as_editors_leave_them_are_read_line_by_line(tmp_path):
    """A byte-order mark and CRLF endings are not text, a U+2028 inside a sentence is not a line break, an empty test
    pair is no pairs; a file that is not the gzip its name says, or a gzip cut short, is one line, not a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.en").write_bytes(b"\xef\xbb\xbfthe cat.\r\nthe dog\xe2\x80\xa8barks.\r\n" + b"a man.\r\n" * 30)
    (src / "train.fr").write_bytes(b"\xef\xbb\xbfle chat.\r\nle chien aboie.\r\n" + b"un homme.\r\n" * 30)
    for name in ("val.en", "val.fr"):
        (src / name).write_text("the child.\n")
    for name in ("test.en", "test.fr"):
        (src / name).write_text("")
    cfg = cfg_for(str(src), 'translation.target_lang="fr"', "model.vocab_size=40")
    with pytest.raises(ConfigError, match=r"test.en and .*test.fr hold no lines: fill the pair, or remove it"):
        prep.prepare(cfg)
    for name in ("test.en", "test.fr"):
        (src / name).write_text("the river.\n")
    train = prep.load(prep.prepare(cfg), "train")
    assert (train["src"][0], train["src"][1], train["tgt"][0]) == ("the cat.", "the dog\u2028barks.", "le chat.")
    (src / "test.en").write_text("plain text, not gzip\n")
    (src / "test.en").rename(src / "test.en.gz")
    with pytest.raises(ConfigError, match=r"test.en.gz: cannot read as gzip: Not a gzipped file"):
        prep.prepare(cfg)
    whole = gzip.compress("".join(f"the cat number {i}.\n" for i in range(2000)).encode())
    (src / "test.en.gz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=r"test.en.gz: cannot read as gzip: Compressed file ended"):
        prep.prepare(cfg)


def test_a_resume_on_other_pairs_is_refused_and_on_the_same_ones_goes_on(toy_dir, tmp_path):
    """What a checkpoint records of a case study's data is the content of its prepared rows and tokenizer: the same
    pairs touched, or moved elsewhere, are the same data; other pairs in the same files are not (with the same
    vocabulary size they resumed silently on a tokenizer whose ids meant other pieces)."""
    import shutil

    from harness.plan.resolve import make_plan
    from harness.run.continuity import check_data_unchanged, data_identity

    src = shutil.copytree(toy_dir, tmp_path / "pairs")
    identity = lambda path: data_identity(make_plan(None, [  # noqa: E731
        'run.task="translation"', "train.max_steps=1", f"data.path={json.dumps(str(path))}", "model.vocab_size=64",
        'translation.target_lang="fr"'], None, 1))
    first = identity(src)
    assert first["path"] == str(src) and len(first["fingerprint"]) == 16
    (src / "train.en.gz").touch()
    moved = src.rename(tmp_path / "moved")
    assert identity(moved)["fingerprint"] == first["fingerprint"]
    plan = make_plan(None, ['run.task="translation"', "train.max_steps=1", f"data.path={json.dumps(str(moved))}",
                            "model.vocab_size=64", 'translation.target_lang="fr"'], None, 1)
    run = tmp_path / "run"
    run.mkdir()
    plan.task.store(plan.run.cfg, run / "data")  # RUN/data/, as a run stores it when it starts
    old = run / "checkpoints" / "step_00000002"  # saved before checkpoints recorded their data (no data.json)
    old.mkdir(parents=True)
    check_data_unchanged(plan, old, False)  # the same data: resumed
    pairs = [toy_pair(random.Random(1)) for _ in range(1200)]
    for lang, side in (("en", 0), ("fr", 1)):
        with gzip.open(moved / f"train.{lang}.gz", "wt") as f:
            f.write("\n".join(p[side] for p in pairs).upper() + "\n")
    assert identity(moved)["fingerprint"] != first["fingerprint"]
    with pytest.raises(ConfigError, match=r"step_00000002: the data prepared now differs from what its run trained "
                                          r"with .* in spm.model.*--data-changed-ok"):
        check_data_unchanged(plan, old, False)
    check_data_unchanged(plan, old, True)


# --- model and loss ----------------------------------------------------------------------------------------------

def test_model_shapes_and_cached_decoding():
    model = tiny_model()
    src, tgt = torch.randint(4, 40, (3, 7)), torch.randint(4, 40, (3, 5))
    src[1, 4:] = 0
    logits = model(src, tgt)
    assert logits.shape == (3, 5, 40)
    keep = tgt > 20
    assert torch.equal(model(src, tgt, keep=keep), logits)  # every position: the loss ignores padding, no gather
    memory, mask = model(src=src)
    assert memory.shape == (3, 7, 32) and mask.tolist()[1] == [True] * 4 + [False] * 3
    cache, steps = None, []
    for t in range(5):
        step, cache = model(tgt_in=tgt[:, t:t + 1], memory=memory, src_mask=mask, cache=cache)
        steps.append(step)
    assert torch.allclose(torch.cat(steps, 1), logits, atol=1e-5)  # the cache computes what teacher forcing does
    shared = [n for n, p in model.named_parameters() if p.shape == (40, 32)]
    assert shared == ["embed"]  # one matrix: source, target and output projection


def test_padding_never_changes_the_loss():
    task, model = TranslationTask(), tiny_model()
    samples = [{"src_ids": [5, 6, 7, 3], "tgt_ids": [2, 8, 9, 3]}, {"src_ids": [10, 3], "tgt_ids": [2, 11, 12, 13, 3]}]
    batch = task.collate(samples)
    wide = {k: torch.cat([v, torch.zeros(v.shape[0], 6, dtype=v.dtype)], 1) for k, v in batch.items()}
    assert task.count(batch) == task.count(wide) == 7
    a, b = task.loss(model, batch), task.loss(model, wide)
    assert torch.allclose(a, b, rtol=1e-5), (a, b)
    alone = sum(task.loss(model, task.collate([s])) for s in samples)  # each sentence padded to itself
    assert torch.allclose(a, alone, rtol=1e-5), (a, alone)


def test_length_buckets_pad_to_the_next_bucket_and_change_no_loss():
    from harness.data.batches import BucketedCollate

    task, model = TranslationTask(), tiny_model()
    samples = [{"src_ids": [5, 6, 7, 3], "tgt_ids": [2, 8, 9, 3]}, {"src_ids": [10, 3], "tgt_ids": [2, 11, 12, 13, 3]}]
    batch, bucketed = task.collate(samples), BucketedCollate(task, (2, 6, 8))(samples)
    assert {k: tuple(v.shape) for k, v in bucketed.items()} == {"src": (2, 6), "tgt_in": (2, 6), "tgt_out": (2, 6)}
    assert torch.equal(bucketed["src"][:, :4], batch["src"]) and (bucketed["src"][:, 4:] == task.pad).all()
    assert torch.allclose(task.loss(model, bucketed), task.loss(model, batch), rtol=1e-5)
    long = [{"src_ids": list(range(4, 13)) + [3], "tgt_ids": [2, 5, 3]}]  # 10 source tokens: past every bucket
    assert BucketedCollate(task, (2, 6, 8))(long)["src"].shape == (1, 10)  # kept as it is


def test_label_smoothing_by_hand():
    logits = torch.tensor([[[2.0, 0.0, 1.0, -1.0], [0.5, 0.5, 0.0, 3.0], [1.0, 1.0, 1.0, 1.0]]])  # (1, 3, V=4)
    batch = {"src": torch.tensor([[3]]), "tgt_in": torch.tensor([[2, 1, 2]]), "tgt_out": torch.tensor([[2, 3, 0]])}
    task, eps = TranslationTask(), 0.2
    got = task.loss(lambda src, tgt_in, keep: logits, batch, label_smoothing=eps)
    want = 0.0
    for row, target in ((logits[0, 0].tolist(), 2), (logits[0, 1].tolist(), 3)):  # the third target is padding
        log_z = math.log(sum(math.exp(x) for x in row))
        nll = [log_z - x for x in row]
        want += (1 - eps) * nll[target] + eps * sum(nll) / len(row)
    assert task.count(batch) == 2
    assert got.item() == pytest.approx(want, rel=1e-6)


# --- decoding ----------------------------------------------------------------------------------------------------

def test_beam_one_equals_greedy_and_lockstep():
    model = tiny_model(seed=3)
    src = torch.randint(4, 40, (5, 6))
    src[2, 3:] = 0
    kw = dict(bos=2, eos=3, pad=0, max_len=12)
    g = greedy(model, src, **kw)
    assert beam_search(model, src, beam_size=1, length_penalty=0.6, **kw) == g

    calls = []

    class Counting(torch.nn.Module):  # a rank done early keeps calling the model, as ZeRO-3 needs
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *a, **k):
            calls.append(1)
            return self.inner(*a, **k)

    more = lambda active: active or len(calls) < 20  # another rank still busy until 20 calls
    counting = Counting().eval()
    assert greedy(counting, src, any_active=more, **kw) == g and len(calls) == 20
    calls.clear()
    b4 = beam_search(model, src, beam_size=4, **kw)
    assert beam_search(counting, src, beam_size=4, any_active=more, **kw) == b4 and len(calls) == 20


# --- end to end: 2 processes, ZeRO-2 -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """A 2-process ZeRO-2 run on its own copy of the toy pairs (a test may change that copy; 4 test pairs, as beam
    search on CPU is slow), with its cache."""
    root = tmp_path_factory.mktemp("toy_run")
    data, cache = write_toy_dir(root / "toy", test=4), root / "cache"
    run = harness(root / "run", str(data), nproc=2, ds="zero2.json", env={"HARNESS_CACHE": str(cache)},
                  sets=['run.task="translation"', 'translation.target_lang="fr"', "model.vocab_size=64",
                        "model.n_heads=4", "train.max_steps=12", "translation.eval_max_sentences=16",
                        "translation.beam_size=2"])
    return run, data, cache


def test_two_process_zero2_run(toy_run):
    run = toy_run[0]
    losses = run.losses
    assert len(losses) == 12 and losses[12] < losses[1] * 0.8, losses
    assert all(0 < m["padding"] < 1 and m["tflops"] > 0 for m in run.metrics)  # sentences differ in length
    final = run.evals[-1]
    assert final["sentences"] == 16 and 0.0 <= final["bleu"] <= 100.0 and "bleu_signature" in final
    assert "copy_source_bleu" in final and final["nll"] > 0


def test_evaluate_data_scores_new_pairs_with_the_run_s_own_tokenizer(toy_run, tmp_path, monkeypatch, capsys,
                                                                      one_thread):
    """`harness evaluate --data` on a directory that now holds two test pairs scores each with the run's stored
    tokenizer: the run's own test pair as `--split test` does, the new one too; once the training data changes,
    `--split` refuses (a re-fitted tokenizer) and `--data` gives the same figures as before."""
    import hashlib

    from harness.cli import main
    from harness.eval.evaluate import evaluate_data, evaluate_run

    run, data, cache = toy_run
    monkeypatch.setenv("HARNESS_CACHE", str(cache))
    assert {"spm.model", "meta.json", "checksums.json"} <= {p.name for p in (run.dir / "data").iterdir()}
    split = evaluate_run(run.dir, "test")
    rng = random.Random(7)
    pairs = [("", ""), *(toy_pair(rng) for _ in range(2))]  # the first is empty: skipped
    for lang, side in (("en", 0), ("fr", 1)):
        (data / f"test_2017_toy.{lang}").write_text("\n".join(p[side] for p in pairs) + "\n")
    both = evaluate_data(run.dir, data)
    assert set(both) == {"toy/test_2016_toy", "toy/test_2017_toy"}
    assert {k: both["toy/test_2016_toy"][k] for k in split} == split
    new = both["toy/test_2017_toy"]
    assert new["sentences"] == new["rows_kept"] == 2 and new["rows_skipped"] == 1 and new["skipped"] == "empty 1"
    names = ("test_2017_toy.en", "test_2017_toy.fr")
    lines = "".join(f"{hashlib.sha256((data / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    assert new["data_sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert json.loads((run.dir / "eval.json").read_text())["toy/test_2017_toy"] == new
    originals = {f: f.read_bytes() for f in data.glob("train.*")}
    try:  # the training data changes after the run: a tokenizer fitted now would differ
        for f in originals:
            with gzip.open(f, "rt") as r:
                text = r.read().upper()
            with gzip.open(f, "wt") as w:
                w.write(text)
        with pytest.raises(ConfigError, match="differs from what the run was trained with .* in spm.model"):
            evaluate_run(run.dir, "test")
        capsys.readouterr()
        assert main(["evaluate", "--run-dir", str(run.dir), "--data", str(data / "test_2017_toy.en"),
                     "--name", "2017"]) == 0
        assert "| metric" in capsys.readouterr().out
        again = json.loads((run.dir / "eval.json").read_text())["2017"]
        assert {k: again[k] for k in new if k not in ("data",)} == {k: v for k, v in new.items() if k != "data"}
    finally:
        for f, raw in originals.items():
            f.write_bytes(raw)
    tests = {f: f.read_bytes() for f in data.glob("test_2016_toy.*")}
    try:  # other test pairs (no verb: none is a training pair, so no training pair leaks out), the same tokenizer:
        for lang, side in (("en", 0), ("fr", 1)):  # scored as they are now, and said so (silent before)
            with gzip.open(data / f"test_2016_toy.{lang}.gz", "wt") as w:
                w.write("\n".join(p[side] for p in [("the cat.", "le chat."), ("a dog.", "un chien.")]) + "\n")
        capsys.readouterr()
        assert evaluate_run(run.dir, "test")["sentences"] == 2
        assert "(the same tokenizer and statistics, other rows): the test split is scored as it is now" in \
            capsys.readouterr().err
    finally:
        for f, raw in tests.items():
            f.write_bytes(raw)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": "y"}\n')
    bare = bare_copy(run.dir, tmp_path / "bare")
    (tmp_path / "half.en").write_text("the cat.\n")  # the other side in another language: said so
    (tmp_path / "half.de").write_text("die Katze.\n")
    for run_dir, path, message in ((run.dir, data / "nothing", "not found as translation pairs"),
                                   (run.dir, tmp_path / "half.en", "half.en: the other side of the pair is missing: "
                                    "no half.fr[.gz] beside it (half.de); this run translates en to fr"),
                                   (run.dir, bad, "needs columns 'en' and 'fr'"),
                                   (bare, data, "holds no stored tokenizer and statistics")):
        assert main(["evaluate", "--run-dir", str(run_dir), "--data", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err



def test_evaluate_and_translate_take_only_scoring_settings_with_set(toy_run, monkeypatch, capsys, one_thread):
    """`--set` of how the trained model is decoded (translation.beam_size: 1 is greedy) for one command, the run's
    config left as it is (before, the beam of the run's config was the only one); a key of what the run trained with,
    or a value out of its bound, is refused in one line."""
    import harness.tasks.translation as translation
    from harness.cli import main
    from harness.eval.evaluate import evaluate_run

    run, data, cache = toy_run
    monkeypatch.setenv("HARNESS_CACHE", str(cache))
    config = (run.dir / "config.toml").read_text()
    decoded, real = [], translation.generate
    monkeypatch.setattr(translation, "generate", lambda *a, **k: decoded.append((k["beam_size"],
                                                                                 k["length_penalty"])) or real(*a, **k))
    assert evaluate_run(run.dir, "test", sets=["translation.beam_size=1"])["beam_size"] == 1
    scored = json.loads((run.dir / "eval.json").read_text())["test"]
    assert set(decoded) == {(1, 0.6)} and (scored["beam_size"], scored["length_penalty"]) == (1, 0.6)
    decoded.clear()
    capsys.readouterr()
    assert main(["translate", "--run-dir", str(run.dir), "--set", "translation.beam_size=3", "--set",
                 "translation.length_penalty=0", "the cat."]) == 0
    assert decoded == [(3, 0.0)] and capsys.readouterr().out.strip()
    assert (run.dir / "config.toml").read_text() == config
    for argv, said in ((["evaluate", "--set", "model.d_model=64"], "--set model.d_model=64: evaluate and translate "
                        "take only settings of how the trained model is scored (this run's are translation.beam_size, "
                        "translation.length_penalty); model.d_model is what the run trained with"),
                       (["evaluate", "--set", "prices.periods=2"], "prices.periods is no setting of a 'translation' "
                        "run"),
                       (["evaluate", "--set", "translation.beam_sise=2"], "translation.beam_sise is no setting of a "
                        "'translation' run (did you mean translation.beam_size?)"),
                       (["translate", "--set", "translation.beam_size=0", "a dog."], "translation.beam_size")):
        assert main([argv[0], "--run-dir", str(run.dir), *argv[1:]]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


def test_loss_is_normalised_by_target_tokens_across_accumulation_and_ranks(toy_dir, tmp_path):
    """Sentences have different lengths, so a mean of per-micro-batch means would weigh tokens unequally:
    4 x 1, 1 x 4 and 2 ranks x 1 x 2 must give the same step losses and the same weights."""
    env, sets = {"HARNESS_CACHE": str(tmp_path / "cache")}, [
        'run.task="translation"', 'translation.target_lang="fr"', "model.vocab_size=64", "model.n_heads=4",
        "train.max_steps=4", "translation.eval_max_sentences=2", "translation.beam_size=1"]
    one = harness(tmp_path / "one", str(toy_dir), env=env, sets=sets)
    accum = harness(tmp_path / "accum", str(toy_dir), env=env,
                    sets=sets + ["train.micro_batch_size=1", "train.grad_accum_steps=4"])
    ranks = harness(tmp_path / "ranks", str(toy_dir), nproc=2, ds="zero2.json", env=env,
                    sets=sets + ["train.micro_batch_size=1", "train.global_batch_size=4"])
    assert "global batch 4 = 1 x 2 x 2" in ranks.proc.stdout
    with pytest.MonkeyPatch.context() as mp:  # the premise: micro-batches of one step hold unequal token counts
        mp.setenv("HARNESS_CACHE", env["HARNESS_CACHE"])
        from harness.data.batches import StepSampler

        cfg = resolve(str(one.dir / "config.toml")).cfg
        task = TranslationTask()
        data = task.build_data(cfg)
        sampler = StepSampler(len(data.train), 1, 4, 0, 1, cfg.train.seed, 0, 1)
        counts = [task.count(task.collate([data.train[int(i)]])) for i in sampler.step_indices(0).flatten()]
        assert len(set(counts)) > 1, counts
    assert_losses_close(accum.losses, one.losses, 1e-5)
    assert_losses_close(ranks.losses, one.losses, 1e-5)
    from safetensors.torch import load_file

    # A key bias shifts every attention score of a query equally, so its true gradient is 0: what reaches it is
    # rounding noise, which Adam blows up to lr-sized steps of random sign. Every other weight must agree: to 1e-4,
    # since a gradient near 0 can meet the same noise (one of 61,472 weights differed by 2.2e-5 on an AVX-512 CPU);
    # weighting micro-batches by their own token counts instead moves 56,278 of them, by up to 1.3e-2.
    ref = load_file(str(one.dir / "model.safetensors"))
    for run in (accum, ranks):
        other = load_file(str(run.dir / "model.safetensors"))
        worst = max((other[k] - ref[k]).abs().max().item() for k in ref if not k.endswith("k_proj.bias"))
        assert worst <= 1e-4, worst

def test_zero3_generation_matches_one_process(toy_dir, tmp_path, one_thread):
    """Beam search under ZeRO-3 on 2 ranks (parameters gathered collectively at every decoder call, ranks
    finishing at different steps) ends without deadlock and scores what the exported model scores in 1 process."""
    cache = tmp_path / "cache"
    ds = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)  # every parameter sharded
    run = harness(tmp_path / "run", str(toy_dir), nproc=2, ds=ds, env={"HARNESS_CACHE": str(cache)},
                  sets=['run.task="translation"', 'translation.target_lang="fr"', "model.vocab_size=64",
                        "model.n_heads=4", "train.max_steps=8", "translation.eval_max_sentences=12",
                        "translation.beam_size=3"], timeout=240)
    final = run.evals[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", str(cache))
        from harness.run.export import load_model
        from harness.distributed.world import single_world

        model, cfg = load_model(run.dir)
        alone = TranslationTask().evaluate(model, cfg, "validation", single_world(), max_sentences=12)
        # in training, the loop's `between_batches` (World.scored) after each decoded batch: a stop signal ends it
        asked = []
        with pytest.raises(Stopped):
            TranslationTask().evaluate(model, cfg, "validation", dataclasses.replace(
                single_world(), between_batches=lambda i, steps: stop_after(1, i, steps, asked)), max_sentences=12)
        assert [i for i, _ in asked] == [0, 1] and asked[0][1] > 2, asked
    assert final["sentences"] == alone["sentences"] == 12
    assert final["bleu"] == pytest.approx(alone["bleu"], abs=1e-6) and final["chrf"] == pytest.approx(alone["chrf"])
    assert final["nll"] == pytest.approx(alone["nll"], rel=1e-4)
    proc = cli("translate", "--run-dir", str(run.dir), "the big cat sees a dog.", "a child likes the red bread.",
               env={"HARNESS_CACHE": str(cache)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.strip().splitlines()) == 2
    # from standard input a line out for each line in, a blank one for a blank one (they had been dropped)
    piped = subprocess.run([python(), "-m", "harness", "translate", "--run-dir", str(run.dir)], cwd=ROOT,
                           input="the big cat sees a dog.\n\na child likes the red bread.\n", capture_output=True,
                           text=True, env=_env({"HARNESS_CACHE": str(cache)}), timeout=120)
    assert piped.returncode == 0, piped.stderr[-2000:]
    latin = subprocess.run([python(), "-m", "harness", "translate", "--run-dir", str(run.dir)], cwd=ROOT,
                           input=b"the cat.\nJesus \xe9 wept.\n", capture_output=True, timeout=120,
                           env=_env({"HARNESS_CACHE": str(cache), "LC_ALL": "en_US.UTF-8"}))
    assert latin.returncode == 2 and latin.stderr.decode().strip().splitlines() == [
        "harness: error: standard input, line 2: not UTF-8 (byte 0xe9 at character 7); convert the text first, e.g. "
        "iconv -f latin1 -t utf-8"], latin.stderr
    first, second = proc.stdout.strip().splitlines()
    assert piped.stdout.splitlines() == [first, "", second]
    # a reader that leaves (`| head -1`): no traceback (a BrokenPipeError's, then Python's at exit)
    gone = subprocess.Popen([python(), "-m", "harness", "translate", "--run-dir", str(run.dir)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({"HARNESS_CACHE": str(cache)}))
    gone.stdout.close()
    _, err = gone.communicate("the big cat sees a dog.\n" * 3, timeout=120)
    assert gone.returncode == 1 and "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    # train.micro_batch_size sentences at a time, each as it is translated alone; a source past data.seq_len - 1
    # pieces is cut as training cut it, and said (it was silent)
    many = ["the big cat sees a dog.", "a child likes the red bread.", "the dog.", "a red cat sees the child."] * 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", str(cache))
        from harness.eval.evaluate import translate

        batched = translate(run.dir, many)
        alone = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=1))
        assert list(batched)[:4] == [next(TranslationTask().translate(model, alone, [s])) for s in many[:4]]
    long = cli("translate", "--run-dir", str(run.dir), "the big cat sees a dog. " * 40, "the dog.",
               env={"HARNESS_CACHE": str(cache)}, timeout=120)
    assert long.returncode == 0 and "note: 1 of 2 sentence(s) (e.g. number 1) are longer than data.seq_len - 1" in \
        long.stderr, long.stderr[-2000:]
    # each batch's translations are printed as they are decoded: Ctrl-C keeps them (all came at the end, or none)
    (tmp_path / "many.txt").write_text("the big cat sees a dog.\n" * 2000)
    with open(tmp_path / "many.txt") as many_in:
        streamed = subprocess.Popen([python(), "-m", "harness", "translate", "--run-dir", str(run.dir)], cwd=ROOT,
                                    stdin=many_in, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=_env({"HARNESS_CACHE": str(cache)}))
    head = streamed.stdout.readline()
    streamed.send_signal(signal.SIGINT)
    rest, err = streamed.communicate(timeout=120)
    assert streamed.returncode == 130 and err.strip().splitlines()[-1] == "harness: interrupted", err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert head.strip() == first and 1 <= len(rest.splitlines()) + 1 < 2000
    # in a terminal, no bar: its redraws on stderr would cut the lines streaming to stdout
    shown, terminal = pty.openpty()
    on_tty = subprocess.run([python(), "-m", "harness", "translate", "--run-dir", str(run.dir)], cwd=ROOT,
                            input="the big cat sees a dog.\n" * 12, stdout=terminal, stderr=subprocess.PIPE, text=True,
                            env=_env({"HARNESS_CACHE": str(cache)}), timeout=120)
    os.close(terminal)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once the terminal's writer is gone
        while chunk := os.read(shown, 65536):
            seen += chunk
    os.close(shown)
    assert on_tty.returncode == 0 and "translating" not in on_tty.stderr, on_tty.stderr[-2000:]
    assert seen.decode().split() == (first.split() * 12), seen
