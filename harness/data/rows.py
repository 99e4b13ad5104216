"""Reading rows through Hugging Face `datasets` and cleaning them by stated rules (batches: `batches.py`).

Cleaning rules (counted, reported at the start of training, never a crash mid-run):
- empty or whitespace-only rows are skipped;
- rows that are not valid UTF-8 (text files) are skipped;
- rows whose text field is missing or not a string (json/csv) are skipped;
- rows longer than `data.max_row_chars` characters are truncated to it.
"""
from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..config.run import ConfigError, DataSection

SUFFIX_FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv"}
PEEK = 1 << 16  # bytes read before launch to judge a data file: empty, only whitespace, only a header
# Row statuses kept; "whole": a protein evaluation chain longer than data.seq_len, scored in windows; "off_site": a
# protein differing from the training sequences outside the sites the model reads (prepare.protein)
KEPT = ("ok", "truncated", "whole", "off_site")


# pandas' default NA strings: a csv is read as text (`parse_records`), and these stay "missing" as they were (a
# price, a protein's class label)
NA_STRINGS = {"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
              "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}

@dataclass
class DataSummary:
    counts: dict[str, Counter] = field(default_factory=dict)  # split -> status -> rows

    @classmethod
    def of(cls, **splits) -> "DataSummary":
        """From `load_rows` outputs, by split name."""
        return cls({name: Counter(rows["status"]) for name, rows in splits.items()})

    def line(self) -> str:
        parts = []
        for split, c in self.counts.items():
            dropped = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in c.items() if s not in KEPT and n)
            notes = f", {c['whole']} longer than data.seq_len kept whole (scored in windows)" if c["whole"] else ""
            notes += f", {c['off_site']} differing outside protein.sites (unseen)" if c["off_site"] else ""
            parts.append(f"{split}: {sum(c[s] for s in KEPT)} rows kept of {sum(c.values())}"
                         f" ({dropped or 'none skipped'}; {c['truncated']} truncated{notes})")
        return "data " + "; ".join(parts)


def data_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = Path(path.lower().removesuffix(".gz")).suffix
    kind = SUFFIX_FORMATS.get(suffix)
    if suffix == ".parquet":  # this reader takes text, json and csv; prepare reads parquet, by row group
        plain = path[:-3] if path.lower().endswith(".gz") else path
        unzip = f"decompress it to {plain}, then " if plain != path else ""
        raise ConfigError(f"{path}: raw parquet is read only by `harness prepare lm`: prepare it once ({unzip}harness "
                          f"prepare lm --input {plain} --out DIR) and name DIR instead")
    if kind is None:
        raise ConfigError(f"{path}: cannot tell the format from the file name; set data.format to text, json or csv")
    return kind


def check_paths(d: DataSection) -> None:
    """Preflight: local data files exist and are readable (hub names are checked when loaded)."""
    files = [p for p in (d.path, d.val_path) if p and Path(p).is_file()]
    if files and d.text_field != "text" and all(data_format(p, d.format) == "text" for p in files):
        raise ConfigError(f"data.text_field = {d.text_field!r} names a field of json or csv rows, and {files[0]} is "
                          f"read as plain text (each line a row); drop it, or set data.format if the file is json or "
                          f"csv")
    for key, path in (("data.path", d.path), ("data.val_path", d.val_path)):
        if path and not path.startswith("hub:"):
            p = Path(path)
            if p.is_dir() and (p / "units" / "settings.json").is_file() and not (p / "manifest.json").is_file():
                raise ConfigError(f"{path}: {key} is a `harness prepare lm` output that was stopped before it ended "
                                  f"(no manifest.json): run the same prepare command again, which finishes it")
            if p.is_dir() and key == "data.val_path" and (p / "manifest.json").is_file():
                train = d.path or "(the embedded default)"
                raise ConfigError(f"data.val_path = {path} is a prepared corpus, and data.path = {train} is not: a "
                                  f"prepared validation corpus goes with a prepared data.path (harness prepare lm "
                                  f"--input {d.path or 'FILES'} --out DIR)")
            if p.is_dir():  # the lm task reads one file (the case studies read their own directory layouts)
                files = sorted(f.name for f in p.iterdir() if f.is_file())[:3]
                raise ConfigError(f"{path}: {key} is a directory ({', '.join(files) or 'empty'}"
                                  f"{', ...' if len(files) == 3 else ''}); name one file of text, json or csv, "
                                  f"or for the lm prepare them once: harness prepare lm --input {path} --out DIR")
            if not p.is_file():
                raise ConfigError(f"{path}: {key} not found")
            try:
                head, whole = _peek(path)
            except (OSError, EOFError) as e:  # EOFError: a .gz cut short
                raise ConfigError(f"{path}: {key} is not readable: {e}") from None
            kind = data_format(path, d.format)
            _check_not_empty(path, head, whole, kind)
            if kind == "csv":
                header, *rows = [line for line in head.splitlines() if line.strip()]
                columns = next(csv.reader([header], delimiter=_delimiter(path)))
                if d.text_field not in columns:
                    raise ConfigError(f"{path}: no column {d.text_field!r} (data.text_field) in its header; columns "
                                      f"are {columns}")
                if whole and not rows:
                    raise ConfigError(f"{path}: only a header ({', '.join(columns)}), no rows")
            if kind == "json":
                _check_json_field(path, head, whole, d.text_field)
            if key == "data.path" and whole and d.val_fraction and not d.val_path:
                _check_split(path, head, kind, d.val_fraction)


def _check_json_field(path: str, head: str, whole: bool, field_name: str) -> None:
    """Before launch: some record carries the text field (JSON lines are read until one does; one JSON array of
    records only if the file was read whole)."""
    if whole:
        read_records(path, "json", field_name)  # refuses a file where no record has it, naming the fields found
        return
    if head.lstrip().startswith("["):
        return
    opener = gzip.open if path.endswith(".gz") else open
    keys, records = set(), 0
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                if field_name in record:
                    return
                keys.update(record)
                records += 1
    if records:
        raise ConfigError(f"{path}: none of its {records} records has a text {field_name!r} field "
                          f"(data.text_field); fields found: {', '.join(sorted(keys))}")


def _check_split(path: str, head: str, kind: str, fraction: float) -> None:
    """Before launch, for a file read whole: its rows counted as `load_rows` reads them."""
    check_split(path, len(parse_records(path, kind)) if kind != "text" else
                sum(1 for line in head.splitlines() if line.strip()), fraction)


def check_split(path: str, rows: int, fraction: float) -> None:
    """A file of one row leaves no training row once data.val_fraction is held out (a split of it would fail)."""
    if rows < 2:
        raise ConfigError(f"{path}: data.path holds {rows} row{'s' * (rows != 1)}: holding out data.val_fraction = "
                          f"{fraction:g} for validation leaves none to train on; use more data, name data.val_path, "
                          f"or set data.val_fraction = 0")


def _peek(path: str) -> tuple[str, bool]:
    """The first PEEK bytes of a file as text (gzip too; undecodable bytes as U+FFFD), and whether that is all."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(PEEK + 1)
    return head[:PEEK].decode("utf-8", errors="replace"), len(head) <= PEEK


def _check_not_empty(path: str, head: str, whole: bool, kind: str) -> None:
    if not head:
        raise ConfigError(f"{path}: the file is empty (0 bytes of {kind} data)")
    if whole and not head.strip():
        raise ConfigError(f"{path}: the file holds only whitespace ({len(head)} characters), no {kind} rows")


def _delimiter(path: str) -> str:
    return "\t" if Path(path.lower().removesuffix(".gz")).suffix == ".tsv" else ","


def load_rows(path: str, d: DataSection, split: str = "train"):
    """A `datasets.Dataset` with one cleaned `text` column and a `status` column (see the rules above)."""
    import datasets

    kind = "hub" if path.startswith("hub:") else data_format(path, d.format)
    try:
        if kind == "hub":
            ds = datasets.load_dataset(path[4:], split=split)
        elif kind == "text":  # undecodable bytes become U+FFFD and the row is skipped below, instead of a crash
            ds = datasets.load_dataset(kind, data_files=path, split="train", encoding_errors="replace")
        else:  # json lines and csv read here, line by line: a bad line is one skipped row, not a refused file
            ds = datasets.Dataset.from_dict({d.text_field: read_records(path, kind, d.text_field)})
    except (ValueError, OSError, EOFError, datasets.exceptions.DatasetGenerationError) as e:
        raise ConfigError(f"{path}: cannot load as {kind} data: {str(e).splitlines()[0]}") from None
    column = "text" if kind == "text" else d.text_field
    if column not in ds.column_names:
        raise ConfigError(f"{path}: no column {column!r} (data.text_field); columns are {ds.column_names}")
    limit = d.max_row_chars

    def clean(batch):
        texts, status = [], []
        for t in batch[column]:
            if not isinstance(t, str):
                texts.append(""), status.append("malformed")
            elif "\ufffd" in t:
                texts.append(""), status.append("undecodable")
            elif not t.strip():
                texts.append(""), status.append("empty")
            elif len(t) > limit:
                texts.append(t[:limit]), status.append("truncated")
            else:
                texts.append(t), status.append("ok")
        return {"text": texts, "status": status}

    return ds.map(clean, batched=True, remove_columns=ds.column_names, desc="cleaning rows")


MALFORMED = None  # a record that does not parse, or lacks the field: counted "malformed" by load_rows


@contextlib.contextmanager
def _reading(path: str | Path):
    """A text file, gzipped or not, as text: undecodable bytes become U+FFFD (their row is skipped and counted by the
    caller), a byte-order mark is dropped, line ends are kept as they are; a file that cannot be read is one line."""
    try:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
            yield io.TextIOWrapper(f, encoding="utf-8-sig", errors="replace", newline="")
    except (OSError, EOFError, zlib.error) as e:  # gzip's BadGzipFile is an OSError; a cut gzip stream EOFError
        raise ConfigError(f"{path}: cannot read{' as gzip' if str(path).endswith('.gz') else ''}: {e}") from None


def read_text(path: str | Path) -> str:
    with _reading(path) as f:
        return f.read()


def read_lines(path: str | Path) -> list[str]:
    """The lines of a text file (`_reading`), split on line breaks alone (LF, CRLF, CR), read as they stream: a
    U+2028 or form feed inside a sentence is text, so line-aligned files stay aligned. An empty file has none."""
    with _reading(path) as f:
        return [line.rstrip("\r\n") for line in f]


def parse_records(path: str, kind: str, tsv_quotes: bool = True) -> list:
    """Every record of a json (an array, or JSON lines) or csv/tsv file, in order: a dict, or MALFORMED for a line
    that does not parse (a csv row whose length differs from the header's). Undecodable bytes stay as U+FFFD; a
    byte-order mark is dropped. `tsv_quotes=False`: a quote in a tsv is text (sentence pairs), not csv quoting."""
    text = read_text(path)
    if kind == "json":
        if text.lstrip().startswith("["):  # one JSON array of records
            try:
                records = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: malformed JSON array at line {e.lineno}, column {e.colno}: {e.msg}") \
                    from None
        else:  # JSON lines: split on newlines only (a raw U+2028 inside a string is text, not a line break)
            records = []
            for line in text.split("\n"):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        records.append(MALFORMED)
        return [r if isinstance(r, dict) else MALFORMED for r in records]
    tsv = _delimiter(path) == "\t"
    csv.field_size_limit(2**31 - 1)  # a long document in one field is a row, not an error
    reader = csv.reader(io.StringIO(text), delimiter="\t" if tsv else ",",
                        quoting=csv.QUOTE_NONE if tsv and not tsv_quotes else csv.QUOTE_MINIMAL)
    try:
        header = next(reader, [])
        return [dict(zip(header, row)) if len(row) == len(header) else MALFORMED for row in reader if row]
    except csv.Error as e:
        raise ConfigError(f"{path}: cannot read as {'tsv' if tsv else 'csv'} at line {reader.line_num}: {e}") from None


def read_records(path: str, kind: str, field_name: str) -> list:
    """The `field_name` value of every record of `parse_records`, in order. A record that does not parse, or lacks
    the field, gives MALFORMED; undecodable bytes stay as U+FFFD; both are skipped and counted by `load_rows`. A
    file where no record has the field is refused, naming the fields found."""
    records = parse_records(path, kind)
    values = [r.get(field_name) if r is not MALFORMED else MALFORMED for r in records]
    values = [v if isinstance(v, str) else MALFORMED for v in values]  # a number or a list: malformed too
    if records and all(v is MALFORMED for v in values):
        if kind == "csv":  # checked before launch too (check_paths), for load_rows called on its own
            columns = next((list(r) for r in records if r is not MALFORMED), None)
            if columns is None:
                raise ConfigError(f"{path}: none of its {len(records)} rows has as many fields as its header (another "
                                  f"delimiter, or one in unquoted text?): nothing to read")
            raise ConfigError(f"{path}: no column {field_name!r} (data.text_field) in its header; columns are "
                              f"{columns}")
        keys = sorted({k for r in records if r is not MALFORMED for k in r})
        raise ConfigError(f"{path}: none of its {len(values)} records has a text {field_name!r} field "
                          f"(data.text_field){'; fields found: ' + ', '.join(keys) if keys else ''}")
    return values


def keep(ds):
    return ds.filter(lambda s: s in KEPT, input_columns="status").remove_columns("status")
