"""The run config: typed, documented fields, resolved once and frozen.

Precedence, stated once: defaults < run file (TOML) < command line (`--set section.key=value`).
Every value remembers where it came from, so `harness plan` and error messages can say so.
The sections here are the core ones; a task declares its own (its `Config` dataclass, fields made with `setting`),
which the task registry hands to `resolve`. The DeepSpeed JSON is resolved against this config in `ds.py`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

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


# A setting's allowed range, checked by `resolve` for every section (a task's too): the bound reads as the error.
BOUNDS = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0,
          "in [0, 1)": lambda v: 0 <= v < 1, "in [0, 1]": lambda v: 0 <= v <= 1}


def one_line(e: BaseException, limit: int | None = 300) -> str:
    """An exception's message on one line (libraries' run over several), cut to `limit` characters (None: whole)."""
    return " ".join(str(e).split())[:limit]


def setting(default: Any, help: str, choices: tuple | None = None, bound: str | None = None, parse=None,
            scoring: bool = False):
    """A documented config field: its help is what `harness keys` prints; `choices` and `bound` (a key of BOUNDS)
    are checked when the config is resolved; `parse(key, value)` turns what a file or `--set` gives into the field's
    type first (raising ValueError with the reason). `scoring`: how a trained model is scored or decoded, not what it
    is (`harness evaluate` and `translate` take it with --set). A task's `Config` declares its fields with it too."""
    if bound is not None and bound not in BOUNDS:
        raise ValueError(f"bound {bound!r} is none of {', '.join(BOUNDS)}")
    return field(default=default, metadata={"help": help, "choices": choices, "bound": bound, "parse": parse,
                                            "scoring": scoring})


def _directory(key: str, value: Any) -> Any:
    if isinstance(value, str) and not value.strip():  # "" is the current directory: --overwrite would clear it
        raise ValueError(f"{value!r} names no directory")
    return value


def _seed(key: str, value: Any) -> Any:
    """A seed the generators take, with the epoch and sample seeds made from it (seed x 100,003 + epoch) still in
    torch.manual_seed's 64 bits: checked before launch, not as an overflow traceback on every rank."""
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < 2**32:
        raise ValueError(f"{value} must be in [0, 2**32)")
    return value


@dataclass(frozen=True)
class RunSection:
    task: str = setting("lm", "which task to train (see `harness keys`): its model, data, loss and metrics")
    output_dir: str = setting("runs/run", "the run directory: config, metrics, checkpoints and the exported model",
                              parse=_directory)
    name: str = setting("", "run name for the tracker; empty means the run directory's name")
    config_wins: str = setting("run", "where a DeepSpeed file's optimizer or scheduler section (or accelerate's "
                               "accumulation and clipping) and a run-config value you set differ: `run` refuses the "
                               "run, listing every mismatch; `deepspeed` takes the DeepSpeed value (an explicit "
                               "DeepSpeed value always replaces a run default)", ("run", "deepspeed"))


@dataclass(frozen=True)
class ModelSection:
    d_model: int = setting(128, "width of the residual stream", bound="> 0")
    n_layers: int = setting(2, "number of Transformer blocks", bound="> 0")
    n_heads: int = setting(4, "attention heads; must divide d_model", bound="> 0")
    d_ff: int = setting(0, "feed-forward width; 0 means 4 * d_model", bound=">= 0")
    dropout: float = setting(0.0, "dropout probability in attention and feed-forward", bound="in [0, 1)")
    vocab_size: int = setting(0, "vocabulary size; 0 means the task decides (256 bytes for `lm`)", bound=">= 0")
    init_from: str = setting("", "a finished run's directory whose exported weights (RUN/model.safetensors) start "
                             "this run's model: the same task and model, trained on any layout (ZeRO stage, tensor "
                             "or pipeline parallelism, precision); the optimizer, schedule and data start anew")
    hf: str = setting("", "a Hugging Face transformers model instead of the built-in one: a hub id or a local "
                      "directory (from_pretrained; its tokenizer comes from there too) or a local config.json (random "
                      "init); needs the [hf] extra")
    hf_class: str = setting("", "the transformers auto class to build model.hf with; empty means the task's (e.g. "
                            "AutoModelForCausalLM for lm)")
    zero_init: bool = setting(True, "ZeRO-3 with model.hf: build the model already partitioned over the ranks "
                              "(deepspeed.zero.Init through transformers' HfDeepSpeedConfig) instead of whole on each")
    trust_remote_code: bool = setting(False, "with model.hf: run the model's own code that its config names (auto_map; "
                                      "transformers' trust_remote_code): only for a source you trust; without it such "
                                      "a model is refused in one line")
    hf_tokenizer: bool = setting(True, "with model.hf: its own tokenizer (AutoTokenizer); false: the task's own (bytes "
                                 "for lm, the trained SentencePiece model for translation, the residue vocabulary for "
                                 "protein), for a model from its config.json (random initialisation) only")


@dataclass(frozen=True)
class DataSection:
    path: str = setting("", "the data: a local file or directory in a format the task reads (see data/README.md: "
                        ".txt/.json/.jsonl/.csv for lm, or a corpus of any size prepared by `harness prepare lm`; "
                        "pairs, fasta, FLIP or csv sources for the case studies; .gz too), or `hub:NAME` for a "
                        "Hugging Face data set; empty means the task's embedded default")
    format: str = setting("auto", "how to read `path`", ("auto", "text", "json", "csv"))
    text_field: str = setting("text", "column holding the text in json/csv data")
    val_path: str = setting("", "validation data in the same format; empty means hold out `val_fraction` of the rows")
    val_fraction: float = setting(0.05, "fraction of rows held out for validation when `val_path` "
                                  "is empty", bound="in [0, 1)")
    seq_len: int = setting(128, "tokens per training sample", bound="> 0")
    max_row_chars: int = setting(20000, "rows longer than this are truncated to it (and counted); a "
                                  "prepared corpus (harness prepare lm) keeps its rows whole", bound="> 0")
    num_workers: int = setting(0, "DataLoader worker processes per rank (each prefetches 4 batches "
                               "ahead)", bound=">= 0")
    length_buckets: str = setting("", "comma-separated lengths (ascending, the last = data.seq_len, e.g. "
                                  "\"32,64,128\"; a TOML list works too) each training batch is padded up to: a few "
                                  "fixed shapes, so train.compile compiles each once, static, instead of one dynamic "
                                  "graph; empty = pad to the batch's longest; tasks with variable-length samples only "
                                  "(translation, protein)", parse=lambda key, v: ",".join(map(str, v))
                                  if isinstance(v, list) else v)  # a TOML list of lengths
    bucket: int = setting(0, "length-bucketed batches: sort samples by length within windows of this many global "
                          "batches, so a micro-batch pads little (the batches' order stays random); 0 = off; tasks "
                          "with variable-length samples only (translation, protein)", bound=">= 0")


@dataclass(frozen=True)
class TrainSection:
    max_steps: int = setting(0, "optimizer steps to train; 0 means derive from `epochs`", bound=">= 0")
    epochs: float = setting(0.0, "passes over the training data, used when `max_steps` is 0", bound=">= 0")
    micro_batch_size: int = setting(8, "samples per rank per forward/backward", bound="> 0")
    grad_accum_steps: int = setting(1, "micro-batches accumulated per optimizer step", bound="> 0")
    global_batch_size: int = setting(0, "samples per optimizer step over all ranks; 0 means "
                                     "micro_batch_size * grad_accum_steps * data-parallel size", bound=">= 0")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 disables clipping", bound=">= 0")
    log_every: int = setting(10, "write metrics every N steps", bound="> 0")
    eval_every: int | str = setting(0, "evaluate every N steps (and always at the end), or \"0.5 epochs\" or \"20 per "
                                    "run\" (see harness/config/cadence.py); 0 means only at the end")
    eval_batches: int = setting(0, "global batches of samples an evaluation reads, spread evenly over the "
                                "validation set (the same ones on every layout of that global batch); 0 means all "
                                "of it", bound=">= 0")
    save_every: int | str = setting(0, "checkpoint every N steps (and always at the end), or \"1 epoch\" or \"5 per "
                                    "run\"; 0 means only at the end")
    keep_checkpoints: int = setting(2, "how many of the latest checkpoints to keep (and the best, with "
                                    "select_best)", bound="> 0")
    select_best: str = setting("", "keep the checkpoint with the best validation value of this metric and export it "
                               "instead of the last: `loss` (or `val_loss`) or any metric the task's evaluation "
                               "reports (perplexity, accuracy, bleu, mse, ...; one the loss does not give runs the "
                               "field's evaluation at every evaluation); recorded in RUN/best.json; empty = off, "
                               "export the last")
    select_mode: str = setting("auto", "whether lower or higher select_best is better; auto = min for loss, "
                               "perplexity, mse, mae, rmse, nll, bits_per_byte, error and names starting or ending "
                               "with one of them (price_mse, ...), max for any other", ("auto", "min", "max"))
    early_stopping_patience: int | str = setting(0, "stop after this many evaluations in a row without improvement of "
                                                 "select_best (needs select_best and eval_every), or \"3 epochs\" (the "
                                                 "evaluations that cover them); 0 = off")
    seed: int = setting(0, "seed for model init, data order and dropout", parse=_seed)
    max_nonfinite_steps: int = setting(10, "stop after this many consecutive steps with a non-finite loss or an update "
                                       "skipped for a non-finite gradient (in fp16: once the loss scale is at its "
                                       "minimum)", bound="> 0")
    activation_checkpointing: bool = setting(False, "recompute each Transformer block's activations in the backward "
                                             "pass instead of storing them: less memory, about a third more compute "
                                             "(pipelines use pipeline.activation_checkpoint_interval instead)")
    loss_chunk: int = setting(0, "the lm's own model: positions per chunk of its output projection and loss, so the "
                              "logits (B x T x vocab, and their fp32 copy for the loss) never exist whole: each "
                              "chunk's are recomputed in the backward pass (the same loss); 0 = all "
                              "positions at once", bound=">= 0")
    compile: bool = setting(False, "compile each Transformer block with torch.compile (fullgraph; blocks of one class "
                            "share one graph; lengths dynamic, or static per data.length_buckets): the steps that "
                            "compile are slow, their compile seconds are logged apart (metrics compile_s), not in "
                            "step_s; a block that cannot compile runs eagerly, said in one line; training only "
                            "(evaluation and decoding run eagerly)")
    collective_timeout_s: float = setting(1800.0, "seconds a rank waits in a collective (a step's all-reduce, a "
                                          "checkpoint's barrier) before the job ends naming the ranks that stopped "
                                          "answering; must cover the longest checkpoint save and "
                                          "evaluation", bound="> 0")
    profile_step: int = setting(0, "trace this optimizer step (counted from 1) with torch.profiler on rank 0 and write "
                                "RUN/profile.json: wall time, data-loader wait, device busy time, host overhead and "
                                "the top kernels; 0 = off", bound=">= 0")


@dataclass(frozen=True)
class OptimizerSection:
    name: str = setting("adamw", "the optimizer: AdamW (DeepSpeed's fused or CPU kernel where it applies) or SGD with "
                        "momentum (torch.optim.SGD)", ("adamw", "sgd"))
    lr: float = setting(3e-4, "peak learning rate", bound=">= 0")
    beta1: float = setting(0.9, "AdamW beta1", bound="in [0, 1)")
    beta2: float = setting(0.95, "AdamW beta2", bound="in [0, 1)")
    eps: float = setting(1e-8, "AdamW epsilon", bound="> 0")
    momentum: float = setting(0.9, "SGD momentum", bound="in [0, 1)")
    nesterov: bool = setting(False, "SGD: Nesterov momentum")
    weight_decay: float = setting(0.1, "weight decay, not applied to biases and norms (AdamW: "
                                  "decoupled; SGD: L2)", bound=">= 0")


@dataclass(frozen=True)
class ScheduleSection:
    kind: str = setting("cosine", "decay after warmup", ("cosine", "linear", "inverse_sqrt", "constant"))
    warmup_steps: int = setting(0, "linear warmup from 0 to `optimizer.lr` over this many steps", bound=">= 0")
    min_lr_ratio: float = setting(0.1, "cosine/linear decay falls to lr * min_lr_ratio at the run's total steps "
                                  "(its last step takes the lr one step before, as transformers' schedules do)",
                                  bound="in [0, 1]")


@dataclass(frozen=True)
class LoggingSection:
    backend: str = setting("wandb", "experiment tracker; wandb runs offline in the run directory when no API key "
                           "is configured", ("wandb", "tensorboard", "none"))
    project: str = setting("harness", "tracker project name")
    plots: bool = setting(True, "draw RUN/curves.png at the end of the run: training loss, learning rate, validation "
                          "loss and the task's metric against the step (`harness plot` overlays runs)")


BUILT_IN_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "d_ff", "dropout", "vocab_size")


@dataclass(frozen=True)
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    task: Any = None  # the task's own section (its `Config` dataclass); None for a task without one
    task_section: str = "task"  # that section's name in the run file: [task] for a plug-in, [protein], ...

    def section(self, name: str) -> Any:
        """The section of that run-file name: a core one or the task's."""
        return self.task if name == self.task_section else getattr(self, name)

    def sections(self) -> dict[str, type]:
        """Each section's run-file name and class: the core ones (a task's own [data] keys in `data`), then the
        task's."""
        core = {**SECTIONS, "data": type(self.data)}
        return core if self.task is None else {**core, self.task_section: type(self.task)}

    def replacing(self, key: str, value: Any) -> RunConfig:
        """This config with `section.key` = value (unchecked: `resolve` checks)."""
        section, name = key.split(".")
        new = dataclasses.replace(self.section(section), **{name: value})
        return dataclasses.replace(self, **{"task" if section == self.task_section else section: new})

    def changed(self) -> dict[str, dict[str, Any]]:
        """Every section by its run-file name, with the keys whose values are not their defaults: what its maker set."""
        def default(f: dataclasses.Field) -> Any:
            return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]

        return {name: {f.name: getattr(self.section(name), f.name) for f in dataclasses.fields(self.section(name))
                       if getattr(self.section(name), f.name) != default(f)} for name in self.sections()}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section by its run-file name: the core ones, then the task's (none for a task without one)."""
        plain = lambda v: [plain(x) for x in v] if isinstance(v, (list, tuple)) else v  # noqa: E731 - as TOML reads
        return {name: {k: plain(v) for k, v in dataclasses.asdict(self.section(name)).items()}
                for name in self.sections()}


SECTIONS: dict[str, type] = {"run": RunSection, "model": ModelSection, "data": DataSection, "train": TrainSection,
                             "optimizer": OptimizerSection, "schedule": ScheduleSection, "logging": LoggingSection}
PLUGIN_SECTION = "task"  # a plug-in task's section; a built-in task's is named after it


def all_keys(sections: dict[str, type] | None = None) -> dict[str, dataclasses.Field]:
    """Every `section.key` with its field (type, default, help) of `sections` (default: the core ones)."""
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
            cfg = cfg.replacing(key, _coerce(key, value, origin, cfg.sections()))
        resolved = Resolved(cfg, {**self.source, **{k: origin for k, (_, origin) in values.items()}})
        _check(resolved)
        return resolved

    @property
    def buckets(self) -> tuple[int, ...]:
        return length_buckets(self.cfg)

    def value(self, key: str) -> Any:
        section, name = key.split(".")
        return getattr(self.cfg.section(section), name)

    def describe(self, key: str) -> str:
        return f"{key} = {self.value(key)!r} ({self.source[key]})"


def closest(word: str, names) -> str | None:
    """The name `word` was most likely meant to be (every did-you-mean of the harness), or None."""
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown(key: str, sections: dict[str, type], origin: str) -> ConfigError:
    keys = all_keys(sections)
    # `train.lr` means optimizer.lr: the same name in another section beats a spelling near the section's name
    moved = [k for k in keys if k.split(".")[-1] == key.split(".")[-1]] if "." in key else []
    close = moved[0] if len(moved) == 1 else closest(key, keys if "." in key else [*keys, *sections])
    hint = f"; did you mean `{close}`?" if close else "; `harness keys` lists them all"
    if key.split(".")[0] == PLUGIN_SECTION and PLUGIN_SECTION not in sections:
        hint = "; [task] holds the keys of a plug-in task that declares a Config dataclass"
    return ConfigError(f"unknown config key `{key}` ({origin}){hint}")


_NO = object()


def _conform(value: Any, expected: Any) -> Any:
    """`value` as a field declared `expected` holds it, or _NO: the type itself (a bool is no int), an int where a
    float is declared, a TOML array where a tuple is, each item of a `list[str]`, `tuple[int, int]` or
    `dict[str, float]`, any member of a union (`int | str`: a cadence; `int | None`)."""
    origin, args = get_origin(expected), get_args(expected)
    if expected is Any:
        return value
    if origin in (Union, types.UnionType):
        return next((out for a in args if (out := _conform(value, a)) is not _NO), _NO)
    if origin is Literal:  # True == 1: the type too
        return value if any(value == a and type(value) is type(a) for a in args) else _NO
    if isinstance(value, bool) and expected is not bool:  # a switch is no number
        return _NO
    if expected is float and isinstance(value, numbers.Real):  # an int, numpy's numbers (a sweep's np.float64)
        return _NO if isinstance(value, numbers.Integral) and abs(value) >= 2**1024 else float(value)  # past float
    if expected is int and isinstance(value, numbers.Integral):
        return int(value)
    if expected is str and isinstance(value, str):
        return str(value)
    kind = origin or expected
    if kind in (list, tuple) and isinstance(value, (list, tuple)):
        if kind is tuple and args and args[-1] is not Ellipsis:  # tuple[int, int]: one type a place
            items = [_conform(v, a) for v, a in zip(value, args)] if len(value) == len(args) else [_NO]
        else:
            items = [_conform(v, args[0]) if args else v for v in value]
        return _NO if any(i is _NO for i in items) else kind(items)
    if kind is dict and isinstance(value, dict):
        pairs = [(_conform(k, args[0]), _conform(v, args[1])) if args else (k, v) for k, v in value.items()]
        return _NO if any(_NO in pair for pair in pairs) else dict(pairs)
    return value if type(value) is expected else _NO


def conforms(value: Any, expected: Any) -> bool:
    """Whether a field declared `expected` holds `value` as a run file or --set gives it (`_conform`)."""
    return _conform(value, expected) is not _NO


def type_name(t: Any) -> str:
    origin, args = get_origin(t), get_args(t)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is not None:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return "None" if t is type(None) else getattr(t, "__name__", str(t))


def _coerce(key: str, value: Any, origin: str, sections: dict[str, type]) -> Any:
    section, name = key.split(".")
    expected = get_type_hints(sections[section])[name]
    parse = all_keys(sections)[key].metadata.get("parse")
    if parse is not None:
        try:
            value = parse(key, value)
        except ValueError as e:
            raise ConfigError(f"{key}: {e} ({origin})") from None
    given, value = value, _conform(value, expected)
    if value is None and all_keys(sections)[key].default is not None:  # a run file cannot say None: it would read
        raise ConfigError(f"{key} = None ({origin}): only a key whose default is None may be None (a run file has "
                          f"no None, so it would read back as the default)")
    if value is _NO:
        raise ConfigError(f"{key} must be {type_name(expected)}, got {type(given).__name__} {given!r} ({origin})")
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
        data = parse(p.read_text(encoding="utf-8-sig"))  # a byte-order mark (Windows editors) is no syntax error
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


UNSET_PREFIX = "--unset "  # an override `--unset section.key`: the key back to its default, whoever set it
UNSET = object()


def parse_override(item: str) -> tuple[str, Any]:
    """`section.key=value`; the value is read as a TOML literal, else taken as a string. `--unset section.key`
    (the command line's `--unset KEY`) gives UNSET."""
    if item.startswith(UNSET_PREFIX):
        key = item.removeprefix(UNSET_PREFIX).strip()
        if key.count(".") != 1:
            raise ConfigError(f"--unset expects section.key, got {key!r}")
        return key, UNSET
    key, eq, raw = item.partition("=")
    if not eq or "." not in key:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError as e:
        text = raw.strip()
        if text[:1] in ('"', "'") or (text[:1], text[-1:]) in (("{", "}"), ("[", "]")):  # meant as TOML: say why not
            why = str(e).split(" (at ")[0]  # its position counts a prefix the user did not write
            raise ConfigError(f"--set {key.strip()}: {raw} is not a TOML value: {why}") from None
        value = raw
    return key.strip(), value


def resolve(run_file: str | None, overrides: list[str], task_ref, task_sections: dict[str, type] | None = None,
            task_data: dict[str, type] | None = None) -> Resolved:
    """The run config from defaults, the run file and `--set` overrides. `task_ref(name)` is the task registry's word
    on `run.task` (`harness.tasks.registry.task_ref`): the name as stored (a plug-in file's path made absolute), the
    name of the task's section in the run file, its class (the task's `Config` dataclass, or None) and the task's
    [data] section (a subclass of DataSection with keys of its own, or None); it raises for a name that is no task.
    `task_sections` holds every built-in task's section by name and `task_data` their own [data] classes, so that
    another task's keys are refused naming it. Callers use `harness.tasks.resolve`: the config knows no task."""
    layers = _layers(run_file, overrides)
    task = RunSection.task
    for origin, flat in layers:
        task = flat.get("run.task", task)
        task = RunSection.task if task is UNSET else task
    stored, own, config, data = task_ref(task) if isinstance(task, str) else (task, PLUGIN_SECTION, None, None)
    core = {**SECTIONS, "data": data or DataSection}
    sections = core if config is None else {**core, own: config}
    known = {**(task_sections or {}), **sections}  # another task's keys too: typos in them get a did-you-mean
    for origin, flat in layers:  # another task's own [data] keys: name the task they belong to
        for key in flat.keys() - all_keys(sections).keys():
            owner = next((t for t, cls in (task_data or {}).items() if key in all_keys({"data": cls})), None)
            if owner:
                raise ConfigError(f"{key} ({origin}) belongs to run.task = {owner!r}; run.task is {task!r}")
    values, source = _given(layers, known)
    if "task" in values["run"]:
        values["run"]["task"] = stored  # a plug-in file found again from any directory
    cfg = RunConfig(**{s: core[s](**values[s]) for s in SECTIONS},
                    task=None if config is None else config(**values[own]), task_section=own)
    resolved = Resolved(cfg, {k: v for k, v in source.items() if k.split(".")[0] in sections})
    _check(resolved)
    for section in (s for s in known if s not in sections):  # another task's keys: name the task they belong to
        given = [f"{k} = {values[section][k.split('.')[1]]!r} ({source[k]})"
                 for k in all_keys({section: known[section]}) if source[k] != "default"]
        if given:
            raise ConfigError(f"[{section}] keys belong to run.task = {section!r}, but "
                              f"{resolved.describe('run.task')}: {'; '.join(given)}")
    return resolved


def _layers(run_file: str | None, overrides: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The run file's `section.key`s and the overrides', each with its origin, the last winning. An override is the
    command line's `section.key=value`, or (origin, `section.key=value`) or (origin, {`section.key`: value}) from
    elsewhere: the Python API's dict config, named as such in errors."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if run_file:
        flat = {}
        for section, body in read_toml(run_file).items():
            if not isinstance(body, dict):
                raise ConfigError(f"{run_file}: [{section}] must be a table")
            flat.update({f"{section}.{k}": v for k, v in body.items()})
        layers.append((f"run file {run_file}", flat))
    last = None
    for item in overrides:
        origin, given = item if isinstance(item, tuple) else ("command line", item)
        if origin != last:  # a layer of its own where the origin changes, in their order
            layers.append((origin, {}))
            last = origin
        layers[-1][1].update(given if isinstance(given, dict) else [parse_override(given)])
    return layers


def _given(layers: list[tuple[str, dict[str, Any]]],
           sections: dict[str, type]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The values the layers give, by section, each of the type its field declares, and every key's source."""
    values: dict[str, dict[str, Any]] = {s: {} for s in sections}
    source = {k: "default" for k in all_keys(sections)}
    for origin, flat in layers:
        for key, value in flat.items():
            if key not in source:
                raise _unknown(key if "." in key else f"{key}.", sections, origin)
            section, name = key.split(".")
            if value is UNSET:
                values[section].pop(name, None)
                source[key] = "default"
                continue
            values[section][name] = _coerce(key, value, origin, sections)
            source[key] = origin
    return values, source


def _check(r: Resolved) -> None:
    c = r.cfg
    for key, f in all_keys(c.sections()).items():  # the task's settings too
        bound = f.metadata.get("bound")
        if bound and not BOUNDS[bound](r.value(key)):
            raise ConfigError(f"{r.describe(key)} must be {bound}")
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
    if c.model.init_from and c.model.hf:  # its export is a from_pretrained directory: what model.hf reads
        raise ConfigError(f"{r.describe('model.init_from')} with {r.describe('model.hf')}: start a Hugging Face "
                          f"model from a run's weights with model.hf = that run's hf/ directory (its export)")
    if c.model.init_from and c.run.task == "protein":
        raise ConfigError(f"{r.describe('model.init_from')}: a protein run starts from another's weights with "
                          f"protein.init_from, which matches the residue vocabularies and starts a new head")
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
    if c.train.max_steps and c.train.profile_step > c.train.max_steps:
        raise ConfigError(f"{r.describe('train.profile_step')} comes after the run's last step, "
                          f"{r.describe('train.max_steps')}: no trace would be written")
    if c.train.max_steps and c.train.epochs:
        raise ConfigError(f"set one of train.max_steps and train.epochs, not both: {r.describe('train.max_steps')}, "
                          f"{r.describe('train.epochs')}; --unset drops one a run file sets (e.g. --unset "
                          f"train.epochs)")


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
        if r.is_set(key) and r.value(key) != getattr(SECTIONS[section], name):
            out.append(r.describe(key))
    return out


def length_buckets(c: RunConfig) -> tuple[int, ...]:
    """data.length_buckets as lengths (checked by `resolve`); () when empty."""
    return tuple(int(x) for x in c.data.length_buckets.split(",") if x.strip())


def run_steps(t: TrainSection, steps_per_epoch: int) -> int:
    """The run's optimizer steps: train.max_steps, else train.epochs of `steps_per_epoch`."""
    return t.max_steps or math.ceil(t.epochs * steps_per_epoch)


def warmup_note(run: Resolved, steps: int) -> str | None:
    """A line where the harness's warmup outlasts the run: its lr never reaches optimizer.lr (not refused: a short
    trial of a long run's file is common)."""
    warmup, lr = run.cfg.schedule.warmup_steps, run.cfg.optimizer.lr
    if steps and warmup > steps:
        return (f"note: {run.describe('schedule.warmup_steps')} is longer than the run's {steps} steps: the lr rises "
                f"to {lr * steps / warmup:.3g} at the last step, never to {run.describe('optimizer.lr')}")
    return None


def check_training_length(c: RunConfig) -> None:
    """Training needs a length; preparing data or evaluating a run does not."""
    if not c.train.max_steps and not c.train.epochs:
        raise ConfigError("set train.max_steps or train.epochs (both are 0): in the run file (--run RUN.toml, e.g. "
                          "configs/runs/lm_demo.toml) or with --set train.max_steps=N")


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

    # None (a task's `x: int | None = None`) has no TOML form: left out, the key reads back as its default
    return tomli_w.dumps({name: {k: v for k, v in body.items() if v is not None} for name, body in cfg.to_dict().items()})
