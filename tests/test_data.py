"""Data rules: malformed rows are skipped or truncated by the stated rule and counted, never a crash."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import harness
from harness.config import ConfigError, DataSection
from harness.data import keep, load_rows


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


def test_json_data_with_a_separate_validation_file_and_loader_workers(tmp_path, corpus):
    lines = corpus.read_text().splitlines()
    for name, part in (("train.jsonl", lines[:1200]), ("val.jsonl", lines[1200:])):
        (tmp_path / name).write_text("".join(json.dumps({"body": t}) + "\n" for t in part))
    run = harness(tmp_path / "run", tmp_path / "train.jsonl", sets=[
        "train.max_steps=2", "data.format=\"json\"", "data.text_field=\"body\"", "data.num_workers=1",
        f"data.val_path={json.dumps(str(tmp_path / 'val.jsonl'))}"])
    assert "train: 1200 rows kept of 1200" in run.proc.stdout and "validation: 300 rows kept of 300" in run.proc.stdout
    assert run.evals[-1]["step"] == 2
