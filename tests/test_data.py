"""Data rules: malformed rows are skipped or truncated by the stated rule and counted, never a crash."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import harness
from harness.config.run import ConfigError, DataSection
from harness.data.rows import keep, load_rows


def test_text_rows_empty_undecodable_and_overlong_are_counted(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_bytes(b"good row\n\n   \nbad \xff\xfe bytes\n" + b"x" * 50 + b"\nlast\n")
    rows = load_rows(str(path), DataSection(max_row_chars=20))
    assert Counter(rows["status"]) == Counter(ok=2, empty=2, undecodable=1, truncated=1)
    kept = keep(rows)["text"]
    assert kept == ["good row", "x" * 20, "last"]


def test_json_rows_with_missing_or_wrong_field_are_malformed(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"body": "fine"}, {"body": None}, {"other": "x"},
                                                       {"body": ""}]) + "\n")
    rows = load_rows(str(path), DataSection(text_field="body"))
    assert Counter(rows["status"]) == Counter(ok=1, malformed=2, empty=1)


def test_csv_without_the_text_column_is_a_clear_error(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="no column 'text'"):
        load_rows(str(path), DataSection())


def test_training_reports_the_cleaning_summary(tmp_path, corpus):
    dirty = tmp_path / "dirty.txt"
    dirty.write_bytes(corpus.read_bytes() + b"\n\n\xff\xff\n" + b"y" * 30000 + b"\n")
    run = harness(tmp_path / "run", dirty, sets=["train.max_steps=1", "data.val_fraction=0.0"])
    assert "2 empty, 1 undecodable" in run.proc.stdout and "1 truncated" in run.proc.stdout
    # nothing held out: no evaluation, said; selecting by it refused before the first step, not after training
    assert "note: the validation split holds nothing to evaluate: no evaluation runs; data.val_path or " \
           "data.val_fraction gives one" in run.proc.stdout and not (run.dir / "eval.jsonl").exists()
    refused = harness(tmp_path / "select", dirty, sets=["train.max_steps=1", "data.val_fraction=0.0",
                                                        'train.select_best="loss"'], check=False)
    assert refused.proc.returncode == 2 and not refused.metrics, refused.proc.stderr[-2000:]
    assert refused.proc.stderr.strip().splitlines()[-1] == (
        "harness: error: train.select_best = 'loss' selects by the validation split, which holds nothing to evaluate: "
        "give one (data.val_path or data.val_fraction), or leave train.select_best out")


def test_json_data_with_a_separate_validation_file_and_loader_workers(tmp_path, corpus):
    lines = corpus.read_text().splitlines()
    for name, part in (("train.jsonl", lines[:1200]), ("val.jsonl", lines[1200:])):
        (tmp_path / name).write_text("".join(json.dumps({"body": t}) + "\n" for t in part))
    run = harness(tmp_path / "run", tmp_path / "train.jsonl", sets=[
        "train.max_steps=2", "data.format=\"json\"", "data.text_field=\"body\"", "data.num_workers=1",
        f"data.val_path={json.dumps(str(tmp_path / 'val.jsonl'))}"])
    assert "train: 1200 rows kept of 1200" in run.proc.stdout and "validation: 300 rows kept of 300" in run.proc.stdout
    assert run.evals[-1]["step"] == 2


def test_bad_lines_in_json_lines_and_csv_are_skipped_and_counted_not_the_whole_file(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b'{"text": "good one"}\n{"text": "bad \xff\xfe bytes"}\n{not json at all\n{"other": 1}\n'
                      b'{"text": 5}\n\n{"text": "good two"}\n')
    rows = load_rows(str(jsonl), DataSection())
    assert rows["status"] == ["ok", "undecodable", "malformed", "malformed", "malformed", "ok"]
    assert keep(rows)["text"] == ["good one", "good two"]
    table = tmp_path / "rows.tsv"  # tab-separated, by its suffix
    table.write_bytes(b"text\tlabel\nhello\t1\n\xff bad\t2\ntoo\tmany\tfields\nfine\t3\n")
    assert load_rows(str(table), DataSection())["status"] == ["ok", "undecodable", "malformed", "ok"]
    array = tmp_path / "rows.json"
    array.write_text('[{"text": "a"}, {"text": "b"},\n {"text": ]')
    with pytest.raises(ConfigError, match="malformed JSON array at line 2"):
        load_rows(str(array), DataSection())
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text('{"body": "x"}\n{"title": "y"}\n')
    with pytest.raises(ConfigError, match="none of its 2 records has a text 'text' field.*fields found: body, title"):
        load_rows(str(nothing), DataSection())
    ragged = tmp_path / "ragged.csv"  # the column is there; no row has the header's length (it said columns: [])
    ragged.write_text("text,label\na, b, 1\nc, d, 0\n")
    with pytest.raises(ConfigError, match=r"none of its 2 rows has as many fields as its header \(another delimiter"):
        load_rows(str(ragged), DataSection())


@pytest.mark.parametrize("name, content, message", [
    ("empty.txt", b"", "the file is empty (0 bytes of text data)"),
    ("blank.jsonl", b"  \n\n\t\n", "holds only whitespace (6 characters), no json rows"),
    ("header.csv", b"text,label\n", "only a header (text, label), no rows"),
    ("columns.csv", b"body,label\nx,1\n", "no column 'text' (data.text_field) in its header; columns are"),
])
def test_an_unusable_data_file_is_named_before_launch(tmp_path, name, content, message):
    from harness.data.rows import check_paths

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        check_paths(DataSection(path=str(path)))
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value)


def test_a_prepare_stopped_before_its_end_is_named_as_such(tmp_path):
    """Its folder has shards and unit records but no manifest: it was called a directory to prepare with --input,
    which then matched no file (the prepare's own output is passed over)."""
    from harness.data.rows import check_paths

    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "settings.json").write_text("{}")
    (tmp_path / "train-000000.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"was stopped before it ended \(no manifest.json\): run the same prepare "):
        check_paths(DataSection(path=str(tmp_path)))


def test_records_keep_a_bom_out_of_the_header_line_separators_in_strings_and_long_fields_whole(tmp_path):
    from harness.data.rows import parse_records

    table = tmp_path / "excel.csv"  # Excel's "CSV UTF-8" starts with a byte-order mark
    table.write_bytes("\ufefftext,label\n".encode() + b"x" * 200_000 + b",1\n")
    assert parse_records(str(table), "csv") == [{"text": "x" * 200_000, "label": "1"}]
    lines = tmp_path / "rows.jsonl"  # json.dumps(ensure_ascii=False) writes U+2028 raw inside a string
    lines.write_text(json.dumps({"text": "one\u2028two"}, ensure_ascii=False) + "\n" + json.dumps({"text": "b"}) + "\n")
    assert parse_records(str(lines), "json") == [{"text": "one\u2028two"}, {"text": "b"}]
    quoted = tmp_path / "pairs.tsv"  # csv quoting in a tsv, as pandas writes it; or quotes as text (sentence pairs)
    quoted.write_text('text\tlabel\n"He said ""hi"""\t1\n')
    assert parse_records(str(quoted), "csv") == [{"text": 'He said "hi"', "label": "1"}]
    assert parse_records(str(quoted), "csv", tsv_quotes=False) == [{"text": '"He said ""hi"""', "label": "1"}]


def test_the_held_out_rows_are_the_same_for_every_train_seed(corpus, monkeypatch, tmp_path):
    """A seeds study scores each seed on the validation set: one set (it had been drawn with train.seed)."""
    import torch

    from harness.tasks import get_task, resolve

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    task = get_task("lm")
    val = [task.build_data(resolve(None, ["train.max_steps=1", f"data.path={json.dumps(str(corpus))}",
                                          f"train.seed={seed}"]).cfg).val for seed in (0, 1)]
    assert len(val[0]) == len(val[1]) > 0
    assert all(torch.equal(torch.as_tensor(a["ids"] if isinstance(a, dict) else a),
                           torch.as_tensor(b["ids"] if isinstance(b, dict) else b)) for a, b in zip(val[0], val[1]))


def test_a_large_raw_file_is_said_before_it_is_tokenized(corpus, monkeypatch, tmp_path, capsys):
    """A raw text file of tens of MB takes seconds to tokenize at every start, before the start line: said as it
    starts (it had said nothing until 100 MB, and then only once done); a small one is not."""
    from harness.tasks import get_task, lm, resolve

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = resolve(None, ["train.max_steps=1", f"data.path={json.dumps(str(corpus))}"]).cfg
    get_task("lm").build_data(cfg)
    assert "data: tokenizing" not in capsys.readouterr().out
    monkeypatch.setattr(lm, "SAID_RAW_BYTES", corpus.stat().st_size - 1)  # the corpus made "large"
    get_task("lm").build_data(cfg)
    assert f"data: tokenizing 0 MB of {corpus} (at every start of a raw file)" in capsys.readouterr().out
