"""Case study: translation with an encoder-decoder Transformer (`harness.models.seq2seq`).

Data, splits and the joint SentencePiece vocabulary come from `harness.prepare.translation`. The loss is
label-smoothed cross-entropy summed over non-padding target tokens (the loop divides by their global count,
across accumulation steps and ranks). Smoothing follows `F.cross_entropy(label_smoothing=eps)`: the target
gets 1 - eps and every vocabulary entry eps / V, i.e. (1 - eps) * nll + eps * mean_v(-log p_v) per token.

`evaluate` decodes a split with beam search (translation.beam_size, GNMT length penalty) and scores the
detokenized output with sacreBLEU's BLEU and chrF (signatures included), next to the BLEU of copying the source
sentence as the translation (the floor any model must clear), and the teacher-forced NLL / perplexity. `read` takes
new pairs for `harness evaluate --data` (formats: `prepare.translation.scoring_sources`) and tokenizes them with the
run's stored tokenizer; `evaluate(..., data=...)` scores them as it scores a split.

With a Hugging Face sequence-to-sequence model (`model.hf`, AutoModelForSeq2SeqLM: T5, Marian, BART...) the model
is called as `model(input_ids, attention_mask, decoder_input_ids)`, its own tokenizer prepares the pairs and its
`generate` decodes (ranks in step under ZeRO-3 and tensor parallelism).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config.run import ConfigError, RunConfig, setting
from ..console import progress
from ..data.batches import eval_batches
from ..data.tokenizer import BOS, EOS, PAD
from ..distributed.world import all_reduce
from ..models import hf
from ..models.decoding import generate, hf_generate
from ..models.seq2seq import Seq2Seq, Seq2SeqConfig
from ..prepare import read_meta, store, summary
from ..prepare import translation as prep
from .interface import ReadData, TaskData
from .metrics import bleu_chrf


@dataclass(frozen=True)
class TranslationSection:
    source_lang: str = setting("en", "language code of the source side (a field name or file suffix in the data)")
    target_lang: str = setting("fr", "language code of the target side")
    label_smoothing: float = setting(0.1, "label smoothing of the cross-entropy; padding never counts")
    beam_size: int = setting(4, "beam width for evaluation and `harness translate`; 1 is greedy decoding",
                             bound="> 0", scoring=True)
    length_penalty: float = setting(0.6, "GNMT length-penalty exponent for beam search; 0 turns it off",
                                    bound=">= 0", scoring=True)
    eval_max_sentences: int = setting(200, "sentences decoded for BLEU at the end of training; 0 means all "
                                      "(`harness evaluate` always decodes the whole split)")


class TranslationTask:
    section, Config = "translation", TranslationSection  # the run file's [translation]: the task's settings
    HF_CLASS = "AutoModelForSeq2SeqLM"
    items = "tokens"  # target tokens
    prepared: Path | None = None  # a run's stored artefacts (RUN/data/), read instead of preparing from data.path

    def __init__(self):
        # The batch methods take no config (task protocol): the run's smoothing, padding id and model kind are
        # bound by `_bind`, which every method given a config calls first.
        self.label_smoothing, self.pad, self.hf = TranslationSection().label_smoothing, PAD, False

    def _bind(self, cfg: RunConfig) -> None:
        self.label_smoothing, self.hf = cfg.task.label_smoothing, bool(cfg.model.hf)
        self.pad = prep.hf_tokenizer(cfg).pad_id if hf.own_tokenizer(cfg) else PAD

    def check(self, cfg: RunConfig) -> None:
        t, m = cfg.task, cfg.model
        if m.hf:
            hf.check(cfg, self.HF_CLASS)
        self._bind(cfg)
        if not 0.0 <= t.label_smoothing < 1.0:
            raise ConfigError(f"translation.label_smoothing = {t.label_smoothing} must be in [0, 1)")
        if t.length_penalty < 0 or t.eval_max_sentences < 0:
            raise ConfigError("translation.length_penalty and translation.eval_max_sentences must be >= 0")
        if m.vocab_size and m.vocab_size < 32:
            raise ConfigError(f"model.vocab_size = {m.vocab_size} is too small for a SentencePiece vocabulary; "
                              f"use 0 (default {prep.DEFAULT_VOCAB}) or at least 32")
        if cfg.data.seq_len < 4:
            raise ConfigError(f"data.seq_len = {cfg.data.seq_len}: translation needs at least 4 tokens a side")
        prep.check(cfg)

    def prepare(self, cfg: RunConfig) -> Path:
        return self.prepared or prep.prepare(cfg)

    def store(self, cfg: RunConfig, out: Path) -> None:
        store(self.prepare(cfg), out, prep.STORED, prep.COMPARED, prep.SCORING_KEYS)

    def read(self, cfg: RunConfig, path: Path, stored: Path) -> list[ReadData]:
        """New pairs, tokenized by the stored tokenizer: the data `evaluate` takes is (pairs, tokenizer)."""
        self._bind(cfg)
        t, tok = cfg.task, prep.tokenizer(stored)
        out = []
        for part, raw, files in prep.scoring_sources(path, t.source_lang, t.target_lang):
            rows, counts = prep.tokenize(raw, tok, cfg.data.seq_len, is_train=False)
            out.append(ReadData((rows, tok), counts, files, part))
        return out

    def build_model(self, cfg: RunConfig) -> Seq2Seq:
        self._bind(cfg)
        m = cfg.model
        if m.hf:  # no key/value cache while training; on the SentencePiece ids, its vocabulary and special ids
            spm_ids = {} if hf.own_tokenizer(cfg) else dict(
                vocab_size=prep.vocab_size(self.prepare(cfg)), pad_token_id=PAD, eos_token_id=EOS,
                bos_token_id=BOS, decoder_start_token_id=BOS)
            return hf.build(cfg, self.HF_CLASS, use_cache=False, **spm_ids)
        # The vocabulary is the prepared tokenizer's: SentencePiece may learn fewer pieces than asked for.
        return Seq2Seq(Seq2SeqConfig(vocab_size=prep.vocab_size(self.prepare(cfg)), d_model=m.d_model,
                                     n_layers=m.n_layers, n_heads=m.n_heads, d_ff=m.d_ff or 4 * m.d_model,
                                     dropout=m.dropout, pad_id=PAD))

    def tokenizer(self, cfg: RunConfig):
        """A Hugging Face model's own tokenizer, for its export (the SentencePiece one stays with the data)."""
        return hf.tokenizer(cfg) if hf.own_tokenizer(cfg) else None

    def build_data(self, cfg: RunConfig) -> TaskData:
        self._bind(cfg)
        directory = self.prepare(cfg)
        columns = ["src_ids", "tgt_ids"]
        return TaskData(prep.load(directory, "train").select_columns(columns),
                        prep.load(directory, "validation").select_columns(columns),
                        summary(read_meta(directory)))

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        src = _pad([s["src_ids"] for s in samples], self.pad)  # (B, S): pieces + EOS, right-padded
        tgt = _pad([s["tgt_ids"] for s in samples], self.pad)  # (B, T + 1): BOS + pieces + EOS
        return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}

    def pad_values(self) -> dict[str, int]:
        """The batch's (B, length) tensors and what pads them (`data.length_buckets`)."""
        return {"src": self.pad, "tgt_in": self.pad, "tgt_out": self.pad}

    def sequence_split(self, batch: dict[str, torch.Tensor]) -> dict[str, str]:
        """Sequence parallelism: source and target split by positions (the model's own, not Hugging Face's)."""
        return {"src": "positions", "tgt_in": "positions", "tgt_out": "positions"}

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["tgt_out"] != self.pad).sum())

    def padding(self, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(real, padded) positions of the batch, source and target sides."""
        src, tgt = batch["src"], batch["tgt_in"]
        return int((src != self.pad).sum()) + self.count(batch), src.numel() + tgt.numel()

    def lengths(self, data) -> list[int]:
        """Each training pair's cost in positions, for length-bucketed batches."""
        return [len(a) + len(b) for a, b in zip(data["src_ids"], data["tgt_ids"])]

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.hf:  # input_ids, attention_mask, decoder_input_ids
            return batch["src"], batch["src"] != self.pad, batch["tgt_in"]
        return batch["src"], batch["tgt_in"], batch["tgt_out"] != PAD  # keep (B, T): the real target tokens

    def loss_from(self, outputs, batch: dict[str, torch.Tensor], label_smoothing: float | None = None) -> torch.Tensor:
        # logits (B, T, V) at every position; the padding's are ignored, not gathered away (no boolean mask: its
        # nonzero would wait for the device every micro-batch)
        eps = self.label_smoothing if label_smoothing is None else label_smoothing
        logits = hf.logits(outputs)
        return F.cross_entropy(logits.float().flatten(0, 1), batch["tgt_out"].flatten(), ignore_index=self.pad,
                               label_smoothing=eps, reduction="sum")

    def loss(self, model, batch: dict[str, torch.Tensor], label_smoothing: float | None = None) -> torch.Tensor:
        return self.loss_from(model(*self.inputs(batch)), batch, label_smoothing)

    def metrics(self, mean_loss: float) -> dict[str, float]:
        return {"loss": mean_loss}  # label-smoothed; `evaluate` reports the plain NLL and perplexity

    # --- the field's evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, model, cfg: RunConfig, split: str, world, in_training: bool = False,
                 max_sentences: int | None = None, data=None) -> dict:
        """BLEU/chrF of beam-search output on `split` (or on `data`: `read`'s pairs and tokenizer), copy-source
        BLEU, NLL; the same on every rank.

        At the end of training (`in_training`) only translation.eval_max_sentences sentences, evenly spread over
        the split, are decoded; `harness evaluate` decodes them all.
        """
        self._bind(cfg)
        if data is None:
            directory = self.prepare(cfg)
            rows, tok = prep.load(directory, split), prep.tokenizer(directory)
            if not len(rows):
                raise ConfigError(f"{directory}: the {split!r} split has no sentence pairs to evaluate")
        else:
            rows, tok = data  # `harness evaluate --data` refuses data that kept no pair
        if max_sentences is None:
            max_sentences = cfg.task.eval_max_sentences if in_training else 0
        n = len(rows) if not max_sentences else min(max_sentences, len(rows))
        chosen = [i * len(rows) // n for i in range(n)]
        # Sorted by source length, so a batch's sentences pad and finish alike; ranks take strided shares.
        chosen.sort(key=lambda i: len(rows[i]["src_ids"]))
        batches, steps = eval_batches(n, cfg.train.micro_batch_size, world.dp_rank, world.dp_size)
        t, dev = cfg.task, world.device

        def any_rank(active: bool) -> bool:  # sync point: decode until every rank's batch is done
            return bool(all_reduce(torch.tensor([float(active)], device=dev)).item())

        was_training = model.training
        model.eval()
        out, nll = [], torch.zeros(2, dtype=torch.float64, device=dev)
        for i in progress(range(steps), desc=f"decoding {split}", disable=not world.is_main, leave=False):
            real = i < len(batches)
            ids = [chosen[j] for j in (batches[i] if real else batches[-1] if batches else [0])]
            batch = {k: v.to(dev) for k, v in self.collate([rows[j] for j in ids]).items()}
            loss = self.loss(model, batch, label_smoothing=0.0)  # one forward on every rank
            hyps = self._decode(model, batch["src"], tok, cfg, any_rank if world.world_size > 1 else None)
            if real:
                nll += torch.tensor([loss.item(), self.count(batch)], dtype=torch.float64, device=dev)
                out += [(j, tok.decode(h)) for j, h in zip(ids, hyps)]
            world.scored(i, steps)  # in training, a stop signal ends it here on every rank
        model.train(was_training)
        all_reduce(nll)  # sync point
        decoded = dict(x for part in world.gather(out) for x in part)  # sync point; index -> hypothesis
        order = sorted(decoded)
        hyps = [decoded[j] for j in order]
        refs = [rows[j]["tgt"] for j in order]
        scores = bleu_chrf(hyps, refs)
        mean_nll = (nll[0] / nll[1]).item()
        return {"bleu": scores["bleu"], "chrf": scores["chrf"],
                "copy_source_bleu": bleu_chrf([rows[j]["src"] for j in order], refs)["bleu"],
                "nll": mean_nll, "perplexity": math.exp(min(mean_nll, 50.0)), "sentences": float(len(order)),
                "beam_size": float(t.beam_size), "length_penalty": float(t.length_penalty),
                "bleu_signature": scores["bleu_signature"], "chrf_signature": scores["chrf_signature"]}

    @torch.no_grad()
    def translate(self, model, cfg: RunConfig, sentences: list[str]) -> Iterator[str]:
        """Translate raw sentences on one process with the run's tokenizer and beam settings, train.micro_batch_size
        at a time (the memory of a batch, not of the whole input), each batch's given as it is decoded; a source past
        data.seq_len - 1 pieces is cut there, as training cut it, and said."""
        self._bind(cfg)
        tok = prep.tokenizer(self.prepare(cfg))
        dev = next(model.parameters()).device
        pieces = [tok.encode(s.strip()) for s in sentences]
        keep = cfg.data.seq_len - 1
        if cut := [i for i, p in enumerate(pieces, 1) if len(p) > keep]:
            print(f"note: {len(cut)} of {len(pieces)} sentence(s) (e.g. number {cut[0]}) are longer than data.seq_len "
                  f"- 1 = {keep} pieces: each is translated from its first {keep}", file=sys.stderr, flush=True)
        ids = [p[:keep] + [tok.eos_id] for p in pieces]
        model.eval()
        b = cfg.train.micro_batch_size
        starts = range(0, len(ids), b)  # a bar on stderr where it takes more than one batch and the translations go
        # to a file or a pipe (in a terminal they show the progress themselves, and the bar's redraws would cut them)
        shown = progress(starts, desc="translating", unit="batch", leave=False) \
            if len(starts) > 1 and not sys.stdout.isatty() else starts
        for i in shown:
            yield from (tok.decode(h) for h in self._decode(model, _pad(ids[i:i + b], self.pad).to(dev), tok, cfg))

    def generation_defaults(self, cfg: RunConfig) -> dict:
        """A Hugging Face model's export decodes with `generate()` as the run's evaluation does (its own beam search,
        given these): greedy, or the run's beam and length penalty. The length cap stays `generate`'s own."""
        t = cfg.task
        return {"num_beams": t.beam_size, "do_sample": False,
                **({"length_penalty": t.length_penalty} if t.beam_size > 1 else {})}

    def _decode(self, model, src: torch.Tensor, tok, cfg: RunConfig, any_rank=None) -> list[list[int]]:
        """Token ids of each source row's translation; `any_rank` (several ranks): decode in step with them."""
        t = cfg.task
        args = dict(bos=tok.bos_id, eos=tok.eos_id, pad=self.pad, max_len=min(cfg.data.seq_len, 2 * src.shape[1] + 10),
                    beam_size=t.beam_size, length_penalty=t.length_penalty)
        if self.hf:
            return hf_generate(model, src, synced=any_rank is not None, **args)
        return generate(model, src, any_active=any_rank or (lambda active: active), **args)


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(map(len, rows), default=1)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out
