"""Evaluation of a finished run: `harness evaluate` (a split, or new data with `--data`) and `harness translate`, on the
exported model in one process (`evaluate.py`). The fields' metrics are the tasks' (`harness/tasks/metrics.py`).

May import: run (the exported model), and everything below it.
"""
