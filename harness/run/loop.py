"""The one training loop, for every strategy DeepSpeed applies: ZeRO 0-3, offload, fp32/bf16/fp16, tensor and
pipeline parallelism. A pipeline runs each step (and each evaluation batch) through DeepSpeed's schedule;
everything else (data, loss normalisation, logging, checkpoints, resume, export) is the same code."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..config import cadence
from ..config.run import (  # raised here, caught by the CLI
    ConfigError,
    Preempted,
    TrainingStopped,
)
from ..data.batches import StepSampler, eval_batches, train_batches, training_collate
from ..distributed.optim import follow_config_lr
from ..distributed.parallel import (
    build_engine,
    full_state_dict,
    pipeline_loss_sum,
    release,
)
from ..distributed.world import World, all_gather_objects, all_reduce, cpu_threads
from ..models import sequence
from ..models.flops import ForwardFlops
from ..plan.resolve import Plan
from ..prepare import store_run_data
from . import checkpoint, profiling
from .export import MODEL_FILE, export_model
from .heartbeat import Heartbeat, diagnose, is_lost, is_timeout
from .preemption import Watch
from .selection import Selection
from .startup import STDERR_TTY_ENV, check_free_space, prepare_run_dir
from .step import Ledger, Steps, to_device
from .tracking import Tracker, truncate_jsonl
from .trust import TRUST


@torch.no_grad()
def loss_sum(engine, task, samples, world: World, micro: int, limit: int = 0, desc: str | None = None
             ) -> tuple[float, int]:
    """The summed loss and the items it counts over `samples` (each once, whatever the world size; the first `limit`
    micro-batches per rank with a limit), the model in eval mode meanwhile; `desc`: a progress bar on rank 0."""
    batches, steps = eval_batches(len(samples), micro, world.dp_rank, world.dp_size, limit)
    totals = torch.zeros(2, dtype=torch.float64, device=world.device)
    was_training = engine.training
    engine.eval()
    if desc:
        from tqdm.auto import tqdm
    shown = tqdm(range(steps), desc=desc, leave=False, disable=not world.is_main) if desc else range(steps)
    for i in shown:
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
    engine.train(was_training)
    all_reduce(totals)  # sync point; ranks that read the same batch count it alike, so the ratio is exact
    return totals[0].item(), int(totals[1].item())


def evaluate(engine, plan: Plan, val, world: World) -> dict[str, float]:
    """Mean loss over the whole validation set (each sample once, whatever the world size) and task metrics."""
    t = plan.run.cfg.train
    total, count = loss_sum(engine, plan.task, val, world, t.micro_batch_size, t.eval_batches)
    return plan.task.metrics(total / count) if count else {}


def train(plan: Plan, world: World, resume_from: Path | None, overwrite: bool, stop_at: int | None) -> dict:
    """Train `plan` on this rank. A scheduler's signal (`preemption.py`) ends it after the step it came in, with a
    checkpoint: raises Preempted."""
    timeout_s = plan.run.cfg.train.collective_timeout_s
    with Watch(world.rank) as watch, contextlib.ExitStack() as teardown:
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
                               lost=not is_timeout(e)) from None
            raise
        finally:
            beat.stop()
            if held:
                held.release()


def _train(plan: Plan, world: World, resume_from: Path | None, stop_at: int | None, watch: Watch,
           beat: Heartbeat, teardown: contextlib.ExitStack) -> dict:
    cfg, ds, task = plan.run.cfg, plan.ds, plan.task
    t = cfg.train
    say = print if world.is_main else (lambda *a, **k: None)
    threads = cpu_threads()  # before anything computes: a shared CPU's share, not torch's guess of the machine

    import datasets
    from accelerate import PartialState

    datasets.disable_progress_bars()  # the data summary line below reports what they would
    with PartialState().main_process_first():  # rank 0 prepares and caches the data, then the others read it
        data = task.build_data(cfg)
    if world.is_main and hasattr(task, "store"):  # RUN/data/: the tokenizer and statistics, to score new data
        note = store_run_data(task, cfg, plan.run_dir)
        if note:
            say(note)
    sampler_args = dict(n=len(data.train), micro=t.micro_batch_size, accum=ds.grad_accum_steps,
                        dp_rank=world.dp_rank, dp_size=world.dp_size, seed=t.seed, bucket=cfg.data.bucket,
                        lengths=task.lengths(data.train) if cfg.data.bucket else None)
    steps_per_epoch = StepSampler(**sampler_args, start_step=0, max_steps=0).steps_per_epoch
    max_steps = t.max_steps or math.ceil(t.epochs * steps_per_epoch)
    try:  # epochs and counts per run become steps now that the data's size is known
        every = cadence.resolve(t, steps_per_epoch, max_steps, plan.run.describe)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    with torch.device("meta"):  # the whole model's shapes, whatever share of it this rank holds: size and FLOPs
        meta_model = task.build_model(cfg)
    n_params = sum(p.numel() for p in meta_model.parameters())
    if world.world_size > 1:  # checked before launch where the launch is one process or `harness launch`
        problem = all_gather_objects(check_free_space(plan, n_params, resume_from) if world.is_main else None)[0]
        if problem:
            raise ConfigError(problem)
    flops = ForwardFlops(meta_model)
    engine, schedule = build_engine(plan, world, max_steps)  # seeds the weights itself: the meta model draws none
    teardown.callback(release, engine)  # however the run ends (parallel.release)
    # What building and loading the model took at its peak on each rank (before DeepSpeed's own buffers): what
    # partitioned loading saves, against the whole model's size.
    build_peaks = all_gather_objects(engine.harness_build_peak)
    start_step, samples_seen, state = 0, 0, {}
    min_loss_scale = float(ds.config.get("fp16", {}).get("min_loss_scale", 1))
    if resume_from is not None:
        # another data-parallel size or ZeRO stage: converted once to DeepSpeed's universal checkpoint
        source = checkpoint.to_universal(resume_from, world) if checkpoint.reshape(resume_from, ds) else resume_from
        state = checkpoint.load(engine, source, world)
        start_step, samples_seen = state["step"], state["samples_seen"]
        read = "unpickled whole (--trust-checkpoint)" if TRUST.get().checkpoint else "weights-only"
        say(f"resumed from {resume_from} at step {start_step} (checkpoint read {read})")
        saved_lr = follow_config_lr(schedule, cfg.optimizer.lr)
        if saved_lr is not None:  # e.g. lowered after a non-finite stop
            say(f"optimizer.lr {cfg.optimizer.lr:g} (the checkpoint's run had {saved_lr:g}) from step "
                f"{start_step + 1}; lr there {schedule.optimizer.param_groups[0]['lr']:.3g}")
    ckpts = plan.run_dir / "checkpoints"
    selection = Selection.start(t, every.patience, state.get("selection"))  # train.select_best; None when off
    # the same on every rank (the checkpoint's state); rank 0's view of the export decides
    done = resume_from is not None and (start_step >= max_steps or bool(selection and selection.stopped_at))
    if done and all_gather_objects((plan.run_dir / MODEL_FILE).is_file() if world.is_main else None)[0]:
        # --resume auto on a finished run: nothing to train, evaluate or export again
        evals = plan.run_dir / "eval.jsonl"
        last = evals.read_text().splitlines()[-1:] if world.is_main and evals.is_file() else []
        say(f"{plan.run_dir}: the run finished at step {start_step} of {max_steps} and exported "
            f"{plan.run_dir / MODEL_FILE}; nothing to do (raise train.max_steps or train.epochs to train on, "
            f"--overwrite to train again)")
        return {"step": start_step, **(json.loads(last[0]) if last else {}),
                **({"best": selection.state()} if selection else {})}
    if selection and selection.value is not None:
        checkpoint.adopt_best(ckpts, selection.step, resume_from.parent, world)
    if world.is_main:
        for name in ("metrics.jsonl", "eval.jsonl"):
            truncate_jsonl(plan.run_dir / name, start_step)
        if selection:
            selection.record(plan.run_dir)
    tracker = Tracker(cfg, plan.run_dir, enabled=world.is_main)

    model_parallel = (f", tensor parallel {world.tp_size}" if world.tp_size > 1 else "") + \
        (f", pipeline {world.pp_size} stages" if world.pp_size > 1 else "") + \
        (f", sequence parallel {world.sp_size}" if world.sp_size > 1 else "")
    say(f"harness: task {cfg.run.task}, {type(meta_model).__name__} of {n_params:,} parameters "
        f"(FLOPs: {flops.method}) | world {world.world_size} "
        f"(data parallel {world.dp_size}{model_parallel}) | ZeRO-{ds.zero_stage} {ds.precision}"
        f"{' (autocast)' if ds.autocast else ''}{' optimizer-offload' if ds.offload_optimizer else ''}{' param-offload' if ds.offload_params else ''}"
        f" (strategy: {ds.origin}) | "
        f"global batch {ds.global_batch_size} = {t.micro_batch_size} x {ds.grad_accum_steps} x {world.dp_size} | "
        f"steps {start_step}->{max_steps} ({steps_per_epoch} per epoch; {every.describe(steps_per_epoch)}) | "
        f"CPU threads {threads} | run dir {plan.run_dir}")
    if build_peaks[0]["host"] is not None:
        def mib(key: str) -> str:
            return " / ".join(f"{p[key] / 2**20:,.1f}" for p in build_peaks) + " MiB"

        ranks = "rank 0" if len(build_peaks) == 1 else "ranks " + "/".join(map(str, range(len(build_peaks))))
        device = f"; of tensors on the GPU {mib('device')}" if build_peaks[0]["device"] is not None else ""
        say(f"model built: at its peak it took {mib('host')} of host memory (resident set, an upper bound){device} "
            f"on {ranks}; the whole model's fp32 weights are {4 * n_params / 2**20:,.1f} MiB")
    say(data.summary.line() if data.summary else f"data train: {len(data.train)} samples; validation: {len(data.val)}")

    sampler = StepSampler(**sampler_args, start_step=start_step, max_steps=max_steps)
    loader = train_batches(data.train, sampler, training_collate(task, plan.run.buckets), cfg.data.num_workers,
                           t.seed, world.device)
    progress = _progress(world, start_step, max_steps)
    teardown.callback(progress.close)  # before the one line an exception ends the run with
    stop = min(max_steps, stop_at) if stop_at else max_steps
    fixed = {"build_peak_bytes": [p["host"] for p in build_peaks],
             "build_peak_device_bytes": [p["device"] for p in build_peaks]}
    items = getattr(task, "items", "items")  # what `count` counts: tokens, sequences...
    compiled = None
    if t.compile:  # what torch compiles, and when, from its own records: compile seconds apart from step time
        from ..distributed.compile import CompileWatch

        compiled = CompileWatch(len(plan.run.buckets) + 1 if plan.run.buckets else 2, progress.write if world.is_main
                                else (lambda line: None))
    ledger = Ledger(tracker, progress, t, stop, steps_per_epoch, flops, fixed, items, min_loss_scale, world,
                    compiled)
    steps = Steps(engine, plan, world, loader, flops, ledger, progress, last=stop,
                  starts=(t.profile_step,) if t.profile_step else ())  # a profiled step shows a span's start
    last_metrics, step = {}, start_step
    while step < stop and not (selection and selection.stopped_at):
        traced = profiling.StepProfile(world.device) if step + 1 == t.profile_step and world.is_main else None
        mark = traced.section if traced else profiling.unmarked  # train.profile_step: where the step's time goes
        samples_seen += ds.global_batch_size
        lr = schedule.optimizer.param_groups[0]["lr"]  # what this step uses (DeepSpeed's OneCycle keeps no last lr)
        result, loader_wait = steps.run(step + 1, lr, samples_seen, watch.signal or 0, mark)
        step += 1
        beat.step = step
        if traced:  # before anything only some steps do: a step that syncs (a span of its own, `Steps`)
            progress.write(f"profiled step {step}: {profiling.write(traced.finish(loader_wait, step), plan.run_dir)}")
        evaluating = every.eval_steps and step % every.eval_steps == 0 and step < max_steps
        saving = every.save_steps and step % every.save_steps == 0
        if evaluating or saving or step == stop or ledger.signal or ledger.give_up:
            ledger.settle(last=step == stop or bool(ledger.signal) or ledger.give_up)  # decisions below need it
        if ledger.give_up:
            # The weights that produced the first non-finite loss were saved, if at all, one step before it.
            first_bad = ledger.step - ledger.nonfinite + 1
            good = checkpoint.rewind_latest(plan.run_dir / "checkpoints", first_bad - 2) if world.is_main else None
            tracker.close()
            kept = f"{good} (--resume auto takes it)" if good else \
                "none (later ones are set aside as step_*.bad; --overwrite starts again)"
            raise TrainingStopped(f"the loss or gradient was non-finite for {ledger.nonfinite} consecutive steps "
                                  f"(steps {first_bad}-{ledger.step}; {ledger.result.skipped_steps} updates skipped "
                                  f"in all); stopping. Last good checkpoint: {kept}. Lower optimizer.lr, check the "
                                  f"data, or use bf16 instead of fp16")
        improved = False
        if evaluating and not ledger.signal:
            last_metrics = _eval_and_log(engine, plan, data.val, world, tracker, step,
                                         want=selection and selection.metric)
            if selection:  # the same verdict on every rank: the metrics are all-reduced
                improved = _select(selection, last_metrics, step, plan, world, tracker, math.isfinite(result.loss))
        stopping = bool(selection and selection.stopped_at)
        if saving or step == stop or improved or stopping or ledger.signal:
            if math.isfinite(result.loss):
                extra = {"selection": selection.state()} if selection else {}
                best = selection.step if selection and selection.value is not None else None
                checkpoint.save(engine, ckpts, step, {"step": step, "samples_seen": samples_seen, **extra}, world,
                                t.keep_checkpoints, best=best, layout=checkpoint.layout_of(ds))
            elif world.is_main:
                progress.write(f"step {step}: loss is not finite, checkpoint skipped")
        if ledger.signal:
            progress.close()
            tracker.close()
            raise Preempted(f"stopped by {signal.Signals(ledger.signal).name} after step {step} of {max_steps}; "
                            f"{checkpoint.resume_hint(ckpts)}")
    progress.close()
    if compiled:
        graphs = f"{compiled.graphs} graph{'s' * (compiled.graphs != 1)}"
        say(f"train.compile: {graphs} compiled in {compiled.seconds:.1f} s, counted apart from step_s (metrics "
            f"compile_s)")
    if step == max_steps:
        last_metrics = _eval_and_log(engine, plan, data.val, world, tracker, step, final=True)
        if selection and _select(selection, last_metrics, step, plan, world, tracker, final=True) and world.is_main:
            checkpoint.mark_best(ckpts, step)
    if step == max_steps or (selection and selection.stopped_at):
        if selection and selection.stopped_at:
            say(f"stopped early at step {step} of {max_steps}: {selection.why_stopped()}")
        if selection and selection.value is not None and selection.step != step:
            checkpoint.load(engine, ckpts / checkpoint.step_name(selection.step), world)  # the best weights
            say(f"best: validation {selection.metric} {selection.value:.6g} at step {selection.step} "
                f"(train.select_best); exporting its checkpoint")
        say(f"exported {export_model(engine, plan.run_dir, world, plan.task, cfg)}")
    else:
        say(f"stopped at step {step} of {max_steps} (--stop-at); continue with --resume auto")
    tracker.close()
    if cfg.logging.plots and world.is_main:
        _draw_curves(plan.run_dir, say)
    return {"step": step, **last_metrics, **({"best": selection.state()} if selection else {})}


def _select(selection: Selection, metrics: dict, step: int, plan: Plan, world: World, tracker: Tracker,
            savable: bool = True, final: bool = False) -> bool:
    """One evaluation's verdict for train.select_best (see `selection.py`); rank 0 records it in RUN/best.json."""
    try:
        improved = selection.update(metrics, step, savable, final)
    except ConfigError:  # the metric named is not among those evaluated
        tracker.close()
        raise
    if world.is_main:
        selection.record(plan.run_dir)
    return improved


def _draw_curves(run_dir: Path, say) -> None:
    """RUN/curves.png; a picture that cannot be drawn is said, never the end of a finished run."""
    from .plots import PLOT_FILE, plot

    try:
        say(f"curves {plot([run_dir], run_dir / PLOT_FILE)}")
    except Exception as e:  # noqa: BLE001 - matplotlib missing or failing must not fail the training
        say(f"curves not drawn: {type(e).__name__}: {e}")


def _eval_and_log(engine, plan, val, world, tracker, step, final: bool = False, want: str | None = None) -> dict:
    metrics = evaluate(engine, plan, val, world)
    # The field's metrics (e.g. BLEU by beam search) once, at the end; at every evaluation when train.select_best
    # names one (`want`) that the loss does not give.
    if (final or (want and want not in metrics)) and hasattr(plan.task, "evaluate"):
        model, eval_world = engine, world
        if world.pp_size > 1:  # a pipeline cannot run free-form forwards (decoding): every rank takes the whole
            model = plan.task.build_model(plan.run.cfg)  # model and a share of the data
            model.load_state_dict(full_state_dict(engine, world, everywhere=True))
            model.to(world.device)
            eval_world = replace(world, dp_rank=world.rank, dp_size=world.world_size, stage=0, pp_size=1)
        metrics.update(plan.task.evaluate(model, plan.run.cfg, "validation", eval_world, in_training=True))
    if metrics:
        tracker.log({"step": step, **metrics}, file="eval.jsonl")
        if world.is_main:
            from tqdm.auto import tqdm

            tqdm.write(f"eval step {step}: " + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()
                                                         if not isinstance(v, str)))
    return metrics


def _progress(world: World, start: int, total: int):
    from tqdm.auto import tqdm

    # a terminal, or `harness launch` relaying to one: redrawn every second; a log: every 30 s
    tty = sys.stderr.isatty() or os.environ.get(STDERR_TTY_ENV)
    return tqdm(total=total, initial=start, disable=not world.is_main, desc="train", unit="step",
                dynamic_ncols=True, mininterval=1.0 if tty else 30.0, file=sys.stderr)

