"""A protein run's samples: "<cls> r1 r2 ... rL" in the model's token ids (`Vocab`: the prepared residue vocabulary's,
or a Hugging Face tokenizer's, whose end token is appended), with a label, a value z-scored by `scale`, or per-residue
targets (`Samples`); a prepared corpus's sequences, read as they are asked for (`CorpusRows`, `check_corpus`); a long
chain of an evaluation split scored in overlapping windows (`windows`).

mlm masks by the BERT rule. max(1, round(mask_prob * L)) residues are chosen; of those 80% become <mask>, 10% a
random standard amino acid, 10% stay as they are. The choice is a pure function of (train.seed, sample index) where
the training set holds `protein.mask_variants` copies of each sequence, copy k at index k * n + i with its own mask:
resumed runs and any number of processes see the same masks, and a sequence meets a new mask in each of its copies.
Validation and test use one fixed masking (EVAL_MASK_SEED, independent of the seed), so perplexities compare across
runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.run import ConfigError, RunConfig
from ..data.corpus import Corpus, Documents
from ..data.tokenizer import PAD
from ..models import hf
from ..prepare import protein as prep

IGNORE = prep.IGNORE
EVAL_MASK_SEED = 1_234_567  # validation/test masks do not depend on train.seed


@dataclass
class Vocab:
    """The model's token ids: the prepared vocabulary's own, or a Hugging Face tokenizer's for the same residues."""
    cls_id: int
    mask_id: int | None
    pad_id: int
    eos_id: int | None                   # appended after the residues (never a target); None: nothing
    residue_ids: torch.Tensor            # the standard amino acids, for mlm's random replacements
    remap: torch.Tensor | None = None    # prepared id -> model id; None: the same

    @classmethod
    def of(cls, cfg: RunConfig, tok) -> "Vocab":
        standard = torch.tensor([tok.piece_id(a) for a in prep.AMINO_ACIDS if _known(tok, a)])
        if not hf.own_tokenizer(cfg):
            return cls(tok.piece_id("<cls>"), tok.piece_id("<mask>"), PAD, None, standard)
        theirs = hf_tokenizer(cfg)
        pieces = [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
        ids = [theirs.convert_tokens_to_ids(p) for p in pieces]
        remap = [theirs.unk_token_id if i is None else i for i in ids]
        if None in remap:
            lost = [p for p, i in zip(pieces, remap) if i is None]
            raise ConfigError(f"model.hf = {cfg.model.hf!r}: its tokenizer has no {', '.join(lost[:8])} and no "
                              f"unknown token to stand for them")
        remap = torch.tensor(remap)
        return cls(theirs.cls_token_id, theirs.mask_token_id, theirs.pad_token_id, theirs.eos_token_id,
                   remap[standard], remap)


def hf_tokenizer(cfg: RunConfig):
    """A Hugging Face model's tokenizer, with the special tokens the objective needs."""
    tok = hf.tokenizer(cfg)
    hf.need_tokens(cfg, tok, "protein", "cls_token", "pad_token", *(["mask_token"] if cfg.task.objective == "mlm"
                                                                      else []))
    return tok


class Samples(torch.utils.data.Dataset):
    """One split's samples for an objective: {"ids": (n,), and "label" (), "value" () (z-scored by `scale`, the
    training values' (mean, std)) or "targets" (n,)}, n = L + 1 (<cls>, residues) or L + 2 (and the end token of a
    Hugging Face tokenizer that has one).

    With `window` (evaluation splits of per-residue objectives), a chain longer than `window` residues gives several
    samples: overlapping windows of `window` residues (see `windows`), each with its own <cls> and end token, whose
    targets keep only the residues that window owns. Every residue is then scored exactly once, in the window
    where it has the most context."""

    def __init__(self, rows, objective: str, vocab: Vocab, mask_prob: float = 0.15, seed: int = 0,
                 variants: int = 1, scale: tuple[float, float] = (0.0, 1.0), window: int = 0):
        self.rows, self.objective, self.n = rows.with_format("torch"), objective, len(rows)
        self.mask_prob, self.seed, self.variants, self.vocab = mask_prob, seed, variants, vocab
        self.scale = scale
        self.specials = 1 + (vocab.eos_id is not None)  # positions besides the residues
        self.spans = None  # sample -> (row, first residue, owned residues from, to)
        if window and objective in ("residue", "mlm"):
            lengths = [len(ids) for ids in rows.with_format(None)["ids"]]
            if max(lengths, default=0) > window:
                self.spans = [(i, *span) for i, n in enumerate(lengths) for span in windows(n, window)]
                self.window, self.windowed = window, sum(n > window for n in lengths)

    def __len__(self) -> int:
        return len(self.spans) if self.spans else self.n * self.variants

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not self.spans:
            return self.whole(index)
        i, start, lo, hi = self.spans[index]
        sample = self.whole(i)
        end = len(sample["ids"]) - self.specials + 1  # where the end token (if any) sits
        keep = torch.cat([torch.tensor([0]), torch.arange(1 + start, 1 + min(start + self.window, end - 1)),
                          torch.arange(end, len(sample["ids"]))])
        targets = torch.full_like(sample["targets"], IGNORE)
        targets[1 + lo:1 + hi] = sample["targets"][1 + lo:1 + hi]  # only the residues this window owns
        return {"ids": sample["ids"][keep], "targets": targets[keep]}

    def whole(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows.at(index) if hasattr(self.rows, "at") else self.rows[index % self.n]
        v = self.vocab
        residues = row["ids"].long() if v.remap is None else v.remap[row["ids"].long()]
        end = [] if v.eos_id is None else [v.eos_id]
        ids = torch.tensor([v.cls_id, *residues.tolist(), *end])  # (n,)
        if self.objective == "classify":
            return {"ids": ids, "label": row["label"]}
        if self.objective == "regress":
            return {"ids": ids, "value": ((row["value"] - self.scale[0]) / self.scale[1]).float()}
        if self.objective == "residue":
            return {"ids": ids, "targets": torch.tensor([IGNORE, *row["states"].tolist(), *[IGNORE] * len(end)])}
        return {"ids": ids, **self.mask(ids, index, len(residues))}

    def mask(self, ids: torch.Tensor, index: int, L: int) -> dict[str, torch.Tensor]:
        """BERT masking of the L residues at positions 1..L, a pure function of (seed, index)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        v = self.vocab
        chosen = torch.randperm(L, generator=g)[:max(1, round(self.mask_prob * L))] + 1  # skip <cls>
        rule = torch.rand(len(chosen), generator=g)
        random_ids = v.residue_ids[torch.randint(len(v.residue_ids), (len(chosen),), generator=g)]
        targets = torch.full_like(ids, IGNORE)
        targets[chosen] = ids[chosen]
        masked = ids.clone()
        masked[chosen] = torch.where(rule < 0.8, v.mask_id, torch.where(rule < 0.9, random_ids, ids[chosen]))
        return {"ids": masked, "targets": targets}


class CorpusRows:
    """A prepared corpus's sequences (`harness prepare protein --input`) as the rows `Samples` reads: {"ids": residue
    ids}, one longer than `residues` cropped to a window of them at an offset drawn from (seed, sample): each mask
    variant of a long sequence sees another part of it; its start where `seed` is None (evaluation). Nothing is read
    before a row is asked for."""

    def __init__(self, corpus: Corpus, split: str, residues: int, seed: int | None):
        self.docs = Documents(corpus, split) if split in corpus.shards else None
        self.residues, self.seed = residues, seed

    def with_format(self, _):
        return self

    def __len__(self) -> int:
        return len(self.docs) if self.docs is not None else 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.at(i)

    def at(self, index: int) -> dict[str, torch.Tensor]:
        """Sample `index`'s row: sequence index % len, cropped as (seed, index) draws."""
        ids = self.docs[index % len(self)]
        start = 0
        if len(ids) > self.residues and self.seed is not None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            start = int(torch.randint(len(ids) - self.residues + 1, (), generator=g))
        return {"ids": torch.from_numpy(ids[start:start + self.residues].astype("int64"))}


def check_corpus(cfg: RunConfig) -> None:
    """A prepared corpus of sequences: residue ids for masked-LM pre-training, its shards whole."""
    corpus, p = Corpus(cfg.data.path), cfg.task
    corpus.check()
    if corpus.tokenizer["kind"] != "residues":
        raise ConfigError(f"data.path = {cfg.data.path}: a corpus of {corpus.tokenizer['kind']} tokens; the protein "
                          f"task reads residues: `harness prepare protein --input FASTA... --out DIR`")
    if p.objective != "mlm":
        raise ConfigError(f"protein.objective = {p.objective!r}: a prepared corpus of sequences has no labels; "
                          f"pre-train with 'mlm' on it (then start from that run: protein.init_from)")
    if cfg.data.val_path or cfg.data.bucket:
        key = "data.val_path" if cfg.data.val_path else "data.bucket"
        raise ConfigError(f"{key}: with a prepared corpus, validation is its held-out sequences (--val-fraction) "
                          f"and samples are not bucketed; leave it out")


def windows(length: int, window: int) -> list[tuple[int, int, int]]:
    """(first residue, owned from, owned to) of windows of `window` residues over a chain of `length`: starts every
    window // 2 residues, the last aligned to the chain's end; where two overlap, each owns the half nearer its own
    centre, so the owned ranges tile the chain. A chain that fits is one window owning everything."""
    if length <= window:
        return [(0, 0, length)]
    starts = [*range(0, length - window, max(1, window // 2)), length - window]
    cuts = [0, *((b + a + window) // 2 for a, b in zip(starts, starts[1:])), length]
    return [(s, lo, hi) for s, lo, hi in zip(starts, cuts, cuts[1:])]


def _known(tok, piece: str) -> bool:
    try:
        tok.piece_id(piece)
        return True
    except KeyError:
        return False


def scale(meta: dict) -> tuple[float, float]:
    """The training values' (mean, std) that regression targets are z-scored with; (0, 1) for other labels."""
    values = meta.get("values") or {}
    return values.get("mean", 0.0), values.get("std", 1.0)
