"""Protein sequences: masked-LM pre-training, sequence classification, per-residue secondary structure.

Every sample is "<cls> r1 r2 ... rL" (residue ids from the prepared residue vocabulary); batches are padded
with id 0 and carry a bool mask (True = real token) that the encoder uses to ignore padding.

- mlm: the BERT rule. max(1, round(mask_prob * L)) residues are chosen; of those 80% become <mask>, 10% a
  random standard amino acid, 10% stay as they are; the loss is summed over the chosen residues (count =
  chosen residues). The choice is a pure function of (train.seed, sample index) where the training set holds
  `protein.mask_variants` copies of each sequence, copy k at index k * n + i with its own mask: resumed runs and
  any number of processes see the same masks, and a sequence meets a new mask in each of its copies.
  Validation and test use one fixed masking (independent of the seed), so perplexities compare across runs.
- classify: cross-entropy per sequence on the mean-pooled encoder output (count = sequences); evaluated by
  accuracy and, for two classes, AUROC of the second class's probability (label 1 = AMP on the default data).
- residue: cross-entropy over resolved residues only (count = resolved residues); evaluated by Q3.
- regress: squared error per sequence (count = sequences) of one value from the pooled encoder output, on
  targets z-scored with the training split's mean and standard deviation (prepared with the data); evaluated on
  the data's own scale by Spearman's rho (the field's figure for fitness, e.g. FLIP GB1), Pearson's r, MSE and
  MAE, beside a ridge regression on one-hot residues fitted on the same training split (`ridge_*`; its penalty
  picked by validation MSE) to show what the Transformer adds. The baseline is computed by `harness evaluate`,
  not during training.
With `protein.sites = "varying"` (classify, regress) a sample is <cls> and the residues at the sites where the training
sequences differ (`prepare.protein`: e.g. FLIP GB1's four), and the model's positions are those sites.
With a Hugging Face encoder (`model.hf`, e.g. the ESM-2 family) the objective picks its auto class (masked LM,
sequence or token classification, `num_labels` set from the data); its tokenizer's ids replace the prepared ones
residue by residue, the sample gains the tokenizer's end token (ESM's "<cls> ... <eos>", never a target), and the
model is called as `model(input_ids, attention_mask)`. To start from an earlier run, name its exported `hf/`
directory as `model.hf` (`from_pretrained` keeps the encoder and starts a new head).
`protein.init_from = RUN_DIR` starts the built-in model from another protein run's exported weights (e.g. an mlm run): parameters
are taken by name and shape (embedding rows matched by residue, position rows up to the shorter length); the
others, e.g. a new head, keep their fresh initialisation; rank 0 prints which were loaded.
`read` takes new sequences for `harness evaluate --data` (`prepare.protein.read_scoring`) as evaluation samples with
the run's stored vocabulary, classes and value statistics; `evaluate(..., data=...)` scores them as it scores a split
(without the ridge baseline, which is fitted on the training split).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config.run import ConfigError, RunConfig, read_toml, run_steps, setting
from ..console import progress
from ..data.batches import eval_batches
from ..data.corpus import Corpus, Documents, is_corpus
from ..data.tokenizer import PAD
from ..distributed.world import launched_rank
from ..models import hf
from ..models.encoder import Encoder
from ..models.transformer import TransformerConfig
from ..prepare import protein as prep
from ..prepare import read_meta, store, summary
from .interface import ReadData, TaskData
from .metrics import accuracy, auroc, pearson, q3, regression, ridge, spearman
from .registry import resolve

IGNORE = prep.IGNORE
EVAL_MASK_SEED = 1_234_567  # validation/test masks do not depend on train.seed
N_STATES = len(prep.STATES)
HF_CLASSES = {"mlm": "AutoModelForMaskedLM", "classify": "AutoModelForSequenceClassification",
              "residue": "AutoModelForTokenClassification", "regress": "AutoModelForSequenceClassification"}
RIDGE_ALPHAS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
RIDGE_MIX = (0.0, 0.25, 0.5, 0.75)  # protein.blend's choices: the encoder keeps a share (1.0 is the baseline alone)
RIDGE_MAX_SIZE = 8000  # the ridge baseline solves a min(rows, features)-square system; beyond this it is skipped


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


@dataclass(frozen=True)
class ProteinSection:
    objective: str = setting("classify", "what to train: masked-LM pre-training, sequence classification, "
                             "per-residue (secondary-structure) labels, or one value per sequence (fitness regression)",
                             ("mlm", "classify", "residue", "regress"))
    pooling: str = setting("mean", "classify and regress with the built-in encoder: one vector per sequence from the "
                           "mean of its positions, or a learned attention over them (for landscapes where a few "
                           "positions matter, e.g. FLIP GB1)", ("mean", "attention"))
    sites: str = setting("all", "classify and regress with the built-in encoder: the model reads every residue, or "
                         "only the positions where the training sequences differ (a mutational library of one length, "
                         "e.g. FLIP GB1's four sites; the ridge baseline uses the same)", ("all", "varying"))
    blend: str = setting("none", "regress with the built-in encoder: `ridge` makes the model's prediction a mix of the "
                         "encoder's and the ridge baseline's (fitted on the training split before training, kept in "
                         "the model): the encoder trains alone, and at the last evaluation (at each, when "
                         "train.select_best names a field metric such as spearman) the ridge share is chosen from 0, "
                         "0.25, 0.5, 0.75 by validation Spearman (ties: the smaller), kept in the export (and in "
                         "checkpoints saved after the evaluation that chose it); needs validation rows; the recipe "
                         "that holds its own at a few hundred variants", ("none", "ridge"))
    mask_prob: float = setting(0.15, "fraction of residues masked for the mlm objective")
    init_from: str = setting("", "a run directory whose exported encoder weights start this run (e.g. an mlm run)")
    mask_variants: int = setting(10, "mlm: distinct masks per training sequence; the training set holds each sequence "
                                 "this many times, each copy with its own fixed mask (so an epoch is that many passes)")
    test_fraction: float = setting(0.1, "share of the distinct sequences held out for test when the source has no "
                                   "test split (validation takes data.val_fraction)")
    train_subsample: int = setting(0, "keep this many rows of the training and validation splits together (each stays "
                                   "in its split; the test split is untouched), drawn by protein.subsample_seed: a "
                                   "low-N study on a large set (the ridge baseline fits the same rows); "
                                   "0 = all", bound=">= 0")
    subsample_seed: int = setting(0, "seed of protein.train_subsample's draw (apart from train.seed, so seeds of one "
                                  "subsample train on the same rows)", bound=">= 0")
    sequence_field: str = setting("sequence", "column (csv/jsonl/hub) holding the amino-acid sequence")
    label_field: str = setting("label", "column holding the label: a class (classify), one state letter per residue "
                               "(residue) or a number (regress); in a fasta header, `label=VALUE`; a FLIP csv "
                               "(sequence,target,set,validation) without this column uses `target`")


class ProteinTask:
    section, Config = "protein", ProteinSection  # the run file's [protein]: the task's settings
    objective, pad, items = "classify", PAD, "seqs"  # bound by `_bind` (`metrics`, `collate`, the progress bar)
    prepared: Path | None = None  # a run's stored artefacts (RUN/data/), read instead of preparing from data.path

    def _bind(self, cfg: RunConfig) -> Vocab:
        vocab = Vocab.of(cfg, prep.tokenizer(self.prepare(cfg)))
        self.objective, self.pad = cfg.task.objective, vocab.pad_id
        self.items = {"classify": "seqs", "regress": "seqs", "mlm": "masked", "residue": "residues"}[self.objective]
        return vocab

    def check(self, cfg: RunConfig) -> None:
        if is_corpus(cfg.data.path):
            check_corpus(cfg)
        else:
            prep.check(cfg)
        p = cfg.task
        if cfg.model.hf:
            ends = hf.own_tokenizer(cfg) and hf.tokenizer(cfg).eos_token_id is not None  # (Vocab.of: <eos> appended)
            hf.check(cfg, HF_CLASSES[p.objective], positions=cfg.data.seq_len + 1 + ends)
            if hf.own_tokenizer(cfg):
                hf_tokenizer(cfg)
            if p.pooling != "mean":
                raise ConfigError(f"protein.pooling = {p.pooling!r} is for the built-in encoder; a Hugging Face "
                                  f"model pools with its own head")
            if p.init_from:
                raise ConfigError(f"protein.init_from = {p.init_from!r} starts the built-in model; with model.hf, "
                                  f"name the earlier run's exported hf/ directory as model.hf instead")
        if p.sites != "all" and (cfg.model.hf or p.init_from or p.objective not in ("classify", "regress")):
            raise ConfigError(f"protein.sites = {p.sites!r} is for classify and regress with a built-in encoder "
                              f"trained from scratch (a pre-trained model needs whole sequences); use 'all'")
        if p.blend != "none" and (cfg.model.hf or p.objective != "regress"):
            raise ConfigError(f"protein.blend = {p.blend!r} is for objective 'regress' with the built-in encoder")
        if p.blend != "none" and cfg.train.select_best in ("loss", "val_loss"):
            raise ConfigError(f"protein.blend = {p.blend!r} chooses the ridge share at the field evaluation, which "
                              f"train.select_best = {cfg.train.select_best!r} does not run at each evaluation: select "
                              f"by spearman, pearson, mse or mae")
        if not 0 < p.mask_prob < 1:
            raise ConfigError(f"protein.mask_prob = {p.mask_prob}: must be between 0 and 1")
        if p.mask_variants < 1:
            raise ConfigError(f"protein.mask_variants = {p.mask_variants}: must be at least 1")
        if p.init_from and not all((Path(p.init_from) / f).is_file() for f in ("config.toml", "model.safetensors")):
            raise ConfigError(f"protein.init_from = {p.init_from!r}: not a finished run directory (it needs "
                              f"config.toml and model.safetensors)")
        if p.init_from and source_config(Path(p.init_from)).task.sites != "all":
            raise ConfigError(f"protein.init_from = {p.init_from!r}: that run read only the sites where its training "
                              f"sequences differ (protein.sites), so its positions are not residue positions")

    def prepare(self, cfg: RunConfig) -> Path:
        if self.prepared:
            return self.prepared
        return Path(cfg.data.path) if is_corpus(cfg.data.path) else prep.prepare(cfg)

    def store(self, cfg: RunConfig, out: Path) -> None:
        store(self.prepare(cfg), out, prep.STORED, prep.COMPARED, prep.SCORING_KEYS)

    def read(self, cfg: RunConfig, path: Path, stored: Path) -> list[ReadData]:
        """New sequences (`prepare.protein.read_scoring`) as evaluation samples, with the stored vocabulary and
        statistics (`prepare(cfg)` is the stored directory while a run is scored)."""
        rows, counts, files = prep.read_scoring(cfg, stored, path)
        states = rows["states"] if cfg.task.objective == "residue" else []  # (the columns: not sample by sample)
        if states and not any(s != IGNORE for chain in states for s in chain):
            raise ConfigError(f"--data {path}: no residue of its {len(states)} sample(s) is resolved (`resolved` is 0 "
                              f"for every one): Q3 has nothing to score")
        return [ReadData(self.samples(cfg, "data", rows=rows), counts, files)]

    def build_model(self, cfg: RunConfig) -> Encoder:
        directory = self.prepare(cfg)
        meta, m, objective = read_meta(directory), cfg.model, cfg.task.objective
        vocab = m.vocab_size or meta["vocab_size"]
        if vocab < meta["vocab_size"]:
            raise ConfigError(f"model.vocab_size = {vocab} is smaller than the prepared vocabulary "
                              f"({meta['vocab_size']}); use 0")
        if objective == "classify" and len(meta["classes"]) < 2:
            raise ConfigError(f"protein.objective = 'classify' needs two classes or more; the data has "
                              f"{meta['classes'] or 'no labels'}")
        n_out = {"mlm": vocab, "classify": len(meta["classes"]), "residue": N_STATES, "regress": 1}[objective]
        if m.hf:  # on the prepared residue ids: that vocabulary and its special ids
            ids = {} if hf.own_tokenizer(cfg) else dict(vocab_size=vocab, pad_token_id=PAD, mask_token_id=(
                prep.tokenizer(directory).piece_id("<mask>")))
            names = {"classify": [str(c) for c in meta["classes"]], "residue": list(prep.STATES)}.get(objective)
            labels = {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}} \
                if names else {}  # the export's pipeline() prints the data's class names, not LABEL_0
            if objective == "regress":  # it predicts z-scores: the export says how to undo them (y = out x std + mean)
                labels = {"problem_type": "regression", "harness_target_scale": dict(zip(("mean", "std"), scale(meta)))}
            return hf.build(cfg, HF_CLASSES[objective], **ids, **labels,
                            **({} if objective == "mlm" else {"num_labels": n_out}))
        positions = len(meta["sites"]["columns"]) if meta.get("sites") else cfg.data.seq_len
        model = Encoder(TransformerConfig(vocab_size=vocab, max_seq_len=positions + 1, d_model=m.d_model,
                                          n_layers=m.n_layers, n_heads=m.n_heads, d_ff=m.d_ff or 4 * m.d_model,
                                          dropout=m.dropout), objective, n_out, cfg.task.pooling,
                        ridge=cfg.task.blend == "ridge")
        if cfg.task.blend == "ridge" and not next(model.parameters()).is_meta:
            load_ridge(model, directory, scale(meta), self._bind(cfg).cls_id)
        source = Path(cfg.task.init_from)
        # `check` requires the source before training; a finished run rebuilt from its stored data (`harness
        # evaluate`, load_model: `prepared`) skips it, as one whose source is gone does: its own exported weights
        # replace these, and the source's data need not exist any more
        if cfg.task.init_from and self.prepared is None and (source / "model.safetensors").is_file() and \
                not next(model.parameters()).is_meta:
            loaded, fresh = init_from(model, cfg, source)
            if launched_rank() == 0:
                print(f"protein.init_from {cfg.task.init_from}: loaded {', '.join(loaded) or 'nothing'}; "
                      f"fresh {', '.join(fresh) or 'nothing'}", flush=True)
        return model

    def samples(self, cfg: RunConfig, split: str, train: bool = False, rows=None) -> Samples:
        directory, vocab = self.prepare(cfg), self._bind(cfg)
        p, corpus = cfg.task, rows is None and is_corpus(directory)
        variants = p.mask_variants if train and p.objective == "mlm" else 1
        if corpus:  # sequences of any number, read by memory map, each cropped to data.seq_len residues
            rows = CorpusRows(Corpus(directory), split, cfg.data.seq_len, cfg.train.seed if train else None)
        return Samples(prep.load(directory, split) if rows is None else rows, p.objective, vocab, p.mask_prob,
                       cfg.train.seed if train else EVAL_MASK_SEED, variants, scale(read_meta(directory)),
                       window=0 if train or corpus else cfg.data.seq_len)

    def sample_order(self, cfg: RunConfig) -> str:
        """A prepared corpus's samples are ordered without holding the order (StepSampler's `order`)."""
        return "lazy" if is_corpus(cfg.data.path) else "held"

    def activations_on_paper(self, cfg: RunConfig) -> bool:
        """The encoder over every residue is one stack of blocks over every position, as the plan's activation formula
        has it; over the sites alone its positions are not data.seq_len."""
        return cfg.task.sites == "all"

    def data_identity(self, cfg: RunConfig) -> dict | None:
        """What a checkpoint records of a prepared corpus, so that a resume on other data is refused."""
        return Corpus(cfg.data.path).identity if is_corpus(cfg.data.path) else None

    def describe_data(self, cfg: RunConfig, global_batch: int) -> str | None:
        """The plan's and the start's account of a prepared corpus: its sequences, the epochs the run covers."""
        if not is_corpus(cfg.data.path):
            return None
        corpus = Corpus(cfg.data.path)
        n = corpus.documents() * cfg.task.mask_variants
        steps = run_steps(cfg.train, n // global_batch)
        return (f"data: a prepared corpus {cfg.data.path}: {corpus.documents():,} sequences ({corpus.tokens():,} "
                f"tokens) in {len(corpus.shards['train'])} shard(s), validation {corpus.documents('validation'):,}; "
                f"each cropped to data.seq_len = {cfg.data.seq_len} residues; a step reads {global_batch} of them, "
                f"{steps:,} steps cover {(e := steps * global_batch / n):.3g} epoch{'s' * (f'{e:.3g}' != '1')} of "
                f"{n:,} samples")

    def tokenizer(self, cfg: RunConfig):
        """A Hugging Face model's own tokenizer, for its export (the residue vocabulary stays with the data)."""
        return hf.tokenizer(cfg) if hf.own_tokenizer(cfg) else None

    def build_data(self, cfg: RunConfig) -> TaskData:
        directory = self.prepare(cfg)
        meta = read_meta(directory)
        sites = meta.get("sites")
        if sites and launched_rank() == 0:
            columns = [str(j + 1) for j in sites["columns"]]
            shown = ", ".join(columns[:12] + (["..."] if len(columns) > 12 else []))
            print(f"protein.sites = 'varying': the model reads {len(columns)} of {sites['length']} positions "
                  f"({shown}; 1-based), where the training sequences differ", flush=True)
        return TaskData(self.samples(cfg, "train", train=True), self.samples(cfg, "validation"), summary(meta))

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        ids = torch.nn.utils.rnn.pad_sequence([s["ids"] for s in samples], batch_first=True, padding_value=self.pad)
        batch = {"ids": ids, "mask": ids != self.pad}  # (B, T) each
        if "label" in samples[0]:
            batch["labels"] = torch.stack([torch.as_tensor(s["label"]) for s in samples]).long()  # (B,)
        elif "value" in samples[0]:
            batch["values"] = torch.stack([s["value"] for s in samples])  # (B,) float32
        else:
            batch["targets"] = torch.nn.utils.rnn.pad_sequence([s["targets"] for s in samples], batch_first=True,
                                                               padding_value=IGNORE)  # (B, T)
        return batch

    def pad_values(self) -> dict[str, int | bool]:
        """The batch's (B, length) tensors and what pads them (`data.length_buckets`); `targets` where the
        objective has one a residue (mlm, residue)."""
        return {"ids": self.pad, "mask": False, "targets": IGNORE}

    def sequence_split(self, batch: dict[str, torch.Tensor]) -> dict[str, str]:
        """Sequence parallelism: the (B, T) tensors split by positions, one label or value per sequence by rows."""
        return {"ids": "positions", "mask": "positions", "targets": "positions", "labels": "rows", "values": "rows"}

    def padding(self, batch: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(real, padded) positions of the batch."""
        return int(batch["mask"].sum()), batch["mask"].numel()

    def lengths(self, data: Samples) -> list[int]:
        """Each sample's length in positions (with <cls>), for length-bucketed batches."""
        lengths = [len(ids) + data.specials for ids in data.rows.with_format(None)["ids"]]
        return lengths * data.variants

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        if "targets" not in batch:
            return len(batch["ids"])  # one label or value per sequence
        return int((batch["targets"] != IGNORE).sum())

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["ids"], batch["mask"]

    def loss(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss_from(model(*self.inputs(batch)), batch)

    def loss_from(self, outputs, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = hf.logits(outputs).float()  # (B, classes), (B, 1) or (B, T, vocab or states)
        if "values" in batch:
            return F.mse_loss(logits.squeeze(-1), batch["values"], reduction="sum")
        if "labels" in batch:
            return F.cross_entropy(logits, batch["labels"], reduction="sum")
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE,
                               reduction="sum")

    def metrics(self, mean_loss: float) -> dict[str, float]:
        """From the mean loss alone (accuracy, AUROC and Q3 come from `evaluate`): mlm's loss is per masked residue."""
        if self.objective == "mlm":
            return {"loss": mean_loss, "perplexity": math.exp(min(mean_loss, 50.0))}
        return {"loss": mean_loss}

    @torch.no_grad()
    def _scores(self, model, samples, batches: list, steps: int, split: str, world, blended=None) -> list[tuple]:
        """This rank's (prediction, target) per sample, with the linear model's prediction third where `blended`
        (the model whose ridge mix is being chosen) is given."""
        mine = []
        for i in progress(range(steps), desc=f"scoring {split}", disable=not world.is_main, leave=False):
            real = i < len(batches)
            index = batches[i] if real else (batches[-1] if batches else [0])  # repeat a batch: same forward count
            batch = {k: v.to(world.device) for k, v in self.collate([samples[j] for j in index]).items()}
            logits = hf.logits(model(batch["ids"], batch["mask"])).float()  # every rank calls the model `steps` times
            if real:
                mine += _per_sample(logits, batch)
                if blended is not None:  # the linear model's prediction beside the encoder's
                    linear = blended.ridge(batch["ids"], batch["mask"]).squeeze(-1).tolist()
                    mine[-len(linear):] = [(p, y, r) for (p, y), r in zip(mine[-len(linear):], linear)]
            world.scored(i, steps)  # in training, a stop signal ends it here on every rank
        return mine

    def evaluate(self, model, cfg: RunConfig, split: str, world, in_training: bool = False,
                 data: Samples | None = None) -> dict[str, float | str]:
        """The field's metrics over the whole split (or `data`, from `read`), on every rank (see the Task protocol
        for the ZeRO-3 rules). The ridge baseline needs the training split: none for `data`."""
        samples = self.samples(cfg, split) if data is None else data
        if not len(samples):
            return {}
        batches, steps = eval_batches(len(samples), cfg.train.micro_batch_size, world.dp_rank, world.dp_size)
        was_training = model.training
        model.eval()
        blended = getattr(model, "module", model)  # protein.blend: the encoder's own predictions first, then the mix
        choose = in_training and split == "validation" and hasattr(blended, "ridge_mix")
        before = blended.ridge_mix.clone() if choose else None
        if choose:
            blended.ridge_mix.zero_()
        try:
            mine = self._scores(model, samples, batches, steps, split, world, blended if choose else None)
        except BaseException:  # cut short (a stop signal, `World.scored`): the model as it was, its checkpoint saved
            if choose:
                blended.ridge_mix.copy_(before)
            model.train(was_training)
            raise
        model.train(was_training)
        outputs = [o for rank in world.gather(mine) for o in rank]  # sync point
        extra = {}
        if choose:  # every rank holds every output: the same choice everywhere
            w = choose_mix([o[0] for o in outputs], [o[2] for o in outputs], [o[1] for o in outputs])
            blended.ridge_mix.fill_(w)
            outputs = [(p + w * (r - p), y) for p, y, r in outputs]
            # the loss the loop measured before this choice, again for the mix the model now predicts with
            extra = {"loss": sum((p - y) ** 2 for p, y in outputs) / len(outputs), "ridge_mix": w}
        if cfg.task.objective != "regress":
            windowed = {"chains_in_windows": float(samples.windowed)} if samples.spans else {}
            return {**_field_metrics(cfg.task.objective, outputs), **windowed}
        mean, std = samples.scale
        metrics = regression_metrics([mean + std * p for p, _ in outputs], [mean + std * y for _, y in outputs])
        metrics |= extra or ({"ridge_mix": blended.ridge_mix.item()} if hasattr(blended, "ridge_mix") else {})
        return metrics if in_training or data is not None else {**metrics, **ridge_baseline(self.prepare(cfg), split)}


def _per_sample(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[tuple]:
    """Per-sample results as plain Python, cheap to gather: (probabilities, label) or (predictions, targets, nll)."""
    if "values" in batch:
        return list(zip(logits.squeeze(-1).tolist(), batch["values"].tolist()))
    if "labels" in batch:
        probs = logits.softmax(-1).cpu()
        return [(p.tolist(), int(y)) for p, y in zip(probs, batch["labels"].cpu())]
    out = []
    nll = F.cross_entropy(logits.transpose(1, 2), batch["targets"], ignore_index=IGNORE, reduction="none")  # (B, T)
    for lg, t, n in zip(logits.cpu(), batch["targets"].cpu(), nll.cpu()):
        keep = t != IGNORE
        out.append((lg[keep].argmax(-1).tolist(), t[keep].tolist(), n[keep].sum().item()))
    return out


def _field_metrics(objective: str, outputs: list[tuple]) -> dict[str, float]:
    if objective == "classify":
        probs, labels = [p for p, _ in outputs], [y for _, y in outputs]
        pred = [max(range(len(p)), key=p.__getitem__) for p in probs]
        nll = -sum(math.log(max(p[y], 1e-12)) for p, y in outputs) / len(outputs)
        result = {"accuracy": accuracy(pred, labels), "sequences": float(len(outputs)), "loss": nll}
        if len(probs[0]) == 2 and 0 < sum(labels) < len(labels):
            result["auroc"] = auroc([p[1] for p in probs], labels)
        return result
    pred = [a for p, _, _ in outputs for a in p]
    target = [a for _, t, _ in outputs for a in t]
    n = len(target)
    if objective == "residue":
        return {"q3": q3(pred, target, [1] * n), "residues": float(n)}
    mean_nll = sum(x for _, _, x in outputs) / n
    return {"masked_accuracy": accuracy(pred, target), "perplexity": math.exp(min(mean_nll, 50.0)),
            "masked_residues": float(n)}


def scale(meta: dict) -> tuple[float, float]:
    """The training values' (mean, std) that regression targets are z-scored with; (0, 1) for other labels."""
    values = meta.get("values") or {}
    return values.get("mean", 0.0), values.get("std", 1.0)


def regression_metrics(pred: list[float], target: list[float]) -> dict[str, float]:
    return {"spearman": spearman(pred, target), "pearson": pearson(pred, target), **regression(pred, target),
            "sequences": float(len(target))}


def one_hot(rows, length: int, vocab_size: int) -> torch.Tensor:
    """(n, length * vocab_size) indicators of each position's residue id; positions past a sequence's end stay 0."""
    ids = torch.full((len(rows), length), -1)
    for i, r in enumerate(rows["ids"]):
        r = r[:length]
        ids[i, :len(r)] = torch.as_tensor(r)
    out = torch.zeros(len(rows), length, vocab_size)
    out.scatter_(2, ids.clamp(min=0).unsqueeze(-1), (ids >= 0).float().unsqueeze(-1))
    return out.flatten(1)


@dataclass
class RidgeFit:
    """Ridge regression on one-hot residues: `weights` (length, vocab) per position and residue id (0 for a residue
    constant in training), `intercept`, on the data's own scale; the penalty `alpha` picked by validation MSE."""
    weights: torch.Tensor
    intercept: float
    alpha: float

    def predict(self, rows) -> torch.Tensor:
        length, vocab = self.weights.shape
        return one_hot(rows, length, vocab).double() @ self.weights.flatten() + self.intercept


def ridge_fit(directory: Path) -> RidgeFit | str:
    """The ridge baseline fitted on the training split, its penalty picked from RIDGE_ALPHAS by validation MSE
    (train's own when there is none); a sentence instead when the system is too large to solve."""
    train, val = prep.load(directory, "train"), prep.load(directory, "validation")
    length, vocab = max(len(r) for r in train["ids"]), read_meta(directory)["vocab_size"]
    x = one_hot(train, length, vocab)
    keep = x.std(0) > 0  # a column constant in training carries nothing the intercept does not
    x = x[:, keep]
    if min(x.shape) > RIDGE_MAX_SIZE:
        return f"skipped: {x.shape[0]} rows x {x.shape[1]} features is too large to solve"
    y = torch.tensor(train["value"])
    vx, vy = (one_hot(val, length, vocab)[:, keep], torch.tensor(val["value"])) if len(val) else (x, y)

    fits = dict(zip(RIDGE_ALPHAS, ridge(x, y, RIDGE_ALPHAS)))  # weights of the kept columns, intercept last
    alpha = min(fits, key=lambda a: (vx.double() @ fits[a][:-1] + fits[a][-1] - vy).pow(2).mean().item())
    weights = torch.zeros(length * vocab, dtype=torch.float64)
    weights[keep] = fits[alpha][:-1]
    return RidgeFit(weights.view(length, vocab), fits[alpha][-1].item(), alpha)


@torch.no_grad()
def load_ridge(model: Encoder, directory: Path, stats: tuple[float, float], cls_id: int) -> None:
    """protein.blend = "ridge": the ridge fit on the z-scored targets the model learns, as the model's `ridge_table`
    (residue positions 0.. are the model's 1.., after <cls>, which carries the intercept). A finished run's stored
    data (`harness evaluate --data`) has no training split: its exported weights hold the table."""
    if not len(prep.load(directory, "train")):
        return
    if not len(prep.load(directory, "validation")):
        raise ConfigError("protein.blend = 'ridge' chooses its share (and the ridge penalty) on the validation split, "
                          "which is empty here: give the data validation rows (data.val_fraction, data.val_path)")
    fitted = ridge_fit(directory)
    if isinstance(fitted, str):
        raise ConfigError(f"protein.blend = 'ridge': the ridge fit is {fitted}")
    mean, std = stats
    vocab = model.cfg.vocab_size
    table = torch.zeros(model.cfg.max_seq_len, vocab, dtype=torch.float64)
    length, width = fitted.weights.shape
    table[1:1 + length, :width] = fitted.weights / std
    table[0, cls_id] = (fitted.intercept - mean) / std
    model.ridge_table.copy_(table.flatten())


def choose_mix(net: list[float], linear: list[float], target: list[float]) -> float:
    """The ridge share of RIDGE_MIX whose mix has the highest Spearman on these (validation) rows; ties: the smaller."""
    def score(w: float) -> float:  # a constant prediction has no rank correlation (nan): the worst, not a tie
        rho = spearman([n + w * (r - n) for n, r in zip(net, linear)], target)
        return rho if math.isfinite(rho) else -math.inf

    return max(RIDGE_MIX, key=lambda w: (score(w), -w))


def ridge_baseline(directory: Path, split: str) -> dict[str, float | str]:
    """The ridge fit (`ridge_fit`) scored on `split`: ridge_spearman, ridge_mse, ... and ridge_alpha."""
    fitted = ridge_fit(directory)
    if isinstance(fitted, str):
        return {"ridge_baseline": fitted}
    test = prep.load(directory, split)
    pred = fitted.predict(test)
    return {f"ridge_{k}": v for k, v in regression_metrics(pred.tolist(), test["value"]).items()
            if k != "sequences"} | {"ridge_alpha": fitted.alpha}


def source_config(run_dir: Path) -> RunConfig:
    """protein.init_from's run config, checked to be a protein run before it is resolved (resolving imports the task
    it names: a run directory from elsewhere must not run code)."""
    task = read_toml(run_dir / "config.toml").get("run", {}).get("task", "lm")
    if task != "protein":
        raise ConfigError(f"protein.init_from = {str(run_dir)!r} is a {task!r} run, not a protein run")
    return resolve(str(run_dir / "config.toml")).cfg


def init_from(model: Encoder, cfg: RunConfig, run_dir: Path) -> tuple[list[str], list[str]]:
    """Copy another protein run's exported weights into `model` where names match; returns (loaded, fresh)."""
    from safetensors.torch import load_file

    source_cfg = source_config(run_dir)
    theirs = load_file(str(run_dir / "model.safetensors"))
    # Residue ids depend on the vocabulary each run prepared: match embedding (and mlm output) rows by piece.
    ours_tok, their_tok = prep.tokenizer(prep.prepare(cfg)), prep.tokenizer(prep.prepare(source_cfg))
    pieces = {their_tok.sp.id_to_piece(i): i for i in range(their_tok.vocab_size)}
    state, loaded, fresh = model.state_dict(), [], []
    for name, own in state.items():
        src = theirs.get(name)
        if name.startswith("ridge_"):  # protein.blend: this run's own fit, on its own rows and ids
            continue
        if src is None or src.dim() != own.dim() or src.shape[1:] != own.shape[1:]:
            fresh.append(name)
        elif name in ("tok_emb.weight", "mlm_head.weight", "mlm_head.bias"):
            for i in range(min(own.shape[0], ours_tok.vocab_size)):
                j = pieces.get(ours_tok.sp.id_to_piece(i))
                if j is not None and j < src.shape[0]:
                    own[i] = src[j]
            loaded.append(name)
        elif name == "pos_emb.weight":  # a different seq_len: the positions both have
            n = min(own.shape[0], src.shape[0])
            own[:n] = src[:n]
            loaded.append(name)
        elif src.shape == own.shape:
            own.copy_(src)
            loaded.append(name)
        else:
            fresh.append(name)
    model.load_state_dict(state)
    return _short(loaded), _short(fresh)


def _short(names: list[str]) -> list[str]:
    """Parameter names grouped by module: blocks.0.attn.q_proj.weight -> blocks.*, cls_head.weight -> cls_head."""
    out = []
    for name in names:
        top = "blocks.*" if name.startswith("blocks.") else name.rsplit(".", 1)[0]
        if top not in out:
            out.append(top)
    return out
