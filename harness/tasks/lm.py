"""Built-in task: a byte-level Transformer language model on a local text file or a prepared corpus of any size
(`harness prepare lm`, read by memory map: `data/corpus.py`).

Its embedded default corpus is the Python documentation's topic pages that ship with every CPython
(`pydoc_data.topics`, Python Software Foundation License), written once to the cache directory.
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F

from ..config.run import ConfigError, RunConfig
from ..data.corpus import Corpus, Windows, is_corpus
from ..data.rows import DataSummary, check_paths, keep, load_rows
from ..models import hf, sequence
from ..models.transformer import TransformerConfig, TransformerLM
from ..prepare import cache_dir
from .interface import TaskData

BYTE_VOCAB = 256  # tokens are the UTF-8 bytes; rows are joined by "\n"
LARGE_RAW_BYTES = 100 << 20  # a raw file this big is tokenized at every start: say how to do it once


def default_corpus() -> str:
    """Path of the embedded default text, written atomically on first use."""
    import pydoc_data.topics

    path = cache_dir() / "pydoc_topics.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)))
        os.replace(tmp, path)
    return str(path)


class LanguageModelTask:
    """Byte-level with the built-in Transformer; with a Hugging Face causal LM (`model.hf`), its own tokenizer."""

    HF_CLASS = "AutoModelForCausalLM"
    items = "tokens"
    byte_level = True  # until a run names a Hugging Face model
    loss_chunk = 0  # train.loss_chunk, set by build_model
    hf_model = False  # a Hugging Face model (model.hf), set by build_model

    def check(self, cfg: RunConfig) -> None:
        if is_corpus(cfg.data.path):
            self._check_corpus(cfg)
        else:
            check_paths(cfg.data)
        if cfg.model.hf:
            hf.check(cfg, self.HF_CLASS)
            if cfg.train.loss_chunk:
                raise ConfigError(f"train.loss_chunk = {cfg.train.loss_chunk}: the chunked loss is the lm's own "
                                  f"model's; a Hugging Face model (model.hf) computes its own logits; set it to 0")
        elif cfg.model.vocab_size not in (0, BYTE_VOCAB):
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: the lm task is byte-level; use 0 or 256")

    def build_model(self, cfg: RunConfig):
        m = cfg.model
        self.hf_model = bool(m.hf)
        if m.hf:
            self.byte_level = not hf.own_tokenizer(cfg)
            byte_ids = dict(vocab_size=BYTE_VOCAB, pad_token_id=None, bos_token_id=None, eos_token_id=None)
            return hf.build(cfg, self.HF_CLASS, use_cache=False,  # no key/value cache while training
                            **({} if hf.own_tokenizer(cfg) else byte_ids))
        self.loss_chunk = cfg.train.loss_chunk
        return TransformerLM(TransformerConfig(vocab_size=BYTE_VOCAB, max_seq_len=cfg.data.seq_len,
                                               d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                                               d_ff=m.d_ff or 4 * m.d_model, dropout=m.dropout))

    def _check_corpus(self, cfg: RunConfig) -> None:
        """A prepared corpus: its shards whole, its tokens those of the run's model, a validation set named."""
        corpus = Corpus(cfg.data.path)
        corpus.check()
        kind, own = corpus.tokenizer["kind"], hf.own_tokenizer(cfg)
        if own:
            from ..prepare.corpus import fingerprint

            tok = hf.tokenizer(cfg)
            if kind != "hf" or corpus.tokenizer["fingerprint"] != fingerprint(tok):
                raise ConfigError(f"data.path = {cfg.data.path}: prepared with {corpus.tokenizer.get('name', kind)} "
                                  f"tokens, but {cfg.model.hf} has its own tokenizer; prepare it with "
                                  f"--tokenizer {hf.tokenizer_dir(cfg)}")
        elif kind != "bytes":
            raise ConfigError(f"data.path = {cfg.data.path}: prepared with the tokenizer {corpus.tokenizer['name']} "
                              f"(vocabulary {corpus.tokenizer['vocab_size']}), but the run's model reads bytes; "
                              f"prepare it without --tokenizer, or name a model.hf with that tokenizer")
        if cfg.data.val_path and not is_corpus(cfg.data.val_path):
            raise ConfigError(f"data.val_path = {cfg.data.val_path}: with a prepared data.path, validation is a "
                              f"prepared directory too (or the corpus's own, --val-fraction at prepare)")
        if cfg.data.val_path:
            Corpus(cfg.data.val_path).check()

    def describe_data(self, cfg: RunConfig, global_batch: int) -> str | None:
        """`harness plan`'s line on a prepared corpus: its size, a step's tokens, the epochs the run covers."""
        if not is_corpus(cfg.data.path):
            return None
        corpus, seq = Corpus(cfg.data.path), cfg.data.seq_len
        windows = max(1, len(Windows(corpus, "train", seq)))
        steps = cfg.train.max_steps or math.ceil(cfg.train.epochs * (windows // global_batch))
        covered = f"; {steps:,} steps cover {steps * global_batch / windows:.3g} epochs" if steps else ""
        return (f"data: prepared corpus {cfg.data.path}: {corpus.tokens():,} tokens in {corpus.documents():,} "
                f"documents, {len(corpus.shards['train'])} shards ({corpus.dtype.name}); validation "
                f"{corpus.tokens('validation'):,} tokens; a step reads {global_batch * seq:,} tokens "
                f"({global_batch} x {seq}){covered}")

    def build_data(self, cfg: RunConfig) -> TaskData:
        d = cfg.data
        if is_corpus(d.path):
            return self._corpus_data(cfg)
        started = time.monotonic()
        data = self._raw_data(cfg)
        path = d.path or default_corpus()
        if os.path.isfile(path) and os.path.getsize(path) > LARGE_RAW_BYTES:
            print(f"data: tokenizing {os.path.getsize(path) / 2**20:,.0f} MB of {path} took "
                  f"{time.monotonic() - started:.0f} s; `harness prepare lm --input {path} --out DIR` does it once "
                  f"(then data.path = DIR starts in seconds)", flush=True)
        return data

    def _corpus_data(self, cfg: RunConfig) -> TaskData:
        d, corpus = cfg.data, Corpus(cfg.data.path)
        train = Windows(corpus, "train", d.seq_len)
        val = Windows(Corpus(d.val_path), "train", d.seq_len) if d.val_path else \
            Windows(corpus, "validation", d.seq_len)
        return TaskData(train, val, CorpusSummary(corpus, train, val))

    def _raw_data(self, cfg: RunConfig) -> TaskData:
        d = cfg.data
        rows = load_rows(d.path or default_corpus(), d)
        if d.val_path:
            val_rows = load_rows(d.val_path, d, split="validation")
        elif d.val_fraction:
            parts = rows.train_test_split(test_size=d.val_fraction, shuffle=True, seed=cfg.train.seed)
            rows, val_rows = parts["train"], parts["test"]
        else:
            val_rows = rows.select([])
        summary = DataSummary.of(train=rows, validation=val_rows)
        encode = self._encoder(cfg)
        return TaskData(self._pack(keep(rows), d.seq_len, encode), self._pack(keep(val_rows), d.seq_len, encode),
                        summary)

    def _encoder(self, cfg: RunConfig):
        """Rows -> one token stream: their UTF-8 bytes joined by "\n", or the HF tokenizer's ids joined by EOS."""
        if not hf.own_tokenizer(cfg):
            return lambda texts: list("\n".join(texts).encode("utf-8"))
        self.byte_level = False
        tok = hf.tokenizer(cfg)
        if tok.eos_token_id is None:
            raise ConfigError(f"model.hf = {cfg.model.hf!r}: its tokenizer has no EOS token to separate the rows")
        return lambda texts: [i for ids in tok(list(texts), add_special_tokens=False)["input_ids"]
                              for i in (*ids, tok.eos_token_id)]

    def data_identity(self, cfg: RunConfig) -> dict | None:
        """What a checkpoint records of a prepared corpus, so that a resume on other data is refused."""
        return {"path": cfg.data.path, "fingerprint": Corpus(cfg.data.path).fingerprint} \
            if is_corpus(cfg.data.path) else None

    def lazy_order(self, cfg: RunConfig) -> bool:
        """A prepared corpus's samples are ordered without holding the order (StepSampler's `lazy`)."""
        return is_corpus(cfg.data.path)

    def tokenizer(self, cfg: RunConfig):
        return hf.tokenizer(cfg) if hf.own_tokenizer(cfg) else None

    @staticmethod
    def _pack(rows, seq_len: int, encode):
        """Concatenate the rows' tokens and cut them into samples of seq_len + 1 tokens (inputs and shifted targets)."""
        n = seq_len + 1

        def chunk(batch):
            stream = encode(batch["text"])
            return {"ids": [list(stream[i:i + n]) for i in range(0, len(stream) - n + 1, n)]}

        packed = rows.map(chunk, batched=True, batch_size=10_000, remove_columns=["text"], desc="packing")
        return packed.with_format("torch")

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        ids = torch.stack([s["ids"] for s in samples]).long()  # (B, T + 1); a prepared corpus's come narrower
        return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}

    def sequence_split(self, batch: dict[str, torch.Tensor]) -> dict[str, str]:
        """Sequence parallelism: inputs and targets split by positions."""
        return {"inputs": "positions", "targets": "positions"}

    def sequence_length(self, cfg: RunConfig) -> tuple[int, tuple[str, ...]]:
        """The positions of every sample and the key that sets them."""
        return cfg.data.seq_len, ("data.seq_len",)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["targets"].numel()

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        return (batch["inputs"],)

    def loss_from(self, outputs, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = hf.logits(outputs)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), reduction="sum")

    def loss(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.loss_chunk:  # the model sums the loss itself, a chunk of positions at a time (train.loss_chunk)
            return model(batch["inputs"], batch["targets"], self.loss_chunk)
        ids = batch["inputs"]
        if self.hf_model and sequence.current() is not None:  # split by DeepSpeed's HF Ulysses: global positions,
            start = sequence.offset(ids.shape[1])  # contiguous (its wrapper all-gathers them; NCCL takes no views)
            positions = torch.arange(start, start + ids.shape[1], device=ids.device).repeat(len(ids), 1)
            return self.loss_from(model(ids, position_ids=positions), batch)
        return self.loss_from(model(*self.inputs(batch)), batch)

    def metrics(self, mean_loss: float) -> dict[str, float]:
        out = {"loss": mean_loss, "perplexity": math.exp(min(mean_loss, 50.0))}
        return {**out, "bits_per_byte": mean_loss / math.log(2)} if self.byte_level else out


class CorpusSummary:
    """The start line's account of a prepared corpus."""

    def __init__(self, corpus: Corpus, train: Windows, val: Windows):
        self.corpus, self.train, self.val = corpus, train, val

    def line(self) -> str:
        c = self.corpus
        return (f"data: prepared corpus {c.dir}: train {c.tokens():,} tokens, {c.documents():,} documents, "
                f"{len(c.shards['train'])} shards, {len(self.train):,} samples; validation {len(self.val):,} samples")
