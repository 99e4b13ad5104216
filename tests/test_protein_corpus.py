"""Protein sequences of any number (`harness prepare protein --input FASTA... --out DIR`): one sequence a document in
residue shards, read by memory map for masked-LM pre-training, resumed exactly on another world size; bad input
refused in one line."""
from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest

from conftest import assert_losses_close, cli, harness, rewind
from harness.config.run import ConfigError
from harness.data.corpus import Corpus, Documents
from harness.data.tokenizer import Tokenizer
from harness.prepare.corpus import prepare_corpus

AMINO = "ACDEFGHIKLMNPQRSTVWY"


def write_fasta(path, n: int, seed: int = 0, width: int = 60) -> list[str]:
    """n records of 20-200 residues over lines of `width`; returns the sequences."""
    rng, seqs = random.Random(seed), []
    lines = []
    for i in range(n):
        seq = "".join(rng.choice(AMINO) for _ in range(rng.randint(20, 200)))
        seqs.append(seq)
        lines += [f">sp|P{i:05d}| protein {i} OS=Homo sapiens"] + [seq[j:j + width] for j in range(0, len(seq), width)]
    text = "\n".join(lines) + "\n"
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return seqs


def sequences(directory) -> list[str]:
    """Every sequence of a prepared directory (both splits), spelled with its vocabulary."""
    corpus, tok = Corpus(directory), Tokenizer.load(directory / "spm.model")
    return ["".join(tok.sp.id_to_piece(int(t)) for t in Documents(corpus, split)[i])
            for split in ("train", "validation") for i in range(len(Documents(corpus, split)))]


def test_fasta_records_become_one_document_each_in_any_unit_cut(tmp_path):
    seqs = write_fasta(tmp_path / "a.fasta", 400) + write_fasta(tmp_path / "b.fa.gz", 50, seed=1)
    odd = tmp_path / "c.faa"
    odd.write_text(">x\nmkv*\n>empty\n\n>y\nAC\nJD\n")  # lower case, a stop codon, an empty record, a letter J
    whole = prepare_corpus([str(tmp_path)], str(tmp_path / "whole"), tokenizer="residues", val_fraction=0.1)
    cut = prepare_corpus([str(tmp_path)], str(tmp_path / "cut"), tokenizer="residues", val_fraction=0.1,
                         unit_bytes=4096, workers=2)  # a.fasta in ranges that fall inside records
    assert cut["units"] > 5 and whole["dtype"] == "uint8" and whole["counts"]["rows"] == {"ok": 452, "empty": 1}
    expected = sorted(seqs + ["MKV", "AC<unk>D"])  # J is none of the residues
    assert sorted(sequences(tmp_path / "whole")) == expected == sorted(sequences(tmp_path / "cut"))
    assert Tokenizer.load(tmp_path / "whole" / "spm.model").piece_id("A") == 6
    (tmp_path / "bad.fasta").write_text("MKV\nACD\n")
    with pytest.raises(ConfigError, match="no record header"):
        prepare_corpus([str(tmp_path / "bad.fasta")], str(tmp_path / "bad"), tokenizer="residues")


@pytest.fixture
def prepared(tmp_path):
    write_fasta(tmp_path / "seqs.fasta", 600, seed=3)
    done = cli("prepare", "protein", "--input", str(tmp_path / "seqs.fasta"), "--out", str(tmp_path / "prepared"),
               "--val-fraction", "0.05")
    assert done.returncode == 0 and "prepared" in done.stdout, done.stderr[-2000:]
    return tmp_path / "prepared"


MLM = ["run.task=\"protein\"", "protein.objective=\"mlm\"", "data.seq_len=48", "train.max_steps=8",
       "train.save_every=2", "train.keep_checkpoints=10"]


def test_masked_lm_pretraining_on_a_prepared_corpus_resumes_exactly_on_another_world_size(tmp_path, prepared):
    whole = harness(tmp_path / "whole", prepared, nproc=2, ds="zero2.json", sets=MLM)
    out = whole.proc.stdout + whole.proc.stderr
    assert f"a prepared corpus {prepared}: {Corpus(prepared).documents():,} sequences" in out, out[-2000:]
    hashes = {m["step"]: m["data_hash"] for m in whole.metrics}
    assert len(set(hashes.values())) == 8
    run = harness(rewind(whole.dir, tmp_path / "run", 4), prepared, ds="zero1.json",
                  sets=[*MLM, "train.grad_accum_steps=2"], args=["--resume", "auto"])
    assert {m["step"]: m["data_hash"] for m in run.metrics} == hashes
    assert_losses_close(run.losses, whole.losses, 1e-5)
    evals = [json.loads(x) for x in (whole.dir / "eval.jsonl").read_text().splitlines()]
    assert evals and np.isfinite(evals[-1]["masked_accuracy"])


def test_a_prepared_corpus_the_protein_task_cannot_read_is_refused_in_one_line(tmp_path, prepared, corpus):
    text = tmp_path / "text"
    prepare_corpus([str(corpus)], str(text))
    for sets, message in (([f"data.path={json.dumps(str(prepared))}", "protein.objective=\"classify\""],
                           "has no labels"),
                          ([f"data.path={json.dumps(str(text))}", "protein.objective=\"mlm\""],
                           "a corpus of bytes tokens")):
        done = cli("plan", "--set", "run.task=\"protein\"", "--set", "train.max_steps=5", *[
            a for s in sets for a in ("--set", s)])
        assert done.returncode == 2 and message in done.stderr.strip().splitlines()[-1], done.stderr[-1500:]
    both = cli("prepare", "protein", "--input", "x.fasta", "--data", "y.csv", "--out", str(tmp_path / "o"))
    assert both.returncode == 2 and "not both" in both.stderr
