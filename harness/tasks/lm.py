"""Built-in task: a byte-level Transformer language model on a local text file or a prepared corpus of any size
(`harness prepare lm`, read by memory map: `data/corpus.py`).

Its embedded default corpus is the Python documentation's topic pages that ship with every CPython
(`pydoc_data.topics`, Python Software Foundation License), written once to the cache directory.
"""
from __future__ import annotations

import hashlib
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config.run import ConfigError, DataSection, RunConfig, run_steps, setting
from ..data.corpus import BLEND_PERIOD, MANIFEST, Corpus, Mixture, Windows, blend, is_corpus
from ..data.rows import DataSummary, check_paths, check_split, data_format, keep, load_rows
from ..distributed.world import launched_rank
from ..models import hf, sequence
from ..models.transformer import TransformerConfig, TransformerLM, document_positions
from ..prepare import cache_dir
from .interface import ReadData, TaskData

BYTE_VOCAB = 256  # tokens are the UTF-8 bytes; rows are joined by "\n"
LARGE_RAW_BYTES = 100 << 20  # a raw file this big is tokenized at every start: say how to do it once
SAID_RAW_BYTES = 10 << 20  # one this big takes seconds to tokenize: said as it starts
MAX_REPEATS = 4  # a mixture source read more often than this is named at the start


def parse_mix(key: str, value) -> tuple[tuple[str, float], ...]:
    """data.mix as ((directory, weight), ...), from a table of directory = weight, a list of directories (equal
    weights) or a list of [directory, weight] pairs."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        if any(not isinstance(v, (str, list, tuple)) for v in value):
            raise ValueError(f"each item must be a directory or a [directory, weight] pair, got {value!r}")
        pairs = [(v, 1.0) if isinstance(v, str) else tuple(v) for v in value]
    else:
        raise ValueError(f"must be a table of directory = weight or a list of directories, got {value!r}")
    seen = set()
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str) or isinstance(pair[1], bool) or \
                not isinstance(pair[1], (int, float)):
            raise ValueError(f"{list(pair)!r} is not a directory and its weight")
        if not (math.isfinite(pair[1]) and pair[1] > 0):
            raise ValueError(f"the weight of {pair[0]} must be a positive number, got {pair[1]!r}")
        if os.path.realpath(pair[0]) in seen:
            raise ValueError(f"lists {pair[0]} twice")
        seen.add(os.path.realpath(pair[0]))
    drawn = blend([w for _, w in pairs])[2] if pairs else []
    if starved := [path for (path, _), n in zip(pairs, drawn) if n == 0]:
        raise ValueError(f"the weight of {starved[0]} is below 1/{2 * BLEND_PERIOD:,} of the mix, the least a source "
                         f"is drawn at (the blend allocates {BLEND_PERIOD:,} samples at a time): it would never be "
                         f"read; raise it or leave the source out")
    return tuple((path, float(weight)) for path, weight in pairs)


@dataclass(frozen=True)
class Data(DataSection):
    """The lm task's [data] keys beyond the core ones."""
    mix: tuple = setting((), "a weighted blend of prepared corpora instead of data.path, e.g. {\"web\" = 0.7, "
                         "\"books\" = 0.3} (or a list of directories, equal weights): each step draws from each in "
                         "that proportion (docs/corpora.md)", parse=parse_mix)
    document_mask: bool = setting(False, "with a prepared corpus: attention stays inside each document of a "
                                  "window and positions restart at each (the built-in model, and Hugging Face causal "
                                  "LMs that take packed sequences)")


SPLIT_SEED = 0  # data.val_fraction's draw (train.seed's default: a run of seed 0 holds out what it always did)


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


def _check_tokens(cfg: RunConfig, key: str, path: str, corpus: Corpus) -> None:
    """A prepared corpus's tokens are the run's model's: bytes for the lm's own model (or a model.hf without a
    tokenizer), the tokenizer of a model.hf that has one (its fingerprint)."""
    spec = corpus.tokenizer
    kind = spec.get("kind")
    made = "bytes" if kind == "bytes" else "protein residues (harness prepare protein)" if kind == "residues" else \
        f"the tokenizer {spec.get('name', kind)} (vocabulary {spec.get('vocab_size')})"
    if hf.own_tokenizer(cfg):
        from ..prepare.tokenizers import fingerprint

        if kind != "hf" or spec.get("fingerprint") != fingerprint(hf.tokenizer(cfg)):
            raise ConfigError(f"{key} = {path}: prepared with {made}, but {cfg.model.hf} has its own tokenizer; "
                              f"prepare it with --tokenizer {hf.tokenizer_dir(cfg)}")
    elif kind == "residues":
        raise ConfigError(f"{key} = {path}: prepared with {made}, a corpus for the protein task's masked-LM: set "
                          f"run.task = \"protein\" (protein.objective = \"mlm\"), or prepare text with `harness "
                          f"prepare lm`")
    elif kind != "bytes":
        raise ConfigError(f"{key} = {path}: prepared with {made}, but the run's model reads bytes; prepare it "
                          f"without --tokenizer, or name a model.hf with that tokenizer")


class LanguageModelTask:
    """Byte-level with the built-in Transformer; with a Hugging Face causal LM (`model.hf`), its own tokenizer."""

    HF_CLASS = "AutoModelForCausalLM"
    Data = Data
    items = "tokens"
    byte_level = True  # until a run names a Hugging Face model
    loss_chunk = 0  # train.loss_chunk, set by build_model
    hf_model = False  # a Hugging Face model (model.hf), set by build_model
    # `evaluate --data --set` them for the new file (`read`); data.format is reset to "auto" (the new file's name
    # tells it, not the run's), data.text_field keeps the run's (None)
    reader_settings = {"data.format": "auto", "data.text_field": None}

    def check(self, cfg: RunConfig) -> None:
        d = cfg.data
        if d.mix and d.path:
            raise ConfigError(f"data.mix and data.path = {d.path} are both set: a run reads one or the other")
        sources = [p for p, _ in d.mix] or ([d.path] if is_corpus(d.path) else [])
        for path in sources:
            self._check_corpus(cfg, path)
        if sources:
            self._check_val_corpus(cfg)
        if not d.mix and not is_corpus(d.path):
            check_paths(d)
            if d.document_mask:
                given = f"data.path = {d.path!r} is not one" if d.path else "data.path names none (the " \
                    "embedded default text)"
                raise ConfigError(f"data.document_mask = true needs a prepared corpus (its document index), and "
                                  f"{given}; `harness prepare lm` makes one")
        if cfg.model.hf:
            hf.check(cfg, self.HF_CLASS)
            if cfg.train.loss_chunk:
                raise ConfigError(f"train.loss_chunk = {cfg.train.loss_chunk}: the chunked loss is the lm's own "
                                  f"model's; a Hugging Face model (model.hf) computes its own logits; set it to 0")
            if d.document_mask and not hf.takes_packed(cfg, self.HF_CLASS):
                raise ConfigError(f"data.document_mask = true: {cfg.model.hf} does not build its attention mask with "
                                  f"transformers' masking utilities, which keep packed documents apart; set it to "
                                  f"false")
        elif cfg.model.vocab_size not in (0, BYTE_VOCAB):
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size}: the lm task is byte-level; use 0 or 256")

    def check_layout(self, cfg: RunConfig, layout) -> None:
        """Before launch: a document mask's positions are not cut into pipeline stages, nor split by DeepSpeed's
        Hugging Face sequence parallelism (the built-in model's is the harness's own and takes it); nor is the loss
        chunked under a pipeline."""
        if cfg.data.document_mask and (layout.pp_size > 1 or (layout.sp_size > 1 and cfg.model.hf)):
            why = "a pipeline" if layout.pp_size > 1 else "DeepSpeed's sequence parallelism for Hugging Face models"
            raise ConfigError(f"data.document_mask = true is not supported under {why}; set it to false")
        if cfg.train.loss_chunk and layout.pp_size > 1:  # the last stage's loss_fn takes the whole logits
            raise ConfigError(f"train.loss_chunk = {cfg.train.loss_chunk} under a pipeline: its last stage computes "
                              f"the loss from the whole logits, so nothing would be chunked; set it to 0")

    def check_batch(self, cfg: RunConfig, global_batch: int) -> None:
        """Before launch: prepared training data holds a global batch of windows (raw text is sized once read)."""
        d = cfg.data
        sources = [p for p, _ in d.mix] or ([d.path] if is_corpus(d.path) else [])
        if not global_batch or not sources:
            return
        windows = sum(len(Windows(Corpus(p), "train", d.seq_len)) for p in sources)
        if windows < global_batch:
            key = "data.mix" if d.mix else f"data.path = {d.path}"
            raise ConfigError(f"{key}: {windows:,} training window(s) of data.seq_len + 1 = {d.seq_len + 1} tokens, "
                              f"fewer than one global batch of {global_batch}; use more data, a smaller batch or a "
                              f"shorter data.seq_len")

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

    def _check_corpus(self, cfg: RunConfig, path: str) -> None:
        """A prepared corpus: its shards whole, its tokens those of the run's model."""
        key = "data.mix" if cfg.data.mix else "data.path"
        if not is_corpus(path):
            raise ConfigError(f"{key}: {path} is no prepared corpus (no manifest.json); `harness prepare lm --input "
                              f"FILES --out {path}` makes one")
        corpus = Corpus(path)
        corpus.check()
        _check_tokens(cfg, key, path, corpus)
        if corpus.tokens() <= cfg.data.seq_len:
            raise ConfigError(f"{key}: {path} holds {corpus.tokens():,} training tokens, not one window of "
                              f"data.seq_len + 1 = {cfg.data.seq_len + 1}; "
                              f"{'leave it out' if cfg.data.mix else 'prepare more text'} or shorten data.seq_len")

    def _check_val_corpus(self, cfg: RunConfig) -> None:
        """With prepared training data, a data.val_path is a prepared corpus too, checked as the training one."""
        if cfg.data.val_path and not is_corpus(cfg.data.val_path):
            key = "data.mix" if cfg.data.mix else "data.path"
            raise ConfigError(f"data.val_path = {cfg.data.val_path}: with a prepared {key}, validation is a "
                              f"prepared directory too (or the corpus's own, --val-fraction at prepare)")
        if cfg.data.val_path:
            val = Corpus(cfg.data.val_path)
            val.check()
            _check_tokens(cfg, "data.val_path", cfg.data.val_path, val)
            if val.tokens() <= cfg.data.seq_len:
                raise ConfigError(f"data.val_path = {cfg.data.val_path}: its training split (what validation reads) "
                                  f"holds {val.tokens():,} tokens, not one window of data.seq_len + 1 = "
                                  f"{cfg.data.seq_len + 1}; prepare more text for it, or shorten data.seq_len")

    def describe_data(self, cfg: RunConfig, global_batch: int) -> str | None:
        """The plan's and the start's account of prepared data: each corpus's size, a step's tokens, the epochs the
        run covers (of each source of a mixture, naming one read more than MAX_REPEATS times)."""
        d, seq = cfg.data, cfg.data.seq_len
        if not d.mix and not is_corpus(d.path):
            return None
        sources = [(p, w) for p, w in d.mix] or [(d.path, 1.0)]
        corpora = [Corpus(p) for p, _ in sources]
        windows = [max(1, len(Windows(c, "train", seq))) for c in corpora]
        steps = run_steps(cfg.train, sum(windows) // global_batch)
        total = sum(w for _, w in sources)
        val = f"; validation: data.val_path = {d.val_path} ({Corpus(d.val_path).tokens():,} tokens: its training " \
            f"split)" if d.val_path else ""
        lines = [f"data: {'a mixture of prepared corpora' if d.mix else 'a prepared corpus'}; a step reads "
                 f"{global_batch * seq:,} tokens ({global_batch} x {seq}), {steps:,} steps{val}"]
        for (path, weight), corpus, n in zip(sources, corpora, windows):
            epochs = steps * global_batch * weight / total / n
            share = f"weight {weight / total:.3g}: " if d.mix else ""
            own_val = "" if d.val_path else f", validation {corpus.tokens('validation'):,} tokens"
            lines.append(f"  {path}: {share}{corpus.tokens():,} tokens in {corpus.documents():,} documents, "
                         f"{len(corpus.shards['train'])} shard(s) of {corpus.dtype.name}{own_val}; the run reads it "
                         f"{epochs:.3g} times"
                         + (f" -- more than {MAX_REPEATS} repeats: a model may memorise it" if epochs > MAX_REPEATS
                            else ""))
        held = Corpus(d.val_path).tokens() if d.val_path else sum(c.tokens("validation") for c in corpora)
        source = "data.val_path" if d.val_path else f"the {'corpora' if d.mix else 'corpus'}'s own (--val-fraction " \
                                                    f"at prepare; data.val_fraction is for raw text)"
        capped = cfg.train.eval_batches * global_batch
        reads = f"~{held // seq:,} windows, all of it (train.eval_batches caps it)" if not 0 < capped < held // seq \
            else f"{capped:,} windows of ~{held // seq:,} (train.eval_batches = {cfg.train.eval_batches} global " \
                 f"batches)"
        lines.append(f"  validation: {source}; an evaluation reads {reads}")
        return "\n".join(lines)

    def build_data(self, cfg: RunConfig) -> TaskData:
        d = cfg.data
        if d.mix or is_corpus(d.path):
            return self._corpus_data(cfg)
        started = time.monotonic()
        path = d.path or default_corpus()
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        if size > SAID_RAW_BYTES and launched_rank() == 0:  # (before the start line: seconds with no word)
            print(f"data: tokenizing {size / 2**20:,.0f} MB of {path} (at every start of a raw file)", flush=True)
        data = self._raw_data(cfg)
        if size > LARGE_RAW_BYTES:
            print(f"data: tokenizing {size / 2**20:,.0f} MB of {path} took "
                  f"{time.monotonic() - started:.0f} s; `harness prepare lm --input {path} --out DIR` does it once "
                  f"(then data.path = DIR starts in seconds)", flush=True)
        return data

    def _corpus_data(self, cfg: RunConfig) -> TaskData:
        """Windows over a prepared corpus, or a blend of several (data.mix); validation: data.val_path's, else the
        corpora's own held-out documents."""
        d = cfg.data
        corpora = [Corpus(p) for p, _ in d.mix] or [Corpus(d.path)]
        train = [Windows(c, "train", d.seq_len, d.document_mask) for c in corpora]
        val = [Windows(Corpus(d.val_path), "train", d.seq_len, d.document_mask)] if d.val_path else \
            [Windows(c, "validation", d.seq_len, d.document_mask) for c in corpora]
        return TaskData(Mixture(train, [w for _, w in d.mix], cfg.train.seed) if d.mix else train[0],
                        Mixture(val) if len(val) > 1 else val[0])

    def _raw_data(self, cfg: RunConfig) -> TaskData:
        d = cfg.data
        rows = load_rows(d.path or default_corpus(), d)
        if d.val_path:
            val_rows = load_rows(d.val_path, d, split="validation")
        elif d.val_fraction:
            check_split(d.path or "the default text", len(rows), d.val_fraction)  # before launch too, if read whole
            # drawn apart from train.seed: the seeds of one study are scored on one validation set
            parts = rows.train_test_split(test_size=d.val_fraction, shuffle=True, seed=SPLIT_SEED)
            rows, val_rows = parts["train"], parts["test"]
        else:
            val_rows = rows.select([])
        summary = DataSummary.of(train=rows, validation=val_rows)
        encode = self._encoder(cfg)
        train = self._pack(keep(rows), d.seq_len, encode)
        if len(train) == 0:
            raise ConfigError(f"{d.path or 'the default text'}: its training rows hold fewer tokens than one sample of "
                              f"data.seq_len + 1 = {d.seq_len + 1}; shorten data.seq_len or use more data")
        return TaskData(train, self._pack(keep(val_rows), d.seq_len, encode), summary)

    def read(self, cfg: RunConfig, path: Path, stored) -> ReadData:
        """`harness evaluate --data PATH`: a text file read as data.path is, its format told by its name (or --set
        data.format) and the same cleaning, cut into windows of data.seq_len + 1 tokens as the validation split is
        (a last part shorter than a window is not scored); or a prepared corpus: every window of its documents,
        held-out ones too."""
        d, name = cfg.data, str(path)
        if name.startswith("hub:"):
            raise ConfigError(f"--data {name}: scores files; prepare the data set once (harness prepare lm --input "
                              f"{name} --out DIR) and score DIR")
        if is_corpus(name):
            return self._read_corpus(cfg, name)
        if os.path.isdir(name):
            raise ConfigError(f"--data {name}: a folder that is no prepared corpus (no {MANIFEST}); name a file, or "
                              f"prepare the folder (harness prepare lm --input {name} --out DIR) and score DIR")
        if os.path.isfile(name) and os.path.getsize(name) == 0:
            raise ConfigError(f"--data {name}: the file is empty: nothing to score")
        rows = load_rows(name, d)
        kept = keep(rows)
        windows = self._pack(kept, d.seq_len, self._encoder(cfg))
        if len(windows) == 0 and len(kept):
            raise ConfigError(f"--data {name}: its rows hold fewer tokens than one window of data.seq_len + 1 = "
                              f"{d.seq_len + 1}: nothing to score")
        return ReadData(windows, dict(Counter(rows["status"])), [Path(name)])

    def _read_corpus(self, cfg: RunConfig, name: str) -> ReadData:
        corpus, seq = Corpus(name), cfg.data.seq_len
        corpus.check()
        _check_tokens(cfg, "--data", name, corpus)
        windows = [Windows(corpus, split, seq, cfg.data.document_mask) for split in ("train", "validation")
                   if corpus.tokens(split) > seq]
        if not windows:
            raise ConfigError(f"--data {name}: holds {corpus.tokens() + corpus.tokens('validation'):,} tokens, not "
                              f"one window of data.seq_len + 1 = {seq + 1}: nothing to score")
        counts = {"ok": corpus.documents() + corpus.documents("validation")}
        return ReadData(Mixture(windows) if len(windows) > 1 else windows[0], counts, [Path(name) / MANIFEST])

    def _encoder(self, cfg: RunConfig):
        """Rows -> one token stream: their UTF-8 bytes joined by "\n", or the HF tokenizer's ids joined by EOS."""
        if not hf.own_tokenizer(cfg):
            return lambda texts: list("\n".join(texts).encode("utf-8"))
        self.byte_level = False
        tok = hf.tokenizer(cfg)
        if tok.eos_token_id is None:
            raise ConfigError(f"model.hf = {cfg.model.hf!r}: its tokenizer has no EOS token to separate the rows")
        # what the function holds, not a module's globals: datasets hashes it to find its cache of the packing, and a
        # module's dict (a ContextVar in it) cannot be hashed: a random hash, said, and the rows packed at every start
        as_text, eos = hf.AS_TEXT, tok.eos_token_id
        return lambda texts: [i for ids in tok(list(texts), **as_text)["input_ids"] for i in (*ids, eos)]

    def data_identity(self, cfg: RunConfig) -> dict | None:
        """What a checkpoint records of the data, so that a resume on other data is refused: the corpora's
        fingerprints (and a mixture's weights), or a text file's bytes with the settings that choose its rows and
        its split (none for a Hub data set: its revision is not known without the network); and the windows' length,
        by which the place in the data is counted."""
        found = self._data_identity(cfg)
        return found and {**found, "windows": cfg.data.seq_len + 1}

    def _data_identity(self, cfg: RunConfig) -> dict | None:
        d = cfg.data
        if d.mix:
            total = sum(w for _, w in d.mix)  # {web = 7, books = 3} is {web = 0.7, books = 0.3}
            parts = "".join(f"{Corpus(p).fingerprint}:{w / total:.12g};" for p, w in d.mix)
            return {"path": "data.mix of " + ", ".join(p for p, _ in d.mix),
                    "fingerprint": hashlib.sha256(parts.encode()).hexdigest()[:16]}
        if is_corpus(d.path):
            return Corpus(d.path).identity
        path = d.path or default_corpus()
        if not os.path.isfile(path):
            return None
        kind = data_format(path, d.format)  # the settings that choose the rows and the split, where they do
        digest = hashlib.sha256(repr((kind, d.text_field if kind != "text" else None,
                                      None if d.val_path else d.val_fraction, d.max_row_chars)).encode())
        with open(path, "rb") as f:  # (read whole anyway, to be tokenised)
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        return {"path": d.path or "the embedded default text", "fingerprint": digest.hexdigest()[:16]}

    def sample_order(self, cfg: RunConfig) -> str:
        """StepSampler's `order`: a blend orders its samples itself (each source permuted within its own epochs, the
        blend's proportions in every step); one prepared corpus is permuted without holding the order."""
        return "given" if cfg.data.mix else "lazy" if is_corpus(cfg.data.path) else "held"

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
        batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
        if "documents" in samples[0]:  # data.document_mask: each input position's document
            batch["documents"] = torch.stack([s["documents"] for s in samples])[:, :-1].long()
        return batch

    def sequence_split(self, batch: dict[str, torch.Tensor]) -> dict[str, str]:
        """Sequence parallelism: inputs, targets (and documents) split by positions."""
        return {key: "positions" for key in batch}

    def activations_on_paper(self, cfg: RunConfig) -> bool:
        """The decoder is one stack of blocks over every position: the plan's activation formula describes it."""
        return True

    def sequence_length(self, cfg: RunConfig) -> tuple[int, tuple[str, ...]]:
        """The positions of every sample and the key that sets them."""
        return cfg.data.seq_len, ("data.seq_len",)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["targets"].numel()

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The built-in model takes each position's document (data.document_mask); a Hugging Face one its positions
        (`loss`)."""
        if "documents" in batch and not self.hf_model:
            return batch["inputs"], batch["documents"]
        return (batch["inputs"],)

    def loss_from(self, outputs, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = hf.logits(outputs)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten(), reduction="sum")

    def loss(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.loss_chunk:  # the model sums the loss itself, a chunk of positions at a time (train.loss_chunk)
            return model(*self.inputs(batch), targets=batch["targets"], chunk=self.loss_chunk)
        ids = batch["inputs"]
        if self.hf_model and "documents" in batch:  # packed documents: transformers masks by restarting positions
            return self.loss_from(model(ids, position_ids=document_positions(batch["documents"])), batch)
        if self.hf_model and sequence.current() is not None:  # split by DeepSpeed's HF Ulysses: global positions,
            start = sequence.offset(ids.shape[1])  # contiguous (its wrapper all-gathers them; NCCL takes no views)
            positions = torch.arange(start, start + ids.shape[1], device=ids.device).repeat(len(ids), 1)
            return self.loss_from(model(ids, position_ids=positions), batch)
        return self.loss_from(model(*self.inputs(batch)), batch)

    def metrics(self, mean_loss: float) -> dict[str, float]:
        out = {"loss": mean_loss, "perplexity": math.exp(min(mean_loss, 50.0))}
        return {**out, "bits_per_byte": mean_loss / math.log(2)} if self.byte_level else out
