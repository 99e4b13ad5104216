"""The task interface: a task says how to build the model, the data, the loss and the metrics.
The harness owns everything else (parallelism, the loop, checkpoints, logging)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..config import ConfigError, RunConfig
from ..data import DataSummary


@dataclass
class TaskData:
    train: Any          # a map-style dataset of samples
    val: Any
    summary: DataSummary


class Task(Protocol):
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


class CaseStudy(Task, Protocol):
    """A task with prepared data and its field's own evaluation (translation, protein, prices)."""

    def prepare(self, cfg: RunConfig) -> Path:
        """Clean, split and tokenize the source once (see `harness.prepare`); return the prepared directory."""

    def evaluate(self, model, cfg: RunConfig, split: str, world, in_training: bool = False) -> dict[str, float | str]:
        """The field's metrics on a split, computed over the whole split on every rank.

        `model` is the DeepSpeed engine at the end of training (every rank, maybe ZeRO-3 or tensor parallel;
        `in_training` is then true and a task may score a sample of the split), the consolidated plain model on
        every rank (pipeline runs), or a plain module in one process (`harness evaluate`). Every rank makes the
        same number of forward calls, through the model's top-level `__call__` only, so ZeRO-3 and tensor
        parallelism can run their collectives; results are gathered with `world.gather`.
        """


TASKS = {  # name -> module:class, imported on use so `harness keys` stays fast
    "lm": "lm:LanguageModelTask",
    "translation": "translation:TranslationTask",
    "protein": "protein:ProteinTask",
    "prices": "prices:PricesTask",
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"run.task = {name!r} is not a task; choose one of {', '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
