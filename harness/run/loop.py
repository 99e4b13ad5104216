"""The one training loop, for every strategy DeepSpeed applies: ZeRO 0-3, offload, fp32/bf16/fp16, tensor and
pipeline parallelism. A pipeline runs each step (and each evaluation batch) through DeepSpeed's schedule;
everything else (data, loss normalisation, logging, checkpoints, resume, export) is the same code."""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from ..config import cadence
from ..config.run import (  # raised here, caught by the CLI
    ConfigError,
    Preempted,
    TrainingStopped,
    run_steps,
    warmup_note,
)
from .. import console
from ..console import progress
from ..data.corpus import is_corpus
from ..data.batches import StepSampler, eval_batches, train_batches, training_collate
from ..distributed.optim import follow_config_lr, follow_config_settings, group_settings, settings_changed
from ..distributed.parallel import (
    build_engine,
    full_state_dict,
    pipeline_loss_sum,
    release,
)
from ..distributed.world import (World, all_gather_objects, all_reduce, cpu_threads, is_lost, is_timeout,
                                 oversubscribed, under_launcher)
from ..models import sequence
from ..models.flops import ForwardFlops
from ..plan.render import build_report, start_line
from ..plan.resolve import Plan
from ..prepare import store_run_data
from ..tasks.interface import check_data, check_metrics, check_model, check_same_data, data_digest
from . import checkpoint, profiling, reshape, resume
from .continuity import check_init_from, data_identity
from .directory import check_free_space, prepare_run_dir, write_configs
from .export import MODEL_FILE, export_model, start_weights
from .heartbeat import Heartbeat, diagnose
from .preemption import EXIT_PREEMPTED, Cut, Watch, agreed, cut_between, cut_if_signalled
from .selection import Selection
from .step import Ledger, Steps, to_device
from .tracking import Tracker, truncate_jsonl
from .trust import TRUST

OWED = "evaluation_owed"  # in a checkpoint's state: a stop signal came before its step's evaluation was whole
OWED_NOTE = ", its evaluation left to the resumed run, which makes it first"


EVAL_BAR_DELAY_S = 2.0


@torch.no_grad()
def loss_sum(engine, task, samples, world: World, micro: int, limit: int = 0, desc: str | None = None,
             signalled: Callable[[], int | None] | None = None) -> tuple[float, int]:
    """The summed loss and the items it counts over `samples` (each once, whatever the world size; with a `limit`,
    that many of them, spread evenly), the model in eval mode meanwhile; `desc`: a progress bar on rank 0.
    `signalled`: this rank's stop signal, if it got one; any rank's cuts the sum short on every rank (raises
    preemption.Cut)."""
    batches, steps = eval_batches(len(samples), micro, world.dp_rank, world.dp_size, limit)
    totals = torch.zeros(2, dtype=torch.float64, device=world.device)
    was_training = engine.training
    engine.eval()
    # drawn once it has taken EVAL_BAR_DELAY_S: a short evaluation draws nothing between the training bar's lines
    shown = progress(range(steps), desc=desc, leave=False, disable=not world.is_main, delay=EVAL_BAR_DELAY_S) \
        if desc else range(steps)
    with contextlib.ExitStack() as restore:
        restore.callback(engine.train, was_training)
        for i in shown:
            _add_batch_loss(engine, task, samples, world, batches, i, totals)
            if signalled:
                cut_between(i, steps, signalled(), world)
    all_reduce(totals)  # sync point; ranks that read the same batch count it alike, so the ratio is exact
    return totals[0].item(), int(totals[1].item())


def _add_batch_loss(engine, task, samples, world: World, batches: list, i: int, totals: torch.Tensor) -> None:
    """Micro-batch `i` of this rank's `batches` (past their end: the last again, counting nothing) into `totals`."""
    real = i < len(batches)
    batch = to_device(task.collate([samples[j] for j in (batches[i] if real else batches[-1] if batches else [0])]),
                      world.device)
    if real and world.sp_rank == 0:  # the sequence ranks split one batch: counted once
        totals[1] += task.count(batch)
    if split := getattr(engine, "harness_split", None):  # each sequence rank sums its own positions
        batch = split.batch(task, batch)
    # Every rank runs `steps` forwards: ZeRO-3 gathers weights, tensor parallelism all-reduces, collectively.
    if world.pp_size > 1:  # the data-parallel mean of the ranks' sums (a rank's repeated batch counts 0),
        totals[0] += pipeline_loss_sum(engine, task, batch, real).double()  # the same on every rank
    else:
        with sequence.split_over(split):  # a forward with collectives (the all-to-all): every rank, every batch
            loss = task.loss(engine, batch).double()
        if real:
            totals[0] += loss


def evaluate(engine, plan: Plan, val, world: World, signalled: Callable[[], int | None] | None = None
             ) -> dict[str, float]:
    """Mean loss over the whole validation set (each sample once, whatever the world size) and task metrics."""
    t = plan.run.cfg.train
    limit = t.eval_batches * plan.ds.global_batch_size  # the same samples on every layout of that batch
    total, count = loss_sum(engine, plan.task, val, world, t.micro_batch_size, limit, desc="evaluating",
                            signalled=signalled)
    metrics = plan.task.metrics(total / count) if count else {}
    check_metrics(plan.task, metrics)
    return {**metrics, "loss": total / count} if count else {}  # the loss whatever the task reports as its own "loss":
    # train.select_best's val_loss, and the record's (a task's metrics(1.0) = {"loss": 123.0} had replaced it)


EVAL_COST = 3  # samples scored per sample trained at which an evaluation (forward only) takes about its steps' time


def eval_cost_note(t, eval_steps: int, n_val: int, global_batch: int) -> str | None:
    """A note where an evaluation reads many times the samples the steps between two train on (by default the whole
    validation split, which of a large corpus is millions of windows): it would take longer than those steps."""
    reads = min(n_val, t.eval_batches * global_batch) if t.eval_batches else n_val
    trained = eval_steps * global_batch
    if not trained or reads <= EVAL_COST * trained:
        return None
    return (f"note: an evaluation reads {reads:,} validation samples, more than {EVAL_COST} times the {trained:,} "
            f"samples trained between two evaluations ({eval_steps} step{'s' if eval_steps > 1 else ''}): it takes "
            f"longer than they do; train.eval_batches = {eval_steps} would read {trained:,}, spread over the split")


def train(plan: Plan, world: World, resume_from: Path | None, overwrite: bool, stop_at: int | None) -> dict:
    """Train `plan` on this rank. A scheduler's signal (`preemption.py`) ends it after the step it came in, with a
    checkpoint: raises Preempted."""
    timeout_s = plan.run.cfg.train.collective_timeout_s
    with Watch() as watch, contextlib.ExitStack() as teardown:
        held = prepare_run_dir(plan, world, resume_from, overwrite)
        beat = Heartbeat(plan.run_dir, world.rank, min(30.0, timeout_s / 4))  # names a hung rank (heartbeat.py)
        try:
            return _train(plan, world, resume_from, stop_at, watch, beat, teardown)
        except RuntimeError as e:
            if world.world_size > 1 and (is_timeout(e) or is_lost(e)):
                from tqdm.auto import tqdm

                for bar in list(tqdm._instances):  # the progress bar's line ends before the error's
                    bar.close()
                raise diagnose(plan.run_dir, world.world_size, world.rank, timeout_s, beat.every_s,
                               lost=not is_timeout(e), step=beat.step) from None
            raise
        finally:
            beat.stop()
            if held:
                held.release()


@dataclass
class Run:
    """What set-up hands the loop and the finish."""
    plan: Plan
    world: World
    data: Any                 # the task's TaskData: train, val, summary
    engine: Any
    schedule: Any
    every: Any                # cadence.Every: evaluation and checkpoint steps
    sampler: StepSampler      # from the resumed step on
    max_steps: int
    stop: int                 # max_steps, or --stop-at's
    samples_seen: int
    selection: Selection | None
    tracker: Tracker
    flops: ForwardFlops
    min_loss_scale: float
    build_peaks: list[dict]
    shapes: dict[str, list[int]]  # the whole model's parameters (resume.SHAPES)
    identity: dict | None         # what the run trains on (resume.DATA): taken once, as the data was read
    owed: bool = False            # the resumed checkpoint's evaluation, which a signal stopped: made first (OWED)

    @property
    def checkpoints(self) -> Path:
        return self.plan.run_dir / "checkpoints"

    @property
    def stopped_early(self) -> bool:
        return bool(self.selection and self.selection.stopped_at)

    @property
    def evaluates(self) -> bool:
        """Whether an evaluation in training has anything to do: the validation loss, or the task's own evaluation
        for train.select_best (`_eval_and_log`)."""
        return bool(len(self.data.val) or (self.selection and hasattr(self.plan.task, "evaluate")))

    def say(self, *args, **kwargs) -> None:
        if self.world.is_main:
            print(*args, **kwargs)


def _train(plan: Plan, world: World, resume_from: Path | None, stop_at: int | None, watch: Watch,
           beat: Heartbeat, teardown: contextlib.ExitStack) -> dict:
    run = _set_up(plan, world, resume_from, stop_at, teardown)
    if isinstance(run, dict):  # --resume auto on a finished run
        return run
    step, metrics = _loop(run, watch, beat, teardown)
    return _finish(run, watch, step, metrics)


def _set_up(plan: Plan, world: World, resume_from: Path | None, stop_at: int | None,
            teardown: contextlib.ExitStack) -> Run | dict:
    """Data, model, engine, resume: the run ready to step, or the result of a run that finished already."""
    cfg, ds, task = plan.run.cfg, plan.ds, plan.task
    say = print if world.is_main else (lambda *a, **k: None)
    threads = cpu_threads()  # before anything computes: a shared CPU's share, not torch's guess of the machine
    crowded = oversubscribed()
    if crowded:
        say(crowded)
    data, sampler_args, steps_per_epoch, max_steps, every = _data(plan, world, resume_from)
    # not at each save: its source may since have been edited, moved or prepared anew; rank 0 alone writes it
    identity = data_identity(plan) if world.is_main else None
    with torch.device("meta"):  # the whole model's shapes, whatever share of it this rank holds: size and FLOPs
        meta_model = task.build_model(cfg)
    check_model(task, meta_model)
    n_params = sum(p.numel() for p in meta_model.parameters())
    weights = _checked_start(plan, world, resume_from, meta_model, n_params, say)
    flops = ForwardFlops(meta_model)
    # seeds the weights itself (the meta model draws none), then takes model.init_from's
    engine, schedule = build_engine(plan, world, max_steps, weights)
    teardown.callback(release, engine)  # however the run ends (parallel.release)
    # What building and loading the model took at its peak on each rank (before DeepSpeed's own buffers)
    build_peaks = all_gather_objects(engine.harness_build_peak)
    state, notes = _resume(plan, world, engine, schedule, resume_from, say) if resume_from is not None else ({}, [])
    start_step = state.get("step", 0)
    selection = Selection.start(cfg.train, every.patience, state.get("selection"))  # train.select_best, or None
    notes += [note] if (note := Selection.resumed_note(cfg.train, state.get("selection"), start_step)) else []
    if resume_from is not None and (start_step >= max_steps or bool(selection and selection.stopped_at)):
        early = selection.why_stopped() if selection and selection.stopped_at and start_step < max_steps else None
        finished = resume.finished(plan.run_dir, plan.run_dir / MODEL_FILE, world, start_step, max_steps, early)
        if finished is not None:  # nothing written: the run directory stays the finished run's record
            return {**finished, **({"best": selection.state()} if selection else {})}
    if resume_from is not None and (note := _leave_later(plan, world, resume_from, start_step)):
        notes.append(note)
    for note in notes:
        say(note)
    if resume_from is not None:
        write_configs(plan, world, resume_from)
    if selection and selection.value is not None:
        checkpoint.adopt_best(plan.run_dir / "checkpoints", selection.step, resume_from.parent, world)
    tracker = _records(plan, world, start_step, max_steps, selection, resume_from is not None, bool(state.get(OWED)))
    say(start_line(plan, world, type(meta_model).__name__, n_params, flops.method, start_step, max_steps,
                   steps_per_epoch, every.describe(steps_per_epoch), threads))
    for line in [build_report(build_peaks, n_params)] if build_peaks[0]["host"] is not None else []:
        say(line)
    for line in ds.sections.notes():  # run keys the DeepSpeed file overrides, or its scheduler does not read
        say(line)
    if not ds.sections.scheduler and (note := warmup_note(plan.run, max_steps)):
        say(note)
    described = task.describe_data(cfg, ds.global_batch_size) if hasattr(task, "describe_data") else None
    say(described or (data.summary.line() if data.summary else
                      f"data train: {len(data.train)} samples; validation: {len(data.val)}"))
    if note := eval_cost_note(cfg.train, every.eval_steps, len(data.val), ds.global_batch_size):
        say(note)
    position = tuple(state["data_position"]) if "data_position" in state else None  # (not in older checkpoints)
    return Run(plan, world, data, engine, schedule, every, StepSampler(**sampler_args, start_step=start_step,
               max_steps=max_steps, position=position), max_steps, min(max_steps, stop_at) if stop_at else max_steps,
               state.get("samples_seen", 0), selection, tracker, flops,
               float(ds.config.get("fp16", {}).get("min_loss_scale", 1)), build_peaks,
               {n: list(p.shape) for n, p in meta_model.named_parameters()}, identity, bool(state.get(OWED)))


def _checked_start(plan: Plan, world: World, resume_from: Path | None, meta_model, n_params: int,
                   say) -> Path | None:
    """The checks of ranks started without `harness launch` (which made them before launch, as one process does), and
    the export model.init_from starts a new run from (checked to fit, and said), or None."""
    init_from = Path(plan.run.cfg.model.init_from) if plan.run.cfg.model.init_from and resume_from is None else None
    if world.world_size > 1 and not under_launcher():
        problem = None
        if world.is_main:
            try:
                if init_from:
                    check_init_from(plan, say=True)
                problem = check_free_space(plan, n_params, resume_from)
            except ConfigError as e:
                problem = str(e)
        problem = all_gather_objects(problem)[0]
        if problem:
            raise ConfigError(problem)
    if init_from is None:
        return None
    step = start_weights(init_from, meta_model)
    say(f"model.init_from: the weights of {init_from} (its step {step}) start this run; its optimizer state, lr "
        f"schedule and place in the data start anew")
    return init_from / MODEL_FILE


def _records(plan: Plan, world: World, start_step: int, max_steps: int, selection: Selection | None,
             resumed: bool, owed: bool = False) -> Tracker:
    """The run's records from `start_step` on: what a crashed run logged past its checkpoint dropped (rank 0), and
    the tracker. W&B continues the run directory's own W&B run where nothing was logged past the checkpoint (a
    preemption's stop); past it, W&B keeps the steps it has, so the run goes on in a new W&B run."""
    ds, logged = plan.ds, 0
    if world.is_main:
        logged = truncate_jsonl(plan.run_dir / "metrics.jsonl", start_step)
        # the final evaluation comes after the last checkpoint: a run resumed there (its export gone) makes it again;
        # so does a run resumed from a checkpoint that owes its evaluation (OWED), which a resume may have made
        truncate_jsonl(plan.run_dir / "eval.jsonl", start_step - (start_step >= max_steps or owed))
        if selection:
            selection.record(plan.run_dir)
    layout = {"layout.world_size": world.world_size, "layout.zero_stage": ds.zero_stage,
              "layout.precision": ds.precision, "layout.global_batch_size": ds.global_batch_size}
    return Tracker(plan.run.cfg, plan.run_dir, enabled=world.is_main, resumed=resumed and logged <= start_step,
                   layout=layout)


def _check_validation(cfg, task, data, world: World) -> None:
    """An empty validation split: no evaluation runs. Selecting by it is refused now, not at its first evaluation
    after training; otherwise said once."""
    if len(data.val) or hasattr(task, "evaluate"):  # a task's own evaluation may read data of its own
        return
    if not hasattr(cfg.data, "mix"):  # not the lm's data section: a plug-in's build_data splits its own data
        where = f"{type(task).__name__}.build_data's validation samples (TaskData.val)"
    elif cfg.data.mix or is_corpus(cfg.data.path):
        where = (f"data.val_path, or a corpus whose validation split (--val-fraction at prepare) holds data.seq_len + "
                 f"1 = {cfg.data.seq_len + 1} tokens")
    else:
        where = "data.val_path or data.val_fraction"
    if cfg.train.select_best:
        raise ConfigError(f"train.select_best = {cfg.train.select_best!r} selects by the validation split, which "
                          f"holds nothing to evaluate: give one ({where}), or leave train.select_best out")
    if world.is_main:
        print(f"note: the validation split holds nothing to evaluate: no evaluation runs; {where} gives one",
              flush=True)


def _data(plan: Plan, world: World, resume_from: Path | None) -> tuple:
    """The task's data (rank 0 first, caching it for the others), the sampler's arguments, steps per epoch, the
    run's steps (train.epochs resumed: from the checkpoint's place in the data) and its cadence in steps."""
    cfg, t, task = plan.run.cfg, plan.run.cfg.train, plan.task
    import datasets
    from accelerate import PartialState

    datasets.disable_progress_bars()  # the data summary line reports what they would
    state = PartialState()
    # rank 0 prepares and caches the data; then each node's local rank 0, which finds it where the cache is shared by
    # the nodes and prepares it again where each node has its own; then the others read it (two barriers on each rank)
    with state.main_process_first(), state.local_main_process_first():
        data = task.build_data(cfg)
    check_data(task, data)
    _check_validation(cfg, task, data, world)
    if world.world_size > 1:  # a split drawn unseeded differs by rank: validation would overlap training
        check_same_data(task, all_gather_objects(data_digest(data)))
    if world.is_main and hasattr(task, "store"):  # RUN/data/: the tokenizer and statistics, to score new data
        note = store_run_data(task, cfg, plan.run_dir)
        if note:
            print(note)
    sampler_args = dict(n=len(data.train), micro=t.micro_batch_size, accum=plan.ds.grad_accum_steps,
                        dp_rank=world.dp_rank, dp_size=world.dp_size, seed=t.seed, bucket=cfg.data.bucket,
                        lengths=task.lengths(data.train) if cfg.data.bucket else None,
                        order=task.sample_order(cfg) if hasattr(task, "sample_order") else "held")
    steps_per_epoch = StepSampler(**sampler_args, start_step=0, max_steps=0).steps_per_epoch
    max_steps = run_steps(t, steps_per_epoch)
    place = resume.saved_place(resume_from) if resume_from is not None and not t.max_steps else None
    if place:  # the steps before it count at their own batch, where the resume changes it
        max_steps = StepSampler(**sampler_args, start_step=place["step"], max_steps=0,
                                position=tuple(place["data_position"])).steps_to(t.epochs)
    try:  # epochs and counts per run become steps now that the data's size is known
        every = cadence.resolve(t, steps_per_epoch, max_steps, plan.run.describe)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return data, sampler_args, steps_per_epoch, max_steps, every


def _resume(plan: Plan, world: World, engine, schedule, resume_from: Path, say) -> tuple[dict, list[str]]:
    """The checkpoint loaded (converted once to DeepSpeed's universal format for another data-parallel size or ZeRO
    stage); its client state."""
    built = group_settings(schedule.optimizer)
    state = checkpoint.load_onto(engine, resume_from, plan.run_dir, plan.ds, world)
    read = "unpickled whole (--trust-checkpoint)" if TRUST.get().checkpoint else "weights-only"
    say(f"resumed from {resume_from} at step {state['step']} (checkpoint read {read})")
    notes = [note] if (note := reshape.batch_note(resume_from, plan.ds, "data_position" in state)) else []
    saved_settings = follow_config_settings(schedule.optimizer, built)
    was, kind = reshape.saved_schedule(resume_from), reshape.schedule_kind(plan.ds)
    if was and was != kind:  # (its state is its step: checkpoint.load)
        notes.append(f"the lr schedule is {kind} from step {state['step'] + 1} (the checkpoint's run had {was})")
    lr = plan.run.cfg.optimizer.lr
    saved = follow_config_lr(schedule, lr)
    if saved is not None:  # e.g. lowered after a non-finite stop, or the run made longer or shorter
        now, step = schedule.optimizer.param_groups[0]["lr"], state["step"] + 1
        changed = f"optimizer.lr {lr:g} (the checkpoint's run had {saved[0]:g})" if saved[0] != lr else \
            "the lr follows this run's schedule (its length and [schedule])"
        notes.append(f"{changed} from step {step}; lr there {now:.3g} (the checkpoint's run: {saved[1]:.3g})")
    if changed := settings_changed(schedule.optimizer, saved_settings):  # (after a scheduler set its momentum)
        notes.append(f"the optimizer's settings are this run's from step {state['step'] + 1}: {'; '.join(changed)}")
    return state, notes


def _leave_later(plan: Plan, world: World, resume_from: Path, step: int) -> str | None:
    """A run resumed from an earlier checkpoint of its own: its later checkpoints set aside as step_N.past (rank 0)
    and `latest` pointed at the one resumed, as its records past `step` are dropped; the line that says so."""
    own = plan.run_dir / "checkpoints"
    if not world.is_main or not resume.is_own(resume_from, plan.run_dir):
        return None
    later = [p.name for p in resume.complete(own) if resume.step_of(p) > step]
    if later:
        resume.rewind_latest(own, step, resume.PAST)
        return (f"note: this run goes on from {resume_from.name}; its later checkpoints ({', '.join(later)}) are set "
                f"aside as step_N{resume.PAST} (rename one back to resume it), removed once it saves at or past their "
                f"steps")
    return None


def _loop(run: Run, watch: Watch, beat: Heartbeat, teardown: contextlib.ExitStack) -> tuple[int, dict]:
    """Step until the stop, a signal or early stopping: each step, then evaluation and a checkpoint when due."""
    plan, world, t = run.plan, run.world, run.plan.run.cfg.train
    steps, ledger, progress, compiled = _stepper(run, teardown)
    metrics, step = {}, run.sampler.start_step
    if run.owed and step < run.max_steps:  # (a run made shorter since makes its final evaluation there instead)
        metrics = _owed_evaluation(run, watch, step, progress)
    while step < run.stop and not run.stopped_early:
        traced = profiling.StepProfile(world.device) if step + 1 == t.profile_step and world.is_main else None
        mark = traced.section if traced else profiling.unmarked  # train.profile_step: where the step's time goes
        run.samples_seen += plan.ds.global_batch_size
        lr = run.schedule.optimizer.param_groups[0]["lr"]  # what this step uses (DeepSpeed's OneCycle keeps none)
        result, loader_wait = steps.run(step + 1, lr, run.samples_seen, watch.signal or 0, mark)
        step += 1
        beat.step = step
        if traced:  # before anything only some steps do: a step that syncs (a span of its own, `Steps`)
            progress.write(f"profiled step {step}: {profiling.write(traced.finish(loader_wait, step), plan.run_dir)}")
        evaluating = run.every.eval_steps and step % run.every.eval_steps == 0 and step < run.max_steps
        saving = run.every.save_steps and step % run.every.save_steps == 0
        if evaluating or saving or step == run.stop or ledger.signal or ledger.give_up:
            ledger.settle(last=step == run.stop or bool(ledger.signal) or ledger.give_up)  # decisions below need it
        if ledger.give_up or (step == run.stop and ledger.bad_weights):  # no export of suspect weights, nor exit
            _give_up(run, ledger, progress)  # 0 (--stop-at: with a checkpoint of this step) after a non-finite loss
        improved, cut, evaluated = False, False, False
        if evaluating and not ledger.signal:
            try:
                with ledger.paused():
                    metrics, improved = _evaluation(run, watch, step, math.isfinite(result.loss))
                evaluated, ledger.signal = True, agreed(watch.signal, world)  # one late in it: stop here, not later
            except Cut as e:
                ledger.signal, cut = e.signum, True
        # cut short, or not begun: the resumed run's, where a checkpoint is saved and there is anything to evaluate
        owed = bool(evaluating and ledger.signal and not evaluated and math.isfinite(result.loss) and run.evaluates)
        if ledger.signal or run.stopped_early:  # a stop found after the steps were read: the step's record too
            ledger.log_last()
        if ledger.signal and world.is_main:  # one line for all ranks, whichever of them got the signal
            progress.write(f"harness: {signal.Signals(ledger.signal).name}: every rank stops after step {step}"
                           f"{' (in its evaluation)' * cut}; saving a checkpoint, then exiting ({EXIT_PREEMPTED})",
                           file=sys.stderr)
        if saving or step == run.stop or improved or run.stopped_early or ledger.signal:
            with ledger.paused():
                _save(run, step, math.isfinite(result.loss), progress, checksums=not ledger.signal, owed=owed)
        if ledger.signal:
            _preempted(run, ledger.signal, step, progress, OWED_NOTE if owed else "")
    progress.close()
    if compiled:
        graphs = f"{compiled.graphs} graph{'s' * (compiled.graphs != 1)}"
        run.say(f"train.compile: {graphs} compiled in {compiled.seconds:.1f} s, counted apart from step_s (metrics "
                f"compile_s)")
    return step, metrics


def _evaluation(run: Run, watch: Watch, step: int, savable: bool = True) -> tuple[dict, bool]:
    """The evaluation of `step` and, with train.select_best, whether it improved (the same verdict on every rank: the
    metrics are all-reduced). A stop signal cuts it short on every rank: raises Cut."""
    metrics = _eval_and_log(run.engine, run.plan, run.data.val, run.world, run.tracker, step,
                            want=run.selection and run.selection.metric, signalled=lambda: watch.signal)
    if not run.selection:
        return metrics, False
    return metrics, _select(run.selection, metrics, step, run.plan, run.world, run.tracker, savable)


def _owed_evaluation(run: Run, watch: Watch, step: int, progress) -> dict:
    """The evaluation of the resumed checkpoint's step, which a signal had stopped: made before the first step."""
    try:
        metrics, improved = _evaluation(run, watch, step)
    except Cut as e:  # the checkpoint still owes it
        _preempted(run, e.signum, step, progress, OWED_NOTE)
    # saved again, owing nothing, where the run ends here (a resume then says it finished, or goes on from it) and
    # where it is now the best (its selection state, and this run's own copy of it: the resumed one may be another's)
    if improved or run.stopped_early or step >= run.stop:
        _save(run, step, True, progress)
    return metrics


def _preempted(run: Run, signum: int, step: int, progress=None, how: str = "") -> NoReturn:
    """End the run for a stop signal: exit EXIT_PREEMPTED (the CLI), naming the checkpoint to resume from."""
    if progress is not None:
        progress.close()
    run.tracker.close(EXIT_PREEMPTED)  # no curves: a scheduler's kill follows its signal, and the exit code must come
    # first
    raise Preempted(f"stopped by {signal.Signals(signum).name} after step {step} of {run.max_steps}{how}; "
                    f"{resume.resume_hint(run.checkpoints)}")


def _stepper(run: Run, teardown: contextlib.ExitStack) -> tuple:
    """What runs the steps and accounts for them: `Steps`, its `Ledger`, the progress bar, the compile watch."""
    plan, world, t = run.plan, run.world, run.plan.run.cfg.train
    loader = train_batches(run.data.train, run.sampler, training_collate(plan.task, plan.run.buckets),
                           plan.run.cfg.data.num_workers, t.seed, world.device)
    progress = _progress(world, run.sampler.start_step, run.max_steps)
    teardown.callback(progress.close)  # before the one line an exception ends the run with
    fixed = {"build_peak_bytes": [p["host"] for p in run.build_peaks],
             "build_peak_device_bytes": [p["device"] for p in run.build_peaks]}
    items = getattr(plan.task, "items", "items")  # what `count` counts: tokens, sequences...
    compiled = None
    if t.compile:  # what torch compiles, and when, from its own records: compile seconds apart from step time
        from ..distributed.compile import CompileWatch

        compiled = CompileWatch(len(plan.run.buckets) + 1 if plan.run.buckets else 2, progress.write if world.is_main
                                else (lambda line: None))
    ledger = Ledger(run.tracker, progress, t, run.stop, run.sampler.epoch_at, run.flops, fixed, items,
                    run.min_loss_scale, world, compiled)
    steps = Steps(run.engine, plan, world, loader, run.flops, ledger, progress, last=run.stop,
                  starts=(t.profile_step,) if t.profile_step else ())  # a profiled step shows a span's start
    return steps, ledger, progress, compiled


def _give_up(run: Run, ledger: Ledger, progress) -> None:
    """Too many non-finite steps in a row: stop, naming the last good checkpoint (the weights that produced the first
    non-finite loss were saved, if at all, one step before it)."""
    first_bad = ledger.step - ledger.nonfinite + 1
    saved = run.world.is_main and any(resume.complete(run.checkpoints))
    good = resume.rewind_latest(run.checkpoints, first_bad - 2) if run.world.is_main else None
    run.tracker.close(exit_code=3)
    progress.close()  # the bar's last line before the curves' and the error's
    _draw_curves(run)  # where the loss went, when it matters most
    kept = f"{good} (--resume auto takes it)" if good else \
        f"none ({'later ones are set aside as step_*.bad; ' if saved else 'the run saved none; '}--overwrite starts " \
        f"again)"
    fp16 = run.plan.ds.precision == "fp16"
    advice = "Lower optimizer.lr, check the data, or use bf16 instead of fp16" if fp16 else \
        "Lower optimizer.lr or check the data"
    if ledger.itemless:  # the loss is divided by the items counted: none, and it is 0/0
        advice = f"{ledger.itemless} of those steps counted no items: check the task's count(batch)"
    raise TrainingStopped(f"the loss or gradient was non-finite for {ledger.nonfinite} consecutive steps "
                          f"(steps {first_bad}-{ledger.step}; {ledger.result.skipped_steps} updates skipped "
                          f"in all); stopping. Last good checkpoint: {kept}. {advice}")


def _save(run: Run, step: int, finite: bool, progress, checksums: bool = True, owed: bool = False) -> None:
    """Collective: a checkpoint of this step, unless its loss is not `finite`; `owed`: its evaluation, which a signal
    stopped, is made first by a run resumed from it."""
    if finite:
        selection = run.selection
        extra = {**({"selection": selection.state()} if selection else {}), **({OWED: True} if owed else {})}
        best = selection.step if selection and selection.value is not None else None
        began = time.perf_counter()
        checkpoint.save(run.engine, run.checkpoints, step,
                        {"step": step, "samples_seen": run.samples_seen, "data_position": list(run.sampler.place(step)),
                         **extra}, run.world,
                        run.plan.run.cfg.train.keep_checkpoints, best=best, layout=reshape.layout_of(run.plan.ds),
                        data=run.identity, shapes=run.shapes, checksums=checksums)
        if run.world.is_main:  # (a large one holds the bar still for a while: said, with where it is)
            progress.write(f"checkpoint {run.checkpoints / resume.step_name(step)} saved in "
                           f"{time.perf_counter() - began:.1f} s")
    elif run.world.is_main:
        progress.write(f"step {step}: loss is not finite, checkpoint skipped")


def _finish(run: Run, watch: Watch, step: int, metrics: dict) -> dict:
    """The final evaluation, the best checkpoint's weights (train.select_best) and the export, or a line saying how
    to continue a run stopped by --stop-at; then the curves."""
    plan, world, selection, ckpts = run.plan, run.world, run.selection, run.checkpoints
    if step >= run.max_steps:  # past it too: a finished run resumed with fewer steps, its export gone
        try:
            metrics = _eval_and_log(run.engine, plan, run.data.val, world, run.tracker, step, final=True,
                                    signalled=lambda: watch.signal)
        except Cut as e:  # the last checkpoint comes before it: a run resumed there makes it, then exports
            _preempted(run, e.signum, step, how=", in the final evaluation (a resumed run makes it, then exports)")
        if selection and _select(selection, metrics, step, plan, world, run.tracker, final=True) and world.is_main:
            checkpoint.mark_best(ckpts, step)
    if step >= run.max_steps or run.stopped_early:
        if run.stopped_early:
            run.say(f"stopped early at step {step} of {run.max_steps}: {selection.why_stopped()}")
        weights = step
        if selection and selection.value is None:  # no figure finite, or none of weights a checkpoint could keep
            run.say(f"train.select_best = {selection.metric!r}: no evaluation could be selected (none gave a finite "
                    f"value on weights a checkpoint kept); exporting the last step's weights")
        elif selection and selection.step != step:
            # the best weights, converted where they were saved in another layout (a resume onto other ranks)
            checkpoint.load_onto(run.engine, ckpts / resume.step_name(selection.step), plan.run_dir, plan.ds, world)
            run.say(f"best: validation {selection.metric} {selection.value:.6g} at step {selection.step} "
                    f"(train.select_best); exporting its checkpoint")
            weights = selection.step
        try:
            exported = export_model(run.engine, plan.run_dir, world, plan.task, plan.run.cfg, step, weights)
        except TrainingStopped:
            run.tracker.close(exit_code=3)
            raise
        run.say(f"exported {exported}")
    else:
        run.say(f"stopped at step {step} of {run.max_steps} (--stop-at); continue with --resume auto")
    run.tracker.close()
    _draw_curves(run)
    return {"step": step, **metrics, **({"best": selection.state()} if selection else {})}


def _select(selection: Selection, metrics: dict, step: int, plan: Plan, world: World, tracker: Tracker,
            savable: bool = True, final: bool = False) -> bool:
    """One evaluation's verdict for train.select_best (see `selection.py`); rank 0 records it in RUN/best.json."""
    try:
        improved = selection.update(metrics, step, savable, final)
    except ConfigError:  # the metric named is not among those evaluated
        tracker.close(exit_code=2)
        raise
    if world.is_main:
        selection.record(plan.run_dir)
    return improved


def _draw_curves(run: Run) -> None:
    """RUN/curves.png (rank 0, logging.plots) at the end, however the run ends with its records; a picture that
    cannot be drawn is said, never the end of the run."""
    from .plots import PLOT_FILE, plot

    if not (run.plan.run.cfg.logging.plots and run.world.is_main):
        return
    run_dir, say = run.plan.run_dir, run.say
    try:
        say(f"curves {plot([run_dir], run_dir / PLOT_FILE)}")
    except Exception as e:  # noqa: BLE001 - matplotlib missing or failing must not fail the training
        say(f"curves not drawn: {type(e).__name__}: {e}")


def _eval_and_log(engine, plan, val, world, tracker, step, final: bool = False, want: str | None = None,
                  signalled: Callable[[], int | None] | None = None) -> dict:
    """The evaluation of `step`, logged; a stop signal (`signalled`) cuts it short (raises preemption.Cut): the task's
    own evaluation where it asks (`World.scored`)."""
    metrics = evaluate(engine, plan, val, world, signalled)
    # The field's metrics (e.g. BLEU by beam search) once, at the end; at every evaluation when train.select_best
    # names one (`want`) that the loss does not give.
    if (final or (want and want not in metrics)) and hasattr(plan.task, "evaluate"):
        model, eval_world = engine, world
        if signalled:  # asked before it and after each of its batches where it asks (`World.scored`): a batch of
            cut_if_signalled(signalled(), world)  # decoding can take seconds, the collective is small beside it
            eval_world = replace(world, between_batches=lambda i, steps: cut_between(i, steps, signalled(), world,
                                                                                       every=True))
        if world.pp_size > 1:  # a pipeline cannot run free-form forwards (decoding): every rank takes the whole
            model = plan.task.build_model(plan.run.cfg)  # model and a share of the data
            model.load_state_dict(full_state_dict(engine, world, everywhere=True))
            model.to(world.device)
            eval_world = replace(eval_world, dp_rank=world.rank, dp_size=world.world_size, stage=0, pp_size=1)
        own = plan.task.evaluate(model, plan.run.cfg, "validation", eval_world, in_training=True)
        check_metrics(plan.task, own, "evaluate(model, cfg, split, world)")
        metrics.update(own)
    if metrics:
        tracker.log({"step": step, **metrics}, file="eval.jsonl")
        if world.is_main:
            console.write(f"eval step {step}: " + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()
                                                            if not isinstance(v, str)))
    return metrics


def _progress(world: World, start: int, total: int):
    return progress(total=total, initial=start, disable=not world.is_main, desc="train", unit="step")

