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

from pathlib import Path
from typing import Any


def _sources(run, fn: str) -> tuple[str | None, list[tuple[str, dict]]]:
    """(run file, overrides) for any accepted form of `run`: a dict's values, and a RunConfig's other than their
    defaults, taken as they are (no TOML text between: a dict-valued key stays one key)."""
    from .config.run import ConfigError, RunConfig

    if run is None or isinstance(run, (str, Path)):
        return (None if run is None else str(run)), []
    if isinstance(run, (RunConfig, dict)):  # named as the origin of its values in errors
        origin = f"the {'RunConfig' if isinstance(run, RunConfig) else 'config dict'} given to harness.{fn}"
        flat = {}
        for section, body in (run.changed() if isinstance(run, RunConfig) else run).items():
            if not isinstance(section, str) or not isinstance(body, dict):
                raise ConfigError(f"harness.{fn}: {origin.removeprefix('the ')}: {section!r} must name a section "
                                  f"and hold a dict of its keys, got {_shown(body)}")
            flat.update({f"{section}.{k}": v for k, v in body.items()})
        return None, [(origin, flat)]
    raise ConfigError(f"harness.{fn}: run = {_shown(run)} must be a run file, a dict of sections or a RunConfig")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What each argument takes: Python takes any value, and a wrong one went on to fail deep inside, or not at all (a
# string for `sets` was read a character at a time, overwrite="no" is true and replaced a run directory).
_ARGS = {
    "sets": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v),
             'a list of "section.key=value" strings, e.g. sets=["train.max_steps=3"]'),
    "ds": (lambda v: v is None or isinstance(v, (str, Path)), "a DeepSpeed config file, or a name in configs/ds"),
    "world_size": (lambda v: v is None or (_is_int(v) and v >= 1), "the number of processes, an int >= 1"),
    "resume": (lambda v: v is None or isinstance(v, (str, Path)),
               '"auto" or the path of a run directory or checkpoint'),
    "stop_at": (lambda v: v is None or (_is_int(v) and v > 0), "a positive step, an int"),
    "run_dir": (lambda v: isinstance(v, (str, Path)), "the path of a run directory"),
    "data": (lambda v: v is None or isinstance(v, (str, Path)), "the path of a data file or directory"),
    "name": (lambda v: v is None or isinstance(v, str), "a name for the data's entry, a str"),
    **{flag: (lambda v: isinstance(v, bool), "True or False")
       for flag in ("overwrite", "trust_checkpoint", "data_changed_ok", "trust_run_dir")},
}


def _shown(value) -> str:
    return value.__qualname__ if isinstance(value, type) else repr(value)


def _check_args(fn: str, **given) -> None:
    """Each argument of the right type and range, or one line naming it."""
    from .config.run import ConfigError

    for name, value in given.items():
        accepts, what = _ARGS[name]
        if not accepts(value):
            raise ConfigError(f"harness.{fn}: {name} = {_shown(value)} must be {what}")


def _check_task(fn: str, task) -> None:
    from .config.run import ConfigError

    if isinstance(task, type):  # would be recorded as 'builtins:type'
        raise ConfigError(f"harness.{fn}: task = {task.__qualname__} is a class; pass an instance: "
                          f"task={task.__qualname__}()")
    if task is not None and not isinstance(task, str) and not callable(getattr(task, "build_model", None)):
        raise ConfigError(f"harness.{fn}: task = {_shown(task)} must be a task's name or a task object (the Task "
                          f"interface of harness/tasks/interface.py)")


def plan(run=None, sets: list[str] = (), ds: str | None = None, task=None, world_size: int | None = None):
    """Resolve and check everything (`harness plan`): a `Plan` whose `harness.plan_text(plan)` is what the
    command prints."""
    from .tasks.registry import given

    with given(task):
        return _plan("plan", run, sets, ds, task, world_size)


def _plan(fn: str, run, sets, ds, task, world_size=None):
    from dataclasses import replace

    from .plan.resolve import make_plan

    _check_args(fn, sets=sets, ds=ds, world_size=world_size)
    _check_task(fn, task)
    run_file, overrides = _sources(run, fn)
    if isinstance(task, str):  # a name, as run.task takes it
        overrides.append((f"task= given to harness.{fn}", {"run.task": task}))
    elif task is not None:  # recorded by reference; the object itself is what trains (`registry.given`)
        from .tasks.registry import name_of

        overrides.append((f"task= given to harness.{fn}", {"run.task": name_of(task)}))
    p = make_plan(run_file, [*overrides, *sets], None if ds is None else str(ds), world_size)
    return p if _object(task) is None else replace(p, task=task)


def plan_text(p) -> str:
    """What `harness plan` prints for a plan `harness.plan` returned."""
    from .config.run import ConfigError
    from .plan.render import render
    from .plan.resolve import Plan

    if not isinstance(p, Plan):
        raise ConfigError(f"harness.plan_text: p = {_shown(p)} must be what harness.plan returns")
    return render(p)


def train(run=None, sets: list[str] = (), ds: str | None = None, task=None, resume: str | None = None,
          overwrite: bool = False, stop_at: int | None = None, trust_checkpoint: bool = False,
          data_changed_ok: bool = False) -> dict[str, Any]:
    """Train (`harness train`); returns the last evaluation's metrics and the step reached (with train.select_best,
    `best`: the selected metric, its best value and step, and the step the run stopped early at, or 0).
    `trust_checkpoint`: checkpoints are unpickled whole, which can run code (`--trust-checkpoint`).
    `data_changed_ok`: resume on a prepared corpus other than the checkpoint's (`--data-changed-ok`)."""
    from .run.startup import preflight
    from .tasks.registry import given

    _check_args("train", resume=resume, overwrite=overwrite, stop_at=stop_at, trust_checkpoint=trust_checkpoint,
                data_changed_ok=data_changed_ok)
    with given(task):
        p = _plan("train", run, sets, ds, task)
        _note_main_task(p)
        resume_from = preflight(p, None if resume is None else str(resume), overwrite, data_changed_ok,
                                stop_at=stop_at)
        return _train(p, resume_from, overwrite, stop_at, trust_checkpoint)


def _train(p, resume_from, overwrite: bool, stop_at: int | None, trust_checkpoint: bool) -> dict[str, Any]:
    from .distributed.world import barrier, close_world, init_world
    from .run.builds import watching_build_locks
    from .run.loop import train as run_training
    from .run.nodes import check_same_plan
    from .run.trust import trusting

    with watching_build_locks():  # DeepSpeed JIT-builds its ops in the process group's start and the engine's
        world = init_world(p.ds.layout, p.run.cfg.train.collective_timeout_s, agree=lambda: check_same_plan(p))
        try:
            with trusting(checkpoint=trust_checkpoint):
                result = run_training(p, world, resume_from, overwrite, stop_at)
            barrier()  # every rank is done before any tears down its connections
            return result
        finally:
            close_world()


def _note_main_task(p) -> None:
    """A task class defined in the calling script or notebook is recorded as `__main__:Class`, which no other
    process can import: said once, at the start (not refused: this process trains it)."""
    from .distributed.world import launched_rank

    cls, module = type(p.task).__qualname__, type(p.task).__module__
    short = cls.rsplit(".", 1)[-1]
    if (module == "__main__" or "<locals>" in cls) and launched_rank() == 0:
        where = "in a function" if "<locals>" in cls else "in the calling script"
        print(f"note: run.task = '{module}:{cls}': {p.run_dir} names a task class defined {where}, which other "
              f"processes cannot import: a later harness.evaluate, harness.load_model or resume needs "
              f"task={short}() given again; or move the class to a file and name it \"path/to/file.py:{short}\"",
              flush=True)


def _object(task):
    """A task given as an object (used as it is); None for a task given by name, or none."""
    return None if task is None or isinstance(task, str) else task


def _task_reference(task, run_dir: str | Path) -> str | None:
    """A task passed as an object, named as the run directory's config.toml names its task (a file by its path, a
    module by its import name), so that it is trusted as that task if it is the same class; a name stays as given."""
    if _object(task) is None:
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


def evaluate(run_dir: str | Path, split: str | None = None, data: str | Path | None = None, name: str | None = None,
             task=None, trust_run_dir: bool = False):
    """The field's metrics of a finished run on a split (`harness evaluate`; by default the test split, or validation
    for a task that builds none, the lm), or with `data` on new data read with
    the run's stored tokenizer and statistics (`--data`: {entry name: metrics}, one entry per data set); also
    written to RUN/eval.json. A run of a plug-in task needs `task` (its name, as you trust it) or `trust_run_dir`
    (see harness/run/trust.py); a task object is used as it is, and trusted as the run's task if it is the one
    config.toml names."""
    from .eval.evaluate import evaluate_data, evaluate_run
    from .run.trust import trusting
    from .tasks.registry import given as given_task

    _check_args("evaluate", run_dir=run_dir, data=data, name=name, trust_run_dir=trust_run_dir)
    _check_task("evaluate", task)
    given = _object(task)
    with trusting(task=_task_reference(task, run_dir), run_dir=trust_run_dir), given_task(given):
        if data is None:  # (given_task: a class defined in a function is found by the name config.toml keeps)
            return evaluate_run(run_dir, split, task=given)
        return evaluate_data(run_dir, data, name, task=given)


def load_model(run_dir: str | Path, task=None, trust_run_dir: bool = False):
    """(model, RunConfig): the task's model with the run's exported weights, in eval mode, on the CPU. `task` and
    `trust_run_dir` as for `evaluate`."""
    from .run.export import load_model as load
    from .run.trust import trusting
    from .tasks.registry import given as given_task

    _check_args("load_model", run_dir=run_dir, trust_run_dir=trust_run_dir)
    _check_task("load_model", task)
    given = _object(task)
    with trusting(task=_task_reference(task, run_dir), run_dir=trust_run_dir), given_task(given):
        return load(run_dir, given)
