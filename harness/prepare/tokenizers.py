"""The tokenizers a corpus is prepared with (`--tokenizer`), each turning a block of documents into ids and the
documents' ends: UTF-8 bytes (the lm task's own), the protein task's residue ids (`residues`), or a Hugging Face
tokenizer; each says in its `spec` what the manifest records of it, a Hugging Face one by its `fingerprint`.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..config.run import ConfigError

NEWLINE = 10
RESIDUES = "residues"  # the protein task's tokenizer (`harness prepare protein --input`)


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
        self.where = self._source(name)
        self._load()

    @staticmethod
    def _source(name: str) -> str:
        """Where the tokenizer is read from: a local directory, or a hub id (its cached snapshot where the Hub does
        not answer: `models.hf.hub_source`); a name that is a path (./, /, ~, or more than OWNER/NAME) is not sent to
        the Hub."""
        from ..models.hf import hub_source

        path = Path(name).expanduser()
        if path.exists():
            return name
        if name.startswith((".", "/", "~")) or len(path.parts) > 2:
            raise ConfigError(f"--tokenizer {name}: no such directory (a hub id is NAME or OWNER/NAME)")
        return hub_source(name, "--tokenizer")

    def _load(self) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(self.where)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer {self.name}: no tokenizer there ({str(e).splitlines()[0]})") from None
        if self.tok.eos_token_id is None:
            raise ConfigError(f"--tokenizer {self.name}: it has no EOS token to end each document with")
        self.spec = {"kind": "hf", "name": self.name, "vocab_size": len(self.tok), "separator": self.tok.eos_token_id,
                     "fingerprint": fingerprint(self.tok)}

    def __getstate__(self):  # a worker loads its own, from where this one found it (no second look at the Hub)
        return {"name": self.name, "where": self.where}

    def __setstate__(self, state):
        self.name, self.where = state["name"], state["where"]
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
