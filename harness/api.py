"""The Python API: what the `harness` command does, as functions. `import harness` gives them.

    import harness
    harness.train("configs/runs/lm_demo.toml", sets=["train.max_steps=20"], ds="configs/ds/zero2.json")
    metrics = harness.evaluate("runs/lm_demo", split="validation")
    model, cfg = harness.load_model("runs/lm_demo")

`run` is a run file, a dict of sections ({"train": {"max_steps": 20}}) or a resolved `RunConfig`; `sets` are
`section.key=value` overrides on top (they win); `task` is a task object to train instead of the one `run.task`
names (its class is recorded in the run directory, so `harness evaluate` finds it again where it is
importable). `train` runs one process on its own, or one rank when the script is started by `accelerate launch`;
it can be called again in the same process. Bad input raises `ConfigError` before anything starts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _sources(run) -> tuple[str | None, list[str]]:
    """(run file, overrides) for any accepted form of `run`."""
    from .config.run import RunConfig, flatten

    if run is None or isinstance(run, (str, Path)):
        return (None if run is None else str(run)), []
    if isinstance(run, RunConfig):
        run = run.to_dict()
    if isinstance(run, dict):
        return None, [f"{k}={json.dumps(v)}" for k, v in flatten(run).items()]
    raise TypeError(f"run must be a run file, a dict of sections or a RunConfig, not {type(run).__name__}")


def plan(run=None, sets: list[str] = (), ds: str | None = None, task=None, world_size: int | None = None):
    """Resolve and check everything (`harness plan`): a `Plan` whose `harness.plan_text(plan)` is what the
    command prints."""
    from dataclasses import replace

    from .plan.resolve import make_plan

    run_file, overrides = _sources(run)
    if task is not None:  # recorded by reference; the object itself is what trains
        overrides.append(f"run.task={json.dumps(f'{type(task).__module__}:{type(task).__qualname__}')}")
    p = make_plan(run_file, [*overrides, *sets], ds, world_size)
    return p if task is None else replace(p, task=task)


def plan_text(p) -> str:
    from .plan.render import render

    return render(p)


def train(run=None, sets: list[str] = (), ds: str | None = None, task=None, resume: str | None = None,
          overwrite: bool = False, stop_at: int | None = None, trust_checkpoint: bool = False,
          data_changed_ok: bool = False) -> dict[str, Any]:
    """Train (`harness train`); returns the last evaluation's metrics and the step reached (with train.select_best,
    `best`: the selected metric, its best value and step, and the step the run stopped early at, or 0).
    `trust_checkpoint`: checkpoints are unpickled whole, which can run code (`--trust-checkpoint`).
    `data_changed_ok`: resume on a prepared corpus other than the checkpoint's (`--data-changed-ok`)."""
    from .config.run import ConfigError
    from .distributed.world import barrier, close_world, init_world
    from .run.loop import train as run_training
    from .run.startup import preflight, watching_build_locks
    from .run.trust import trusting

    p = plan(run, sets, ds, task)
    resume_from = preflight(p, resume, overwrite, data_changed_ok)
    if stop_at is not None and stop_at <= 0:
        raise ConfigError(f"stop_at must be a positive step, got {stop_at}")
    with watching_build_locks():  # DeepSpeed JIT-builds its ops in the process group's start and the engine's
        world = init_world(p.ds.layout, p.run.cfg.train.collective_timeout_s)
        try:
            with trusting(checkpoint=trust_checkpoint):
                result = run_training(p, world, resume_from, overwrite, stop_at)
            barrier()  # every rank is done before any tears down its connections
            return result
        finally:
            close_world()


def _task_reference(task, run_dir: str | Path) -> str | None:
    """A task passed as an object, named as the run directory's config.toml names its task (a file by its path, a
    module by its import name), so that it is trusted as that task if it is the same class; a name stays as given."""
    if task is None or isinstance(task, str):
        return task
    import inspect

    from .config.run import ConfigError, read_toml

    try:
        named = str(read_toml(Path(run_dir) / "config.toml").get("run", {}).get("task", ""))
    except ConfigError:  # no readable config.toml: evaluate says so itself
        named = ""
    cls = type(task)
    where = inspect.getfile(cls) if named.rpartition(":")[0].endswith(".py") else cls.__module__
    return f"{where}:{cls.__qualname__}"


def evaluate(run_dir: str | Path, split: str = "test", data: str | Path | None = None, name: str | None = None,
             task=None, trust_run_dir: bool = False):
    """The field's metrics of a finished run on a split (`harness evaluate`), or with `data` on new data read with
    the run's stored tokenizer and statistics (`--data`: {entry name: metrics}, one entry per data set); also
    written to RUN/eval.json. A run of a plug-in task needs `task` (its name, as you trust it) or `trust_run_dir`
    (see harness/run/trust.py); a task object is used as it is, and trusted as the run's task if it is the one
    config.toml names."""
    from .eval.evaluate import evaluate_data, evaluate_run
    from .run.trust import trusting

    given = None if task is None or isinstance(task, str) else task
    with trusting(task=_task_reference(task, run_dir), run_dir=trust_run_dir):
        if data is None:
            return evaluate_run(run_dir, split, task=given)
        return evaluate_data(run_dir, data, name, task=given)


def load_model(run_dir: str | Path, task=None, trust_run_dir: bool = False):
    """(model, RunConfig): the task's model with the run's exported weights, in eval mode, on the CPU. `task` and
    `trust_run_dir` as for `evaluate`."""
    from .run.export import load_model as load
    from .run.trust import trusting

    with trusting(task=_task_reference(task, run_dir), run_dir=trust_run_dir):
        return load(run_dir, None if task is None or isinstance(task, str) else task)
