"""Reading the protein sources into rows: {split: [(sequence, label, resolved, parse_status)]}, not yet cleaned.

Sources (`data.path`):
- empty: the embedded default, modlamp's `data/AMPvsUniProt.csv`: 2,600 antimicrobial peptides (label 1) and
  2,600 random UniProt sequences (label 0). Its first line, "5200,1,UniProt,AMP", is a count (rows, features,
  class names), not a header; the rows are "SEQUENCE, LABEL".
- a directory such as `../shared/data/flip_ss`: FLIP's `splits.zip` (or its files unpacked) with
  `sequences.fasta`, `sampled.fasta` (one C/H/E state per residue; header `SET=train|test VALIDATION=True|False`)
  and `mask.fasta` (1 = resolved residue). Validation is `VALIDATION=True` within the training set.
- a user's .csv/.tsv/.jsonl file (columns `protein.sequence_field`, `protein.label_field`; a csv may also use
  the count-line layout above) or .fasta file (`>name label=VALUE`); validation from `data.val_path` or held out.
  A FLIP-format csv (`sequence,target,set,validation`, e.g. `../shared/data/flip_gb1/sampled.csv.gz`) keeps its
  splits: `set` = train/test, and `validation` = True marks the train rows FLIP reserves for validation. A csv's
  label is `target` (FLIP's column, in new data to score too) unless `protein.label_field` names a column it has.
- `hub:NAME`: a Hugging Face data set with those two columns; its train/validation/test splits are used.
Rows that cannot be parsed (a csv row with the wrong number of fields, a jsonl line that is not an object)
come back with parse_status "malformed" and are counted by `protein.clean`; text files are read whole
(`data.rows.read_lines`: gzip handled, a byte-order mark dropped), FLIP's zip archive through `zipfile`.
"""
from __future__ import annotations

import csv
import json
import zipfile
from pathlib import Path
from typing import Any

from ..config.run import ConfigError, RunConfig
from ..data.rows import read_lines
from . import package_file

SPLITS = ("train", "validation", "test")
DEFAULT = ("modlamp", "data/AMPvsUniProt.csv")
DEFAULT_CLASS_NAMES = {"0": "UniProt (random)", "1": "antimicrobial peptide"}
FLIP_FILES = ("sequences.fasta", "sampled.fasta", "mask.fasta")
FASTA_SUFFIXES = (".fasta", ".fa", ".faa")
TRUE = ("true", "1")  # a FLIP validation flag as R or pandas may write it ("TRUE", "True", "1")
Row = tuple  # (sequence, label, resolved, parse_status: "" or "malformed")


def source_kind(path: str) -> str:
    if not path:
        return "default"
    if path.startswith("hub:"):
        return "hub"
    return "flip" if Path(path).is_dir() else "file"


def read_source(cfg: RunConfig) -> tuple[dict[str, list[Row]], dict[str, Any]]:
    d, p = cfg.data, cfg.task
    kind, info = source_kind(d.path), {}
    if kind == "default":
        rows, info = _read_csv(package_file(*DEFAULT), p.sequence_field, p.label_field, count_line=True)
        info["class_names"] = DEFAULT_CLASS_NAMES
        splits = {"all": rows}
    elif kind == "flip":
        splits = _read_flip(Path(d.path))
    elif kind == "hub":
        splits = _read_hub(d.path[4:], p.sequence_field, p.label_field, labelled=p.objective != "mlm")
    else:
        rows, info = _read_file(d.path, cfg)
        sets = info.pop("sets", None)
        splits = {"all": rows} if sets is None else {s: [r for r, x in zip(rows, sets) if x == s] for s in SPLITS
                                                     if s in sets}  # no validation rows: held out from train
    if d.val_path:
        splits["validation"] = _read_file(d.val_path, cfg)[0]
    return splits, info


def _lines(path: Path) -> list[str]:
    """A text file's lines (gzipped or not; a byte-order mark dropped). Undecodable bytes become U+FFFD: outside the
    residue alphabet, or not a number, so their row is skipped and counted as malformed."""
    return read_lines(path)


def file_format(path: str) -> str:
    name = path.lower().removesuffix(".gz")
    for fmt, suffixes in (("csv", (".csv",)), ("tsv", (".tsv",)), ("jsonl", (".jsonl", ".json")),
                          ("fasta", FASTA_SUFFIXES)):
        if name.endswith(suffixes):
            return fmt
    raise ConfigError(f"{path}: protein data must be .csv, .tsv, .jsonl/.json (one object a line) or .fasta")


def _read_file(path: str, cfg: RunConfig) -> tuple[list[Row], dict[str, Any]]:
    p, fmt = cfg.task, file_format(path)
    labelled = p.objective != "mlm"
    if fmt in ("csv", "tsv"):
        return _read_csv(Path(path), p.sequence_field, p.label_field, delimiter="\t" if fmt == "tsv" else ",",
                         labelled=labelled)
    if fmt == "fasta":
        rows = [(seq, fields.get(p.label_field), None, "") for _, fields, seq in _fasta(_lines(Path(path)))]
        if labelled and rows and all(r[1] is None for r in rows):
            raise ConfigError(f"{path}: no header holds {p.label_field}=VALUE (protein.label_field), which "
                              f"protein.objective = {p.objective!r} needs")
        return rows, {}
    rows = []
    for line in _lines(Path(path)):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append((obj.get(p.sequence_field), obj.get(p.label_field), obj.get("resolved"), ""))
        except (json.JSONDecodeError, AttributeError):
            rows.append((None, None, None, "malformed"))
    if labelled and any(r[3] == "" for r in rows) and all(r[1] is None for r in rows):
        raise ConfigError(f"{path}: no line has the field {p.label_field!r} (protein.label_field), which "
                          f"protein.objective = {p.objective!r} needs")
    return rows, {}


def _read_csv(path: Path, seq_field: str, label_field: str, delimiter: str = ",",
              count_line: bool = False, labelled: bool = False) -> tuple[list[Row], dict[str, Any]]:
    """A header line naming the columns, or modlamp's count line "N,FEATURES,CLASS0,CLASS1" then "SEQ, LABEL" rows.
    `labelled`: the objective needs a label, so a header without its column is refused."""
    lines = [line for line in _lines(path) if line.strip()]
    if not lines:
        return [], {}
    parsed = list(csv.reader(lines, delimiter=delimiter, skipinitialspace=True))
    head, body = parsed[0], parsed[1:]
    info: dict[str, Any] = {}
    if count_line or (seq_field not in head and head and head[0].strip().isdigit()):
        if not head or not head[0].strip().isdigit():
            raise ConfigError(f"{path}: the first line {lines[0]!r} is not modlamp's count line 'N,FEATURES,...'")
        if int(head[0]) != len(body):
            raise ConfigError(f"{path}: its first line announces {head[0]} rows but {len(body)} follow; "
                              f"is the file cut short?")
        info["first_line"] = {"rows": int(head[0]), "names": head[2:]}
        return [(r[0], r[1], None, "") if len(r) == 2 else (None, None, None, "malformed") for r in body], info
    if seq_field not in head:
        raise ConfigError(f"{path}: no column {seq_field!r} (protein.sequence_field); the header is {head}")
    flip = {"set", "target"} <= set(head)
    if "target" in head and label_field not in head:  # FLIP's name for the label, in its splits or in new data
        label_field = "target"
    if labelled and label_field not in head:
        raise ConfigError(f"{path}: no column {label_field!r} (protein.label_field), which the objective needs; "
                          f"the header is {head}")
    si, li = head.index(seq_field), head.index(label_field) if label_field in head else None
    ri = head.index("resolved") if "resolved" in head else None
    rows = [(r[si], r[li] if li is not None else None, r[ri] if ri is not None else None, "")
            if len(r) == len(head) else (None, None, None, "malformed") for r in body]
    if flip:  # FLIP's layout: its own train/validation/test (a row that cannot be parsed counts under train)
        seti, vi = head.index("set"), head.index("validation") if "validation" in head else None
        info["sets"] = ["test" if len(r) == len(head) and r[seti].strip().lower() == "test" else
                        "validation" if len(r) == len(head) and vi is not None and r[vi].strip().lower() in TRUE else
                        "train" for r in body]
    return rows, info


def _fasta(lines) -> list[tuple[str, dict[str, str], str]]:
    """(name, {key: value} from the header's KEY=VALUE words, sequence) per record. Text before the first header
    is one record without a name or sequence (None, {}, None): malformed and counted, not dropped unseen."""
    records, name, fields, seq = [], None, {}, []
    for line in lines:
        line = line.strip()
        if line and name is None and not line.startswith(">") and not records:
            records.append((None, {}, None))
        if line.startswith(">"):
            if name is not None:
                records.append((name, fields, "".join(seq)))
            words = line[1:].split()
            name, fields, seq = (words[0] if words else ""), dict(w.split("=", 1) for w in words[1:] if "=" in w), []
        elif line and name is not None:
            seq.append(line)
    if name is not None:
        records.append((name, fields, "".join(seq)))
    return records


def _flip_lines(directory: Path, name: str) -> list[str] | None:
    """A FLIP file's lines, from splits.zip (any folder inside it) or unpacked in `directory`; None if absent."""
    archive = directory / "splits.zip"
    if archive.is_file():
        with zipfile.ZipFile(archive) as z:
            found = [n for n in z.namelist() if Path(n).name == name]
            return z.read(found[0]).decode("utf-8-sig").splitlines() if found else None
    return _lines(directory / name) if (directory / name).is_file() else None


def check_flip(directory: Path) -> None:
    archive = directory / "splits.zip"
    if archive.is_file():
        with zipfile.ZipFile(archive) as z:
            names = {Path(n).name for n in z.namelist()}
    else:
        names = {f.name for f in directory.iterdir()}
    if not set(FLIP_FILES[:2]) <= names:
        raise ConfigError(f"{directory}: expected FLIP's splits.zip (or its files) with {', '.join(FLIP_FILES)}")


def _read_flip(directory: Path) -> dict[str, list[Row]]:
    seqs = {name: s for name, _, s in _fasta(_flip_lines(directory, "sequences.fasta"))}
    masks = {name: s for name, _, s in _fasta(_flip_lines(directory, "mask.fasta") or [])}
    splits: dict[str, list[Row]] = {s: [] for s in SPLITS}
    for name, fields, states in _fasta(_flip_lines(directory, "sampled.fasta")):
        split = "test" if fields.get("SET") == "test" else \
            "validation" if fields.get("VALIDATION", "").lower() in TRUE else "train"
        seq = seqs.get(name)
        splits[split].append((seq, states, masks.get(name), "" if seq is not None else "malformed"))
    return splits


def _read_hub(name: str, seq_field: str, label_field: str, labelled: bool = False) -> dict[str, list[Row]]:
    import datasets

    try:
        dd = datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001 - the hub raises many kinds; all mean "cannot use this name"
        raise ConfigError(f"hub:{name}: cannot load: {str(e).splitlines()[0]}") from None
    aliases = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
    splits = {}
    for split, names in aliases.items():
        found = next((n for n in names if n in dd), None)
        if found:
            ds = dd[found]
            if seq_field not in ds.column_names:
                raise ConfigError(f"hub:{name}: no column {seq_field!r}; columns are {ds.column_names}")
            if labelled and label_field not in ds.column_names:
                raise ConfigError(f"hub:{name}: no column {label_field!r} (protein.label_field), which the objective "
                                  f"needs; columns are {ds.column_names}")
            labels = ds[label_field] if label_field in ds.column_names else [None] * len(ds)
            splits[split] = [(s, lab, None, "") for s, lab in zip(ds[seq_field], labels)]
    if "train" not in splits:
        raise ConfigError(f"hub:{name}: no train split; it has {list(dd)}")
    return splits


def read_scored(path: Path, cfg: RunConfig) -> tuple[list[Row], int, list[Path]]:
    """New data for `harness evaluate --data`: (the rows to score, the rows not scored, the files read). A FLIP
    directory or a FLIP-format csv gives its test rows (the benchmark's test set), any other file every row."""
    if path.is_dir():
        check_flip(path)
        splits = _read_flip(path)
        files = [path / "splits.zip"] if (path / "splits.zip").is_file() else \
            [path / n for n in FLIP_FILES if (path / n).is_file()]
        return splits["test"], len(splits["train"]) + len(splits["validation"]), files
    if not path.is_file():
        raise ConfigError(f"{path}: not found")
    rows, info = _read_file(str(path), cfg)
    sets = info.get("sets")
    if sets is None:
        return rows, 0, [path]
    return [r for r, x in zip(rows, sets) if x == "test"], sum(x != "test" for x in sets), [path]
