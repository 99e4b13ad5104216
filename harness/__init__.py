"""harness: one run file, every DeepSpeed strategy, launched by accelerate.

The Python API (`harness/api.py`): `harness.plan`, `harness.train`, `harness.evaluate`, `harness.load_model`.
"""
__version__ = "0.1.0"

from .api import evaluate, load_model, plan, plan_text, train  # noqa: E402,F401 - light: they import on call
from .config import ConfigError, TrainingStopped  # noqa: E402,F401
