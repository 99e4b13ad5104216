"""The task interface: a task says how to build the model, the data, the loss and the metrics.
The harness owns everything else (parallelism, the loop, checkpoints, logging)."""
from __future__ import annotations

from dataclasses import dataclass
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

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The SUM of per-item losses over the batch; the loop divides by the global item count."""

    def metrics(self, mean_loss: float) -> dict[str, float]:
        """Evaluation metrics from the mean validation loss."""


def get_task(name: str) -> Task:
    from .lm import LanguageModelTask

    tasks = {"lm": LanguageModelTask}
    if name not in tasks:
        raise ConfigError(f"run.task = {name!r} is not a task; choose one of {', '.join(tasks)}")
    return tasks[name]()
