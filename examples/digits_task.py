"""A complete plug-in task: regress the mean of a sequence of digits (a toy, with data it builds itself).

    harness train --run examples/digits.toml                      # run.task = "examples/digits_task.py:DigitsTask"
    accelerate launch --config_file launch/cpu_2proc.yaml -m harness train --run examples/digits.toml --ds configs/ds/zero3.json
    harness evaluate --run-dir runs/digits --split test --task examples/digits_task.py:DigitsTask
    harness evaluate --run-dir runs/digits --data my_digits.txt --task examples/digits_task.py:DigitsTask
                                                                  # new data: one line of `length` digits a sample
(`--task`: a run directory alone never imports the plug-in it names; you name it.)

What a task must provide and what it may leave out: the Task interface in harness/tasks/interface.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from harness.config import ConfigError
from harness.tasks import ReadData, TaskData


@dataclass(frozen=True)
class DigitsConfig:  # the run file's [task] section: checked like every other section
    train_samples: int = 4000
    test_samples: int = 500
    length: int = 16


class DigitsModel(nn.Module):  # no forward_flops: the harness counts its FLOPs on the meta device
    def __init__(self, d: int, layers: int, length: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(10, d), nn.Parameter(torch.zeros(length, d))
        self.mlp = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.GELU())])
        self.head = nn.Linear(d, 1)

    def forward(self, digits: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(digits) + self.pos).mean(1)).squeeze(-1)


def _split(n: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 10, (n, length), generator=g)
    return [{"digits": row, "target": row.float().mean() / 9} for row in x]


class DigitsTask:
    Config = DigitsConfig

    def check(self, cfg) -> None:
        if cfg.task.length < 1 or cfg.task.train_samples < 1:
            raise ConfigError(f"task.length and task.train_samples must be >= 1, got {cfg.task}")

    def build_model(self, cfg) -> nn.Module:
        return DigitsModel(cfg.model.d_model, cfg.model.n_layers, cfg.task.length)

    def build_data(self, cfg) -> TaskData:
        t = cfg.task
        train, val = _split(t.train_samples, t.length, seed=1), _split(t.test_samples, t.length, seed=2)
        return TaskData(train, val)

    def collate(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([s[k] for s in samples]) for k in ("digits", "target")}

    def count(self, batch) -> int:
        return len(batch["target"])

    def inputs(self, batch) -> tuple[torch.Tensor]:
        return (batch["digits"],)

    def loss_from(self, prediction, batch) -> torch.Tensor:  # a SUM over the batch: the harness normalises
        return ((prediction.float() - batch["target"]) ** 2).sum()

    def metrics(self, mean_loss: float) -> dict[str, float]:
        return {"mse": mean_loss, "rmse": math.sqrt(mean_loss)}

    def read(self, cfg, path, stored) -> ReadData:
        """`harness evaluate --data PATH`: a text file, one sample a line of task.length digits (others skipped)."""
        if not path.is_file():
            raise ConfigError(f"{path}: not found")
        lines = path.read_text().split()
        rows = [torch.tensor([int(c) for c in x]) for x in lines if x.isdigit() and len(x) == cfg.task.length]
        return ReadData([{"digits": r, "target": r.float().mean() / 9} for r in rows],
                        {"ok": len(rows), "malformed": len(lines) - len(rows)}, [path])

    @torch.no_grad()
    def evaluate(self, model, cfg, split: str, world, in_training: bool = False, data=None) -> dict[str, float]:
        """MSE and Pearson r on a split (or on `data`, from `read`); every rank makes the same number of forward calls
        (ZeRO-3 gathers)."""
        rows = data or _split(cfg.task.test_samples, cfg.task.length, seed=2 if split == "validation" else 3)
        mine, b = rows[world.dp_rank::world.dp_size], cfg.train.micro_batch_size
        device = next(model.parameters()).device
        pairs = []
        for i in range(math.ceil(math.ceil(len(rows) / world.dp_size) / b)):
            chunk = mine[i * b:(i + 1) * b]
            batch = self.collate(chunk or rows[:1])  # a rank without rows left still runs the forward
            prediction = model(batch["digits"].to(device)).float().cpu()
            pairs += list(zip(prediction.tolist(), batch["target"].tolist()))[:len(chunk)]
        p, y = torch.tensor([x for part in world.gather(pairs) for x in part]).T
        return {"mse": float(((p - y) ** 2).mean()), "pearson": float(torch.corrcoef(torch.stack([p, y]))[0, 1])}
