"""The inputs of `harness prepare lm --input PATH...` and the units they are cut into. Files named, found in
directories (recursively) or matched by globs, and Hugging Face data sets (`hub:NAME`), each of a kind told by its name
(`expand`); a plain text, JSON-lines or FASTA file in byte ranges of `UNIT_BYTES` (aligned to its lines as it is read,
`readers.py`), any other file whole (a compressed one, a csv) or by row group (parquet): the units that `--part I/N`
divides and a record names (`plan_units`).
"""
from __future__ import annotations

import bz2
import glob
import gzip
import json
import lzma
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..config.run import ConfigError, one_line
from ..data.corpus import FORMAT, MANIFEST

UNIT_BYTES = 64 << 20
TEXT, JSON, CSV, PARQUET, HUB, FASTA = ".txt", ".jsonl", ".csv", ".parquet", "hub", ".fasta"
KINDS = {".txt": TEXT, ".text": TEXT, ".jsonl": JSON, ".json": JSON, ".csv": CSV, ".tsv": CSV, ".parquet": PARQUET,
         ".fasta": FASTA, ".fa": FASTA, ".faa": FASTA, ".fas": FASTA}
KNOWN = ".txt, .jsonl, .json, .csv, .tsv, .parquet, .fasta/.fa/.faa/.fas"
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}


@dataclass(frozen=True)
class Unit:
    id: int
    path: str
    kind: str
    start: int = 0       # byte range, or the row group (parquet)
    end: int = -1
    size: int = 0        # the input file's size and mtime when planned: a changed file is prepared again
    mtime_ns: int = 0

    @property
    def source(self) -> str:
        return f"{self.path}[{self.start}:{self.end}]" if self.end >= 0 else self.path


def compression_of(path: str) -> str:
    suffix = Path(path).suffix.lower()
    return suffix if suffix in OPENERS else ""


def kind_suffix(path: str) -> str:
    """The suffix that names a file's kind: `.csv` of `rows.csv.gz`."""
    p = Path(path.lower())
    return (p.with_suffix("") if compression_of(path) else p).suffix


def kind_of(path: str) -> str | None:
    return KINDS.get(kind_suffix(path))


def expand(inputs: list[str], exclude: Path | None = None) -> list[str]:
    """Files named, found in directories (recursively) or matched by globs, sorted, each once; one line for a name
    that matches nothing. What a directory or a glob finds passes over prepared corpora (their manifests and records
    are JSON), `exclude` (the prepare's own --out) among them; a file named is taken as it is."""
    files: list[str] = []
    passed_over = _corpora(exclude)
    for name in inputs:
        if name.startswith("hub:"):  # streamed by `datasets`, never held whole
            files.append(name)
            continue
        matches = sorted(glob.glob(name, recursive=True)) if glob.has_magic(name) else [name]
        found, over, unread = [], [], {}
        for m in matches:
            p = Path(m)
            if p.is_dir():
                walked = _walk(p)
                kind = [(f, passed_over(f)) for f in walked if kind_of(str(f))]
                found += sorted(str(f) for f, over_it in kind if not over_it)  # (as strings: the unit numbers of before)
                over += [f for f, over_it in kind if over_it]
                unread.update((f.resolve(), f) for f in walked if not kind_of(str(f)) and not passed_over(f)
                              and not any(part.startswith(".") for part in f.relative_to(p).parts))
            elif p.is_file() and (m == name or not passed_over(p)):
                found.append(m)
            elif p.is_file():
                over.append(p)
        _say_unread(name, sorted(unread.values()))  # once for the input, each file once (a glob's folders overlap)
        if not found:
            raise ConfigError(f"--input {name}: matches no file" + (f" of a known kind ({KNOWN}, compressed "
                              f".gz/.bz2/.xz/.zst)" if Path(name).is_dir() else "") +
                              (f" outside prepared corpora and --out ({len(over)} inside)" if over else ""))
        for f in found:
            if kind_of(f) is None:
                raise ConfigError(f"--input {f}: cannot tell its kind from its name ({KNOWN}, optionally "
                                  f"compressed .gz/.bz2/.xz/.zst)")
        files += [str(Path(f).resolve()) for f in found]
    return list(dict.fromkeys(files))


def _say_unread(folder: str, unread: list[Path]) -> None:
    """One line for the files that folders of an input hold and no reader takes (a `.md` of text, say), by suffix
    (hidden ones and those in hidden folders, `.git/`, left out): they are not read."""
    if not unread:
        return
    kinds = Counter(("".join(f.suffixes[-2:]) if compression_of(str(f)) else f.suffix).lower() or "no suffix"
                    for f in unread)
    listed = ", ".join(f"{k} {n}" for k, n in kinds.most_common(4)) + (", ..." if len(kinds) > 4 else "")
    print(f"note: --input {folder}: {len(unread)} file(s) of no kind it reads, not read ({listed}; e.g. {unread[0]}); "
          f"it reads {KNOWN}: rename a text file .txt, or convert it, to include it", flush=True)


def _walk(root: Path) -> list[Path]:
    """Every file under `root`, through linked folders as a glob's ** goes (Path.rglob does not follow them before
    Python 3.13), each folder once; a link to nothing is refused: its data is missing (an unmounted volume)."""
    files, seen = [], set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add(real)
        if {"state.json", "dataset_info.json"} <= set(names):  # its JSON is bookkeeping, its rows are in .arrow
            raise ConfigError(f"--input {root}: {folder} is a Hugging Face `save_to_disk` folder; write its rows as "
                              f"parquet or JSON lines (datasets.load_from_disk(...).to_parquet('rows.parquet')) and "
                              f"give that")
        for name in names + [d for d in dirs if not os.path.exists(os.path.join(folder, d))]:
            f = Path(folder) / name
            if not f.exists() and kind_of(name) and not name.startswith("."):  # (an editor's lock file, .#a.txt,
                # is a link to nothing by design)
                raise ConfigError(f"--input {root}: {f} is a link to nothing ({os.readlink(f)}); its data is missing")
            if f.is_file():
                files.append(f)
    return files


def _corpora(exclude: Path | None):
    """Whether a file lies in `exclude` or in a prepared corpus (one prepare's look: a folder is asked once)."""
    skip, seen = exclude.resolve() if exclude else None, {}

    def corpus(d: Path) -> bool:
        if d not in seen:
            seen[d] = d == skip or (d / "units" / "settings.json").is_file() or \
                record_or_empty(d / MANIFEST).get("format") == FORMAT
        return seen[d]

    return lambda f: any(corpus(d) for d in Path(f).resolve().parents)


def size_and_mtime(path: str) -> tuple[int, int]:
    """(size, mtime_ns) of an input file; (0, 0) for a hub data set."""
    if path.startswith("hub:"):
        return 0, 0
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def plan_units(files: list[str], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every unit of the inputs, numbered in order: what `--part` divides and a record names."""
    units: list[Unit] = []
    for path in files:
        (size, mtime), kind = size_and_mtime(path), HUB if path.startswith("hub:") else kind_of(path)
        ranges: list[tuple[int, int]] = [(0, -1)]
        if kind in (TEXT, JSON, FASTA) and not compression_of(path) and size > unit_bytes:
            ranges = [(s, min(s + unit_bytes, size)) for s in range(0, size, unit_bytes)]
        elif kind == PARQUET:
            import pyarrow.parquet as pq

            if compression_of(path):
                raise ConfigError(f"--input {path}: a parquet file compresses inside itself; decompress it to "
                                  f"{path[:path.rindex('.')]}")
            try:
                groups = pq.ParquetFile(path).num_row_groups
            except Exception as e:  # noqa: BLE001 - pyarrow's own errors: one line naming the file
                raise ConfigError(f"--input {path}: not a readable parquet file ({one_line(e, None)})") \
                    from None
            ranges = [(g, g) for g in range(groups)]
        units += [Unit(len(units) + i, path, kind, s, e, size, mtime) for i, (s, e) in enumerate(ranges)]
    return units


def parse_part(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    i, slash, n = text.partition("/")
    if not slash or not i.isdigit() or not n.isdigit() or not 1 <= int(i) <= int(n):
        raise ConfigError(f"--part {text}: expected I/N with 1 <= I <= N, e.g. 1/4")
    return int(i), int(n)


def record_or_empty(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
