"""Protein sequences: masked-LM pre-training, sequence classification, per-residue secondary structure.

Every sample is "<cls> r1 r2 ... rL" (residue ids from the prepared residue vocabulary: `protein_samples.py`); batches
are padded with id 0 and carry a bool mask (True = real token) that the encoder uses to ignore padding.

- mlm: the BERT rule (`protein_samples.py`); the loss is summed over the chosen residues (count = chosen residues).
- classify: cross-entropy per sequence on the mean-pooled encoder output (count = sequences).
- residue: cross-entropy over resolved residues only (count = resolved residues).
- regress: squared error per sequence (count = sequences) of one value from the pooled encoder output, on
  targets z-scored with the training split's mean and standard deviation (prepared with the data).
What each is evaluated by, and the ridge baseline beside regress, is `protein_scoring.py`'s.
With `protein.sites = "varying"` (classify, regress) a sample is <cls> and the residues at the sites where the
training sequences differ (`prepare.protein`: e.g. FLIP GB1's four), and the model's positions are those sites.
With a Hugging Face encoder (`model.hf`, e.g. the ESM-2 family) the objective picks its auto class (masked LM,
sequence or token classification, `num_labels` set from the data); its tokenizer's ids replace the prepared ones
residue by residue, the sample gains the tokenizer's end token (ESM's "<cls> ... <eos>", never a target), and the
model is called as `model(input_ids, attention_mask)`. To start from an earlier run, name its exported `hf/`
directory as `model.hf` (`from_pretrained` keeps the encoder and starts a new head).
`protein.init_from = RUN_DIR` starts the built-in model from another protein run's exported weights
(`protein_init_from.py`).
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

from ..config.run import ConfigError, RunConfig, run_steps, setting
from ..console import progress
from ..data.batches import eval_batches
from ..data.corpus import Corpus, is_corpus
from ..data.tokenizer import PAD
from ..distributed.world import launched_rank
from ..models import hf
from ..models.encoder import Encoder
from ..models.transformer import TransformerConfig
from ..prepare import protein as prep
from ..prepare import read_meta, store, summary
from .interface import ReadData, TaskData
from .protein_init_from import init_from, source_config
from .protein_samples import EVAL_MASK_SEED, IGNORE, CorpusRows, Samples, Vocab, check_corpus, hf_tokenizer, scale
from .protein_scoring import choose_mix, field_metrics, load_ridge, per_sample, regression_metrics, ridge_baseline

N_STATES = len(prep.STATES)
HF_CLASSES = {"mlm": "AutoModelForMaskedLM", "classify": "AutoModelForSequenceClassification",
              "residue": "AutoModelForTokenClassification", "regress": "AutoModelForSequenceClassification"}


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
                mine += per_sample(logits, batch)
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
            return {**field_metrics(cfg.task.objective, outputs), **windowed}
        mean, std = samples.scale
        metrics = regression_metrics([mean + std * p for p, _ in outputs], [mean + std * y for _, y in outputs])
        metrics |= extra or ({"ridge_mix": blended.ridge_mix.item()} if hasattr(blended, "ridge_mix") else {})
        return metrics if in_training or data is not None else {**metrics, **ridge_baseline(self.prepare(cfg), split)}
