"""The run config: typed, documented fields, resolved once and frozen.

Precedence, stated once: defaults < run file (TOML) < command line (`--set section.key=value`).
Every value remembers where it came from, so `harness plan` and error messages can say so.
The DeepSpeed JSON is resolved against this config in `ds.py`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from . import cadence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(Exception):
    """A problem with the user's input: reported as one line, exit code 2, before any training."""


class TrainingStopped(Exception):
    """The run cannot go on (e.g. the loss stayed non-finite); its last good checkpoint is kept. Exit code 3."""


class Preempted(Exception):
    """A scheduler's signal stopped the run after a step, with a checkpoint of it (`preemption.py`). Exit code 75."""


def _f(default: Any, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class RunSection:
    task: str = _f("lm", "which task to train (see `harness keys`): its model, data, loss and metrics")
    output_dir: str = _f("runs/run", "the run directory: config, metrics, checkpoints and the exported model")
    name: str = _f("", "run name for the tracker; empty means the run directory's name")
    config_wins: str = _f("run", "where a DeepSpeed file's optimizer or scheduler section (or accelerate's "
                          "accumulation and clipping) and a run-config value you set differ: `run` refuses the run, "
                          "listing every mismatch; `deepspeed` takes the DeepSpeed value (an explicit DeepSpeed value "
                          "always replaces a run default)", ("run", "deepspeed"))


@dataclass(frozen=True)
class ModelSection:
    d_model: int = _f(128, "width of the residual stream")
    n_layers: int = _f(2, "number of Transformer blocks")
    n_heads: int = _f(4, "attention heads; must divide d_model")
    d_ff: int = _f(0, "feed-forward width; 0 means 4 * d_model")
    dropout: float = _f(0.0, "dropout probability in attention and feed-forward")
    vocab_size: int = _f(0, "vocabulary size; 0 means the task decides (256 bytes for `lm`)")
    hf: str = _f("", "a Hugging Face transformers model instead of the built-in one: a hub id or a local directory "
                 "(from_pretrained; its tokenizer comes from there too) or a local config.json (random init); "
                 "needs the [hf] extra")
    hf_class: str = _f("", "the transformers auto class to build model.hf with; empty means the task's (e.g. "
                       "AutoModelForCausalLM for lm)")
    zero_init: bool = _f(True, "ZeRO-3 with model.hf: build the model already partitioned over the ranks "
                         "(deepspeed.zero.Init through transformers' HfDeepSpeedConfig) instead of whole on each")
    trust_remote_code: bool = _f(False, "with model.hf: run the model's own code that its config names (auto_map; "
                                 "transformers' trust_remote_code): only for a source you trust; without it such a "
                                 "model is refused in one line")
    hf_tokenizer: bool = _f(True, "with model.hf: its own tokenizer (AutoTokenizer); false: the task's own (bytes for "
                            "lm, the trained SentencePiece model for translation, the residue vocabulary for protein), "
                            "for a model from its config.json (random initialisation) only")


@dataclass(frozen=True)
class DataSection:
    path: str = _f("", "the data: a local file or directory in a format the task reads (see data/README.md: "
                   ".txt/.json/.jsonl/.csv for lm; pairs, fasta, FLIP or csv sources for the case studies; .gz "
                   "too), or `hub:NAME` for a Hugging Face data set; empty means the task's embedded default")
    format: str = _f("auto", "how to read `path`", ("auto", "text", "json", "csv"))
    text_field: str = _f("text", "column holding the text in json/csv data")
    val_path: str = _f("", "validation data in the same format; empty means hold out `val_fraction` of the rows")
    val_fraction: float = _f(0.05, "fraction of rows held out for validation when `val_path` is empty")
    seq_len: int = _f(128, "tokens per training sample")
    max_row_chars: int = _f(20000, "rows longer than this are truncated to it (and counted)")
    num_workers: int = _f(0, "DataLoader worker processes per rank (each prefetches 4 batches ahead)")
    length_buckets: str = _f("", "comma-separated lengths (ascending, the last = data.seq_len, e.g. \"32,64,128\"; a "
                             "TOML list works too) each training batch is padded up to: a few fixed shapes, so "
                             "train.compile compiles each once, static, instead of one dynamic graph; empty = pad to "
                             "the batch's longest; tasks with variable-length samples only (translation, protein)")
    bucket: int = _f(0, "length-bucketed batches: sort samples by length within windows of this many global "
                     "batches, so a micro-batch pads little (the batches' order stays random); 0 = off; tasks with "
                     "variable-length samples only (translation, protein)")


@dataclass(frozen=True)
class TrainSection:
    max_steps: int = _f(0, "optimizer steps to train; 0 means derive from `epochs`")
    epochs: float = _f(0.0, "passes over the training data, used when `max_steps` is 0")
    micro_batch_size: int = _f(8, "samples per rank per forward/backward")
    grad_accum_steps: int = _f(1, "micro-batches accumulated per optimizer step")
    global_batch_size: int = _f(0, "samples per optimizer step over all ranks; 0 means "
                                "micro_batch_size * grad_accum_steps * data-parallel size")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 disables clipping")
    log_every: int = _f(10, "write metrics every N steps")
    eval_every: int | str = _f(0, "evaluate every N steps (and always at the end), or \"0.5 epochs\" or \"20 per run\" "
                               "(see harness/config/cadence.py); 0 means only at the end")
    eval_batches: int = _f(0, "micro-batches per rank per evaluation; 0 means the whole validation set")
    save_every: int | str = _f(0, "checkpoint every N steps (and always at the end), or \"1 epoch\" or \"5 per run\"; "
                               "0 means only at the end")
    keep_checkpoints: int = _f(2, "how many of the latest checkpoints to keep (and the best, with select_best)")
    select_best: str = _f("", "keep the checkpoint with the best validation value of this metric and export it "
                          "instead of the last: `loss` (or `val_loss`) or any metric the task's evaluation reports "
                          "(perplexity, accuracy, bleu, mse, ...; one the loss does not give runs the field's "
                          "evaluation at every evaluation); recorded in RUN/best.json; empty = off, export the last")
    select_mode: str = _f("auto", "whether lower or higher select_best is better; auto = min for loss, perplexity, "
                          "mse, mae, rmse, nll, bits_per_byte, error and names starting or ending with one of them "
                          "(price_mse, ...), max for any other", ("auto", "min", "max"))
    early_stopping_patience: int | str = _f(0, "stop after this many evaluations in a row without improvement of "
                                            "select_best (needs select_best and eval_every), or \"3 epochs\" (the "
                                            "evaluations that cover them); 0 = off")
    seed: int = _f(0, "seed for model init, data order and dropout")
    max_nonfinite_steps: int = _f(10, "stop after this many consecutive steps with a non-finite loss or an update "
                                  "skipped for a non-finite gradient (in fp16: once the loss scale is at its minimum)")
    activation_checkpointing: bool = _f(False, "recompute each Transformer block's activations in the backward "
                                        "pass instead of storing them: less memory, about a third more compute "
                                        "(pipelines use pipeline.activation_checkpoint_interval instead)")
    loss_chunk: int = _f(0, "the lm's own model: positions per chunk of its output projection and loss, so the "
                         "logits (B x T x vocab, and their fp32 copy for the loss) never exist whole: each chunk's "
                         "are recomputed in the backward pass (the same loss); 0 = all positions at once")
    compile: bool = _f(False, "compile each Transformer block with torch.compile (fullgraph; blocks of one class "
                       "share one graph; lengths dynamic, or static per data.length_buckets): the steps that "
                       "compile are slow, their compile seconds are logged apart (metrics compile_s), not in "
                       "step_s; a block that cannot compile runs eagerly, said in one line; training only "
                       "(evaluation and decoding run eagerly)")
    collective_timeout_s: float = _f(1800.0, "seconds a rank waits in a collective (a step's all-reduce, a "
                                     "checkpoint's barrier) before the job ends naming the ranks that stopped "
                                     "answering; must cover the longest checkpoint save and evaluation")
    profile_step: int = _f(0, "trace this optimizer step (counted from 1) with torch.profiler on rank 0 and write "
                           "RUN/profile.json: wall time, data-loader wait, device busy time, host overhead and the "
                           "top kernels; 0 = off")


@dataclass(frozen=True)
class OptimizerSection:
    name: str = _f("adamw", "the optimizer: AdamW (DeepSpeed's fused or CPU kernel where it applies) or SGD with "
                   "momentum (torch.optim.SGD)", ("adamw", "sgd"))
    lr: float = _f(3e-4, "peak learning rate")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    momentum: float = _f(0.9, "SGD momentum")
    nesterov: bool = _f(False, "SGD: Nesterov momentum")
    weight_decay: float = _f(0.1, "weight decay, not applied to biases and norms (AdamW: decoupled; SGD: L2)")


@dataclass(frozen=True)
class ScheduleSection:
    kind: str = _f("cosine", "decay after warmup", ("cosine", "linear", "inverse_sqrt", "constant"))
    warmup_steps: int = _f(0, "linear warmup from 0 to `optimizer.lr` over this many steps")
    min_lr_ratio: float = _f(0.1, "cosine/linear decay ends at lr * min_lr_ratio")


@dataclass(frozen=True)
class LoggingSection:
    backend: str = _f("wandb", "experiment tracker; wandb runs offline in the run directory when no API key "
                      "is configured", ("wandb", "tensorboard", "none"))
    project: str = _f("harness", "tracker project name")
    plots: bool = _f(True, "draw RUN/curves.png at the end of the run: training loss, learning rate, validation "
                     "loss and the task's metric against the step (`harness plot` overlays runs)")


@dataclass(frozen=True)
class TranslationSection:
    source_lang: str = _f("en", "language code of the source side (a field name or file suffix in the data)")
    target_lang: str = _f("fr", "language code of the target side")
    label_smoothing: float = _f(0.1, "label smoothing of the cross-entropy; padding never counts")
    beam_size: int = _f(4, "beam width for evaluation and `harness translate`; 1 is greedy decoding")
    length_penalty: float = _f(0.6, "GNMT length-penalty exponent for beam search; 0 turns it off")
    eval_max_sentences: int = _f(200, "sentences decoded for BLEU at the end of training; 0 means all "
                                 "(`harness evaluate` always decodes the whole split)")


@dataclass(frozen=True)
class ProteinSection:
    objective: str = _f("classify", "what to train: masked-LM pre-training, sequence classification, "
                        "per-residue (secondary-structure) labels, or one value per sequence (fitness regression)",
                        ("mlm", "classify", "residue", "regress"))
    pooling: str = _f("mean", "classify and regress with the built-in encoder: one vector per sequence from the mean "
                      "of its positions, or a learned attention over them (for landscapes where a few positions "
                      "matter, e.g. FLIP GB1)", ("mean", "attention"))
    sites: str = _f("all", "classify and regress with the built-in encoder: the model reads every residue, or only "
                    "the positions where the training sequences differ (a mutational library of one length, e.g. "
                    "FLIP GB1's four sites; the ridge baseline uses the same)", ("all", "varying"))
    blend: str = _f("none", "regress with the built-in encoder: `ridge` makes the model's prediction a mix of the "
                    "encoder's and the ridge baseline's (fitted on the training split before training, kept in the "
                    "model): the encoder trains alone, and at the last evaluation (at each, when train.select_best "
                    "names a field metric such as spearman) the ridge share is chosen from 0, 0.25, 0.5, 0.75 by "
                    "validation Spearman (ties: the smaller), kept in the export (and in checkpoints saved after the "
                    "evaluation that chose it); needs validation rows; the recipe that holds its own at a few "
                    "hundred variants", ("none", "ridge"))
    mask_prob: float = _f(0.15, "fraction of residues masked for the mlm objective")
    init_from: str = _f("", "a run directory whose exported encoder weights start this run (e.g. an mlm run)")
    mask_variants: int = _f(10, "mlm: distinct masks per training sequence; the training set holds each sequence "
                            "this many times, each copy with its own fixed mask (so an epoch is that many passes)")
    test_fraction: float = _f(0.1, "share of the distinct sequences held out for test when the source has no "
                              "test split (validation takes data.val_fraction)")
    train_subsample: int = _f(0, "keep this many rows of the training and validation splits together (each stays in "
                              "its split; the test split is untouched), drawn by protein.subsample_seed: a low-N "
                              "study on a large set (the ridge baseline fits the same rows); 0 = all")
    subsample_seed: int = _f(0, "seed of protein.train_subsample's draw (apart from train.seed, so seeds of one "
                             "subsample train on the same rows)")
    sequence_field: str = _f("sequence", "column (csv/jsonl/hub) holding the amino-acid sequence")
    label_field: str = _f("label", "column holding the label: a class (classify), one state letter per residue "
                          "(residue) or a number (regress); in a fasta header, `label=VALUE`; a FLIP csv "
                          "(sequence,target,set,validation) without this column uses `target`")


@dataclass(frozen=True)
class PricesSection:
    lookback: int = _f(96, "past time steps the forecaster sees")
    horizon: int = _f(24, "future time steps it predicts at once")
    patch_len: int = _f(16, "time steps per patch (token)")
    stride: int = _f(8, "steps between patch starts")
    symbols: str = _f("AAPL,IBM,MSFT,GOOG", "embedded stocks only: comma-separated tickers; the series starts on "
                      "the first date every one of them trades")
    columns: str = _f("", "comma-separated channels: for the embedded stocks the price fields taken per symbol "
                      "(empty = `Adj Close`, split- and dividend-adjusted); for a csv/hub source its numeric "
                      "columns (empty = every column but the date)")
    date_column: str = _f("", "csv/hub sources: the column holding the time stamp; empty = `date`/`Date`, else the "
                          "first column")
    transform: str = _f("auto", "applied before z-scoring; auto = log for the embedded stocks, none otherwise",
                        ("auto", "none", "log"))
    train_end: str = _f("", "last date of the training period (inclusive, e.g. 2010-12-31); empty = the source's "
                        "default (stocks: 2010-12-31; ETTh: the standard 8640-row split; csv: 70% of the rows)")
    val_end: str = _f("", "last date of the validation period (inclusive); the test period follows it; empty = the "
                      "source's default (stocks: 2011-12-31; ETTh: row 11519; csv: 80% of the rows)")
    context: str = _f("split", "where validation/test input windows may start: `split` = inside their own split "
                      "(no window touches another split), `previous` = up to `lookback` steps back into the "
                      "preceding split (the standard ETTh1 protocol); targets always stay inside the split",
                      ("split", "previous"))
    head_dropout: float = _f(0.0, "dropout before the flatten head")
    center: str = _f("mean", "per-window normalisation subtracts the window's mean (RevIN) or its last value "
                     "(PatchTST's subtract_last; the untrained model then forecasts persistence)", ("mean", "last"))
    periods: int = _f(1, "`harness evaluate`: also score the split in this many consecutive periods by forecast "
                      "origin (rolling origin, the trained model fixed), each against persistence with its own "
                      "verdict; 1 = the whole split only; `--periods K` sets it for one evaluation")


BUILT_IN_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "d_ff", "dropout", "vocab_size")
TASK_SECTIONS = ("translation", "protein", "prices")  # each belongs to the task of the same name


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    translation: TranslationSection = field(default_factory=TranslationSection)
    protein: ProteinSection = field(default_factory=ProteinSection)
    prices: PricesSection = field(default_factory=PricesSection)
    task: Any = None  # a plug-in task's own section (its `Config` dataclass), from the run file's [task]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section, except the sections of tasks other than `run.task` (and [task] when there is none)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if (k not in TASK_SECTIONS or k == self.run.task) and v is not None}


SECTIONS: dict[str, type] = {k: v for k, v in get_type_hints(RunConfig).items() if k != "task"}
PLUGIN_SECTION = "task"


def all_keys(sections: dict[str, type] | None = None) -> dict[str, dataclasses.Field]:
    """Every `section.key` with its field (type, default, help); `sections` adds a plug-in task's [task]."""
    return {f"{s}.{f.name}": f for s, cls in (sections or SECTIONS).items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class Resolved:
    """The frozen run config and, for every key, where its value came from."""
    cfg: RunConfig
    source: dict[str, str]

    def is_set(self, key: str) -> bool:
        return self.source[key] != "default"

    def adopting(self, values: dict[str, tuple[Any, str]]) -> Resolved:
        """This config with `values` (key -> (value, where it came from)) taken from elsewhere: a DeepSpeed file's
        explicit settings where the run keeps its defaults. Checked again as a whole."""
        cfg = self.cfg
        for key, (value, origin) in values.items():
            section, name = key.split(".")
            value = _coerce(key, value, origin, SECTIONS)
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
        resolved = Resolved(cfg, {**self.source, **{k: origin for k, (_, origin) in values.items()}})
        _check(resolved)
        return resolved

    @property
    def buckets(self) -> tuple[int, ...]:
        return length_buckets(self.cfg)

    def describe(self, key: str) -> str:
        section, name = key.split(".")
        return f"{key} = {getattr(getattr(self.cfg, section), name)!r} ({self.source[key]})"


def _unknown(key: str, sections: dict[str, type]) -> ConfigError:
    close = difflib.get_close_matches(key, list(all_keys(sections)) + list(sections), n=1, cutoff=0.6)
    hint = f"; did you mean `{close[0]}`?" if close else "; `harness keys` lists them all"
    if key.split(".")[0] == PLUGIN_SECTION and PLUGIN_SECTION not in sections:
        hint = "; [task] holds the keys of a plug-in task that declares a Config dataclass"
    return ConfigError(f"unknown config key `{key}`{hint}")


def _coerce(key: str, value: Any, origin: str, sections: dict[str, type]) -> Any:
    section, name = key.split(".")
    expected = get_type_hints(sections[section])[name]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if key == "data.length_buckets" and isinstance(value, list):  # a TOML list of lengths
        value = ",".join(map(str, value))
    allowed = get_args(expected) if get_origin(expected) is not None else (expected,)  # int | str: a cadence
    if type(value) not in allowed:
        raise ConfigError(f"{key} must be {' or '.join(a.__name__ for a in allowed)}, got {type(value).__name__} "
                          f"{value!r} ({origin})")
    if expected is float and not math.isfinite(value):  # TOML has nan and inf literals
        raise ConfigError(f"{key} must be a finite number, got {value!r} ({origin})")
    choices = all_keys(sections)[key].metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r} ({origin})")
    return value


def read_file(path: str | Path, what: str, parse, syntax_error: type[Exception], language: str) -> dict[str, Any]:
    """Read and parse a config file; every failure is one line naming the file."""
    p = Path(path)
    try:
        data = parse(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read {what}: {e}") from None
    except syntax_error as e:
        raise ConfigError(f"{p}: malformed {language}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a {what} must hold a {language} object")
    return data


def read_toml(path: str | Path) -> dict[str, Any]:
    return read_file(path, "run file", tomllib.loads, tomllib.TOMLDecodeError, "TOML")


def parse_override(item: str) -> tuple[str, Any]:
    """`section.key=value`; the value is read as a TOML literal, else taken as a string."""
    key, eq, raw = item.partition("=")
    if not eq or "." not in key:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def resolve(run_file: str | None, overrides: list[str], task_ref) -> Resolved:
    """The run config from defaults, the run file and `--set` overrides. `task_ref(name)` is the task registry's word
    on `run.task` (`harness.tasks.registry.task_ref`): the name as stored (a plug-in file's path made absolute) and
    the plug-in's [task] section (a dataclass) or None; it raises for a name that is no task. Callers use
    `harness.tasks.resolve`, which passes it: the config knows no task."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if run_file:
        flat = {}
        for section, body in read_toml(run_file).items():
            if not isinstance(body, dict):
                raise ConfigError(f"{run_file}: [{section}] must be a table")
            flat.update({f"{section}.{k}": v for k, v in body.items()})
        layers.append((f"run file {run_file}", flat))
    layers.append(("command line", dict(parse_override(o) for o in overrides)))
    task = RunSection.task
    for origin, flat in layers:
        task = flat.get("run.task", task)
    stored, section = task_ref(task) if isinstance(task, str) else (task, None)
    sections = SECTIONS if section is None else {**SECTIONS, PLUGIN_SECTION: section}
    values: dict[str, dict[str, Any]] = {s: {} for s in sections}
    source = {k: "default" for k in all_keys(sections)}
    for origin, flat in layers:
        for key, value in flat.items():
            if key not in source:
                raise _unknown(key if "." in key else f"{key}.", sections)
            section, name = key.split(".")
            values[section][name] = _coerce(key, value, origin, sections)
            source[key] = origin
    if "task" in values["run"]:
        values["run"]["task"] = stored  # a plug-in file found again from any directory
    try:
        cfg = RunConfig(**{s: sections[s](**values[s]) for s in sections})
    except TypeError as e:  # a plug-in's Config with a field that has no default
        raise ConfigError(f"[task]: {e}") from None
    resolved = Resolved(cfg, source)
    _check(resolved)
    return resolved


POSITIVE = ("train.micro_batch_size", "train.grad_accum_steps", "train.log_every", "train.keep_checkpoints",
            "train.max_nonfinite_steps", "model.d_model", "model.n_layers", "model.n_heads", "data.seq_len",
            "data.max_row_chars", "optimizer.eps", "train.collective_timeout_s")
NON_NEGATIVE = ("train.max_steps", "train.global_batch_size", "train.eval_batches", "train.grad_clip", "train.epochs",
                "model.d_ff", "model.vocab_size", "schedule.warmup_steps", "optimizer.lr", "optimizer.weight_decay",
                "data.num_workers", "data.bucket", "train.profile_step", "train.seed", "protein.train_subsample",
                "protein.subsample_seed", "train.loss_chunk")
# the cadences (train.eval_every, ...) are checked by config/cadence.py
BELOW_ONE = ("model.dropout", "data.val_fraction", "optimizer.beta1", "optimizer.beta2", "optimizer.momentum")  # [0, 1)
UP_TO_ONE = ("schedule.min_lr_ratio",)  # [0, 1]


def _check(r: Resolved) -> None:
    c = r.cfg
    for key in (*POSITIVE, *NON_NEGATIVE, *BELOW_ONE, *UP_TO_ONE):
        section, name = key.split(".")
        v = getattr(getattr(c, section), name)
        if key in POSITIVE and v <= 0:
            raise ConfigError(f"{r.describe(key)} must be > 0")
        if v < 0 or (key in BELOW_ONE and v >= 1) or (key in UP_TO_ONE and v > 1):
            bound = "must be >= 0" if key in NON_NEGATIVE else f"must be in [0, 1{')' if key in BELOW_ONE else ']'}"
            raise ConfigError(f"{r.describe(key)} {bound}")
    every = {}
    for key in cadence.UNITS:  # steps, epochs or a count per run: the forms are checked now, the steps at launch
        try:
            every[key] = cadence.parse(key, getattr(c.train, key.split(".")[1]))
        except ValueError as e:
            raise ConfigError(f"{e} ({r.source[key]})") from None
    _check_buckets(r)
    if c.model.d_model % c.model.n_heads:
        raise ConfigError(f"model.n_heads must divide model.d_model: {r.describe('model.d_model')}, "
                          f"{r.describe('model.n_heads')}")
    for key in ("model.hf_tokenizer", "model.trust_remote_code"):
        if not c.model.hf and getattr(c.model, key.split(".")[1]) != getattr(ModelSection, key.split(".")[1]):
            raise ConfigError(f"{r.describe(key)} applies to a Hugging Face model (model.hf)")
    if c.model.hf:  # the built-in model's sizes mean nothing to a Hugging Face model: its config has its own
        given = _chosen(r, [f"model.{k}" for k in BUILT_IN_MODEL_KEYS])
        if given:
            raise ConfigError(f"{'; '.join(given)} belongs to the built-in model, not {r.describe('model.hf')}: "
                              f"change the Hugging Face model's config.json instead")
    only = {"adamw": ("optimizer.beta1", "optimizer.beta2", "optimizer.eps"),
            "sgd": ("optimizer.momentum", "optimizer.nesterov")}
    for name, keys in only.items():
        given = _chosen(r, keys)
        if given and c.optimizer.name != name:
            raise ConfigError(f"{'; '.join(given)} apply to optimizer.name = {name!r}, but "
                              f"{r.describe('optimizer.name')}")
    if not c.train.select_best:
        given = _chosen(r, ["train.select_mode", "train.early_stopping_patience"])
        if given:
            raise ConfigError(f"{'; '.join(given)} needs train.select_best, the metric to select by (e.g. \"loss\")")
    elif every["train.early_stopping_patience"].amount and not every["train.eval_every"].amount:
        raise ConfigError(f"{r.describe('train.early_stopping_patience')} counts evaluations, but "
                          f"{r.describe('train.eval_every')} evaluates only at the end")
    if c.train.max_steps and c.train.epochs:
        raise ConfigError(f"set one of train.max_steps and train.epochs, not both: {r.describe('train.max_steps')}, "
                          f"{r.describe('train.epochs')}")
    for section in TASK_SECTIONS:
        given = [r.describe(k) for k in r.source if k.startswith(f"{section}.") and r.is_set(k)]
        if given and c.run.task != section:
            raise ConfigError(f"[{section}] keys belong to run.task = {section!r}, but {r.describe('run.task')}: "
                              f"{'; '.join(given)}")


def _check_buckets(r: Resolved) -> None:
    text, seq_len = r.cfg.data.length_buckets, r.cfg.data.seq_len
    if not text.strip():
        return
    try:
        buckets = r.buckets
    except ValueError:
        raise ConfigError(f"{r.describe('data.length_buckets')}: must be whole lengths separated by commas, "
                          f"e.g. \"32,64,{seq_len}\"") from None
    if any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ConfigError(f"{r.describe('data.length_buckets')}: lengths must be > 0 and ascending, each once")
    if buckets[-1] != seq_len:
        why = "does not cover" if buckets[-1] < seq_len else "pads past the model's positions beyond"
        raise ConfigError(f"{r.describe('data.length_buckets')}: its largest {buckets[-1]} {why} "
                          f"{r.describe('data.seq_len')}; end the list at {seq_len}")


def _chosen(r: Resolved, keys: list[str] | tuple[str, ...]) -> list[str]:
    """The keys given a value other than their default, described: a default written back (the run directory's
    config.toml) is no choice."""
    out = []
    for key in keys:
        section, name = key.split(".")
        if r.is_set(key) and getattr(getattr(r.cfg, section), name) != getattr(SECTIONS[section], name):
            out.append(r.describe(key))
    return out


def length_buckets(c: RunConfig) -> tuple[int, ...]:
    """data.length_buckets as lengths (checked by `resolve`); () when empty."""
    return tuple(int(x) for x in c.data.length_buckets.split(",") if x.strip())


def check_training_length(c: RunConfig) -> None:
    """Training needs a length; preparing data or evaluating a run does not."""
    if not c.train.max_steps and not c.train.epochs:
        raise ConfigError("set train.max_steps or train.epochs (both are 0)")


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as a run file that `harness train --run` accepts as is (written by tomli-w: any string,
    control characters included, reads back as it was)."""
    import tomli_w

    return tomli_w.dumps(cfg.to_dict())
