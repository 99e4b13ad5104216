"""A prepared corpus (`harness prepare lm`), read by memory map: its format, its checks, its fixed-length windows.

The format (docs/corpora.md says it for other tools): a directory with `manifest.json` and, per shard, `NAME.bin`
(the token ids, little-endian, of the manifest's `dtype`: each document followed by the separator token) and
`NAME.idx` (little-endian uint32: the end offset of each document in the shard, in tokens). A split's token stream is
its shards in manifest order. Nothing here reads a shard whole: starting costs the same for 100 MB as for 10 GB.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config.run import ConfigError

MANIFEST = "manifest.json"
FORMAT = "harness-corpus"
VERSION = 1
VERIFIED = "verified.json"  # shard -> (size, mtime_ns) whose sha256 matched: an unchanged shard is not read again
SPLITS = ("train", "validation")
INDEX = np.dtype("<u4")  # a document's end in its shard


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned type that holds every token id."""
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def is_corpus(path: str | Path) -> bool:
    return bool(path) and (Path(path) / MANIFEST).is_file()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Shard:
    path: Path       # NAME.bin; its index is NAME.idx beside it
    tokens: int
    documents: int
    sha256: str
    idx_sha256: str | None = None  # (corpora prepared before the index had its checksum: None)

    @classmethod
    def of(cls, directory: Path, record: dict) -> "Shard":
        """A manifest's (or a prepare unit's) shard record, its file found from `directory`."""
        return cls((directory / record["file"]).resolve(), record["tokens"], record["documents"], record["sha256"],
                   record.get("idx_sha256"))

    @property
    def index(self) -> Path:
        return self.path.with_suffix(".idx")

    def problem(self, dtype: np.dtype, stamps: dict, fresh: dict) -> str | None:
        """What is wrong with the shard's two files, or None: each there, of the size its record says, and of its
        checksum, read again only where the file changed since `stamps` (path -> [size, mtime_ns]) recorded it
        checked. The stamps of what passed go into `fresh`."""
        files = ((self.path, self.tokens * dtype.itemsize, self.sha256),
                 (self.index, self.documents * INDEX.itemsize, self.idx_sha256))
        for file, size, digest in files:
            if not file.is_file():
                return f"shard {file.name} is missing"
            if file.stat().st_size != size:
                return f"shard {file.name} holds {file.stat().st_size} bytes, its manifest says {size}: truncated " \
                       f"or changed"
        for file, _, digest in files:
            stat = file.stat()
            key, seen = str(file), [stat.st_size, stat.st_mtime_ns]
            if digest is not None and stamps.get(key) != seen and sha256(file) != digest:
                return f"shard {file.name} fails its checksum (sha256): the file changed since it was prepared"
            if digest is not None:
                fresh[key] = seen
        return None


class Corpus:
    """A prepared directory's manifest, its shards checked (present, of their size, their checksum once)."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        try:
            self.manifest = json.loads((self.dir / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.dir}: no readable {MANIFEST} ({e}); prepare it with `harness prepare lm`") \
                from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ConfigError(f"{self.dir / MANIFEST}: not a {FORMAT} manifest of version {VERSION}")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.tokenizer = self.manifest["tokenizer"]
        self.shards = {split: [Shard.of(self.dir, s) for s in self.manifest["shards"] if s["split"] == split]
                       for split in SPLITS}

    @property
    def fingerprint(self) -> str:
        """What a checkpoint records of the data it trained on: the shards' checksums, in order (not their indexes':
        a corpus prepared before they had checksums keeps its fingerprint; `check` verifies them)."""
        digest = hashlib.sha256("".join(s.sha256 for split in SPLITS for s in self.shards[split]).encode())
        return digest.hexdigest()[:16]

    @property
    def identity(self) -> dict:
        """What a checkpoint records of the data it trained on (`data.json`); a resume compares the fingerprint."""
        return {"path": str(self.dir), "fingerprint": self.fingerprint}

    def tokens(self, split: str = "train") -> int:
        return sum(s.tokens for s in self.shards[split])

    def documents(self, split: str = "train") -> int:
        return sum(s.documents for s in self.shards[split])

    def check(self) -> None:
        """Every shard there, of the size its manifest says, and (once per change of the file) its checksum."""
        stamps, fresh = read_stamps(self.dir), {}
        for shard in (s for split in SPLITS for s in self.shards[split]):
            problem = shard.problem(self.dtype, stamps, fresh)
            if problem:
                again = "prepare it again: the same command redoes that unit"
                if self.manifest.get("merged"):
                    again = "prepare its part again (the part's command redoes that unit), then --merge again"
                raise ConfigError(f"{self.dir}: {problem}; {again}")
        if fresh != stamps:
            write_stamps(self.dir, fresh)


def read_stamps(directory: Path) -> dict:
    """`verified.json`: the files whose checksums matched, as [size, mtime_ns] when they did."""
    try:
        stamps = json.loads((directory / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def write_stamps(directory: Path, stamps: dict) -> None:
    try:
        write_whole(directory / VERIFIED, json.dumps(stamps))
    except OSError:  # a read-only corpus: checked again next time
        pass


TMP = ".tmp"  # the suffix of a corpus file being written


def partial(path: Path) -> Path:
    """A corpus file's name while this process writes it (`harness prepare lm` removes what killed ones leave)."""
    return path.with_name(f"{path.name}.{os.getpid()}{TMP}")


def write_whole(path: Path, text: str) -> None:
    """`path` whole or not at all: written under `partial`'s name, then renamed (the partial file removed on error)."""
    tmp = partial(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def permute(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """A seeded permutation of range(n) evaluated at `positions` alone: a 4-round Feistel network over the smallest
    even number of bits that covers n, walked again while a value falls outside it (cycle walking), so an epoch's
    order costs nothing to set up and nothing to keep, whatever n. In numpy: a step's few hundred positions pay no
    per-operation dispatch."""
    if n < 1:
        raise ValueError(f"permute: no order of {n} items")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    rounds = np.random.default_rng(key).integers(0, 1 << 31, 4, dtype=np.uint64)
    out = np.asarray(positions).astype(np.uint64)
    todo = np.ones(len(out), dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> np.uint64(half), x & mask
        for k in rounds:
            mixed = (right * np.uint64(0x9E3779B1) + k) & np.uint64(0xFFFFFFFF)
            mixed = ((mixed ^ (mixed >> np.uint64(15))) * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
            left, right = right, left ^ ((mixed ^ (mixed >> np.uint64(12))) & mask)
        out[todo] = (left << np.uint64(half)) | right
        todo = out >= n
    return out.astype(np.int64)


class ShardMaps:
    """A split's shards and their document indexes, memory-mapped in each process on first use (a DataLoader
    worker opens its own); `starts` and `firsts`: each shard's first token and first document in the split."""

    def __init__(self, corpus: Corpus, split: str):
        shards = corpus.shards[split]
        self.paths, self.dtype = [str(s.path) for s in shards], corpus.dtype
        self.starts = np.cumsum([0] + [s.tokens for s in shards])
        self.firsts = np.cumsum([0] + [s.documents for s in shards])
        self._tokens: list | None = None
        self._ends: list | None = None

    def shard_tokens(self, k: int) -> np.ndarray:
        if self._tokens is None:
            self._tokens = [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
        return self._tokens[k]

    def shard_ends(self, k: int) -> np.ndarray:
        """Shard k's document ends, in tokens (its .idx)."""
        if self._ends is None:
            self._ends = [np.memmap(Path(p).with_suffix(".idx"), dtype=INDEX, mode="r") for p in self.paths]
        return self._ends[k]


class Windows(ShardMaps):
    """Sample i: the tokens [i * seq_len, i * seq_len + seq_len + 1) of a split's stream (inputs and shifted
    targets), read from the memory-mapped shards; the maps are opened in each process on first use. With
    `documents`, each token's document too (numbered from the window's first), from the shards' indexes. A map-style
    data set for torch's DataLoader; torch is imported on first read, so `harness prepare lm`'s workers never import
    it."""

    def __init__(self, corpus: Corpus, split: str, seq_len: int, documents: bool = False):
        super().__init__(corpus, split)
        self.seq_len, self.documents = seq_len, documents
        self.n = max(0, (int(self.starts[-1]) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def tokens(self, start: int, stop: int) -> np.ndarray:
        parts = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            local = start - int(self.starts[shard])
            take = min(stop - start, int(self.starts[shard + 1]) - start)
            parts.append(self.shard_tokens(shard)[local:local + take])
            start, shard = start + take, shard + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def document_ids(self, start: int, stop: int) -> np.ndarray:
        """Each token's document in [start, stop), numbered from the first one's: a document ends with its
        separator, the index's end offset."""
        at = np.arange(start, stop)
        shard = np.searchsorted(self.starts, at, side="right") - 1
        out = np.empty(len(at), dtype=np.int64)
        for s in np.unique(shard):
            mine = shard == s
            out[mine] = self.firsts[s] + np.searchsorted(self.shard_ends(s), at[mine] - self.starts[s], side="right")
        return (out - out[0]).astype(np.int32)

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        """A batch's windows at once (torch's DataLoader asks so), copied out of the maps in their own dtype (int32
        for 16- and 32-bit ids: torch's own unsigned types do little); the task's collate makes them int64."""
        if any(not 0 <= i < self.n for i in indices):
            raise IndexError(indices)
        span = self.seq_len + 1
        rows = np.stack([self.tokens(i * self.seq_len, i * self.seq_len + span) for i in indices])
        import torch

        ids = torch.from_numpy(rows if rows.dtype == np.uint8 else rows.astype(np.int32))
        if not self.documents:
            return [{"ids": row} for row in ids]
        docs = torch.from_numpy(np.stack([self.document_ids(i * self.seq_len, i * self.seq_len + span)
                                          for i in indices]))
        return [{"ids": row, "documents": d} for row, d in zip(ids, docs)]


class Documents(ShardMaps):
    """Document i of a split, its tokens without the separator, read from the memory-mapped shards and indexes
    (e.g. one protein sequence a document, for a masked LM)."""

    def __init__(self, corpus: Corpus, split: str):
        super().__init__(corpus, split)
        self.n = int(self.firsts[-1])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        shard = int(np.searchsorted(self.firsts, i, side="right")) - 1
        tokens, ends = self.shard_tokens(shard), self.shard_ends(shard)
        j = i - int(self.firsts[shard])
        return tokens[(int(ends[j - 1]) if j else 0):int(ends[j]) - 1]


BLEND_PERIOD = 4096  # a mixture repeats its allocation of sources every this many samples


def blend(weights) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One period of a mixture: each sample's source, its number among its source's in the period, and each
    source's samples in it (a weight is held as its share of BLEND_PERIOD: one below half of 1/BLEND_PERIOD draws
    none)."""
    weights = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.zeros(len(weights), dtype=np.int64)
    source_of, rank_in = np.empty(BLEND_PERIOD, dtype=np.int64), np.empty(BLEND_PERIOD, dtype=np.int64)
    for p in range(BLEND_PERIOD):
        k = int(np.argmax(weights * (p + 1) - counts))
        source_of[p], rank_in[p] = k, counts[k]
        counts[k] += 1
    return source_of, rank_in, counts


class Mixture:
    """Several sources' windows as one data set. With `weights`, a blend over the run's sample numbers (any i >= 0:
    StepSampler's order "given", so each step holds every source in its share): sample i comes from the source
    furthest below its share of the first i (Megatron-core's BlendedDataset), the allocation of BLEND_PERIOD samples
    computed once and repeated, so sample i's source and its number within the source are arithmetic; a source's
    j-th sample is its window `permute`d in its epoch j // len, so a source read 2.5 times sees every window twice
    and a random half once more. `len` is the sources' windows together: what an epoch of the run reads. Without
    weights, the sources one after another (validation)."""

    def __init__(self, sources: list[Windows], weights: list[float] | None = None, seed: int = 0):
        self.sources, self.seed = sources, seed
        self.sizes = np.array([len(s) for s in sources])
        self.offsets = np.cumsum([0, *self.sizes])  # each source's first sample, one after another
        self.n = int(self.offsets[-1])
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64) / sum(weights)
        if self.weights is not None:
            self.source_of, self.rank_in, self.per_period = blend(self.weights)

    def __len__(self) -> int:
        return self.n

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's source and its window there."""
        if self.weights is None:
            source = np.searchsorted(self.offsets, indices, side="right") - 1
            return source, indices - self.offsets[source]
        period, p = np.divmod(indices, BLEND_PERIOD)
        source = self.source_of[p]
        j = period * self.per_period[source] + self.rank_in[p]
        epoch, local = np.divmod(j, self.sizes[source])
        window = np.empty_like(local)
        for k, e in {(int(k), int(e)) for k, e in zip(source, epoch)}:
            mine = (source == k) & (epoch == e)
            window[mine] = permute(local[mine], int(self.sizes[k]), (self.seed * 1_000_003 + k) * 100_003 + e)
        return source, window

    def __getitem__(self, i: int) -> dict:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        if any(i < 0 or (self.weights is None and i >= self.n) for i in indices):
            raise IndexError(indices)
        source, window = self.locate(np.asarray(indices, dtype=np.int64))
        out: list = [None] * len(indices)
        for k in np.unique(source):
            at = np.flatnonzero(source == k)
            for i, sample in zip(at, self.sources[k].__getitems__(window[at].tolist())):
                out[i] = sample
        return out
