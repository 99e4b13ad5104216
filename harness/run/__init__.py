"""A run's life, from the plan to the exported model: the checks before it starts (`startup.py`'s preflight) of this
machine (`machine.py`) and its JIT builds (`builds.py`), the run directory (`directory.py`), what a run continues
from (`continuity.py`) and what its nodes share (`nodes.py`); the one training loop (`loop.py`) and its step
(`step.py`), checkpoints saved and loaded (`checkpoint.py`), their folder and what a resume takes (`resume.py`),
their checksums (`checksums.py`) and conversion to another layout (`reshape.py`), the best checkpoint and early
stopping (`selection.py`), the consolidated model (`export.py`), the run directory's lock (`lock.py`), hung ranks
(`heartbeat.py`), the scheduler's signals (`preemption.py`), metrics files and trackers (`tracking.py`), one traced
step (`profiling.py`) and the curves (`plots.py`).

May import: everything below it (plan, tasks, prepare, distributed, models, data, config); never eval, bench or the
command line.
"""
