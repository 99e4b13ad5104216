"""The files in data/samples/: each one is read by its task's own reader, and every row written comes back.

Expected rows are read here with the standard library, independently of the harness; prepared data and the
`datasets` cache go to a temporary directory, never into the repository.
"""
from __future__ import annotations

import csv
import gzip
import json
import re
import runpy
from pathlib import Path

import pytest

from harness.tasks import resolve
from harness.prepare import protein as protein_prep
from harness.prepare import read_meta
from harness.prepare import translation as translation_prep
from harness.tasks.lm import LanguageModelTask
from harness.tasks.prices import PricesTask
from harness.tasks.protein import ProteinTask
from harness.tasks.translation import TranslationTask

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
SAMPLES = DATA / "samples"
SPLITS = ("train", "validation", "test")
IGNORE = -100


@pytest.fixture(scope="module", autouse=True)
def caches(tmp_path_factory):
    import datasets.config

    mp = pytest.MonkeyPatch()
    mp.setenv("HARNESS_CACHE", str(tmp_path_factory.mktemp("harness_cache")))
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
    yield
    mp.undo()


def config(task: str, path: Path, *sets: str):
    return resolve(None, [f'run.task="{task}"', f"data.path={json.dumps(str(path))}", "train.max_steps=1",
                          *sets]).cfg


def kept(counts: dict) -> int:
    return counts.get("ok", 0) + counts.get("truncated", 0)


# ---- lm: one text row per line (.txt), or a `text` field (.jsonl, .json, .csv) ---------------------------------

def lm_rows(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    if path.suffix == ".json":
        return [r["text"] for r in json.loads(path.read_text(encoding="utf-8"))]
    with path.open(encoding="utf-8", newline="") as f:
        return [r["text"] for r in csv.DictReader(f)]


@pytest.mark.parametrize("name", ["sample.txt", "sample.jsonl", "sample.json", "sample.csv"])
def test_lm_reads_every_row_in_order(name):
    path, seq_len = SAMPLES / "lm" / name, 16
    rows = lm_rows(path)
    cfg = config("lm", path, f"data.seq_len={seq_len}", "data.val_fraction=0.0")
    task = LanguageModelTask()
    task.check(cfg)
    data = task.build_data(cfg)
    assert dict(data.summary.counts["train"]) == {"ok": len(rows)}
    # Rows are joined by "\n" and cut into samples of seq_len + 1 bytes, in file order when nothing is held out.
    stream = "\n".join(rows).encode("utf-8")
    assert len(data.train) == len(stream) // (seq_len + 1)
    assert bytes(data.train[0]["ids"].tolist()) == stream[:seq_len + 1]
    assert bytes(data.train[len(data.train) - 1]["ids"].tolist()) in stream


def test_lm_val_fraction_holds_rows_out():
    path = SAMPLES / "lm" / "sample.txt"
    data = LanguageModelTask().build_data(config("lm", path, "data.seq_len=16", "data.val_fraction=0.2"))
    assert data.summary.counts["train"]["ok"] == 8 and data.summary.counts["validation"]["ok"] == 2


# ---- translation: a directory of line-aligned files, or one file of pairs --------------------------------------

def lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def translation_check(path: Path):
    """(training data, meta, {split: {source: target}}) of the prepared sample."""
    cfg = config("translation", path, "model.vocab_size=200", "data.seq_len=48")
    task = TranslationTask()
    task.check(cfg)
    data = task.build_data(cfg)
    directory = task.prepare(cfg)
    meta = read_meta(directory)
    splits = {s: translation_prep.load(directory, s) for s in meta["splits"]}
    return data, meta, {s: dict(zip(d["src"], d["tgt"])) for s, d in splits.items()}, directory


def gzipped_copy(tmp_path: Path) -> Path:
    """The sample directory as Multi30k ships: gzipped, the test split named test_<something>."""
    out = tmp_path / "pairs_gz"
    out.mkdir()
    for f in (SAMPLES / "translation" / "pairs").iterdir():
        name = f.name.replace("test.", "test_2016.") + ".gz"
        with gzip.open(out / name, "wt", encoding="utf-8") as g:
            g.write(f.read_text(encoding="utf-8"))
    return out


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzipped"])
def test_translation_directory_gives_three_aligned_splits(gz, tmp_path):
    source = SAMPLES / "translation" / "pairs"
    data, meta, pairs, _ = translation_check(gzipped_copy(tmp_path) if gz else source)
    expected = {split: dict(zip(lines(source / f"{stem}.en"), lines(source / f"{stem}.fr")))
                for split, stem in (("train", "train"), ("validation", "val"), ("test", "test"))}
    assert {s: meta["counts"][s] for s in SPLITS} == {s: {"ok": len(expected[s])} for s in SPLITS}
    assert pairs == expected  # line i of train.en still goes with line i of train.fr
    assert len(data.train) == 12 and len(data.val) == 3


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs_nested.jsonl", "pairs.json", "pairs.csv", "pairs.tsv"])
def test_translation_file_of_pairs(name):
    expected = {json.loads(line)["en"]: json.loads(line)["fr"]
                for line in (SAMPLES / "translation" / "pairs.jsonl").read_text(encoding="utf-8").splitlines()}
    data, meta, pairs, directory = translation_check(SAMPLES / "translation" / name)
    assert meta["splits"] == ["train", "validation"]  # a file has no test split
    assert meta["counts"] == {"train": {"ok": 9}, "validation": {"ok": 1}}  # val_fraction 0.05 of 10 rows
    assert {**pairs["train"], **pairs["validation"]} == expected
    tok = translation_prep.tokenizer(directory)  # the ids decode back to a target sentence that was written
    assert tok.decode(data.train[0]["tgt_ids"]) in expected.values()


# ---- protein: csv/tsv/jsonl/fasta files (one class, or one state per residue), a FLIP directory ----------------

def classify_rows(path: Path) -> dict[str, str]:
    """sequence -> label, read with the standard library."""
    text = path.read_text()
    if path.suffix == ".fasta":
        records = re.findall(r">\S+ label=(\S+)\n([A-Z\n]+)", text)
        return {seq.replace("\n", ""): label for label, seq in records}
    if path.suffix == ".jsonl":
        return {r["sequence"]: str(r["label"]) for r in map(json.loads, text.splitlines())}
    if path.name == "classify_counted.csv":
        return {s: label.strip() for s, label in (line.split(",") for line in text.splitlines()[1:])}
    rows = csv.DictReader(text.splitlines(), delimiter="\t" if path.suffix == ".tsv" else ",")
    return {r["sequence"]: r["label"] for r in rows}


def prepared_rows(directory: Path) -> dict[str, list[dict]]:
    return {s: protein_prep.load(directory, s).to_list() for s in SPLITS}


def read_protein(path, objective: str):
    """(the task's data, the prepared meta, the prepared rows by split) of a protein sample, 60/20/20."""
    cfg = config("protein", path, f'protein.objective="{objective}"', "data.seq_len=64", "data.val_fraction=0.2",
                 "protein.test_fraction=0.2")
    task = ProteinTask()
    task.check(cfg)
    data = task.build_data(cfg)
    directory = task.prepare(cfg)
    return data, read_meta(directory), prepared_rows(directory)


@pytest.mark.parametrize("name", ["classify.csv", "classify.tsv", "classify.jsonl", "classify.fasta",
                                  "classify_counted.csv"])
def test_protein_classify_files(name):
    path = SAMPLES / "protein" / name
    expected = classify_rows(path)
    data, meta, rows = read_protein(path, "classify")
    assert len(expected) == 10 and meta["classes"] == ["0", "1"]
    assert all(set(meta["counts"][s]) == {"ok"} for s in SPLITS)  # nothing dropped, nothing truncated
    assert {s: len(rows[s]) for s in SPLITS} == {"train": 6, "validation": 2, "test": 2}  # by class: 3 / 1 / 1
    got = {r["sequence"]: meta["classes"][r["label"]] for s in SPLITS for r in rows[s]}
    assert got == expected
    assert len(data.train) == 6 and int(data.train[0]["label"]) in (0, 1)


def expected_states(label: str, resolved: str | None) -> list[int]:
    three = {"H": 1, "G": 1, "I": 1, "E": 2, "B": 2}  # everything else is coil (0)
    return [three.get(s, 0) if resolved is None or r == "1" else IGNORE
            for s, r in zip(label, resolved or "1" * len(label))]


def residue_rows() -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / "protein" / "residue.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["residue.csv", "residue.jsonl", "residue.fasta"])
def test_protein_residue_files(name):
    path = SAMPLES / "protein" / name
    with_mask = name != "residue.fasta"  # a fasta header holds the label only, no resolved mask
    expected = {r["sequence"]: expected_states(r["label"], r["resolved"] if with_mask else None)
                for r in residue_rows()}
    data, meta, rows = read_protein(path, "residue")
    assert meta["labels"] == "residue" and sum(kept(meta["counts"][s]) for s in SPLITS) == 6
    assert {r["sequence"]: r["states"] for s in SPLITS for r in rows[s]} == expected
    assert IGNORE in data.train[0]["targets"].tolist()  # at least <cls>, which is never scored


def test_protein_flip_directory_takes_its_splits_from_the_headers():
    path = SAMPLES / "protein" / "flip"
    cfg = config("protein", path, 'protein.objective="residue"', "data.seq_len=64")
    task = ProteinTask()
    task.check(cfg)
    task.build_data(cfg)
    directory = task.prepare(cfg)
    meta, rows = read_meta(directory), prepared_rows(directory)
    assert {s: meta["counts"][s] for s in SPLITS} == {"train": {"ok": 3}, "validation": {"ok": 1}, "test": {"ok": 2}}
    truth = {r["sequence"]: expected_states(r["label"], r["resolved"]) for r in residue_rows()}
    assert {r["sequence"]: r["states"] for s in SPLITS for r in rows[s]} == truth
    assert [r["sequence"] for r in rows["test"]] == [r["sequence"] for r in residue_rows()[4:]]


def test_protein_fitness_csv_keeps_its_flip_splits_and_values():
    path = SAMPLES / "protein" / "fitness.csv"
    with path.open(newline="") as f:
        written = list(csv.DictReader(f))
    cfg = config("protein", path, 'protein.objective="regress"', "data.seq_len=64")
    ProteinTask().check(cfg)
    directory = ProteinTask().prepare(cfg)
    rows = prepared_rows(directory)
    split = {"test": "test"}
    expected = {s: [(r["sequence"], float(r["target"])) for r in written
                    if split.get(r["set"], "validation" if r["validation"] == "True" else "train") == s] for s in SPLITS}
    assert {s: [(r["sequence"], r["value"]) for r in rows[s]] for s in SPLITS} == expected
    assert [len(expected[s]) for s in SPLITS] == [6, 2, 2]


def test_protein_mlm_reads_a_labelled_file():
    cfg = config("protein", SAMPLES / "protein" / "classify.csv", 'protein.objective="mlm"', "data.seq_len=64",
                 "protein.mask_variants=3")
    data = ProteinTask().build_data(cfg)
    meta = read_meta(ProteinTask().prepare(cfg))
    assert sum(kept(meta["counts"][s]) for s in SPLITS) == 10
    assert len(data.train) == 3 * kept(meta["counts"]["train"])


# ---- prices: a csv with a date column and numeric columns ------------------------------------------------------

def test_prices_series_is_what_its_script_writes():
    script = runpy.run_path(str(SAMPLES / "prices" / "make_series.py"))
    assert (SAMPLES / "prices" / "series.csv").read_text() == "\n".join(script["rows"]()) + "\n"


@pytest.mark.parametrize("where", ["file", "directory"])
def test_prices_csv_splits_70_10_20_and_normalises_on_train(where):
    path = SAMPLES / "prices" / ("series.csv" if where == "file" else "")
    with (SAMPLES / "prices" / "series.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    channels = ["load_mw", "temp_c", "price"]
    cfg = config("prices", path, "prices.lookback=16", "prices.horizon=4", "prices.patch_len=8", "prices.stride=4")
    task = PricesTask()
    task.check(cfg)
    data = task.build_data(cfg)
    meta = read_meta(task.prepare(cfg))
    assert len(table) == 300 and meta["channels"] == channels
    assert {s: meta["counts"][s] for s in SPLITS} == {"train": {"ok": 210}, "validation": {"ok": 30},
                                                      "test": {"ok": 60}}
    assert meta["splits"]["validation"]["first"].startswith(table[210]["date"])
    train_mean = [sum(float(r[c]) for r in table[:210]) / 210 for c in channels]
    assert meta["norm"]["mean"] == pytest.approx(train_mean)
    assert meta["norm"]["transform"] == "none"
    assert len(data.train) == 210 - 16 - 4 + 1 and len(data.val) == 30 - 16 - 4 + 1
    assert tuple(data.train[0]["x"].shape) == (16, 3) and tuple(data.train[0]["y"].shape) == (4, 3)


# ---- the index: every sample is listed, every link resolves ----------------------------------------------------

def test_readme_lists_every_sample_and_its_links_resolve():
    readme = (DATA / "README.md").read_text()
    samples = [p.relative_to(DATA).as_posix() for p in SAMPLES.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    missing = [s for s in samples if s not in readme and f"{Path(s).parent.as_posix()}/" not in readme]
    assert not missing, f"data/README.md does not mention {missing}"
    for doc in [DATA / "README.md", *sorted((DATA / "cards").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or (doc.parent / target).resolve().is_relative_to(ROOT.parent / "shared"):
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}, which is missing"
