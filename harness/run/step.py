"""A training step and the loop's account of it, for every strategy: `train_step` (forward, backward and DeepSpeed's
step over one global batch's micro-batches, the loss normalised by the global work count), `Steps` (fetching a
span's batches ahead and counting their work), `Span` (one collective for a span of steps instead of one a step) and
`Ledger` (the steps' figures, read a span late from that collective, logged and judged). The loop (`loop.py`) and
the overhead study's hand-written loop (`harness/bench/reference.py`) both run steps through these."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, fields
from typing import Callable, ClassVar

import torch

from ..data.batches import PREFETCH
from ..distributed.memory import peak_memory_bytes
from ..distributed.parallel import pipeline_step
from ..distributed.world import (
    World,
    all_gather_rows,
    all_gather_start,
    all_reduce,
    host_to_device,
    to_host_later,
)
from ..models import sequence
from ..models.flops import TRAIN_FACTOR, ForwardFlops
from ..plan.resolve import Plan
from ..tasks.interface import check_batch, check_count_and_inputs, check_loss
from . import profiling
from .tracking import Tracker


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Fields:
    """Named numbers that travel as a float64 row in a collective: `pack` puts them in field order, `unpack` reads
    a row (or a slice of one) back on the host; N, how many (set by `row`)."""
    N: ClassVar[int]

    def pack(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def unpack(cls, row: list[float], at: int = 0):
        return cls(*row[at:at + cls.N])

    @classmethod
    def column(cls, name: str) -> int:
        return [f.name for f in fields(cls)].index(name)


def row(cls: type) -> type:
    """A dataclass of `Fields`, its N counted from its fields."""
    cls = dataclass(cls)
    cls.N = len(fields(cls))
    return cls


@row
class Head(Fields):
    """The start of a rank's row in a span's collective."""
    signal: float   # a stop signal the rank got, else 0
    step_s: float   # its seconds per step over the last span (0: not known yet)


@row
class Work(Fields):
    """A step's work on a rank, counted on the host from its batches (`step_work`); summed over ranks, a step's."""
    items: float    # what the loss is normalised by (e.g. target tokens)
    flops: float    # model training FLOPs
    real: float     # real positions
    padded: float   # positions with padding
    data_hash: float  # `batch_hash` of its batches: the same whatever the ranks and micro-batches hold

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(self.pack(), other.pack())))


@row
class Figures(Fields):
    """A step's figures on a rank, carried to the next span's collective (`_figures` builds them on the device)."""
    carried: float    # 1: the loop's bookkeeping carried them
    peak_mem: float   # bytes
    has_norm: float   # 1 where there is a gradient norm
    grad_norm: float
    loss_sum: float


SYNC_S = 1.0  # a span's collective comes about once a second at most: as many steps as run in it, up to
MAX_SPAN = 16  # this many (batches fetched ahead), and one when the steps take a second or more


def span_length(step_s: float) -> int:
    """Steps in the next span, from the slowest rank's seconds per step (0: not known yet, a span of one)."""
    return 1 if step_s <= 0 else max(1, min(MAX_SPAN, int(SYNC_S / step_s)))


@dataclass
class StepResult:
    """A step's outcome. What only the ranks together know (the loss, the peak memory) is read by the `Ledger` when
    the next span's collective brings it; until then `loss` and its kin are None."""
    rows: Callable[[], torch.Tensor] | None  # the first step of a span: -> every rank's row of the span's
    #                                          collective on the host (`Span`: Head, k x Work, n x Figures)
    mine: torch.Tensor | None  # (Figures.N,) this rank's figures of this step, on its device; None: read (pipeline)
    skipped: bool              # the update was skipped for a non-finite gradient (fp16: or an overflow)
    skipped_steps: int         # updates skipped so far
    loss_scale: float | None   # fp16's loss scale after the step; None in fp32 and bf16
    loss: float | None = None         # mean over the step's global items (e.g. target tokens)
    peak_mem: int | None = None       # the most memory any rank has held so far (bytes; world.peak_memory_bytes)
    signal: int | None = None         # a stop signal some rank got (the highest number), else 0: preemption.py
    grad_norm: float | None = None    # global gradient norm before clipping, where DeepSpeed or the loop has one


class Span:
    """One collective for the next `k` steps, where the loop had one a step: on a shared CPU a collective costs about
    1% of a small model's step, however well hidden (gloo's thread, a second meeting of the ranks). Started at the
    span's first step and awaited before its first backward (the first forward hides it), every rank's row:
    [a stop signal it got, its seconds per step of the last span, the work counts of each of the `k` steps (the
    loss normalisers; their batches fetched ahead), the figures of the steps run since the last span
    (`Ledger.carry`)]. On a GPU nothing here waits for the device: host values go up from pinned memory, and the
    rows come down behind the gather (`to_host_later`)."""

    def __init__(self, works: list[Work], signal: int, step_s: float, carry: torch.Tensor, world: World,
                 factor: int = 1):
        self.world, self.factor = world, factor  # factor: sequence parallel under ZeRO-3 (`Ulysses.loss_factor`)
        head = torch.tensor([*Head(signal, step_s).pack(), *(w for work in works for w in work.pack())],
                            dtype=torch.float64)
        self.out, self.pending = all_gather_start(torch.cat([host_to_device(head, world.device), carry]))
        self.gathered, self.rows = None, None

    def loss_scale(self, i: int, accum: int) -> torch.Tensor:
        """Step `i` of the span's: DeepSpeed divides by the accumulation steps and averages over data-parallel
        ranks; scaling by their product over the global count makes the gradient that of sum(loss) / n_items."""
        world = self.world
        if self.gathered is None:
            if self.pending is not None:
                self.pending.wait()
            self.gathered = self.out.view(world.world_size, -1)
            self.rows = to_host_later(self.gathered)
        # Ranks that read the same batch (tensor-parallel peers, pipeline stages, sequence ranks) each count it:
        # hence replicas.
        items = self.gathered[:, Head.N + i * Work.N + Work.column("items")].sum() / world.replicas
        return (world.dp_size * accum * self.factor / items).float()


class Ledger:
    """The loop's account of its steps, a span behind them. A step's own figures (`StepResult.mine`) ride to the
    other ranks in the next span's one collective (`Span`, `carry`): no step has a sync of its own beyond
    DeepSpeed's and that one, once a span. A step whose figures a decision needs at once (an evaluation, a
    checkpoint, the end, a stop signal) is read with a collective of its own: `settle`. A stop signal some rank got
    travels at the head of a span's row: `signal` has it once the span's first step has been added, so the run
    stops at that step's end (within about `SYNC_S` seconds and a step of the signal).

    Reading a step counts it towards `train.max_nonfinite_steps` (`give_up` once there, up to a span after the
    step that made it so; every save and evaluation settles first) and writes its metrics
    record at `train.log_every` and at the end. A record's window runs from one logged step's end to the next's, so
    every second of the loop, the logging's own included, is in one."""

    def __init__(self, tracker: Tracker, progress, t, stop: int, epoch_at: Callable[[int], float], flops: ForwardFlops,
                 fixed: dict, items: str, min_loss_scale: float, world: World, compiled=None):
        """`epoch_at(step)`: the epochs read after `step` steps (StepSampler.epoch_at: from its place in the data, which
        a resume at another batch keeps)."""
        self.tracker, self.progress, self.t, self.stop, self.world = tracker, progress, t, stop, world
        self.compiled = compiled  # train.compile's CompileWatch: the seconds compiling, kept out of step_s
        self.epoch_at, self.flops, self.fixed, self.items = epoch_at, flops, fixed, items
        self.min_loss_scale = min_loss_scale
        self.said_estimate = False  # the FLOPs count fell back to 6N, said once
        self.nothing = torch.zeros(0, dtype=torch.float64, device=world.device)  # nothing carried
        self.pending: list[tuple] = []  # steps run, not read: (step, StepResult, its global work, lr, samples, end)
        self.works: list[Work] = []  # the global work of the span's steps not yet added
        self.span = 1  # steps in the next span (`span_length`)
        self.step, self.result = None, None  # the last step read
        self.unlogged: tuple | None = None  # the last step read, while it has no record: what `_log` takes
        self.nonfinite, self.give_up, self.signal = 0, False, 0
        self.itemless = 0  # of the non-finite steps in a row, those whose batches counted no items (a 0/0 loss)
        # whether the weights are suspect: one of them updated the weights (ZeRO-0 in fp32 does; 1-3 skip it), or its
        # forward itself gave a non-finite loss (weights damaged before it: a checkpoint's bytes, a bad update)
        self.bad_weights = False
        self.window_work, self.window_steps, self.window_start = Work(0, 0, 0, 0, 0), 0, time.perf_counter()
        self.window_loss = 0.0  # the summed losses of the steps since the last record, each times its items
        self.pauses: list[tuple[float, float]] = []  # (start, seconds): the loop's evaluations and saves (`paused`)
        self.data_hash = 0.0  # the last step's `batch_hash`

    def carry(self) -> torch.Tensor:
        """What the next span's collective carries: this rank's figures of the steps not yet read, in order."""
        return torch.cat([p[1].mine for p in self.pending]) if self.pending else self.nothing

    def add(self, step: int, result: StepResult, lr: float, samples_seen: int, mark=profiling.unmarked) -> None:
        """Step `step` has run: at a span's first step, read the steps before it (their figures came with its
        collective); keep this one for later."""
        if result.rows is not None:
            with mark("loss to host"):
                rows = result.rows().tolist()  # sync point: on a GPU, with a copy queued early in the step
            heads = [Head.unpack(r) for r in rows]
            result.signal = int(max(h.signal for h in heads))  # sent before the step ran: stops the run at its end
            self.signal = self.signal or result.signal
            self.span = span_length(max(h.step_s for h in heads))
            carried = len(rows[0]) - len(self.pending) * Figures.N  # where the figures of the steps before begin
            assert (carried - Head.N) % Work.N == 0 and not self.works, "a span's collective is out of step"
            self._read_pending([r[carried:] for r in rows], mark=mark)
            # the steps' global work: ranks that read the same batch (tensor-parallel peers) each counted it
            self.works = [self._global_work(rows, i) for i in range(Head.N, carried, Work.N)]
        self.pending.append((step, result, self.works.pop(0), lr, samples_seen, time.perf_counter()))
        if result.mine is None:  # read already (a pipeline's step)
            self._read_pending(None, mark=mark)

    def _global_work(self, rows: list[list[float]], at: int) -> Work:
        """A step's work over the ranks, from each rank's `Work` at `at` in its row."""
        total = sum((Work.unpack(r, at) for r in rows), Work(0, 0, 0, 0, 0))
        return Work(*(x / self.world.replicas for x in total.pack()))

    def settle(self, last: bool = False) -> None:
        """Read the steps not yet read, now (`last`: the loop ends after them, so the last one's record is
        written)."""
        if self.pending:
            self._read_pending(all_gather_rows(self.carry()).tolist(), last)  # sync point: a collective of its own

    def _read_pending(self, ranks: list[list[float]] | None, last: bool = False, mark=profiling.unmarked) -> None:
        """The pending steps, in order, from every rank's figures of them (Figures.N numbers a step, on the host)."""
        pending, self.pending = self.pending, []
        for j, p in enumerate(pending):
            self._read(p, None if ranks is None else [Figures.unpack(r, j * Figures.N) for r in ranks],
                       last and j == len(pending) - 1, mark)

    def _read(self, pending: tuple, ranks: list[Figures] | None, last: bool, mark) -> None:
        """One step's figures from every rank's, on the host (Python numbers: one conversion, not a tensor
        operation per figure)."""
        step, r, work, lr, samples_seen, ended = pending
        if ranks is not None:
            assert all(f.carried == 1 for f in ranks), "a step's figures were not carried"  # the loop's bookkeeping
            r.peak_mem = int(max(f.peak_mem for f in ranks))
            r.grad_norm = ranks[0].grad_norm if ranks[0].has_norm else None  # global: every rank's is the same
            # a step without items (a 0/0 loss) is a non-finite step
            # each loss sum counted by the ranks that compute it (the sequence ranks sum their own positions)
            r.loss = sum(f.loss_sum for f in ranks) / self.world.loss_replicas / work.items if work.items else math.nan
        if self.give_up:  # the run stops at the step that gave up: reads after it are not counted
            return
        bad_skip = r.skipped and (r.loss_scale is None or r.loss_scale <= self.min_loss_scale)
        self.nonfinite = self.nonfinite + 1 if bad_skip or not math.isfinite(r.loss) else 0
        self.itemless = (self.itemless + (not work.items)) if self.nonfinite else 0
        damaged = not math.isfinite(r.loss) and (r.loss_scale is None or bad_skip)  # (fp16: not an overflow it scales)
        self.bad_weights = (self.bad_weights or not r.skipped or damaged) if self.nonfinite else False
        self.give_up = self.nonfinite >= self.t.max_nonfinite_steps
        self.step, self.result = step, r
        self.window_work = self.window_work + work
        self.window_steps += 1
        self.window_loss += r.loss * work.items if work.items else 0.0
        self.data_hash = work.data_hash  # the logged step's own: comparable with any other run's at that step
        # A skipped update (DeepSpeed found the gradient non-finite) is a bad step in fp32 and bf16; in fp16 only once
        # the loss scale can fall no further (before that, skipping is how dynamic loss scaling finds its scale).
        if r.skipped and self.world.is_main:
            why = "gradient not finite" if r.loss_scale is None else f"fp16 overflow (loss scale now {r.loss_scale:g})"
            self.progress.write(f"step {step}: {why}, update skipped ({r.skipped_steps} so far)")
        self.unlogged = (step, r, lr, samples_seen, ended)
        if step % self.t.log_every == 0 or step == self.stop or last or self.give_up or r.signal:
            with mark("logging"):
                self.log_last()

    @contextlib.contextmanager
    def paused(self):
        """The loop's evaluation or checkpoint save after the steps read so far (`settle`): its seconds are left out of
        the next record's step_s, tokens_per_s and tflops (given as paused_s), as a compile's are."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.pauses.append((began, time.perf_counter() - began))

    def log_last(self) -> None:
        """The last step read gets its record if it has none: the loop stops after it (a stop it found later)."""
        if self.unlogged is not None:
            self._log(*self.unlogged)
            self.unlogged = None

    def _log(self, step: int, r: StepResult, lr: float, samples_seen: int, ended: float) -> None:
        # the pauses before the record's step ended (one after it, before a record logged late, is the next one's)
        paused = min(sum(s for began, s in self.pauses if began < ended), ended - self.window_start)
        self.pauses = [(began, s) for began, s in self.pauses if began >= ended]
        seconds = max(ended - self.window_start - paused, 1e-9)
        compiling = 0.0
        if self.compiled:  # the window's compiles, ended by its end: not step time (a perf_counter end, as wall time)
            compiling = min(seconds, self.compiled.update(step, until=time.time() - (time.perf_counter() - ended)))
            seconds = max(seconds - compiling, 1e-9)
        w = self.window_work
        # over every step since the last record (weighted by their items: the loss of them all)
        mean = r.loss if self.window_steps == 1 else self.window_loss / w.items if w.items else math.nan
        record = {"step": step, "time": round(time.time(), 3), "loss": r.loss, "loss_avg": mean, "lr": float(lr),
                  "grad_norm": r.grad_norm, "samples_seen": samples_seen,
                  "tokens_per_s": w.items / seconds, "step_s": seconds / self.window_steps,
                  "tflops": w.flops / seconds / 1e12, "padding": 1 - w.real / w.padded if w.padded else 0.0,
                  "peak_mem_bytes": r.peak_mem, "epoch": self.epoch_at(step),
                  "flops_method": self.flops.method, **self.fixed,  # the method: once the first batch was counted
                  "skipped_steps": r.skipped_steps, "data_hash": int(self.data_hash)}  # skipped: non-finite, so far
        if r.loss_scale is not None:
            record["loss_scale"] = r.loss_scale
        if self.compiled:
            record["compile_s"] = compiling
        if paused:
            record["paused_s"] = paused
        # the start line said "counted": what model_flops_per_s and MFU rest on changed, said once
        if self.flops.method.startswith("estimated") and not self.said_estimate and self.world.is_main:
            self.progress.write(f"note: FLOPs {self.flops.method}: model_flops_per_s and MFU from here rest on it")
            self.said_estimate = True
        self.tracker.log(record)
        self.progress.set_postfix({"loss": f"{mean:.4f}", "lr": f"{lr:.2e}",
                                   f"{self.items}/s": f"{record['tokens_per_s']:.0f}"}, refresh=False)
        self.window_start, self.window_work, self.window_steps, self.window_loss = ended, Work(0, 0, 0, 0, 0), 0, 0.0


class Steps:
    """What the loop does each step, from fetching its batches to handing it to the `Ledger` (which reads the steps
    before): `_train` runs it once a step, and `harness bench overhead` times it against a plain PyTorch step in the
    same processes (`bench/plain.py`). At a span's first step it fetches and counts the
    batches of all the span's steps (`Ledger.span` of them, none past `last`, no more than the loader's workers
    hold ready: data loading still overlaps training) and starts the span's collective (`Span`); a step in `starts`
    is a span of its own (a profiled step: it shows what a step that syncs costs)."""

    def __init__(self, engine, plan: Plan, world: World, loader, flops: ForwardFlops, ledger: Ledger, progress,
                 last: int, starts: tuple[int, ...] = ()):
        self.engine, self.plan, self.world, self.loader = engine, plan, world, loader
        self.flops, self.ledger, self.progress, self.last, self.starts = flops, ledger, progress, last, starts
        workers = plan.run.cfg.data.num_workers  # each holds PREFETCH micro-batches ready (`train_batches`)
        self.ready = max(1, PREFETCH * workers // plan.ds.grad_accum_steps) if workers else MAX_SPAN  # steps' worth
        self.ahead: list[tuple[list[dict[str, torch.Tensor]], float]] = []  # the span's batches, with their fetch's s
        self.span, self.index, self.span_start = None, 0, (0, 0.0)  # (step, time) the last span began
        self.split = getattr(engine, "harness_split", None)  # sequence parallel (`distributed/sequence.py`)

    def run(self, step: int, lr: float, samples_seen: int, stop_signal: int = 0,
            mark=profiling.unmarked) -> tuple[StepResult, float]:
        """Train step number `step`: (its result, the seconds waited for its batches)."""
        first = not self.ahead
        if first:
            self._start_span(step, stop_signal, mark)
        cpu_batches, loader_wait = self.ahead.pop(0)
        with mark("to device"):
            batches = [to_device(b, self.world.device) for b in cpu_batches]
            if self.split:  # sequence parallel: this rank's positions of each batch
                batches = [self.split.batch(self.plan.task, b) for b in batches]
        saved = {} if "activation_bytes" not in self.ledger.fixed and self.world.pp_size == 1 else None
        result = train_step(self.engine, self.plan, batches, self.world, self.span, self.index, mark, saved)
        if saved is not None:  # the run's first step: what its first micro-batch kept for backward (rank 0's logged)
            self.ledger.fixed["activation_bytes"] = saved.get("bytes")
        result.rows = self.span.rows if first else None
        self.index += 1
        with mark("progress bar"):
            self.progress.update(1)
        self.ledger.add(step, result, lr, samples_seen, mark)  # at a span's first step, reads the steps before it
        return result, loader_wait

    def _start_span(self, step: int, stop_signal: int, mark) -> None:
        then, started = self.span_start
        now = time.perf_counter()
        step_s = (now - started) / (step - then) if then else 0.0  # this rank's, over the last span
        k = 1 if step in self.starts else \
            min(self.ledger.span, self.last - step + 1, self.ready, *(s - step for s in self.starts if s > step))
        works = []
        for _ in range(k):
            fetch_start = time.perf_counter()
            with mark("data"):
                cpu_batches = [next(self.loader) for _ in range(self.plan.ds.grad_accum_steps)]
            self.ahead.append((cpu_batches, time.perf_counter() - fetch_start))
            with mark("count work"):
                works.append(step_work(self.plan.task, self.flops, cpu_batches))  # on the host: no device sync
        with mark("step collective"):
            self.span = Span(works, stop_signal, step_s, self.ledger.carry(), self.world,
                             self.split.loss_factor if self.split else 1)
        self.index, self.span_start = 0, (step, now)


def step_work(task, flops: ForwardFlops, batches: list[dict[str, torch.Tensor]]) -> Work:
    """This rank's share of a step, from its host-side batches (FLOPs: `models/flops.py`, analytic or counted)."""
    items = model_flops = real = padded = hashed = 0
    for b in batches:
        check_batch(task, b)
        n, args = task.count(b), task.inputs(b)
        check_count_and_inputs(task, n, args)
        r, p = task.padding(b) if hasattr(task, "padding") else (1, 1)
        items, model_flops, real, padded = items + n, model_flops + flops(args, n), real + r, padded + p
        hashed += batch_hash(b)
    return Work(float(items), float(TRAIN_FACTOR * model_flops), float(real), float(padded), float(hashed))


def batch_hash(batch: dict[str, torch.Tensor]) -> int:
    """A checksum of a batch's integer tensors (token ids, labels) summed over its samples, each sample's taken mod
    2^24 over its positions in order: a step's is the same however its samples are split into ranks and
    micro-batches, so a resumed run shows it read what the uninterrupted one read (metrics `data_hash`)."""
    total = 0
    for key in sorted(batch):
        x = batch[key]
        if x.ndim and not x.is_floating_point() and x.dtype != torch.bool:
            flat = x.reshape(len(x), -1).long() + 1
            weights = (torch.arange(flat.shape[1], dtype=torch.long) * 2654435761 + 12345) % (1 << 20)
            total += int(((flat * weights).sum(1) % (1 << 24)).sum())
    return total


def train_step(engine, plan: Plan, micro_batches: list[dict[str, torch.Tensor]], world: World, span: Span,
               index: int, mark=profiling.unmarked, saved: dict | None = None) -> StepResult:
    """One optimizer step over this rank's micro-batches, step `index` of `span`; gradients averaged over ranks by
    DeepSpeed. `mark` names the parts of the step for a traced one (`profiling.StepProfile.section`). The loss
    normaliser comes from the span's collective (`Span.loss_scale`: its first step waits for it before its first
    backward, so the first forward hides it). This step's figures (peak memory, gradient norm, loss sum) are
    returned to be carried by the next span's collective; a pipeline's are read at once. `saved` (not a pipeline):
    given a dict, the bytes the first micro-batch's forward keeps for backward are set in it (`saved_bytes`)."""
    task, accum = plan.task, len(micro_batches)

    def loss_scale() -> torch.Tensor:
        with mark("step collective"):
            return span.loss_scale(index, accum)

    skipped_before = engine.skipped_steps
    if world.pp_size > 1:
        scale = loss_scale()
        with mark("engine"):
            step_loss = pipeline_step(engine, task, micro_batches, scale).double().reshape(1)  # already global
        with mark("loss to host"):
            peak = all_reduce(host_to_device(torch.tensor([float(peak_memory_bytes(world.device))],
                                                           dtype=torch.float64), world.device),
                              torch.distributed.ReduceOp.MAX)
            step_loss, peak = torch.cat([step_loss, peak]).tolist()  # sync point
        mine = None
    else:
        with sequence.split_over(engine.harness_split):  # backward too: checkpointed blocks run their forward again
            grad_norm, mine = _micro_steps(engine, plan, micro_batches, world, loss_scale, mark, saved)
    fp16 = plan.ds.precision == "fp16"
    result = StepResult(None, mine, engine.skipped_steps > skipped_before, engine.skipped_steps,
                        float(engine.optimizer.loss_scale) if fp16 else None)
    if mine is None:
        norm = engine.get_global_grad_norm()
        result.loss, result.peak_mem = step_loss, int(peak)
        result.grad_norm = None if norm is None else float(norm)
    return result


def _micro_steps(engine, plan: Plan, micro_batches: list[dict[str, torch.Tensor]], world: World, loss_scale,
                 mark, saved: dict | None = None) -> tuple:
    """Forward, backward and DeepSpeed's step over each micro-batch (not a pipeline): (the gradient norm if the loop
    computed it, else DeepSpeed's; this step's figures)."""
    task, accum, grad_norm, scale = plan.task, len(micro_batches), None, None
    loss_sum = torch.zeros((), dtype=torch.float64, device=world.device)
    for i, batch in enumerate(micro_batches):
        with mark("engine"), saved_bytes(saved if i == 0 else None, engine.module.parameters()):
            loss = task.loss(engine, batch)
        check_loss(task, loss)
        scale = loss_scale() if scale is None else scale
        with mark("engine"):
            engine.backward(loss * scale)
        if plan.ds.loop_norms and i == accum - 1:  # gradients are all-reduced in the boundary backward
            with mark("grad norm"):
                grad_norm = torch.nn.utils.clip_grad_norm_(  # max_norm inf: the norm only, nothing clipped
                    engine.module.parameters(), plan.ds.loop_clips or float("inf"))
        with mark("engine"):
            engine.step()  # steps the optimizer and schedule only at the accumulation boundary
        loss_sum += loss.detach().double()
    with mark("grad norm"):
        if grad_norm is None:
            grad_norm = engine.get_global_grad_norm()  # a float, a tensor, or None
        return grad_norm, _figures(world, grad_norm, loss_sum)


@contextlib.contextmanager
def saved_bytes(out: dict | None, params=()):
    """With a dict: the bytes of the tensors autograd keeps for backward during the block, set as out["bytes"] (each
    storage once): the activation memory of a forward pass, measured (not estimated), the same on a CPU as on a GPU.
    The weights, `params`, are not counted: a saved tensor on a parameter's storage (autograd saves `weight.t()`, a
    view, not the Parameter), on the storage ZeRO-3 gathers one into, or autocast's 16-bit copy of one. Without a
    dict: nothing."""
    if out is None:
        yield
        return
    params = list(params)
    gathered = any(hasattr(p, "ds_id") for p in params)  # ZeRO-3: a layer's forward gathers weights into new storages
    # under ZeRO-3 a storage at the start is a partition, whose address an activation may take: compared when saved
    ids, weights = {id(p) for p in params}, set() if gathered else {p.untyped_storage().data_ptr() for p in params}
    seen: set[int] = set()
    out["bytes"] = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or ptr in weights:
            return t
        if gathered and ptr in {p.untyped_storage().data_ptr() for p in params}:  # gathered for this layer
            weights.add(ptr)  # kept for backward, so the address stays this weight's
            return t
        seen.add(ptr)
        if not _weight_copy(t, ids):
            out["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _weight_copy(t: torch.Tensor, ids: set[int]) -> bool:
    """Whether `t` is (a view of) autocast's cast of a parameter, whose id is in `ids`. Not counted as an activation:
    its size is the weight's whatever the batch and length (`plan/scaling.py` scales activations by both), and it
    would set ZeRO-0's bf16 (autocast over fp32 weights) apart from ZeRO 1-3's, whose 16-bit weights are not cast."""
    fn = (t._base if t._is_view() else t).grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    source = fn.next_functions[0][0]
    return id(getattr(source, "variable", None)) in ids


def _figures(world: World, grad_norm, loss_sum: torch.Tensor) -> torch.Tensor:
    """This rank's `Figures` of a step, packed as (Figures.N,) float64 on its device (peak memory exact to 2**53
    bytes), built without waiting for the device: a norm DeepSpeed keeps on the device stays there."""
    known = [1.0, float(peak_memory_bytes(world.device)), float(grad_norm is not None)]
    if isinstance(grad_norm, torch.Tensor):
        norm = grad_norm.detach().reshape(1).to(world.device, torch.float64)
        return torch.cat([host_to_device(torch.tensor(known, dtype=torch.float64), world.device), norm,
                          loss_sum.reshape(1)])
    known.append(0.0 if grad_norm is None else float(grad_norm))
    return torch.cat([host_to_device(torch.tensor(known, dtype=torch.float64), world.device), loss_sum.reshape(1)])
