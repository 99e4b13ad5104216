"""Configuration: the run config (`run.py`: typed, documented fields; defaults < run file < `--set`, each value with
its source; frozen), the DeepSpeed JSON resolved against it (`ds.py`: ZeRO stage, offload, precision, the "auto"
values filled from the run), and how the world is split, data x tensor x pipeline (`layout.py`).

The bottom layer: it imports nothing of the harness. It knows no task (the task registry, `harness.tasks.resolve`,
tells it the task's own section). `from harness.config import ConfigError` is what a plug-in uses.
"""
from .layout import Layout
from .run import ConfigError, Preempted, Resolved, RunConfig, TrainingStopped

__all__ = ["ConfigError", "Layout", "Preempted", "Resolved", "RunConfig", "TrainingStopped"]
