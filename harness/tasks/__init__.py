"""Tasks: what a task provides (`interface.py`: the model, the data, the loss, the metrics), the built-in ones
(`lm`, `translation`, `protein`, whose samples, scoring and init_from are `protein_samples.py`, `protein_scoring.py`
and `protein_init_from.py`, and `prices`), the fields' metrics (`metrics.py`) and the registry that finds a task by
name (`registry.py`). A plug-in task imports `Task`, `TaskData`, `DataSummary` and `ReadData` from here.

May import: config, data, models, prepare, dist (a rank's place; collectives in a task's evaluation). Never the run,
plan, eval or bench: a task does not know how it is run.
"""
from ..data.rows import DataSummary
from .interface import REQUIRED, CaseStudy, ReadData, Task, TaskData, TaskDefaults
from .registry import (
           PLUGIN_HINT,
           TASKS,
           get_task,
           is_plugin_name,
           plugin_path,
           resolve,
           task_class,
           task_data,
           task_ref,
           task_sections,
)

__all__ = ["CaseStudy", "DataSummary", "PLUGIN_HINT", "REQUIRED", "ReadData", "TASKS", "Task", "TaskData",
           "TaskDefaults", "get_task", "is_plugin_name", "plugin_path", "resolve", "task_class", "task_data",
           "task_ref", "task_sections"]
