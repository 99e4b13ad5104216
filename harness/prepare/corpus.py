"""`harness prepare lm --input PATH... --out DIR`: a corpus of any size tokenized once into shards (`data/corpus.py`
reads them), never held whole in memory.

The inputs (files, directories, globs) are cut into units: a plain text or JSON-lines file in byte ranges of
`UNIT_BYTES` aligned to its lines, any other file whole (a compressed one, a csv) or by row group (parquet). Each
unit becomes its own shards, written under temporary names and renamed when whole, then a record in `units/`: an
interrupted prepare redoes only the units without a record (or whose shards are no longer whole: each shard's size
and checksum are checked, read again only where the file changed since its record or `verified.json` stamped it),
and the same command again redoes none. Units go to
`--workers` processes; `--part I/N` takes every N-th unit only, and `--merge` joins parts into one manifest that
points at their shards. A document is a line of text, a JSON line's or csv row's or parquet row's text field; it is
held out for validation with probability `--val-fraction`, drawn from (seed, unit, document): the same documents
whatever the workers or parts. Rows are skipped by the rules of `data/rows.py` (empty, whitespace-only, undecodable
or fieldless rows, counted), but none is cut at data.max_row_chars; an unreadable file or a truncated compressed one
stops the prepare naming the file and line, or with `--on-error skip` is counted and skipped.
"""
from __future__ import annotations

import bz2
import csv
import errno
import fcntl
import glob
import gzip
import hashlib
import io
import itertools
import json
import lzma
import os
import signal
import time
import zlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..config.run import ConfigError, one_line
from ..data.corpus import (FORMAT, INDEX, MANIFEST, TMP, VERIFIED, VERSION, Shard, dtype_for, partial, read_stamps,
                           write_whole)

UNIT_BYTES = 64 << 20
BLOCK = 16 << 20  # bytes of text tokenized at a time
TEXT, JSON, CSV, PARQUET, HUB, FASTA = ".txt", ".jsonl", ".csv", ".parquet", "hub", ".fasta"
KINDS = {".txt": TEXT, ".text": TEXT, ".jsonl": JSON, ".json": JSON, ".csv": CSV, ".tsv": CSV, ".parquet": PARQUET,
         ".fasta": FASTA, ".fa": FASTA, ".faa": FASTA, ".fas": FASTA}
KNOWN = ".txt, .jsonl, .json, .csv, .tsv, .parquet, .fasta/.fa/.faa/.fas"
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".zst": None}
NEWLINE = 10
BOM = b"\xef\xbb\xbf"
RESIDUES = "residues"  # the protein task's tokenizer (`harness prepare protein --input`)
MAX_SHARD_TOKENS = (1 << 32) - 1  # a document's end in its shard is a uint32
FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


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


def _compression(path: str) -> str:
    suffix = Path(path).suffix.lower()
    return suffix if suffix in OPENERS else ""


def _suffix(path: str) -> str:
    """The suffix that names a file's kind: `.csv` of `rows.csv.gz`."""
    p = Path(path.lower())
    return (p.with_suffix("") if _compression(path) else p).suffix


def kind_of(path: str) -> str | None:
    return KINDS.get(_suffix(path))


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
    kinds = Counter(("".join(f.suffixes[-2:]) if _compression(str(f)) else f.suffix).lower() or "no suffix"
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
                _read_json(d / MANIFEST).get("format") == FORMAT
        return seen[d]

    return lambda f: any(corpus(d) for d in Path(f).resolve().parents)


def _stat(path: str) -> tuple[int, int]:
    """(size, mtime_ns) of an input file; (0, 0) for a hub data set."""
    if path.startswith("hub:"):
        return 0, 0
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def plan_units(files: list[str], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Every unit of the inputs, numbered in order: what `--part` divides and a record names."""
    units: list[Unit] = []
    for path in files:
        (size, mtime), kind = _stat(path), HUB if path.startswith("hub:") else kind_of(path)
        ranges: list[tuple[int, int]] = [(0, -1)]
        if kind in (TEXT, JSON, FASTA) and not _compression(path) and size > unit_bytes:
            ranges = [(s, min(s + unit_bytes, size)) for s in range(0, size, unit_bytes)]
        elif kind == PARQUET:
            import pyarrow.parquet as pq

            if _compression(path):
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


# --- reading documents ---------------------------------------------------------------------------------------------

def _open(path: str):
    comp = _compression(path)
    if comp == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"--input {path}: reading .zst needs the zstandard package (pip install zstandard)") \
                from None
        # buffered: `text_blocks` and `fasta_records` read lines, which zstandard's own reader does not
        return io.BufferedReader(_Zstd(path, zstandard.ZstdDecompressor()))
    return OPENERS[comp](path, "rb") if comp else open(path, "rb")


class _Zstd(io.RawIOBase):
    """A .zst file's bytes, frame after frame; a stream cut short raises EOFError, as gzip, bz2 and lzma do
    (zstandard's own reader ends there quietly, the last document cut)."""

    def __init__(self, path: str, dctx):
        self.raw, self.dctx, self.d, self.fed = open(path, "rb"), dctx, dctx.decompressobj(), False
        self.out, self.at = memoryview(b""), 0  # what the last input piece gave, and how much of it was read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.out):
            if self.d.eof:  # a frame ended: the next one, if any, starts in what is left over
                rest, self.d, self.fed = self.d.unused_data, self.dctx.decompressobj(), False
                if rest:
                    self.out, self.at, self.fed = memoryview(self.d.decompress(rest)), 0, True
                    continue
            piece = self.raw.read(1 << 14)  # small pieces: what one gives stays small however well it compressed
            if not piece:
                if self.fed:
                    raise EOFError("the compressed stream ends before its last frame does (cut short)")
                return 0
            self.out, self.at, self.fed = memoryview(self.d.decompress(piece)), 0, True
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def text_blocks(unit: Unit):
    """The unit's bytes in blocks that end at a line's end: the lines that start in its range (`data/rows.py`'s
    line rule), the last one completed."""
    with _open(unit.path) as f:
        pos, end, first = 0, unit.end, unit.start == 0
        if unit.start > 0:
            f.seek(unit.start - 1)
            f.readline()  # the line under way belongs to the unit before
            pos = f.tell()
        compressed = bool(_compression(unit.path))
        block = BLOCK if not compressed else 1 << 18
        while end < 0 or pos < end:
            try:
                chunk = _block(f, block if end < 0 else min(block, end - pos), compressed)
            except _Cut as cut:  # a compressed stream cut short: its whole lines, then the error (counted)
                kept = cut.kept[:cut.kept.rfind(b"\n") + 1]
                if kept:
                    yield kept.removeprefix(BOM) if first else kept
                raise cut.error from None
            if not chunk:
                return
            pos += len(chunk)
            yield chunk.removeprefix(BOM) if first else chunk  # a BOM is no part of the first document
            first = False


class _Cut(Exception):
    def __init__(self, kept: bytes, error: EOFError):
        self.kept, self.error = kept, error


def _block(f, n: int, compressed: bool) -> bytes:
    """Up to `n` bytes, and the rest of the line under way. A compressed stream cut short raises EOFError in the read
    that reaches the cut, losing what that read had decompressed: read piece by piece, the bytes before the cut come
    with the error (`_Cut`)."""
    parts, got = [], 0
    try:
        while got < n and (piece := (f.read1 if compressed else f.read)(n - got)):
            parts.append(piece)
            got += len(piece)
        if parts and not parts[-1].endswith(b"\n"):
            parts.append(f.readline())
    except EOFError as e:
        raise _Cut(b"".join(parts), e) from None
    return b"".join(parts)


def fasta_records(unit: Unit):
    """The sequences of the records whose header line starts in the unit's range, in blocks of 10,000: a record under
    way at the range's start belongs to the unit before, one under way at its end is read to its end."""
    with _open(unit.path) as f:
        if unit.start > 0:
            f.seek(unit.start - 1)
            f.readline()  # the line under way belongs to the unit before
        pos, block, seq, header = f.tell(), [], None, False
        for raw in f:
            line = raw.removeprefix(BOM) if pos == 0 else raw  # a BOM is no part of the first header
            if line.startswith(b">"):
                if seq is not None:
                    block.append(b"".join(seq))
                if len(block) >= 10_000:
                    yield block
                    block = []
                if 0 <= unit.end <= pos:
                    seq = None
                    break
                seq, header = [], True
            elif seq is not None:
                seq.append(line.strip())
            pos += len(raw)
        if seq is not None:
            block.append(b"".join(seq))
        if not header and unit.start == 0 and pos:
            raise ValueError("no record header ('>') in it: not FASTA")
        yield block


def documents(unit: Unit, text_field: str, counts: Counter):
    """The unit's documents, as lists of str (a block's worth at a time); what is skipped is counted."""
    if unit.kind == FASTA:
        for block in fasta_records(unit):
            yield _clean_lines(block, counts)
    elif unit.kind == TEXT:
        for block in text_blocks(unit):
            lines = block.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            yield _clean_lines(lines, counts)
    elif unit.kind == JSON:
        for block in text_blocks(unit):
            texts = []
            for line in block.split(b"\n"):
                if not line.strip():
                    continue
                if unit.start == 0 and not texts and not sum(counts.values()) and line.lstrip().startswith(b"["):
                    raise ConfigError(f"--input {unit.path}: a JSON array, not JSON lines (one object a line); "
                                      f"convert it once: python -c \"import json,sys; [print(json.dumps(r)) for r in "
                                      f"json.load(open(sys.argv[1]))]\" FILE.json > FILE.jsonl")
                try:
                    row = json.loads(line)
                except ValueError:
                    counts["malformed"] += 1
                    continue
                texts.append(row.get(text_field) if isinstance(row, dict) else None)
            yield _clean_texts(texts, counts)
    elif unit.kind == CSV:
        yield from _csv_texts(unit, text_field, counts)
    elif unit.kind == HUB:
        yield from _hub(unit.path[4:], text_field, counts)
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        if text_field not in pf.schema_arrow.names:
            raise ConfigError(f"--input {unit.path}: no column {text_field!r} (--text-field); its columns are "
                              f"{pf.schema_arrow.names}")
        for batch in pf.iter_batches(row_groups=[unit.start], columns=[text_field], batch_size=10_000):
            yield _clean_texts(batch.column(0).to_pylist(), counts)


def _csv_texts(unit: Unit, text_field: str, counts: Counter):
    """A csv or tsv file's text column, 10,000 rows at a time. Bytes that are not UTF-8 are kept as surrogates so that
    `_clean_texts` skips their rows, as it does rows of another width than the header, as the raw path does; a BOM is
    no part of the header."""
    csv.field_size_limit(2**31 - 1)  # a document of any length (the default stops at 128 KiB)
    with _open(unit.path) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.reader(text, delimiter="\t" if _suffix(unit.path) == ".tsv" else ",")
        header = next(reader, None)
        if header is None:
            raise ConfigError(f"--input {unit.path}: empty: no header line naming the column {text_field!r}")
        if text_field not in header:
            raise ConfigError(f"--input {unit.path}: no column {text_field!r} (--text-field) in its header {header}")
        at, batch = header.index(text_field), []
        for row in reader:
            if not row:  # a blank line
                continue
            batch.append(row[at] if len(row) == len(header) else None)  # another width: malformed
            if len(batch) >= 10_000:
                yield _clean_texts(batch, counts)
                batch = []
        yield _clean_texts(batch, counts)


def _hub(name: str, text_field: str, counts: Counter):
    """A Hugging Face data set's train split, streamed (`datasets`, streaming=True): never downloaded whole."""
    import datasets

    try:
        stream = datasets.load_dataset(name, split="train", streaming=True)
        columns = stream.column_names
    except Exception as e:  # noqa: BLE001 - the hub out of reach, a name that is no data set: one line
        raise ConfigError(f"--input hub:{name}: cannot be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
    if columns is not None and text_field not in columns:
        raise ConfigError(f"--input hub:{name}: no column {text_field!r} (--text-field); its columns are {columns}")
    for batch in stream.iter(batch_size=10_000):
        yield _clean_texts(batch.get(text_field, [None] * len(next(iter(batch.values()), []))), counts)


def _clean_lines(lines: list[bytes], counts: Counter) -> list[str]:
    out = []
    for line in lines:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            counts["undecodable"] += 1
            continue
        if text.strip():
            out.append(text.removesuffix("\r"))
        else:
            counts["empty"] += 1
    return out


def _clean_texts(texts: list, counts: Counter) -> list[str]:
    out = []
    for t in texts:
        if not isinstance(t, str):
            counts["malformed"] += 1
        elif not t.strip():
            counts["empty"] += 1
        elif not _encodable(t):  # a lone surrogate (a JSON escape such as "\\ud83d", a csv's undecodable bytes)
            counts["undecodable"] += 1
        else:
            out.append(t)
    return out


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- tokenizers ----------------------------------------------------------------------------------------------------

class Bytes:
    """The lm task's own tokens: UTF-8 bytes, each document followed by "\\n" (as the raw-file path joins rows)."""
    spec = {"kind": "bytes", "vocab_size": 256, "separator": NEWLINE, "fingerprint": "utf-8"}

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        data = [t.encode("utf-8") + b"\n" for t in texts]
        return np.frombuffer(b"".join(data), dtype=np.uint8), np.cumsum([len(d) for d in data], dtype=np.int64)


class Residues:
    """The protein task's residue ids: one a residue (upper-cased; a stop codon's trailing "*" dropped, any other
    character <unk>), each sequence followed by the end token. The ids are the residue vocabulary's
    (`prepare/protein.py`'s, letter by letter as its `encode` looks them up), which is written beside the shards."""

    def __init__(self):
        import tempfile

        from ..data.tokenizer import EOS, UNK, train_tokenizer
        from .protein import ALPHABET, TOKENIZER, USER_SYMBOLS, encode

        letters = "".join(sorted(ALPHABET))
        with tempfile.TemporaryDirectory() as tmp:  # distinct counts: the same vocabulary every time
            tok = train_tokenizer(["".join(c * (40 - i) for i, c in enumerate(letters))], Path(tmp) / TOKENIZER,
                                  vocab_size=64, model_type="char", user_symbols=USER_SYMBOLS)
            self.model = (Path(tmp) / TOKENIZER).read_bytes()
        self.table = np.full(256, UNK, dtype=np.uint8)
        for c, i in zip(letters, encode(tok, [letters])[0]):
            self.table[ord(c)] = self.table[ord(c.lower())] = i
        self.eos = EOS
        self.spec = {"kind": RESIDUES, "vocab_size": tok.vocab_size, "separator": EOS, "fingerprint": "residues-v1"}

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        seqs = [t.strip().removesuffix("*").encode("ascii", "replace") + b"\0" for t in texts]
        ids = self.table[np.frombuffer(b"".join(seqs), dtype=np.uint8)]
        ends = np.cumsum([len(q) for q in seqs], dtype=np.int64)
        ids[ends - 1] = self.eos
        return ids, ends

    def write_vocabulary(self, out: Path) -> None:
        from .protein import TOKENIZER

        if not (out / TOKENIZER).is_file() or (out / TOKENIZER).read_bytes() != self.model:
            (out / TOKENIZER).write_bytes(self.model)


class HFTokenizer:
    """A Hugging Face tokenizer (fast, batched), each document followed by its EOS token."""

    def __init__(self, name: str):
        self.name = name
        self._load()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        from ..models.hf import hub_source

        where = self.name if Path(self.name).exists() else hub_source(self.name, "--tokenizer")
        try:
            self.tok = AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer {self.name}: no tokenizer there ({str(e).splitlines()[0]})") from None
        if self.tok.eos_token_id is None:
            raise ConfigError(f"--tokenizer {self.name}: it has no EOS token to end each document with")
        self.spec = {"kind": "hf", "name": self.name, "vocab_size": len(self.tok), "separator": self.tok.eos_token_id,
                     "fingerprint": fingerprint(self.tok)}

    def __getstate__(self):  # a worker loads its own
        return {"name": self.name}

    def __setstate__(self, state):
        self.name = state["name"]
        self._load()

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        from ..models.hf import AS_TEXT  # (torch: imported once a worker has a tokenizer, not by every prepare)

        ids = self.tok(texts, **AS_TEXT)["input_ids"] if texts else []
        eos = self.spec["separator"]
        flat = np.fromiter((i for doc in ids for i in (*doc, eos)), dtype=np.int64, count=sum(len(d) + 1 for d in ids))
        return flat, np.cumsum([len(d) + 1 for d in ids], dtype=np.int64)


def fingerprint(tok) -> str:
    """What identifies a Hugging Face tokenizer's mapping from text to ids."""
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- writing -------------------------------------------------------------------------------------------------------

class ShardWriter:
    """One split's shards of a unit: tokens and document ends appended under temporary names, each shard's sha256
    taken as it goes; a shard that would pass `limit` tokens (its index's uint32) is closed and the next opened;
    `close` renames them into place and returns their records."""

    def __init__(self, out: Path, name: str, dtype: str):
        self.out, self.name, self.dtype, self.limit, self.done = out, name, np.dtype(dtype), MAX_SHARD_TOKENS, []
        self._open()

    def _open(self) -> None:
        stem = self.name if not self.done else f"{self.name}-{len(self.done)}"
        self.bin, self.idx = self.out / f"{stem}.bin", self.out / f"{stem}.idx"
        # per process: a worker of an earlier prepare killed with its parent may still be writing under its own
        self.tmp_bin, self.tmp_idx = (partial(p) for p in (self.bin, self.idx))
        self.f_bin, self.f_idx = open(self.tmp_bin, "wb"), open(self.tmp_idx, "wb")
        self.tokens, self.documents, self.hash, self.idx_hash = 0, 0, hashlib.sha256(), hashlib.sha256()

    def add(self, ids: np.ndarray, ends: np.ndarray) -> None:
        while len(ends):
            fit = int(np.searchsorted(ends, self.limit - self.tokens, side="right"))  # whole documents that fit
            if not fit and self.documents:
                self._finish()
                self._open()
                continue
            fit = max(fit, 1)
            cut = int(ends[fit - 1])
            data = ids[:cut].astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self.hash.update(data)
            self.f_bin.write(data)
            index = (ends[:fit] + self.tokens).astype(INDEX).tobytes()
            self.idx_hash.update(index)
            self.f_idx.write(index)
            self.tokens, self.documents = self.tokens + cut, self.documents + fit
            ids, ends = ids[cut:], ends[fit:] - cut

    def _finish(self) -> None:
        self.f_bin.close()
        self.f_idx.close()
        self.done.append(((self.tmp_bin, self.bin), (self.tmp_idx, self.idx),
                          {"file": self.bin.name, "tokens": self.tokens, "documents": self.documents,
                           "sha256": self.hash.hexdigest(), "idx_sha256": self.idx_hash.hexdigest()}))

    def close(self) -> list[dict]:
        self._finish()
        if not self.done[-1][2]["documents"]:  # an empty last shard (a split the unit gave no document)
            for tmp, _ in self.done.pop()[:2]:
                tmp.unlink()
        for (tmp_bin, final_bin), (tmp_idx, final_idx), _ in self.done:
            os.replace(tmp_bin, final_bin)
            os.replace(tmp_idx, final_idx)
        return [record for *_, record in self.done]

    def abort(self) -> None:
        for f in (self.f_bin, self.f_idx):
            f.close()
        for p in [self.tmp_bin, self.tmp_idx, *(tmp for pair in self.done for tmp, _ in pair[:2])]:
            p.unlink(missing_ok=True)


def prepare_unit(unit: Unit, out: Path, tokenizer, text_field: str, val_fraction: float, seed: int,
                 on_error: str) -> dict:
    """The unit's shards and its record (`units/NNNNNN.json`, written last): what a rerun finds done."""
    dtype, counts = dtype_for(tokenizer.spec["vocab_size"]), Counter()
    writers = {s: ShardWriter(out, f"{s}-{unit.id:06d}", dtype) for s in ("train", "validation")}
    rng = np.random.default_rng([seed, unit.id])
    try:
        for texts in _guarded(documents(unit, text_field, counts), unit, on_error, counts):
            ids, ends = tokenizer.encode(texts)
            held = rng.random(len(ends)) < val_fraction
            starts = np.concatenate([[0], ends[:-1]])
            for split, mask in (("train", ~held), ("validation", held)):
                if mask.any():
                    keep = np.repeat(mask, ends - starts)
                    writers[split].add(ids[keep], np.cumsum((ends - starts)[mask]))
            counts["ok"] += len(ends)
    except BaseException as e:  # a refusal, a full disk, Ctrl-C: no partial shard is left behind
        for w in writers.values():
            w.abort()
        if isinstance(e, OSError) and e.errno in FULL:
            raise _disk_full(e, f"the shards of {unit.source}", out, "the partial shard is removed: ") from None
        raise
    shards = [{**s, "split": split, "unit": unit.id, "source": unit.source}
              for split, w in writers.items() for s in w.close()]
    record = {"unit": asdict(unit), "shards": shards, "counts": dict(counts), "stamps": _stamps(out, shards)}
    write_json(out / "units" / f"{unit.id:06d}.json", record, out)
    return record


def _stamps(root: Path, shards: list[dict]) -> dict:
    """The [size, mtime_ns] of the shards' files as written, their checksums taken while writing: a file whose stamp
    still matches is not read again (`Shard.problem`)."""
    files = (f for shard in (Shard.of(root, s) for s in shards) for f in (shard.path, shard.index))
    return {str(f): [(st := f.stat()).st_size, st.st_mtime_ns] for f in files}


def _write_changed(path: Path, value: dict, out: Path, indent: int | None = None) -> None:
    """`write_json`, unless the file holds `value` already: a rerun that does nothing writes nothing (a full disk
    does not stop it)."""
    if _read_json(path) != value:
        write_json(path, value, out, indent)


def _disk_full(e: OSError, what: str, out: Path, removed: str = "") -> ConfigError:
    return ConfigError(f"the disk filled while writing {what} in {out} ({e.strerror}); {removed}free space and run "
                       f"the same command again, it continues")


def write_json(path: Path, value, out: Path, indent: int | None = None) -> None:
    """`path` whole or not at all (`data.corpus.write_whole`); a full disk is one line."""
    try:
        write_whole(path, json.dumps(value, indent=indent))
    except OSError as e:
        if e.errno in FULL:
            raise _disk_full(e, path.name, out) from None
        raise


def _guarded(blocks, unit: Unit, on_error: str, counts: Counter):
    """The blocks of documents; a read that fails (a truncated or corrupt file) stops the prepare in one line naming
    the file, or with `--on-error skip` ends the unit there, counted."""
    try:
        yield from blocks
    except (OSError, EOFError, UnicodeDecodeError, ValueError, lzma.LZMAError, csv.Error, *_zstd_errors()) as e:
        if isinstance(e, OSError) and e.errno in FULL:
            raise
        row = sum(counts.values()) + 1
        if on_error == "stop":
            said = one_line(e, None)  # (pyarrow's messages run over several lines)
            raise ConfigError(f"--input {unit.source}: unreadable at about row {row} ({type(e).__name__}: {said}); "
                              f"--on-error skip keeps the rows before it and goes on") from None
        counts["unreadable_tail"] += 1


def _zstd_errors() -> tuple:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


def _run_unit(args) -> dict:
    return prepare_unit(*args)


def done_records(out: Path, units: list[Unit], dtype: np.dtype, stamps: dict, fresh: dict) -> dict[int, dict]:
    """The records of units prepared from the same input (its size and mtime) whose shards are whole: there, of their
    sizes and checksums (read again where a file changed since `stamps` recorded it checked; what passed goes into
    `fresh`). A unit with a damaged shard is said and prepared again."""
    done = {}
    for unit in units:
        path = out / "units" / f"{unit.id:06d}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("unit") != asdict(unit):
            continue
        known = {**stamps, **record.get("stamps", {})}
        problem = next((p for s in record["shards"] if (p := Shard.of(out, s).problem(dtype, known, fresh))), None)
        if problem:
            print(f"{unit.source}: {problem}; preparing it again", flush=True)
        else:
            done[unit.id] = record
    return done


def prepare_corpus(inputs: list[str], out: str, workers: int = 1, tokenizer: str | None = None,
                   text_field: str = "text", val_fraction: float = 0.0, seed: int = 0, part: str | None = None,
                   on_error: str = "stop", unit_bytes: int = UNIT_BYTES) -> dict:
    """Prepare (or continue preparing) `out`; returns its manifest."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    which = parse_part(part)
    root = Path(out)
    files = expand(inputs, exclude=root)
    units = plan_units(files, unit_bytes)
    mine = [u for u in units if which is None or u.id % which[1] == which[0] - 1]
    tok = Residues() if tokenizer == RESIDUES else HFTokenizer(tokenizer) if tokenizer else Bytes()
    settings = {"inputs": [{"path": f, "size": _stat(f)[0]} for f in files], "tokenizer": tok.spec,
                "text_field": text_field, "val_fraction": val_fraction, "seed": seed, "unit_bytes": unit_bytes,
                "units": len(units), "part": part}
    dtype = dtype_for(tok.spec["vocab_size"])
    with _claim(root, settings):
        fresh = {}
        done = done_records(root, mine, np.dtype(dtype), read_stamps(root), fresh)
        todo = [u for u in mine if u.id not in done]
        if done:  # the same command again (after Ctrl-C, a lost worker, a finished prepare): what it picks up
            print(f"prepare {root.name}: {len(done)} of {len(mine)} unit(s) prepared before, kept; "
                  + (f"preparing the other {len(todo)}" if todo else "nothing left to prepare"), flush=True)
        _work(todo, root, tok, text_field, val_fraction, seed, on_error, workers, done)
        for unit in todo:  # checksums taken while writing: a run need not read these shards again
            fresh.update(done[unit.id]["stamps"])
        return _write_manifest(root, settings, [done[u.id] for u in mine], dtype, fresh)


@contextmanager
def _claim(root: Path, settings: dict):
    """`out` for these settings, held by this prepare alone: new, or a prepare of the same settings to continue, or
    of other settings that prepared nothing yet; anything else is refused. What a killed prepare left half-written is
    removed, on the way in and out."""
    settings_file = root / "units" / "settings.json"
    if not settings_file.is_file() and root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root}: exists and is not a prepared corpus; use another --out")
    (root / "units").mkdir(parents=True, exist_ok=True)
    with open(root / "units" / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"{root}: another prepare is writing it; wait for it to end") from None
        try:
            _remove_partial(root)
            if settings_file.is_file():
                _check_settings(root, _read_json(settings_file), settings)
            _write_changed(settings_file, settings, root, indent=1)
            yield
        finally:
            _remove_partial(root)


def _inputs_changed(before: list[dict], now: list[dict]) -> str:
    """Which input files differ: added, gone, or of another size (the first of each, and how many)."""
    was, are = ({i["path"]: i["size"] for i in x} for x in (before, now))
    kinds = (("added", [p for p in are if p not in was]), ("gone", [p for p in was if p not in are]),
             ("resized", [p for p in are if p in was and are[p] != was[p]]))
    said = [f"{what} {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") for what, names in kinds
            if names]
    return f"inputs ({'; '.join(said) or 'in another order'})"


def _remove_partial(root: Path) -> None:
    for left in (*root.glob(f"*{TMP}"), *(root / "units").glob(f"*{TMP}")):
        left.unlink(missing_ok=True)


def _check_settings(root: Path, before: dict, settings: dict) -> None:
    """The same settings as the prepare `root` holds, or a prepare that made nothing yet (say, one whose
    --text-field was wrong), whose records then go: anything else is refused."""
    changed = [k for k in settings if k != "inputs" and not _same(k, before.get(k), settings[k])]
    if before.get("inputs") != settings["inputs"]:  # the count of units follows from the inputs: not named beside them
        inputs = _inputs_changed(before.get("inputs") or [], settings["inputs"])
        changed = [inputs, *(k for k in changed if k != "units")]
    if not changed:
        return
    records = sorted((root / "units").glob("[0-9]*.json"))
    made = (root / MANIFEST).is_file() or any(_read_json(r).get("shards") for r in records)
    if made:
        was, now = ({i["path"]: i["size"] for i in x} for x in (before.get("inputs") or [], settings["inputs"]))
        grown = was.items() < now.items() and not changed[1:]  # files added, none gone or changed, no other setting
        raise ConfigError(f"{root}: prepared with other {', '.join(changed)}; use another --out (or delete it)" + (
            "; to add the new files without preparing the others again, prepare them alone into another --out and "
            "train on both with data.mix, each weighted by its tokens (docs/corpora.md)" if grown else ""))
    for r in records:
        r.unlink()


def _same(key: str, a, b) -> bool:
    """The same tokenizer named by another path (`./tok`, `tok`) is the same: its kind, size, EOS and mapping."""
    if key == "tokenizer" and isinstance(a, dict) and isinstance(b, dict):
        return {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    return a == b


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _work(todo: list[Unit], root: Path, tok, text_field: str, val_fraction: float, seed: int, on_error: str,
          workers: int, done: dict) -> None:
    from ..console import progress

    bar = progress(total=sum(map(_weight, todo)), unit="B", unit_scale=True, desc=f"prepare {root.name}",
                   disable=not todo)
    started, tokens, docs = time.monotonic(), 0, 0
    jobs = [(u, root, tok, text_field, val_fraction, seed, on_error) for u in todo]

    def finished(unit: Unit, record: dict) -> None:
        nonlocal tokens, docs
        done[unit.id] = record
        tokens += sum(s["tokens"] for s in record["shards"])
        docs += sum(s["documents"] for s in record["shards"])
        bar.set_postfix_str(f"{docs:,} docs, {tokens / max(1e-9, time.monotonic() - started):,.0f} tokens/s")
        bar.update(_weight(unit))

    try:
        if workers == 1 or len(jobs) <= 1:
            for job in jobs:
                finished(job[0], prepare_unit(*job))
        else:
            _in_workers(jobs, workers, root, finished)
    finally:
        bar.close()  # an error's line then starts a line of its own


def _in_workers(jobs: list[tuple], workers: int, root: Path, finished) -> None:
    """The units in `workers` processes, each `finished` as it ends. A worker killed from outside (the OOM killer)
    breaks the pool, said in one line (multiprocessing.Pool replaced it and waited for its unit for ever); on any
    error or Ctrl-C the other workers are stopped, not waited for."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start, initargs=(os.getpid(),))
    try:
        pending = {pool.submit(_run_unit, job): job[0] for job in jobs}
        while pending:
            ended, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in ended:
                finished(pending.pop(future), future.result())
    except BrokenProcessPool:
        _stop(pool)
        raise ConfigError(f"a worker of the prepare died (killed from outside, or out of memory: each holds up to "
                          f"{BLOCK >> 20} MB of text and its tokens at a time); {root} keeps the units it finished: "
                          f"run the same command again (with fewer --workers if memory ran out)") from None
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()


def _stop(pool) -> None:
    """Stop a pool's workers now, their units unfinished (`_claim` removes what they leave)."""
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in ([] if stop else processes):
        process.terminate()
    if stop:
        stop()
    for process in processes:  # gone before `_claim` removes their partial files and lets the directory go
        process.join(5)
    pool.shutdown(wait=False, cancel_futures=True)


def _worker_start(parent: int) -> None:
    """A worker leaves Ctrl-C to the prepare (which stops the pool) and dies with it: a prepare killed with -9 leaves
    no worker writing on into a directory that the same command, run again, is preparing (Linux: PR_SET_PDEATHSIG)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _weight(unit: Unit) -> int:
    """A unit's share of the progress bar: its bytes (a whole file's for a parquet row group)."""
    return unit.end - unit.start if unit.end >= 0 and unit.kind != PARQUET else unit.size


def _fields(paths: list[str]) -> list[str]:
    """The fields of the first JSON-lines or parquet input (for the line that says none has --text-field): every key
    among its first 100 JSON objects, most common first, or its parquet columns; [] where there are none."""
    path = next((p for p in paths if kind_of(p) in (JSON, PARQUET)), None)
    if path is None:
        return []
    keys = Counter()
    try:
        if kind_of(path) == PARQUET:
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
        with _open(path) as f:
            for line in itertools.islice(f, 100):
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    keys.update(row.keys())  # (a dict itself would add its values)
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error, ConfigError, *_zstd_errors()):
        pass  # unreadable (pyarrow's errors are ValueError and OSError): the line goes without the fields
    return [k for k, _ in keys.most_common()]


def _write_manifest(root: Path, settings: dict, records: list[dict], dtype: str, stamps: dict) -> dict:
    """The manifest over `records`' shards, and `stamps` (their files checked) as `verified.json`. A part (`--part`)
    may hold no document; a corpus must."""
    counts = Counter()
    for r in records:
        counts.update(r["counts"])
    shards = [s for r in records for s in r["shards"]]
    if not any(s["split"] == "train" for s in shards) and not settings.get("part"):
        if counts["malformed"] and not counts["ok"]:
            found = _fields([i["path"] for i in settings["inputs"]])
            raise ConfigError(f"{root}: no row has the field {settings['text_field']!r} (--text-field) as text "
                              f"({counts['malformed']} rows without it)" + (f"; fields found: {', '.join(found)}"
                                                                           if found else ""))
        raise ConfigError(f"{root}: the inputs hold no document to train on ({dict(counts) or 'nothing read'})")
    manifest = {"format": FORMAT, "version": VERSION, "dtype": dtype, **settings,
                "counts": {"rows": dict(counts), **{split: {
                    "tokens": sum(s["tokens"] for s in shards if s["split"] == split),
                    "documents": sum(s["documents"] for s in shards if s["split"] == split)}
                    for split in ("train", "validation")}},
                "shards": shards}
    _write_changed(root / MANIFEST, manifest, root, indent=1)
    _write_changed(root / VERIFIED, stamps, root)
    if settings["tokenizer"]["kind"] == RESIDUES:  # what the protein task reads of a prepared directory
        from . import META

        Residues().write_vocabulary(root)
        split_counts = {split: {"ok": manifest["counts"][split]["documents"]} for split in ("train", "validation")}
        _write_changed(root / META, {"task": "protein", "corpus": True, "labels": "none", "classes": [], "values": {},
                                 "vocab_size": settings["tokenizer"]["vocab_size"], "sites": None,
                                 "counts": {**split_counts, "test": {}}}, root, indent=1)
    return manifest


MERGED_KEYS = ("inputs", "tokenizer", "text_field", "val_fraction", "seed", "unit_bytes", "units")


def merge(parts: list[str], out: str) -> dict:
    """One manifest over prepared parts (`--part I/N` each), pointing at their shards: no data copied. The parts
    must cover every unit once: a part missing (or one that is not finished) is refused, naming it."""
    root = Path(out)
    manifests = [_part_manifest(p, root) for p in parts]
    first = manifests[0]
    for p, m in zip(parts[1:], manifests[1:]):
        for key in (*MERGED_KEYS, "dtype"):
            if not _same(key, m.get(key), first.get(key)):
                raise ConfigError(f"--merge {p}: its manifest's {key!r} differs from {parts[0]}'s: parts of one "
                                  f"corpus only")
    _check_cover(parts, manifests, first["units"])
    if root.exists() and any(root.iterdir()) and "merged" not in _read_json(root / MANIFEST):
        raise ConfigError(f"--out {out}: exists and is not a merge of parts (it would be overwritten); use another "
                          f"--out")
    root.mkdir(parents=True, exist_ok=True)
    shards = sorted(({**s, "file": os.path.relpath(Path(p) / s["file"], root)} for p, m in zip(parts, manifests)
                     for s in m["shards"]), key=lambda s: (s["unit"], s["split"] != "train"))
    files = {str(f) for shard in (Shard.of(root, s) for s in shards) for f in (shard.path, shard.index)}
    stamps = {k: v for p in parts for k, v in read_stamps(Path(p)).items() if k in files}  # the parts' checks
    counts = sum((Counter(m["counts"]["rows"]) for m in manifests), Counter())
    return _write_manifest(root, {**{k: first[k] for k in MERGED_KEYS}, "part": None,
                                  "merged": [str(Path(p).resolve()) for p in parts]},
                           [{"shards": shards, "counts": counts}], first["dtype"], stamps)


def _part_manifest(part: str, root: Path) -> dict:
    path = Path(part) / MANIFEST
    if Path(part).resolve() == root.resolve():
        raise ConfigError(f"--merge {part}: --out is this part itself; merge into a directory of its own")
    manifest = _read_json(path)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"--merge {part}: no readable {MANIFEST}: not a prepared part (or not finished)")
    return manifest


def _check_cover(parts: list[str], manifests: list[dict], units: int) -> None:
    """Each unit in exactly one part (a part's units are every N-th: `--part I/N`)."""
    owner: dict[int, int] = {}
    for i, m in enumerate(manifests):
        which = parse_part(m.get("part"))
        for u in range(units) if which is None else range(which[0] - 1, units, which[1]):
            if owner.setdefault(u, i) != i:
                raise ConfigError(f"--merge: {parts[i]} and {parts[owner[u]]} both hold unit {u}: the parts overlap")
    missing = sorted(set(range(units)) - set(owner))
    if missing:
        sizes = {parse_part(m.get("part"))[1] for m in manifests if m.get("part")}
        hint = ""
        if len(sizes) == 1:
            n = sizes.pop()
            hint = f": prepare {', '.join(f'--part {i}/{n}' for i in sorted({u % n + 1 for u in missing}))} first"
        raise ConfigError(f"--merge: units {missing[:5]}{' ...' if len(missing) > 5 else ''} of {units} are in none "
                          f"of the parts{hint}")
