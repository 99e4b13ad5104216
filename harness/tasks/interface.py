"""The task interface: what a task provides (the model, the data, the loss, the metrics) and may leave to a default.
The harness owns everything else (parallelism, the loop, checkpoints, logging). `harness.tasks` re-exports these
names: a plug-in imports them from there."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch
from torch import nn

from ..config.run import ConfigError, RunConfig
from ..data.rows import KEPT, DataSummary


@dataclass
class TaskData:
    train: Any          # a map-style dataset of samples
    val: Any
    summary: DataSummary | None = None  # what was read and dropped; None: the harness says the sizes
    test: Any = None    # held out for `harness evaluate --split test` by a task without its own `evaluate`


class Task(Protocol):
    """What a task provides; the harness owns everything else. A plug-in task (`run.task = "package.module:Class"`
    or `"path/to/file.py:Class"`) implements the required methods; each optional one not given takes the default
    of `TaskDefaults` (stated there). Batches are dicts of tensors; a model is a plain `nn.Module`.

    Required: `build_model`, `build_data`, `collate`, `count`, `inputs`, `loss_from`.
    Optional: `check`, `check_layout(cfg, layout)` (what the task needs of the parallel layout, before launch),
    `check_batch(cfg, global_batch)` (that data it can size cheaply holds a global batch, before launch),
    `loss`, `metrics`, `Config` (the task's own `[task]` section), `Data` (a DataSection subclass: keys of its own
    in [data], e.g. the lm's `data.mix`), `lengths` (length-bucketed
    batches), `pad_values` (the batch's (B, length) tensors and their padding value: `data.length_buckets` pads
    them to a few lengths), `padding` (the padding fraction in the logs), `evaluate` (`harness evaluate`; without it,
    the mean loss and `metrics` of the split: validation, or `TaskData.test` for test), `prepare`,
    `store` and `read` (`harness evaluate --data`; see `CaseStudy`): without `read`, `--data` is refused in one line;
    `reader_settings`: the run keys `evaluate --data --set` may give for the new data, as {key: the value it is reset
    to for new data, or None to keep the run's} (the lm's data.format and data.text_field).
    `generation_defaults(cfg)`: what a Hugging Face model's export writes in its generation_config, so `generate()`
    on it decodes as the task's evaluation does (translation: the run's beam); a `Config` field declared
    `setting(..., scoring=True)` is one `harness evaluate --set` may change.
    `items` names what `count` counts, for the progress bar's rate (default "items"). `activations_on_paper(cfg)`:
    true where the model is one stack of blocks over every position, so that `harness plan` and a launch on GPUs
    estimate its activations on paper (`plan.render.memory_on_paper`); without it, no estimate and no refusal.
    The model may define `forward_flops(*inputs)` (analytic FLOPs of one forward pass, for MFU); without it the
    harness counts the FLOPs of a forward pass on the meta device once per input shape (torch's FlopCounterMode).
    A pipeline needs the model's `pipeline_layers()` (see `models/transformer.py`).
    """

    def check(self, cfg: RunConfig) -> None:
        """Preflight: raise ConfigError for bad input before any process group starts."""

    def build_model(self, cfg: RunConfig) -> nn.Module:
        """A plain nn.Module (on the meta device too, for `harness plan`)."""

    def build_data(self, cfg: RunConfig) -> TaskData: ...

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]: ...

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        """How many items (e.g. target tokens) the batch's loss sums over, known before the forward pass."""

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The model's positional arguments for this batch (also what a pipeline's first stage receives)."""

    def loss_from(self, outputs, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The SUM of per-item losses over the batch, from the model's outputs; the loop divides by the global
        item count. `loss(model, batch)` is `loss_from(model(*inputs(batch)), batch)`."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def metrics(self, mean_loss: float) -> dict[str, float]:
        """Evaluation metrics from the mean validation loss."""


REQUIRED = ("build_model", "build_data", "collate", "count", "inputs", "loss_from")


class TaskDefaults:
    """The optional parts of a task, as a plug-in task gets them when it does not define them."""

    # A frozen dataclass whose fields all have defaults (`harness.config.run.setting` documents one): the task's own
    # section of the run file, [task] for a plug-in (a built-in task names its own: `section`); None: no section.
    Config = None

    def check(self, cfg: RunConfig) -> None:
        """Nothing beyond the harness's own checks."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss_from(model(*self.inputs(batch)), batch)

    def metrics(self, mean_loss: float) -> dict[str, float]:
        return {"loss": mean_loss}


@dataclass
class ReadData:
    """New data read by a task's `read` for `harness evaluate --data`, one data set of PATH."""
    data: Any                     # handed back to the task's `evaluate(..., data=data)`
    counts: dict[str, int]        # rows by status (the rules of the task's reader)
    files: list[Path]             # the files read, for the report's sha256
    part: str = ""                # which of PATH's data sets (a directory may hold several); "" for the only one
    kept: tuple[str, ...] = KEPT  # the statuses of rows kept; rows of any other were skipped


class CaseStudy(Task, Protocol):
    """A task with prepared data and its field's own evaluation (translation, protein, prices)."""

    def prepare(self, cfg: RunConfig) -> Path:
        """Clean, split and tokenize the source once (see `harness.prepare`); return the prepared directory."""

    def store(self, cfg: RunConfig, out: Path) -> None:
        """Write into `out` (RUN/data/, rank 0, when training starts) what reading new data needs: the tokenizer and
        the statistics fitted on the training split (`harness.prepare.store` copies them with their sha256)."""

    def read(self, cfg: RunConfig, path: Path, stored: Path | None) -> list[ReadData]:
        """`harness evaluate --data PATH`: PATH read in the formats the task reads, cleaned by its rules, with the
        run's stored artefacts in `stored` (RUN/data/, None where the task stores none; never re-fitted); one
        ReadData per data set PATH holds (or a single one). Bad input: ConfigError. A task with a `prepared`
        attribute has it set to `stored` while a run is loaded (`harness evaluate --data`, `translate`,
        `load_model`), so that its `prepare(cfg)` and what builds on it (the model's vocabulary) read the run's copy."""

    def evaluate(self, model, cfg: RunConfig, split: str, world, in_training: bool = False,
                 data=None) -> dict[str, float | str]:
        """The field's metrics on a split, computed over the whole split on every rank; `data` (what `read`
        returned) replaces the split, which then only names it.

        `model` is the DeepSpeed engine at the end of training (every rank, maybe ZeRO-3 or tensor parallel;
        `in_training` is then true and a task may score a sample of the split), the consolidated plain model on
        every rank (pipeline runs), or a plain module in one process (`harness evaluate`). Every rank makes the
        same number of forward calls, through the model's top-level `__call__` only, so ZeRO-3 and tensor
        parallelism can run their collectives; results are gathered with `world.gather`. After each micro-batch `i`
        of `steps` (every rank alike) it may call `world.scored(i, steps)`: in training, a stop signal then ends the
        evaluation there on every rank (it raises; leave it be); without, a signal waits until it is whole.
        """


# What a task returns, checked where the harness first reads it: one line naming the method, not a traceback from
# deep in the loop or DeepSpeed (`checked` below).
RESERVED_METRICS = ("step",)  # an evaluation record's own key (eval.jsonl)


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        grad = "" if value.requires_grad else ", not requiring grad"
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}{grad}"
    if isinstance(value, (list, tuple, Mapping)):
        return f"a {type(value).__name__} of {len(value)} items"
    return " ".join(f"{type(value).__name__} {value!r}".split())[:80]


def _refused(task, method: str, value, want: str) -> ConfigError:
    return ConfigError(f"task {type(task).__name__}: {method} returned {_shown(value)}; {want}")


def check_model(task, model) -> None:
    if not isinstance(model, nn.Module):
        raise _refused(task, "build_model(cfg)", model, "it must return a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):  # torch's "optimizer got an empty parameter list"
        raise ConfigError(f"task {type(task).__name__}: build_model(cfg) gave a {type(model).__name__} with no "
                          f"trainable parameters (none, or every one frozen): nothing to train")


def check_data(task, data) -> None:
    if not isinstance(data, TaskData):
        raise _refused(task, "build_data(cfg)", data, "it must return harness.tasks.TaskData(train, val)")
    for name in ("train", "val"):
        split = getattr(data, name)
        if not (hasattr(split, "__len__") and hasattr(split, "__getitem__")):
            raise ConfigError(f"task {type(task).__name__}: build_data(cfg) gave TaskData.{name} = {_shown(split)}; "
                              f"each split must be a map-style data set (len() and [i]: a list, a datasets.Dataset, "
                              f"a torch Dataset with __len__); [] for none")


def data_digest(data: TaskData) -> tuple:
    """What ranks compare of the data each built (`build_data` runs on every rank): each split's size and three of
    its samples, by value (tensors and arrays by their bytes), in a form no process's hash seed changes."""
    import hashlib

    def value(x) -> Any:
        if isinstance(x, float):  # NaN, unpickled on another rank, is not equal to itself: its hex is
            return x.hex()
        if isinstance(x, (str, int, bool, type(None))):
            return x
        if isinstance(x, torch.Tensor) or hasattr(x, "__array__"):
            try:
                t = torch.as_tensor(x).detach().cpu()
                flat = t.contiguous().reshape(-1).view(torch.uint8)
            except (TypeError, ValueError, RuntimeError):  # an array of objects, an image: its kind alone
                return type(x).__name__
            return str(t.dtype), tuple(t.shape), hashlib.sha1(flat.numpy().tobytes()).hexdigest()
        if isinstance(x, Mapping):  # the same keys in another order are the same sample
            return tuple(sorted(((str(k), value(v)) for k, v in x.items()), key=lambda kv: kv[0]))
        if isinstance(x, (list, tuple)):
            return tuple(value(v) for v in x)
        if isinstance(x, (set, frozenset)):
            return tuple(sorted(repr(value(v)) for v in x))
        return type(x).__name__  # an object of the task's own: its kind alone

    digest = []
    for name in ("train", "val"):
        split = getattr(data, name)
        n = len(split)
        digest.append((name, n, tuple(value(split[i]) for i in sorted({0, n // 2, n - 1}) if n)))
    return tuple(digest)


def check_same_data(task, digests: list[tuple]) -> None:
    """Every rank's `data_digest` alike, or one line (on every rank) naming the first that differs."""
    rank = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if rank is None:
        return
    sizes = lambda d: ", ".join(f"{name} {n}" for name, n, _ in d)  # noqa: E731
    raise ConfigError(f"task {type(task).__name__}: build_data(cfg) gave rank {rank} other data than rank 0 "
                      f"({sizes(digests[rank])} samples there, {sizes(digests[0])} on rank 0, or other samples): "
                      f"every rank must build the same splits; seed any shuffle or split (e.g. "
                      f"random.Random(cfg.train.seed))")


def check_batch(task, batch) -> None:
    """A batch as the loop moves, splits and checksums it: a dict of tensors."""
    if not isinstance(batch, Mapping):  # a dict, or e.g. transformers' BatchEncoding
        raise _refused(task, "collate(samples)", batch, "it must return a dict of tensors")
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise _refused(task, f"collate(samples)[{key!r}]", value, "every value of the batch must be a tensor")


def check_count_and_inputs(task, count, inputs) -> None:
    """What `count(batch)` and `inputs(batch)` return: a whole number of items >= 0 (an int, or a one-value integer
    tensor) and the model's positional arguments as a tuple (or list)."""
    number = count.item() if isinstance(count, torch.Tensor) and count.numel() == 1 else count
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number) or \
            number < 0 or number != int(number):  # numpy's integers too
        raise _refused(task, "count(batch)", count, "it must return the batch's number of items, a whole number >= 0")
    if not isinstance(inputs, (tuple, list)):  # a bare tensor would be unpacked into the model's arguments
        raise _refused(task, "inputs(batch)", inputs, "it must return the model's positional arguments as a tuple, "
                       "e.g. (batch['ids'],)")


def check_loss(task, loss) -> None:
    """What backward takes: the batch's summed loss as a floating-point scalar with a graph."""
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point() and loss.requires_grad):
        raise _refused(task, "its loss (loss_from, or loss where the task defines it)", loss,
                       "it must return the batch's summed loss as a floating-point scalar tensor with its graph "
                       "(not .item(), not detached)")


def check_metrics(task, metrics, method: str = "metrics(mean_loss)") -> None:
    """What the evaluation record takes from `method` (metrics, or a task's own evaluate): a dict of names to Python
    numbers (that a float can hold) or strings, none of them a name the record keeps for itself."""
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise _refused(task, method, metrics, "it must return a dict of names to numbers")
    for key, value in metrics.items():
        if key in RESERVED_METRICS:
            raise ConfigError(f"task {type(task).__name__}: {method} names a metric {key!r}, which the "
                              f"evaluation record keeps for itself; rename it")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)) or \
                (isinstance(value, int) and abs(value) > 2**1023):  # past float's range: it cannot be printed so
            raise _refused(task, f"{method}[{key!r}]", value, "each metric must be a Python number "
                           "(float(...)) or a string")