"""The task registry: the built-in tasks by name, plug-in tasks by module or file path, and the run config resolved
with the task it names (a task's `Config` is its section: [translation] for the translation task, [task] for a
plug-in). The config knows no task; this module tells it."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import types
import typing
from pathlib import Path

from ..config.run import PLUGIN_SECTION, ConfigError, DataSection, Resolved, closest, conforms, type_name
from ..config.run import resolve as resolve_layers
from .interface import REQUIRED, Task, TaskDefaults

TASKS = {  # name -> module:class, imported on use so `harness keys` stays fast
    "lm": "lm:LanguageModelTask",
    "translation": "translation:TranslationTask",
    "protein": "protein:ProteinTask",
    "prices": "prices:PricesTask",
}
PLUGIN_HINT = ('a plug-in task is named "package.module:ClassName" (importable here) or "path/to/file.py:ClassName" '
               '(see the Task interface in harness/tasks/interface.py)')


def plugin_path(name: str) -> str:
    """A file-path reference made absolute, so a new process (evaluate, resume, bench) in any directory finds it."""
    target, _, cls = name.rpartition(":")
    if target.endswith(".py"):
        return f"{Path(target).resolve()}:{cls}"
    return name


def moved_plugin(saved: str, named: str | None) -> str | None:
    """The plug-in task `named` (what the user names now) made absolute, where it is the one a run's config.toml
    names (`saved`) at another place: the same class, in a file of the same name, where the saved file is gone or
    holds the same code (the project moved: another checkout, a cluster's copy); else None."""
    if not named or not is_plugin_name(saved):
        return None
    (old, _, cls), (new, _, now) = saved.rpartition(":"), plugin_path(named).rpartition(":")
    if cls != now or not (old.endswith(".py") and new.endswith(".py")) or Path(old).name != Path(new).name:
        return None
    try:
        return f"{new}:{now}" if not Path(old).exists() or Path(old).read_bytes() == Path(new).read_bytes() else None
    except OSError:  # the new file unreadable: its import says why
        return None


def is_plugin_name(task: str) -> bool:
    return isinstance(task, str) and ":" in task


def task_ref(name: str) -> tuple[str, str, type | None, type | None]:
    """`run.task` as the run config stores it, the name of the task's section in the run file (a built-in task's
    `section`, [task] for a plug-in), that section (its `Config` dataclass; None for a task without one) and the
    task's own [data] section (`Data`, a subclass of DataSection; None for the core one); raises for a name that is
    no task."""
    cls = task_class(name)
    if is_plugin_name(name):
        return plugin_path(name), PLUGIN_SECTION, cls.Config, getattr(cls, "Data", None)
    return name, getattr(cls, "section", PLUGIN_SECTION), getattr(cls, "Config", None), getattr(cls, "Data", None)


def task_sections() -> dict[str, type]:
    """Each built-in task's section by name, with its `Config` (`harness keys` lists them)."""
    classes = [task_class(name) for name in TASKS]
    return {cls.section: cls.Config for cls in classes if getattr(cls, "Config", None) is not None}


def task_data() -> dict[str, type]:
    """Each built-in task's own [data] section by task name, where it has keys of its own (`harness keys` lists
    them)."""
    classes = {name: task_class(name) for name in TASKS}
    return {name: cls.Data for name, cls in classes.items() if getattr(cls, "Data", None) is not None}


def resolve(run_file: str | None, overrides: list[str] = ()) -> Resolved:
    """The run config (defaults < run file < `--set`), with the task `run.task` names checked and its section's keys
    (another built-in task's keys are refused, naming it)."""
    return resolve_layers(run_file, overrides, task_ref, task_sections(), task_data())


def task_class(name: str) -> type:
    """The class `run.task` names: a built-in task, or a plug-in by module or file path."""
    if not is_plugin_name(name):
        if name not in TASKS:
            raise ConfigError(f"run.task = {name!r} is not a task; the built-in tasks are {', '.join(TASKS)}; "
                              f"{PLUGIN_HINT}")
        module, cls = TASKS[name].split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
    target, _, cls_name = name.rpartition(":")
    if not target or not cls_name:
        raise ConfigError(f"run.task = {name!r}: {PLUGIN_HINT}")
    cls = GIVEN.get().get(name) or _plugin_class(name, target, cls_name)
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"run.task = {name!r}: {cls_name} lacks {', '.join(missing)} (the Task interface in "
                          f"harness/tasks/interface.py lists what a task provides)")
    _check_signatures(name, cls)
    _check_section(name, cls_name, getattr(cls, "Config", None))
    data = getattr(cls, "Data", None)
    if data is not None and not (isinstance(data, type) and issubclass(data, DataSection)):
        raise ConfigError(f"run.task = {name!r}: {cls_name}.Data must be a dataclass subclassing "
                          f"harness.config.run.DataSection (the task's own [data] keys)")
    for attr in ("Config", "check", "loss", "metrics"):  # the defaults of what it leaves out, on its own class
        if not hasattr(cls, attr):                          # (so its objects pickle as what they are)
            setattr(cls, attr, TaskDefaults.__dict__[attr])
    return cls


# What the harness passes each method it calls (positionally, after self), e.g. loss_from(outputs, batch)
ARGUMENTS = {"build_model": ("cfg",), "build_data": ("cfg",), "collate": ("samples",), "count": ("batch",),
             "inputs": ("batch",), "loss_from": ("outputs", "batch"), "loss": ("model", "batch"),
             "metrics": ("mean_loss",), "check": ("cfg",), "evaluate": ("model", "cfg", "split", "world")}


def _check_signatures(name: str, cls: type) -> None:
    """Each method takes what the harness passes it, and the class is built without arguments: refused by name here,
    not as a TypeError from deep in the loop or torch's DataLoader."""
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise ConfigError(f"run.task = {name!r}: {cls.__name__}() must build without arguments ({e})") from None
    except ValueError:  # no signature to read (a builtin): taken as it is
        pass
    for method, args in ARGUMENTS.items():
        fn = getattr(cls, method, None)
        if not callable(fn):
            continue
        # self is passed to a function alone (not to a staticmethod, classmethod, partial or callable object)
        bound = not isinstance(inspect.getattr_static(cls, method), types.FunctionType)
        extra = {"in_training": True, **({"data": None} if hasattr(cls, "read") else {})} if method == "evaluate" \
            else {}  # what the end of training and `harness evaluate --data` pass it too
        try:
            inspect.signature(fn).bind(*(() if bound else (None,)), *args, **extra)
        except TypeError:
            given = ", ".join([*args, *(f"{k}={v}" for k, v in extra.items())])
            raise ConfigError(f"run.task = {name!r}: {cls.__name__}.{method}{inspect.signature(fn)} cannot take "
                              f"({given}), what the harness passes it") from None
        except ValueError:
            pass


# Classes of task objects given to the Python API (`task=`), by the name run.task records, while that call runs
# (`given`): the object trains whether or not its class can be imported by name (one of a function's,
# `f.<locals>.Task`); a later call that names the run's task without the object imports it, or cannot
GIVEN: contextvars.ContextVar[dict[str, type]] = contextvars.ContextVar("given_tasks", default={})


@contextlib.contextmanager
def given(task):
    """While the block runs, `task` (an object given to the API) is the class its name (`name_of`) finds."""
    token = GIVEN.set({**GIVEN.get(), name_of(task): type(task)} if task is not None and not isinstance(task, str)
                      else GIVEN.get())
    try:
        yield
    finally:
        GIVEN.reset(token)


def name_of(task) -> str:
    """run.task for a task object: its class's module and qualified name."""
    return f"{type(task).__module__}:{type(task).__qualname__}"


def _plugin_class(name: str, target: str, cls_name: str) -> type:
    try:
        module = _import_file(target) if target.endswith(".py") else _import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import: one line naming it
        raise ConfigError(f"run.task = {name!r}: importing {target} failed{_where(e, target)}: "
                          f"{type(e).__name__}: {e}") from None
    cls = module
    for part in cls_name.split("."):  # Outer.Inner: a class defined in a class
        cls = getattr(cls, part, None)
    if not isinstance(cls, type):
        classes = [k for k, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__]
        close = closest(cls_name, classes)
        hint = f"; did you mean {close!r}?" if close else f"; its classes: {', '.join(classes) or 'none'}"
        raise ConfigError(f"run.task = {name!r}: {target} has no class {cls_name!r}{hint}")
    return cls


def _check_section(name: str, cls_name: str, section: type | None) -> None:
    """A plug-in's `Config`, checked before anything is built: a dataclass whose every field has a default."""
    if section is None:
        return
    if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
        raise ConfigError(f"run.task = {name!r}: {cls_name}.Config must be a dataclass (the [task] section's keys; "
                          f"the class, not an instance)")
    try:
        hints = typing.get_type_hints(section)
    except Exception as e:  # noqa: BLE001 - an annotation naming what its module lacks
        raise ConfigError(f"run.task = {name!r}: {cls_name}.Config's annotations do not resolve ({e})") from None
    for f in dataclasses.fields(section):
        key = f"run.task = {name!r}: {cls_name}.Config.{f.name}"
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key} has no default (every [task] key needs one)")
        if not _tomlable(hints[f.name]):  # config.toml could not be written once the run started
            raise ConfigError(f"{key}: {type_name(hints[f.name])} is no type a TOML file holds (bool, int, float, "
                              f"str, their lists, tuples and dicts, unions, Literal)")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if default is not None and not conforms(default, hints[f.name]):  # (None: "not set", as files may leave it)
            raise ConfigError(f"{key} = {default!r}: its default is no {type_name(hints[f.name])}")


def _tomlable(t) -> bool:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return True
    if origin in (list, tuple, dict, typing.Union, types.UnionType):
        return all(a is Ellipsis or _tomlable(a) for a in args)
    return t in (bool, int, float, str, list, tuple, dict, type(None), typing.Any)


def _import_module(target: str):
    """A plug-in named "package.module", importable from where the run is launched (as the docs say). `python -m
    harness` has the current directory on sys.path, the `harness` console script does not: it is added there, last
    and only when the package is found nowhere else, so that it never hides an installed module of the same name;
    it stays, so that processes started from this one (data loader workers) find the module too."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != target.split(".")[0] or here in sys.path or "" in sys.path:
            raise
    sys.path.append(here)
    return importlib.import_module(target)


def _where(e: Exception, target: str) -> str:
    """' at FILE:LINE', the innermost line of the plug-in's own file that the import failure passed through (the
    error itself is often raised in a library it called), or '' where none did (a SyntaxError names its line itself)."""
    if target.endswith(".py"):
        own = Path(target).resolve()
    else:
        try:
            own = Path(importlib.util.find_spec(target).origin).resolve()
        except Exception:  # noqa: BLE001 - its package failed to import too: no file to name
            return ""
    lines = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == own]
    return f" at {lines[-1].filename}:{lines[-1].lineno}" if lines else ""


def _import_file(path: str):
    file = Path(path)
    if not file.is_file():
        where = "" if file.is_absolute() else f" (a relative path is read from the working directory, {Path.cwd()})"
        raise ConfigError(f"run.task: no file {file}{where}")
    # One module per file, under a name of its own: importing the same file again (a second run) reuses it, unless
    # the file changed since (edited between two harness.train calls of one session: the new code runs)
    name = "harness_task_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    stamp = file.stat().st_mtime_ns, file.stat().st_size
    if getattr(sys.modules.get(name), "__harness_stamp__", None) != stamp:
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        module.__harness_stamp__ = stamp
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def get_task(name: str) -> Task:
    return task_class(name)()
