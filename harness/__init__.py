"""harness: one run file, every DeepSpeed strategy, launched by accelerate.

The Python API (`harness/api.py`): `harness.plan`, `harness.train`, `harness.evaluate`, `harness.load_model`.
"""
import importlib
import inspect
import types

__version__ = "0.1.0"

from . import api  # noqa: E402
from .api import evaluate, load_model, plan_text, train  # noqa: E402,F401 - light: they import on call
from .config import ConfigError, Preempted, TrainingStopped  # noqa: E402,F401


class _CallablePackage(types.ModuleType):
    """The subpackage `harness/plan/` is also `harness.plan`, the API's function: importing a subpackage sets the
    parent's attribute of its name, so without this a second `harness.plan(...)` (after the first imported it) would
    call a module."""

    def __call__(self, *args, **kwargs):
        return api.plan(*args, **kwargs)


plan = importlib.import_module(".plan", __name__)  # the package, callable as the API's function
plan.__class__ = _CallablePackage
plan.__signature__ = inspect.signature(api.plan)
