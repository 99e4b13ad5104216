"""Everything between the plan and the first step that needs no process group: `preflight`, which runs the checks
in order: the machine's JIT builds (`builds.py`), what this machine can run (`machine.py`), the run directory
(`directory.py`) and what the run continues from (`continuity.py`). The ranks then take the run directory
(`directory.prepare_run_dir`) and compare their plans across nodes (`nodes.py`).

`preflight` runs before any process group exists, so bad input ends with one line and exit code 2 on every
rank instead of a stack trace on rank 7. The plan is made in `harness/plan/`; parallelism is applied to the model
in `harness/distributed/parallel.py`.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..config.run import ConfigError
from ..distributed.world import launched_world_size
from ..plan.resolve import Plan
from .builds import clear_stale_build_locks
from .continuity import (check_data_unchanged, check_history, check_init_from, check_same_model,
                         check_same_optimizer, resume_checkpoint)
from .directory import check_free_space, check_replaceable, check_writable, never_trained
from .machine import (FIT_CHECK_ENV, check_fits, check_kernel, check_nvme, check_precision, check_zeropp,
                      device_memory_bytes)
from .nodes import shared_wait_s


def preflight(plan: Plan, resume: str | None, overwrite: bool, data_changed_ok: bool = False,
              machine_rank: int = 0, stop_at: int | None = None) -> Path | None:
    """Checks of this machine that need no process group (`machine_rank`: the node's, for `harness launch` on each
    node). Returns the checkpoint to resume from, if any. The notes about what is resumed are said by the first rank,
    or by `harness launch`'s own check where it started the ranks."""
    clear_stale_build_locks()
    check_precision(plan.ds.precision)
    check_nvme(plan.ds)
    check_zeropp(plan.ds)
    check_kernel(plan.ds)
    shared_wait_s()
    from ..distributed.world import launched_rank, under_launcher
    from . import checksums, lock, reshape

    run_dir, say = plan.run_dir, launched_rank() == 0 and not under_launcher()  # (harness launch said its notes)
    check_writable(run_dir, plan.run.describe("run.output_dir"))
    if say and (note := _record_elsewhere(plan)):
        print(note, flush=True)
    # A live run in this directory: refused, whatever the flags say. Judged here by one process alone, before any
    # rank starts: `harness train`, or `harness launch` on the first node. A lock's holder is told by its pid on its
    # own host but by the lock's age elsewhere, and a rank or node refusing alone would leave the others waiting at
    # the rendezvous: launched ranks leave it to rank 0's taking of the lock, which refuses on every rank together
    # (prepare_run_dir).
    note = lock.check(run_dir) if launched_world_size() == 1 and machine_rank == 0 else None
    if note:
        print(note, flush=True)
    if resume and overwrite:
        raise ConfigError(f"--resume {resume} and --overwrite: continue the run or replace it; name one")
    found = resume_checkpoint(resume, run_dir, say) if resume else None
    if resume:
        if found is not None:
            checksums.check_records(found)  # what the checks below read: as it was saved
            check_history(plan, found)
            reshape.reshape(found, plan.ds)  # a layout it cannot convert to: refused here
            check_same_model(plan, found)
            check_same_optimizer(plan, found)
            check_data_unchanged(plan, found, data_changed_ok)
    elif run_dir.exists() and any(run_dir.iterdir()):
        if overwrite or not never_trained(plan):
            check_replaceable(plan, overwrite)
        elif say:
            print(f"note: {run_dir} holds only the start-up files of a run that never trained a step: replaced",
                  flush=True)
    check_stop_at(plan, stop_at, found, say)
    if launched_world_size() == 1:  # `harness launch`'s check, or one process: ranks would prepare the data at once
        from ..plan.render import meta_model  # prepares the data where the model's size depends on it

        if found is None and plan.run.cfg.model.init_from:
            check_init_from(plan, say)
        model = meta_model(plan)
        # the loop checks ranks started otherwise
        problem = check_free_space(plan, sum(p.numel() for p in model.parameters()), found)
        gpus = device_memory_bytes() if os.environ.get(FIT_CHECK_ENV) != "0" else []
        problem = problem or (check_fits(plan, model, min(gpus)) if gpus else None)
        if problem:
            raise ConfigError(problem)
    return found


def check_stop_at(plan: Plan, stop_at: int | None, found: Path | None, say: bool) -> None:
    """--stop-at before the step resumed is refused (the run had started in full to stop at once, saying "stopped at
    step 40"; at that step it is a requeued chunk's, done); past train.max_steps it is said (it ends there)."""
    from .resume import step_of

    if stop_at is None:
        return
    if found is not None and stop_at < (step := step_of(found)):
        raise ConfigError(f"--stop-at {stop_at}: the run resumes at step {step} ({found}), past it; name a later "
                          f"step, or resume an earlier checkpoint (--resume {found.parent}/step_N)")
    steps = plan.run.cfg.train.max_steps
    if say and steps and stop_at > steps:
        print(f"note: --stop-at {stop_at} is past the run's end, {plan.run.describe('train.max_steps')}: it ends "
              f"there", flush=True)


def _record_elsewhere(plan: Plan) -> str | None:
    """A line where the run file is a run directory's config.toml (a copied or moved run) whose run.output_dir is
    another directory: the run trains there, not beside the file (a copy had resumed the run it was copied from)."""
    source = plan.run.source.get("run.output_dir", "")
    file = Path(source.removeprefix("run file ")) if source.startswith("run file ") else None
    if file is None or file.name != "config.toml" or file.parent.resolve() == plan.run_dir.resolve() or not (
            (file.parent / "metrics.jsonl").is_file() or (file.parent / "checkpoints").is_dir()):  # a run's records
        return None
    return (f"note: the run file {file} is a run directory's record, and names run.output_dir = {plan.run_dir}: "
            f"this run is there, not in {file.parent} (--set run.output_dir=\"{file.parent}\" to train there)")
