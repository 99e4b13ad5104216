"""A unit's documents, read a block at a time and never held whole: a line of text, a FASTA record's sequence, a JSON
line's, csv row's, parquet row's or hub row's text field. Rows are skipped by the rules of `data/rows.py` (empty,
whitespace-only, undecodable or fieldless rows, counted), but none is cut at data.max_row_chars; a compressed file cut
short raises EOFError, .zst too, so that the prepare can name it (`shards._guarded`).
"""
from __future__ import annotations

import bz2
import contextlib
import csv
import gzip
import io
import itertools
import json
import lzma
import zlib
from collections import Counter

from ..config.run import ConfigError
from .inputs import CSV, FASTA, HUB, JSON, PARQUET, TEXT, Unit, compression_of, kind_of, kind_suffix

BLOCK = 16 << 20  # bytes of text tokenized at a time
BOM = b"\xef\xbb\xbf"


@contextlib.contextmanager
def _open(path: str, moved=None):
    """The file's bytes, decompressed; `moved(n)`: told of the n bytes of the file on disk each read takes (a
    compressed file's too, by the bytes of it read), so a long unit's progress moves as it is read."""
    comp = compression_of(path)
    if comp == ".zst":
        try:
            import zstandard
        except ImportError:
            raise ConfigError(f"--input {path}: reading .zst needs the zstandard package (pip install zstandard)") \
                from None
    with io.BufferedReader(_Counted(io.FileIO(path), moved) if moved else io.FileIO(path)) as disk:
        if comp == ".zst":  # buffered: `text_blocks` and `fasta_records` read lines, which zstandard's reader does not
            with io.BufferedReader(_Zstd(disk, zstandard.ZstdDecompressor())) as f:
                yield f
        elif comp:
            with DECOMPRESSORS[comp](disk) as f:  # (which leaves `disk` open: closed here)
                yield f
        else:
            yield disk


DECOMPRESSORS = {".gz": lambda f: gzip.GzipFile(fileobj=f, mode="rb"), ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile}


class _Counted(io.RawIOBase):
    """A raw file that tells `moved(n)` of the bytes each read takes."""

    def __init__(self, raw: io.RawIOBase, moved):
        self.raw, self.moved = raw, moved

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.raw.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        if n:
            self.moved(n)
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


class _Zstd(io.RawIOBase):
    """A .zst file's bytes, frame after frame; a stream cut short raises EOFError, as gzip, bz2 and lzma do
    (zstandard's own reader ends there quietly, the last document cut)."""

    def __init__(self, raw, dctx):
        self.raw, self.dctx, self.d, self.fed = raw, dctx, dctx.decompressobj(), False
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


def text_blocks(unit: Unit, moved=None):
    """The unit's bytes in blocks that end at a line's end: the lines that start in its range (`data/rows.py`'s
    line rule), the last one completed."""
    with _open(unit.path, moved) as f:
        pos, end, first = 0, unit.end, unit.start == 0
        if unit.start > 0:
            f.seek(unit.start - 1)
            f.readline()  # the line under way belongs to the unit before
            pos = f.tell()
        compressed = bool(compression_of(unit.path))
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


def fasta_records(unit: Unit, moved=None):
    """The sequences of the records whose header line starts in the unit's range, in blocks of 10,000: a record under
    way at the range's start belongs to the unit before, one under way at its end is read to its end."""
    with _open(unit.path, moved) as f:
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


def documents(unit: Unit, text_field: str, counts: Counter, moved=None):
    """The unit's documents, as lists of str (a block's worth at a time); what is skipped is counted. `moved(n)`: told
    of the bytes of its file read (`_open`), a parquet row group's and a hub data set's not."""
    if unit.kind == FASTA:
        for block in fasta_records(unit, moved):
            yield _clean_lines(block, counts)
    elif unit.kind == TEXT:
        for block in text_blocks(unit, moved):
            lines = block.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            yield _clean_lines(lines, counts)
    elif unit.kind == JSON:
        for block in text_blocks(unit, moved):
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
        yield from _csv_texts(unit, text_field, counts, moved)
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


def _csv_texts(unit: Unit, text_field: str, counts: Counter, moved=None):
    """A csv or tsv file's text column, 10,000 rows at a time. Bytes that are not UTF-8 are kept as surrogates so that
    `_clean_texts` skips their rows, as it does rows of another width than the header, as the raw path does; a BOM is
    no part of the header."""
    csv.field_size_limit(2**31 - 1)  # a document of any length (the default stops at 128 KiB)
    with _open(unit.path, moved) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.reader(text, delimiter="\t" if kind_suffix(unit.path) == ".tsv" else ",")
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


def zstd_errors() -> tuple:
    try:
        import zstandard
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


def first_fields(paths: list[str]) -> list[str]:
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
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error, ConfigError, *zstd_errors()):
        pass  # unreadable (pyarrow's errors are ValueError and OSError): the line goes without the fields
    return [k for k, _ in keys.most_common()]
