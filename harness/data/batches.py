"""Batches sharded across ranks: the training sampler, its loader, and evaluation's shards.

Batches are a pure function of (seed, step), so a resumed run sees exactly the data it would have seen.
"""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from ..config.run import ConfigError
from .corpus import permute

PREFETCH = 4  # batches each loader worker keeps ready


def train_batches(dataset, sampler: Sampler, collate, num_workers: int, seed: int, device: torch.device) -> Iterator:
    """The training loader's batches, as `sampler` lays them out: `num_workers` processes with PREFETCH batches ahead
    each, pinned memory on a GPU. The loader has its own generator: drawing its worker seed from the global RNG
    would shift dropout after a resume."""
    from torch.utils.data import DataLoader

    return iter(DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                           pin_memory=device.type == "cuda", prefetch_factor=PREFETCH if num_workers else None,
                           persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(seed)))


class BucketedCollate:
    """`task.collate`, then each of the batch's (B, T) tensors named by `task.pad_values()` padded at the end to the
    smallest of `buckets` (ascending) that holds it, with its padding value: a few shapes instead of one per batch
    (compiled blocks compile once per bucket, `distributed/compile.py`). A batch longer than every bucket keeps its
    length. Padding the same way as the task's own collate, it changes no loss."""

    def __init__(self, task, buckets: tuple[int, ...]):
        self.collate, self.pad, self.buckets = task.collate, task.pad_values(), buckets

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collate(samples)
        for key, value in self.pad.items():
            if key not in batch:
                continue
            x = batch[key]
            width = next((b for b in self.buckets if b >= x.shape[1]), x.shape[1])
            if width > x.shape[1]:
                batch[key] = torch.cat([x, x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)], 1)
        return batch


def training_collate(task, buckets: tuple[int, ...]):
    """What turns a training micro-batch's samples into tensors: the task's collate, bucketed where asked."""
    return BucketedCollate(task, buckets) if buckets else task.collate


class StepSampler(Sampler[list[int]]):
    """This rank's micro-batches of sample indices, from `start_step` to `max_steps`.

    Step s of epoch e takes the next `global_batch` indices of `epoch_order(e)`, laid out as (accum, dp_size,
    micro): rank r's j-th micro-batch is [j, r, :]. Ranks are disjoint and together cover the global batch, and
    a 1-process run with the same global batch sees the same samples at each step. `order`: "held" (an epoch's
    permutation drawn whole), "lazy" (a prepared corpus of any size: `permute`d position by position, never held) or
    "given" (a blend that orders itself, `data.corpus.Mixture`: the run's sample numbers in turn, past len(data)).
    """

    def __init__(self, n: int, micro: int, accum: int, dp_rank: int, dp_size: int, seed: int,
                 start_step: int, max_steps: int, lengths: list[int] | None = None, bucket: int = 0,
                 order: str = "held", position: tuple[int, int] | None = None):
        """`position`: where `start_step` takes up the data, as `place` gave it to a checkpoint (epoch, offset in
        samples): a resume with another global batch goes on from the samples read, not from step x batch."""
        self.n, self.micro, self.accum, self.dp_rank, self.dp_size = n, micro, accum, dp_rank, dp_size
        self.order, self.position = order, position
        self.seed, self.start_step, self.max_steps = seed, start_step, max_steps
        self.global_batch = micro * accum * dp_size
        self.steps_per_epoch = n // self.global_batch
        if self.steps_per_epoch == 0:
            raise ConfigError(f"the training set has {n} samples, fewer than one global batch of "
                              f"{self.global_batch}; use more data or a smaller batch")
        self.lengths = None if lengths is None else torch.as_tensor(lengths)
        self.bucket, self._epoch = bucket, (None, None)
        self._bucketed = bool(bucket) and self.lengths is not None

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The samples of one epoch in order: a permutation of all n seeded by (seed, epoch), of which the epoch's
        steps read the first steps_per_epoch x global_batch (a resume at another batch may read on, `place`); with
        bucketing, those alone, sorted by length within windows of `bucket` global batches, then the epoch's global
        batches shuffled, so each micro-batch holds similar lengths but steps still vary."""
        if self._epoch[0] == epoch:
            return self._epoch[1]
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(self.n, generator=g)  # whole: a resume at another batch may read past spe x batch
        if self._bucketed:
            order = order[:self.steps_per_epoch * self.global_batch]
            window = self.bucket * self.global_batch
            order = torch.cat([w[torch.argsort(self.lengths[w], stable=True)] for w in order.split(window)])
            batches = order.view(self.steps_per_epoch, self.global_batch)
            order = batches[torch.randperm(self.steps_per_epoch, generator=g)].flatten()
        self._epoch = (epoch, order)
        return order

    def place(self, step: int) -> tuple[int, int]:
        """(epoch, offset of its first sample in the epoch's order) of step `step`; for order "given" (0, the
        samples before it). An epoch ends where another global batch would not fit: its last samples go unread (with
        data.bucket, past the steps its arrangement holds)."""
        g = self.global_batch
        if self.position is None or step < self.start_step:
            epoch, k = divmod(step, self.steps_per_epoch)
            return (0, step * g) if self.order == "given" else (epoch, k * g)
        epoch, offset = self.position
        i = step - self.start_step
        if self.order == "given":
            return 0, offset + i * g
        held = self.steps_per_epoch * g if self._bucketed else self.n  # the samples of an epoch's order
        left = max(0, (held - offset) // g)  # the resumed epoch's steps left at this batch
        if i < left:
            return epoch, offset + i * g
        more, k = divmod(i - left, self.steps_per_epoch)
        return epoch + 1 + more, k * g

    def epoch_at(self, steps_done: int) -> float:
        """The epochs read after `steps_done` steps, from the place in the data (`place`): steps / steps_per_epoch
        where the batch never changed; after a resume at another batch, what the steps before it read counts too."""
        epoch, offset = self.place(steps_done)
        if self.order == "given":  # (0, the samples read)
            return offset / (self.steps_per_epoch * self.global_batch)
        return epoch + min(1.0, offset / (self.steps_per_epoch * self.global_batch))  # (a resumed epoch may read a
        # batch past its own length)

    def steps_to(self, epochs: float) -> int:
        """The run's steps for train.epochs: the first step count whose `epoch_at` reaches `epochs`; ceil(epochs x
        steps_per_epoch) where the batch never changed, and after a resume at another batch, counted from the place
        in the data the checkpoint kept, so the steps before it count at their own batch."""
        lo = self.start_step
        hi = lo + max(0, math.ceil((epochs - self.epoch_at(lo)) * self.steps_per_epoch))  # (each step reads at least
        while lo < hi:  # 1 / steps_per_epoch of an epoch)
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.epoch_at(mid) < epochs else (lo, mid)
        return lo

    def step_indices(self, step: int) -> torch.Tensor:
        """All indices of global step `step`, shape (accum, dp_size, micro)."""
        epoch, start = self.place(step)
        if self.order == "given":
            order = torch.arange(start, start + self.global_batch)
        elif self.order == "lazy":
            order = torch.from_numpy(permute(np.arange(start, start + self.global_batch), self.n,
                                             self.seed * 100_003 + epoch))
        else:
            order = self.epoch_order(epoch)[start:start + self.global_batch]
        return order.view(self.accum, self.dp_size, self.micro)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            for micro_batch in self.step_indices(step)[:, self.dp_rank]:
                yield micro_batch.tolist()

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.accum


def eval_batches(n: int, micro: int, dp_rank: int, dp_size: int, samples: int = 0) -> tuple[list[list[int]], int]:
    """This rank's evaluation micro-batches (a strided shard of all n samples) and how many batches every rank
    must run: ranks with fewer real batches repeat a forward pass so collective ops (ZeRO-3) stay in step. With
    `samples` < n, that many are evaluated, spread evenly over all n, the same ones on every layout (not the first
    ones: a prepared corpus's validation windows lie in file order, a mixture's source by source, and the first
    would have been one file's or one source's)."""
    chosen = range(n) if not 0 < samples < n else [k * n // samples for k in range(samples)]
    mine = list(chosen[dp_rank::dp_size])
    batches = [mine[i:i + micro] for i in range(0, len(mine), micro)]
    return batches, math.ceil(math.ceil(len(chosen) / dp_size) / micro)
