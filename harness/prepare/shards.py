"""A unit's shards and its record. Each unit becomes its own shards, written under temporary names and renamed when
whole, then a record in `units/` (`prepare_unit`); a document is held out for validation with probability
`--val-fraction`, drawn from (seed, unit, document): the same documents whatever the workers or parts. A rerun keeps
the units whose record matches their input and whose shards are whole (`done_records`: each shard's size and checksum
are checked, read again only where the file changed since its record or `verified.json` stamped it). An unreadable
file or a truncated compressed one stops the prepare naming the file and line, or with `--on-error skip` is counted
and skipped (`_guarded`).
"""
from __future__ import annotations

import csv
import errno
import hashlib
import json
import lzma
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..config.run import ConfigError, one_line
from ..data.corpus import INDEX, Shard, dtype_for, partial, write_whole
from .inputs import Unit, record_or_empty
from .readers import documents, zstd_errors

MAX_SHARD_TOKENS = (1 << 32) - 1  # a document's end in its shard is a uint32
FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


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
                 on_error: str, moved=None) -> dict:
    """The unit's shards and its record (`units/NNNNNN.json`, written last): what a rerun finds done. `moved(n)`:
    told of the bytes of its file read as it goes (`readers._open`)."""
    dtype, counts = dtype_for(tokenizer.spec["vocab_size"]), Counter()
    writers = {s: ShardWriter(out, f"{s}-{unit.id:06d}", dtype) for s in ("train", "validation")}
    rng = np.random.default_rng([seed, unit.id])
    try:
        for texts in _guarded(documents(unit, text_field, counts, moved), unit, on_error, counts):
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


def write_changed(path: Path, value: dict, out: Path, indent: int | None = None) -> None:
    """`write_json`, unless the file holds `value` already: a rerun that does nothing writes nothing (a full disk
    does not stop it)."""
    if record_or_empty(path) != value:
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
    except (OSError, EOFError, UnicodeDecodeError, ValueError, lzma.LZMAError, csv.Error, *zstd_errors()) as e:
        if isinstance(e, OSError) and e.errno in FULL:
            raise
        row = sum(counts.values()) + 1
        if on_error == "stop":
            said = one_line(e, None)  # (pyarrow's messages run over several lines)
            raise ConfigError(f"--input {unit.source}: unreadable at about row {row} ({type(e).__name__}: {said}); "
                              f"--on-error skip keeps the rows before it and goes on") from None
        counts["unreadable_tail"] += 1


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
