"""Corpora of any size (`harness prepare lm`, `data.path = DIR`): prepared once into shards, read by memory map,
continued after an interruption, split into parts and merged, refused in one line when bad; training reads them."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import zlib

import numpy as np
import pytest

from conftest import ROOT, assert_losses_close, cli, command, harness, rewind, write_corpus
from harness.config.run import ConfigError
from harness.data.batches import StepSampler
from harness.data.corpus import MANIFEST, Corpus, Windows, permute
from harness.prepare.corpus import merge, prepare_corpus


@pytest.fixture
def inputs(tmp_path):
    """Text, JSON lines (one row without the field, one malformed), a csv and a gzip file, in a directory tree."""
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    write_corpus(root / "a.txt", lines=300, seed=1)
    with open(root / "a.txt", "a") as f:
        f.write("   \n\nlast line without newline")
    rows = [{"text": f"json document {i} " * 3} for i in range(50)] + [{"other": 1}]
    (root / "sub" / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    (root / "sub" / "c.csv").write_text("id,text\n" + "".join(f"{i},csv row {i}\n" for i in range(40)))
    with gzip.open(root / "sub" / "d.txt.gz", "wt") as f:
        f.write("".join(f"gzipped line {i}\n" for i in range(60)))
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(30)] + [None]}), root / "e.parquet",
                   row_group_size=8)  # 4 row groups: 4 units
    (root / "f.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": f"zstd row {i}"}) + "\n" for i in range(20)).encode()))
    return root


def documents(directory) -> list[bytes]:
    """Every document of a prepared corpus (train and validation), from its shards and indexes."""
    corpus, docs = Corpus(directory), []
    for split in ("train", "validation"):
        for shard in corpus.shards[split]:
            data = np.fromfile(shard.path, dtype=corpus.dtype).tobytes()
            ends = np.fromfile(shard.path.with_suffix(".idx"), dtype="<u4")
            docs += [data[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    return docs


def test_prepare_reads_every_kind_cleans_by_the_rows_rules_and_is_read_back_whole(inputs, tmp_path, capsys):
    out = tmp_path / "corpus"
    m = prepare_corpus([str(inputs)], str(out), workers=2, val_fraction=0.1, unit_bytes=4096)
    assert m["dtype"] == "uint8" and m["tokenizer"]["kind"] == "bytes" and m["units"] > 4  # a.txt in ranges
    expected = [line for line in (inputs / "a.txt").read_text().split("\n") if line.strip()]
    expected += [f"json document {i} " * 3 for i in range(50)] + [f"csv row {i}" for i in range(40)]
    expected += [f"gzipped line {i}" for i in range(60)]
    expected += [f"parquet row {i}" for i in range(30)] + [f"zstd row {i}" for i in range(20)]
    assert sorted(documents(out)) == sorted((t + "\n").encode() for t in expected)  # each once, in whole
    assert m["counts"]["rows"] == {"ok": len(expected), "empty": 2, "malformed": 3}
    c = m["counts"]
    assert 0 < c["validation"]["documents"] < c["train"]["documents"]
    disk = sum(f.stat().st_size for f in out.glob("*.bin"))
    assert disk == c["train"]["tokens"] + c["validation"]["tokens"]  # a byte a token
    # the same command again: nothing redone, in well under a second
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("*.bin")}
    assert prepare_corpus([str(inputs)], str(out), workers=2, val_fraction=0.1, unit_bytes=4096) == m
    assert before == {f.name: f.stat().st_mtime_ns for f in out.glob("*.bin")}
    # an interrupted prepare (a unit without its record) redoes that unit only
    (out / "units" / "000001.json").unlink()
    for f in out.glob("*-000001.bin"):
        f.unlink()
    capsys.readouterr()
    assert prepare_corpus([str(inputs)], str(out), workers=1, val_fraction=0.1, unit_bytes=4096) == m
    units = len(list((out / "units").glob("[0-9]*.json")))  # (said: what it picks up)
    assert f"prepare {out.name}: {units - 1} of {units} unit(s) prepared before, kept; preparing the other 1\n" in \
        capsys.readouterr().out
    assert {n: t for n, t in before.items() if "000001" not in n} == \
        {f.name: f.stat().st_mtime_ns for f in out.glob("*.bin") if "000001" not in f.name}


def test_a_full_shard_is_closed_and_the_unit_goes_on_in_the_next(inputs, tmp_path, monkeypatch):
    """A shard's document ends are uint32: a unit that would pass that many tokens goes on in another shard (here,
    a limit of 500 tokens), each document whole in one."""
    whole = documents(prepare_corpus([str(inputs / "a.txt")], str(tmp_path / "one"), unit_bytes=1 << 20) and
                      tmp_path / "one")
    monkeypatch.setattr("harness.prepare.shards.MAX_SHARD_TOKENS", 500)
    m = prepare_corpus([str(inputs / "a.txt")], str(tmp_path / "many"), unit_bytes=1 << 20)
    assert len(m["shards"]) > 20 and all(s["tokens"] <= 500 for s in m["shards"])
    assert {s["unit"] for s in m["shards"]} == {0} and documents(tmp_path / "many") == whole
    Corpus(tmp_path / "many").check()


def test_a_hub_data_set_is_streamed_and_one_out_of_reach_is_one_line(tmp_path):
    """`hub:NAME` goes through `datasets.load_dataset(NAME, streaming=True)`: here NAME is a local data set folder
    (the Hub is out of reach on this machine and on CI), then a name that is no data set."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"body": f"streamed row {i}"}) + "\n" for i in range(40)))
    m = prepare_corpus([f"hub:{folder}"], str(tmp_path / "out"), text_field="body")
    assert m["counts"]["rows"] == {"ok": 40} and sorted(documents(tmp_path / "out")) == sorted(
        f"streamed row {i}\n".encode() for i in range(40))
    with pytest.raises(ConfigError, match="no column 'text'"):
        prepare_corpus([f"hub:{folder}"], str(tmp_path / "other"))
    done = cli("prepare", "lm", "--input", "hub:no-such-org/no-such-set", "--out", str(tmp_path / "missing"),
               env={"HF_HUB_OFFLINE": "1"})  # offline, as this machine and CI are: datasets says so at once
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith("harness: error: --input hub:no-such-org/no-such-set: cannot be "
                                                    "loaded"), done.stderr[-2000:]


def test_parts_merge_into_the_corpus_one_prepare_makes(inputs, tmp_path):
    whole = prepare_corpus([str(inputs)], str(tmp_path / "whole"), val_fraction=0.2, unit_bytes=4096)
    parts = [str(tmp_path / f"part{i}") for i in (1, 2, 3)]
    for i, p in enumerate(parts, 1):
        prepare_corpus([str(inputs)], p, val_fraction=0.2, part=f"{i}/3", unit_bytes=4096)
    merged = merge(parts, str(tmp_path / "merged"))
    key = lambda s: (s["unit"], s["split"], s["sha256"], s["tokens"])  # noqa: E731
    assert sorted(map(key, merged["shards"])) == sorted(map(key, whole["shards"]))
    assert Corpus(tmp_path / "merged").fingerprint == Corpus(tmp_path / "whole").fingerprint
    Corpus(tmp_path / "merged").check()  # the parts' shards, where they lie: nothing copied
    assert not list((tmp_path / "merged").glob("*.bin"))
    with pytest.raises(ConfigError, match="both hold unit"):
        merge([parts[0], parts[0]], str(tmp_path / "twice"))
    with pytest.raises(ConfigError, match="--part 3/2: expected I/N"):
        prepare_corpus([str(inputs)], str(tmp_path / "bad"), part="3/2")


def test_windows_cross_shards_and_the_lazy_order_is_a_permutation(inputs, tmp_path):
    out = tmp_path / "corpus"
    prepare_corpus([str(inputs)], str(out), unit_bytes=2048)
    corpus = Corpus(out)
    stream = b"".join(np.fromfile(s.path, dtype=np.uint8).tobytes() for s in corpus.shards["train"])
    w = Windows(corpus, "train", 64)
    assert len(w) == (len(stream) - 1) // 64 and len(corpus.shards["train"]) > 2
    for i in (0, 1, len(w) // 2, len(w) - 1):
        assert bytes(w[i]["ids"].tolist()) == stream[i * 64:i * 64 + 65]
    for n in (1, 2, 5, 1000, 4099):
        assert sorted(permute(np.arange(n), n, 7).tolist()) == list(range(n))
    assert permute(np.arange(100), 100, 1).tolist() != permute(np.arange(100), 100, 2).tolist()
    # an epoch's order is the same however the ranks split it, and costs nothing to set up for any size
    one = StepSampler(10**9, 4, 2, 0, 1, 0, 0, 3, order="lazy")
    two = [StepSampler(10**9, 4, 1, r, 2, 0, 0, 3, order="lazy") for r in (0, 1)]
    for step in range(3):
        assert sorted(one.step_indices(step).flatten().tolist()) == sorted(
            i for s in two for i in s.step_indices(step)[:, s.dp_rank].flatten().tolist())


@pytest.mark.parametrize("case, message", [
    ("no match", "matches no file"),
    ("empty", "hold no document to train on"),
    ("no field", "no row has the field 'body' (--text-field) as text (2 rows without it); fields found: text, id"),
    ("truncated gz", "unreadable at about row"),
    ("parquet gz", "a parquet file compresses inside itself; decompress it to "),
    ("out a file", "out: " + "{out} is a file, not a directory"),
])
def test_prepare_refuses_bad_input_in_one_line(case, message, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    args = ["prepare", "lm", "--out", str(tmp_path / "out")]
    message = message.format(out=tmp_path / "out")
    if case == "parquet gz":
        (src / "r.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
        args += ["--input", str(src / "r.parquet.gz")]
    elif case == "out a file":
        (tmp_path / "out").write_text("notes\n")
        (src / "a.txt").write_text("one line\n")
        args += ["--input", str(src / "a.txt")]
    elif case == "no match":
        args += ["--input", str(src / "*.txt")]
    elif case == "empty":
        (src / "e.txt").write_text("\n  \n")
        args += ["--input", str(src / "e.txt")]
    elif case == "no field":
        (src / "r.jsonl").write_text('{"text": "a", "id": 1}\n{"text": "b", "id": 2}\n')
        args += ["--input", str(src / "r.jsonl"), "--text-field", "body"]
    else:
        data = gzip.compress(b"".join(b"line %d\n" % i for i in range(200_000)))
        (src / "t.txt.gz").write_bytes(data[:len(data) // 2])
        args += ["--input", str(src / "t.txt.gz")]
    done = cli(*args)
    last = done.stderr.strip().splitlines()[-1]  # after the progress bar, if it started: the error, one line
    assert done.returncode == 2 and last.startswith("harness: error: ") and message in last, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not list((tmp_path / "out").glob("*.tmp"))  # a refusal mid-unit leaves no partial shard
    if case == "truncated gz":  # or kept up to where it breaks, every whole line before the cut, counted
        done = cli(*args, "--on-error", "skip")
        assert done.returncode == 0, done.stderr
        rows = json.loads((tmp_path / "out" / MANIFEST).read_text())["counts"]["rows"]
        before = zlib.decompressobj(wbits=31).decompress(data[:len(data) // 2]).count(b"\n")
        assert rows["unreadable_tail"] == 1 and rows["ok"] == before, (rows, before)  # (a read's 256 KB were lost)


def test_a_disk_that_fills_removes_the_partial_shard_and_the_prepare_continues(tmp_path):
    src = write_corpus(tmp_path / "big.txt", lines=40_000)
    out = tmp_path / "out"
    code = (f"import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)); "
            f"import sys; from harness.cli import main; sys.exit(main(['prepare', 'lm', '--input', {str(src)!r}, "
            f"'--out', {str(out)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "the disk filled" in done.stderr, done.stderr[-2000:]
    assert not list(out.glob("*.tmp")) and not (out / MANIFEST).exists()
    done = cli("prepare", "lm", "--input", str(src), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert Corpus(out).tokens() + Corpus(out).tokens("validation") == src.stat().st_size


def test_training_reads_a_prepared_corpus_and_refuses_a_damaged_one(tmp_path, corpus):
    """Also: `harness evaluate --data` scores a prepared corpus as the run's validation of it did."""
    from harness.eval.evaluate import evaluate_data, evaluate_run

    prepared, held = tmp_path / "prepared", tmp_path / "held"
    done = cli("prepare", "lm", "--input", str(corpus), "--out", str(prepared), "--val-fraction", "0.05")
    assert done.returncode == 0, done.stderr
    prepare_corpus([str(write_corpus(tmp_path / "held.txt", lines=100, seed=5))], str(held))
    run = tmp_path / "run"
    train = subprocess.run(command(run, prepared, sets=[f"data.val_path={json.dumps(str(held))}"]), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "prepared corpus" in train.stdout + train.stderr
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records)
    scored, new = evaluate_run(run, "validation"), evaluate_data(run, held)["held"]
    assert {k: new[k] for k in scored} == pytest.approx(scored, rel=1e-6), (new, scored)
    assert new["rows_kept"] == Corpus(held).documents() and new["data"] == str(held / MANIFEST)
    plan = cli("plan", "--set", f"data.path={json.dumps(str(prepared))}", "--set", "train.max_steps=10")
    assert plan.returncode == 0 and "prepared corpus" in plan.stdout and "epochs" in plan.stdout, plan.stderr
    shard = Corpus(prepared).shards["train"][0].path
    data = bytearray(shard.read_bytes())
    data[0] ^= 1  # the same size, another byte: the checksum tells
    shard.write_bytes(bytes(data))
    bad = cli("plan", "--set", f"data.path={json.dumps(str(prepared))}", "--set", "train.max_steps=10")
    assert bad.returncode == 2 and "fails its checksum" in bad.stderr
    shard.write_bytes(bytes(data[:-10]))
    bad = cli("plan", "--set", f"data.path={json.dumps(str(prepared))}", "--set", "train.max_steps=10")
    assert bad.returncode == 2 and "truncated or changed" in bad.stderr
    shard.unlink()
    bad = cli("plan", "--set", f"data.path={json.dumps(str(prepared))}", "--set", "train.max_steps=10")
    assert bad.returncode == 2 and "is missing" in bad.stderr
    small = tmp_path / "small"  # fewer windows than a global batch: refused before launch, not by every rank
    prepare_corpus([str(write_corpus(tmp_path / "small.txt", lines=30, seed=1))], str(small))
    bad = cli("plan", "--set", f"data.path={json.dumps(str(small))}", "--set", "train.global_batch_size=64", "--set",
              "train.max_steps=10")
    assert bad.returncode == 2 and "training window(s) of data.seq_len + 1 = " in bad.stderr and \
        "fewer than one global batch of 64" in bad.stderr, bad.stderr
    good = tmp_path / "good"
    prepare_corpus([str(corpus)], str(good))
    bad = cli("plan", "--set", f"data.path={json.dumps(str(good))}", "--set", f"data.val_path={json.dumps(str(prepared))}",
              "--set", "train.max_steps=10")  # a separate validation corpus is checked as the training one
    assert bad.returncode == 2 and "is missing" in bad.stderr


def test_a_prepared_corpus_resumes_exactly_on_another_world_size_stage_or_sequence_split(tmp_path, corpus):
    """Stopped on 2 processes (ZeRO-2) and resumed on 1 with accumulation 2, under ZeRO-3, and split over 2 sequence
    ranks: every step reads the samples the uninterrupted run read (its `data_hash`) and reaches its loss."""
    prepared = tmp_path / "prepared"
    prepare_corpus([str(corpus)], str(prepared), val_fraction=0.05, unit_bytes=8192)
    assert len(Corpus(prepared).shards["train"]) > 3  # windows cross shards
    sets = ["train.max_steps=10", "train.save_every=2", "train.keep_checkpoints=10"]
    whole = harness(tmp_path / "whole", prepared, nproc=2, ds="zero2.json", sets=sets, args=["--stop-at", "8"])
    hashes = {m["step"]: m["data_hash"] for m in whole.metrics}
    assert len(set(hashes.values())) == 8  # each step its own samples
    out = rewind(whole.dir, tmp_path / "run", 2)

    def leg(nproc: int, ds: str, stop: int, *extra: str) -> None:
        run = harness(out, prepared, nproc=nproc, ds=ds, sets=[*sets, *extra], args=["--resume", "auto", "--stop-at",
                                                                                     str(stop)])
        assert {m["step"]: m["data_hash"] for m in run.metrics} == {k: v for k, v in hashes.items() if k <= stop}
        assert_losses_close(run.losses, {k: v for k, v in whole.losses.items() if k <= stop}, 1e-5)

    leg(1, "zero1.json", 4, "train.grad_accum_steps=2")
    leg(2, "zero3.json", 6)
    leg(2, "sp2_zero3.json", 8, "train.grad_accum_steps=2")


def test_a_resume_on_other_data_is_refused_unless_the_user_says_so(tmp_path, corpus):
    prepared, other = tmp_path / "prepared", tmp_path / "other"
    prepare_corpus([str(corpus)], str(prepared), val_fraction=0.05)
    prepare_corpus([str(write_corpus(tmp_path / "b.txt", lines=1500, seed=7))], str(other), val_fraction=0.05)
    run = tmp_path / "run"
    harness(run, prepared, sets=["train.save_every=2"], args=["--stop-at", "2"])
    refused = harness(run, other, args=["--resume", "auto"], check=False)
    last = refused.proc.stderr.strip().splitlines()[-1]
    assert refused.proc.returncode == 2 and f"trained on {prepared} (fingerprint" in last and \
        "--data-changed-ok" in last, refused.proc.stderr[-2000:]
    done = harness(run, other, args=["--resume", "auto", "--data-changed-ok", "--stop-at", "4"])
    assert [m["step"] for m in done.metrics] == [1, 2, 3, 4]
    moved = tmp_path / "moved"  # the same corpus elsewhere: its fingerprint is the same, the resume goes on
    other.rename(moved)
    done = harness(run, moved, args=["--resume", "auto", "--stop-at", "6"])
    assert [m["step"] for m in done.metrics] == [1, 2, 3, 4, 5, 6]
    # a text file read as it is: its bytes (and how its rows are chosen and split) are what the run trained on
    text = write_corpus(tmp_path / "text.txt", lines=1500, seed=3)
    raw = tmp_path / "raw"
    harness(raw, text, sets=["train.save_every=2"], args=["--stop-at", "2"])
    refused = harness(raw, text, sets=["data.val_fraction=0.2"], args=["--resume", "auto"], check=False)
    assert refused.proc.returncode == 2 and "--data-changed-ok" in refused.proc.stderr, refused.proc.stderr[-2000:]
    assert "(the data settings that differ: data.val_fraction 0.1 there, 0.2 here)" in refused.proc.stderr  # (the
    # fingerprints alone had not said what changed)
    text.write_text(text.read_text().replace("model", "models"))
    refused = harness(raw, text, args=["--resume", "auto"], check=False)
    last = refused.proc.stderr.strip().splitlines()[-1]
    assert refused.proc.returncode == 2 and f"trained on {text} (fingerprint" in last, refused.proc.stderr[-2000:]


def test_a_damaged_shard_is_prepared_again_by_the_same_command(tmp_path, capsys):
    """The same command again checks the shards (a changed file's checksum read again) and redoes a unit whose shard
    is changed, cut short or missing; an index changed at its size fails its own checksum when a run starts."""
    src = write_corpus(tmp_path / "a.txt", lines=400)
    out = tmp_path / "out"
    m = prepare_corpus([str(src)], str(out))
    shard = Corpus(out).shards["train"][0]
    for damage in ("flip a byte", "cut short"):
        data = bytearray(shard.path.read_bytes())
        data[100] ^= 1
        shard.path.write_bytes(bytes(data) if damage == "flip a byte" else bytes(data[:50]))
        with pytest.raises(ConfigError, match="prepare it again: the same command redoes that unit"):
            Corpus(out).check()
        assert prepare_corpus([str(src)], str(out)) == m
        assert "a.txt: shard train-000000.bin" in capsys.readouterr().out
        Corpus(out).check()
    ends = np.fromfile(shard.index, dtype="<u4")
    ends[:-1] = ends[-1]  # every document merged into one: the same size
    ends.tofile(shard.index)
    with pytest.raises(ConfigError, match="train-000000.idx fails its checksum"):
        Corpus(out).check()
    assert prepare_corpus([str(src)], str(out)) == m
    Corpus(out).check()


def test_prepare_reads_what_the_raw_path_reads(tmp_path):
    """A .zst bigger than its read blocks, a BOM, a row that is not UTF-8 (skipped, as the raw path skips it), a csv
    field over csv's default limit, a JSON escape of a lone surrogate (skipped), a tsv told by its suffix alone."""
    import zstandard

    src = tmp_path / "in.tsv.d"  # ".tsv" in a directory's name is no tsv
    src.mkdir()
    lines = [f"zstd line {i} " + "x" * (i % 50) for i in range(20_000)]
    (src / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    (src / "b.txt").write_bytes(b"\xef\xbb\xbfbom first line\nsecond\n")
    (src / "c.csv").write_bytes(b"\xef\xbb\xbfid,text\n1,caf\xe9\n2,ok row\n3,\"" + b"y" * 200_000 + b"\"\n")
    (src / "d.jsonl").write_text('{"text": "kept"}\n{"text": "bad \\ud83d"}\n')
    m = prepare_corpus([str(src)], str(tmp_path / "out"))
    expected = lines + ["bom first line", "second", "ok row", "y" * 200_000, "kept"]
    assert sorted(documents(tmp_path / "out")) == sorted((t + "\n").encode() for t in expected)
    assert m["counts"]["rows"] == {"ok": len(expected), "undecodable": 2}
    (src / "e.json").write_text(json.dumps([{"text": f"row {i}"} for i in range(3)], indent=1))
    with pytest.raises(ConfigError, match="a JSON array, not JSON lines"):
        prepare_corpus([str(src / "e.json")], str(tmp_path / "array"))
    # a .zst cut short stops as a .gz does (it ended quietly, its last document cut); a BOM before FASTA's first
    # header (its record was lost); csv rows of another width than the header (kept, where the raw path skips them)
    whole = (src / "a.txt.zst").read_bytes()
    (tmp_path / "cut.txt.zst").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=r"unreadable at about row .* \(EOFError: the compressed stream ends"):
        prepare_corpus([str(tmp_path / "cut.txt.zst")], str(tmp_path / "cut"))
    (tmp_path / "bom.fa").write_bytes(b"\xef\xbb\xbf>s1\nMKTAYIAKQR\n>s2\nMKLLVV\n")
    assert prepare_corpus([str(tmp_path / "bom.fa")], str(tmp_path / "fa"), tokenizer="residues")["counts"]["train"][
        "documents"] == 2
    (tmp_path / "ragged.csv").write_text("text,id\nfine,1\nextra row,2,3\nshort row\n\n")
    m = prepare_corpus([str(tmp_path / "ragged.csv")], str(tmp_path / "ragged"))
    assert m["counts"]["rows"] == {"ok": 1, "malformed": 2}


def test_prepare_s_command_line_takes_every_input_and_passes_over_its_own_output(tmp_path):
    """--input given twice keeps both; an --out inside the input directory is not read as input, so the same
    command again does nothing; a first prepare that made nothing can be run again with other settings."""
    src = tmp_path / "in"
    src.mkdir()
    write_corpus(src / "a.txt", lines=100)
    write_corpus(tmp_path / "b.txt", lines=50, seed=1)
    args = ["prepare", "lm", "--input", str(src), "--input", str(tmp_path / "b.txt"), "--out", str(src / "prep"),
            "--val-fraction", "0"]
    first = cli(*args)
    assert first.returncode == 0 and "in 150 documents" in first.stdout, first.stderr[-2000:]
    again = cli(*args)  # it says so, and nothing else changes
    assert again.returncode == 0 and again.stdout == "prepare prep: 2 of 2 unit(s) prepared before, kept; nothing " \
        "left to prepare\n" + first.stdout, again.stdout + again.stderr[-2000:]
    glob_args = ["prepare", "lm", "--input", str(src / "**" / "*.*"), "--out", str(src / "globbed"),
                 "--val-fraction", "0"]  # a glob over the input folder, its corpora included
    globbed = cli(*glob_args)
    assert globbed.returncode == 0 and "in 100 documents" in globbed.stdout, globbed.stderr[-2000:]
    again = cli(*glob_args)
    assert again.returncode == 0 and again.stdout.split("\n", 1)[1] == globbed.stdout, again.stderr[-2000:]
    (tmp_path / "r.jsonl").write_text('{"id": 1}\n{"body": "x y"}\n{"body": "z"}\n')
    wrong = cli("prepare", "lm", "--input", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "r"))
    # the fields of every row read, the commonest first (the first row's alone had been named)
    assert wrong.returncode == 2 and "no row has the field 'text'" in wrong.stderr and \
        wrong.stderr.strip().endswith("fields found: body, id"), wrong.stderr
    right = cli("prepare", "lm", "--input", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "r"),
                "--text-field", "body", "--val-fraction", "0")
    assert right.returncode == 0 and "in 2 documents" in right.stdout and "note:" not in right.stdout, \
        right.stderr[-2000:]
    # validation asked for, none drawn (whole documents are): said at prepare, not first when nothing evaluates
    unheld = cli("prepare", "lm", "--input", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "r2"),
                 "--text-field", "body")
    assert unheld.returncode == 0 and "1 shards (1 train, 0 validation; uint8)" in unheld.stdout and \
        "note: no document was held out for validation" in unheld.stdout, unheld.stdout
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x y"], "n": [1]}), tmp_path / "r.parquet")
    columns = cli("prepare", "lm", "--input", str(tmp_path / "r.parquet"), "--out", str(tmp_path / "rp"),
                  "--text-field", "n")  # a column, not of text
    assert columns.returncode == 2 and columns.stderr.strip().endswith("fields found: body, n"), columns.stderr


def test_a_directory_is_searched_through_its_linked_folders_as_a_glob_is(tmp_path):
    """A folder linked into the input directory was passed over (Path.rglob does not follow links) while a `**` glob
    read it: 400 KB of a user's corpus dropped with "none skipped". A link back up the tree is read once; a link to
    nothing is refused, naming it."""
    import datasets

    from harness.prepare.inputs import expand

    src, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    for folder in (src, elsewhere):
        folder.mkdir()
    (src / "a.txt").write_text("a\n")
    (elsewhere / "b.txt").write_text("b\n")
    (src / "linked").symlink_to(elsewhere)
    assert expand([str(src)]) == [str(src / "a.txt"), str(elsewhere / "b.txt")] == expand([str(src / "**/*.txt")])
    (elsewhere / "back").symlink_to(src)
    assert expand([str(src)]) == [str(src / "a.txt"), str(elsewhere / "b.txt")]
    (src / ".#a.txt").symlink_to("root@host.1234:1700000000")  # an editor's lock: a link to nothing by design
    (src / "notes.md").symlink_to(tmp_path / "elsewhere.md")  # no kind of input
    assert expand([str(src)]) == [str(src / "a.txt"), str(elsewhere / "b.txt")]
    saved = tmp_path / "saved"  # datasets' save_to_disk: its JSON files were read as rows ("no row has the field")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(saved))
    with pytest.raises(ConfigError, match=r"saved is a Hugging Face `save_to_disk` folder; write its rows as parquet"):
        expand([str(saved)])
    (src / "gone.txt").symlink_to(tmp_path / "unmounted.txt")
    with pytest.raises(ConfigError, match=r"gone.txt is a link to nothing .*unmounted.txt\); its data is missing"):
        expand([str(src)])


def test_the_files_of_a_folder_that_no_reader_takes_are_said_not_passed_over_silently(tmp_path, capsys):
    """A folder of .txt and .md notes: one line counts what is not read (the .md), by suffix; a corpus prepared inside
    it (shards, records) and hidden files are not counted."""
    from harness.prepare.inputs import KNOWN, expand

    src = tmp_path / "in"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    for name in ("b.md", "c.md", "d.pdf", ".hidden"):
        (src / name).write_text("x\n")
    prepare_corpus([str(src / "a.txt")], str(src / "prepared"), val_fraction=0.0)
    capsys.readouterr()
    assert expand([str(src)]) == [str(src / "a.txt")]
    assert capsys.readouterr().out == (f"note: --input {src}: 3 file(s) of no kind it reads, not read (.md 2, .pdf 1; "
                                       f"e.g. {src / 'b.md'}); it reads {KNOWN}: rename a text file .txt, or convert "
                                       f"it, to include it\n")
    assert expand([str(src / "a.txt")]) == [str(src / "a.txt")] and capsys.readouterr().out == ""


def test_a_prepare_over_changed_inputs_names_the_files_that_changed(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        write_corpus(src / name, lines=20, seed=len(name))
    prepare_corpus([str(src)], str(tmp_path / "out"), val_fraction=0.0)
    (src / "a.txt").write_text("longer now\n" * 30)
    (src / "b.txt").unlink()
    for name in ("d.txt", "e.txt"):
        (src / name).write_text("new\n")
    with pytest.raises(ConfigError, match=rf"prepared with other inputs \(added {src / 'd.txt'} and 1 more; gone "
                                          rf"{src / 'b.txt'}; resized {src / 'a.txt'}\); use another --out "
                                          rf"\(or delete it\)$"):
        prepare_corpus([str(src)], str(tmp_path / "out"), val_fraction=0.0)
    (src / "b.txt").write_text("back\n")  # files added, none gone or changed: the way to add them without the rest
    prepare_corpus([str(src / "b.txt")], str(tmp_path / "grown"), val_fraction=0.0)
    (src / "c2.txt").write_text("new\n")
    with pytest.raises(ConfigError, match=rf"prepared with other inputs \(added {src / 'c2.txt'}\); use "
                                          r"another --out \(or delete it\); to add the new files without preparing "
                                          r"the others again, prepare them alone into another --out and train on both "
                                          r"with data.mix"):
        prepare_corpus([str(src / "b.txt"), str(src / "c2.txt")], str(tmp_path / "grown"), val_fraction=0.0)


def test_merge_needs_every_part_once_and_a_directory_of_its_own(tmp_path):
    src = write_corpus(tmp_path / "a.txt", lines=300)
    parts = [str(tmp_path / f"p{i}") for i in (1, 2, 3)]
    for i, p in enumerate(parts, 1):  # one unit, three parts: two hold nothing
        prepare_corpus([str(src)], p, part=f"{i}/3")
    with pytest.raises(ConfigError, match=r"units \[0\] of 1 are in none of the parts: prepare --part 1/3 first"):
        merge(parts[1:], str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="--out is this part itself"):
        merge(parts, parts[0])
    other = tmp_path / "other"
    whole = prepare_corpus([str(src)], str(other))
    with pytest.raises(ConfigError, match="exists and is not a merge of parts"):
        merge(parts, str(other))
    merged = merge(parts, str(tmp_path / "m"))
    assert merged["counts"] == whole["counts"] and Corpus(tmp_path / "m").fingerprint == Corpus(other).fingerprint
    assert merge(parts, str(tmp_path / "m")) == merged  # a merge again replaces its own manifest


def test_one_prepare_at_a_time_and_its_workers_die_with_it(tmp_path):
    """A second prepare into an --out that one is writing is refused; a worker busy with a unit when its prepare is
    killed (kill -9) dies with it, instead of writing on into the directory the next prepare continues."""
    import fcntl
    import os
    import signal
    import time

    src = write_corpus(tmp_path / "a.txt", lines=100)
    prepare_corpus([str(src)], str(tmp_path / "out"))
    with open(tmp_path / "out" / "units" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match="another prepare is writing it"):
            prepare_corpus([str(src)], str(tmp_path / "out"))
    code = ("import multiprocessing, os, time\nfrom harness.prepare.corpus import _worker_start\n"
            "pool = multiprocessing.get_context('spawn').Pool(2, initializer=_worker_start, initargs=(os.getpid(),))\n"
            "pool.map(time.sleep, [0] * 8)\npool.map_async(time.sleep, [60, 60], chunksize=1)\n"
            "print(' '.join(str(p.pid) for p in multiprocessing.active_children()), flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert workers, "the pool's workers did not start"
    time.sleep(0.5)  # the sleeps under way
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.1)
    alive = [p for p in workers if _alive(p)]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their prepare"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sets, message", [
    (["data.val_path={bpe}"], "data.val_path = {bpe}: prepared with the tokenizer"),
    (["data.val_path={protein}"], "data.val_path = {protein}: prepared with protein residues"),
    (["data.path={protein}", "data.val_path=\"\""], "data.path = {protein}: prepared with protein residues "
                                                    "(harness prepare protein), a corpus for the protein task's"),
    (["data.path={short}"], "data.path: {short} holds 3 training tokens, not one window"),
    (["data.path={raw}", "data.val_path={bytes}"], "data.val_path = {bytes} is a prepared corpus, and data.path = "
                                                   "{raw} is not"),
    (["data.val_path={short}"], "its training split (what validation reads) holds"),
])
def test_a_corpus_of_other_tokens_or_a_validation_corpus_too_short_is_refused(sets, message, tmp_path, tiny_llama):
    src = write_corpus(tmp_path / "a.txt", lines=200)
    (tmp_path / "s.fasta").write_text(">s1\nMKVLAAGIVG\n>s2\nMKTAYIAKQR\n")
    (tmp_path / "short.txt").write_text("ab\n")
    paths = {"bytes": tmp_path / "bytes", "bpe": tmp_path / "bpe", "protein": tmp_path / "protein",
             "short": tmp_path / "short", "raw": src}
    prepare_corpus([str(src)], str(paths["bytes"]))
    prepare_corpus([str(src)], str(paths["bpe"]), tokenizer=str(tiny_llama))
    prepare_corpus([str(tmp_path / "s.fasta")], str(paths["protein"]), tokenizer="residues")
    prepare_corpus([str(tmp_path / "short.txt")], str(paths["short"]))
    named = {k: json.dumps(str(v)) for k, v in paths.items()}
    args = ["plan", "--set", f"data.path={named['bytes']}", "--set", "data.seq_len=32", "--set",
            "train.max_steps=10"]
    for s in sets:
        args += ["--set", s.format(**named)]
    done = cli(*args)
    assert done.returncode == 2 and message.format(**{k: str(v) for k, v in paths.items()}) in done.stderr, \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_special_tokens_written_in_the_text_are_text(tiny_llama):
    """"[EOS]" written in a document (web and code corpora hold "<|endoftext|>") became the EOS id mid-document: a
    false document boundary the model would learn. It is read as the characters it is, by the corpus's tokenizer and
    by the tokenizer of a run that reads text itself."""
    from transformers import AutoTokenizer

    from harness.models.hf import TextTokenizer
    from harness.prepare.tokenizers import HFTokenizer

    tok = HFTokenizer(str(tiny_llama))
    ids, ends = tok.encode(["the [EOS] cat", "[PAD] dog"])
    eos, pad = tok.tok.eos_token_id, tok.tok.pad_token_id
    assert [i for i, x in enumerate(ids) if x == eos] == [e - 1 for e in ends] and pad not in ids.tolist()
    assert eos not in TextTokenizer(AutoTokenizer.from_pretrained(tiny_llama)).encode("the [EOS] cat")


def test_a_worker_killed_from_outside_stops_the_prepare_in_one_line(tmp_path, tiny_llama):
    """The OOM killer (here kill -9) takes a worker mid-unit: multiprocessing.Pool replaced it and waited for its unit
    for ever. Now one line, exit 2; the same command again finishes the corpus."""
    import os
    import signal
    import time

    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        write_corpus(src / f"{i}.txt", lines=60_000, seed=i)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "harness", "prepare", "lm", "--input", str(src), "--out", str(out), "--tokenizer",
            str(tiny_llama), "--workers", "2"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, deadline = None, time.monotonic() + 120
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        for partial in out.glob("*.tmp"):  # NAME.PID.tmp: the worker writing it
            pid = int(partial.name.split(".")[-2])
            if pid != proc.pid:
                os.kill(pid, signal.SIGKILL)
                killed = pid
                break
        time.sleep(0.05)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert killed and proc.returncode == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("harness: error: a worker of the prepare died"), err[-2000:]
    assert "Traceback" not in err
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert Corpus(out).documents() + Corpus(out).documents("validation") == 180_000


def test_a_long_unit_moves_the_progress_by_the_bytes_of_its_file_it_has_read(tmp_path):
    """The bar had moved only as a unit ended (up to 64 MB, a compressed file whole: a 5 GB .jsonl.gz stood at 0% for
    the hour it took): each read of the file on disk is counted, a compressed file's by its compressed bytes, and the
    documents read are the same as without the count."""
    import bz2
    import lzma
    from collections import Counter

    from harness.prepare.inputs import plan_units
    from harness.prepare.readers import documents

    text = "".join(f"line {i} of a long unit, {'x' * (i % 50)}\n" for i in range(40_000)).encode()
    files = {"plain.txt": text, "plain.txt.gz": gzip.compress(text), "plain.txt.bz2": bz2.compress(text),
             "plain.txt.xz": lzma.compress(text)}
    want = None
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        unit, = plan_units([str(tmp_path / name)])
        seen: list[int] = []
        got = [d for block in documents(unit, "text", Counter(), seen.append) for d in block]
        want = want or [d for block in documents(unit, "text", Counter()) for d in block]
        assert got == want and sum(seen) == len(data), (name, len(seen), sum(seen), len(data))
        assert len(seen) > 1 or name == "plain.txt", name  # (plain text: read 16 MB at a time, this one in one)
    # a file cut into byte ranges: each unit counts its range's bytes at least (its last line runs past it)
    units = plan_units([str(tmp_path / "plain.txt")], unit_bytes=len(text) // 3)
    assert len(units) >= 3
    for unit in units:
        seen = []
        for _ in documents(unit, "text", Counter(), seen.append):
            pass
        assert sum(seen) >= unit.end - unit.start, unit
