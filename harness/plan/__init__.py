"""The plan: a run resolved before anything starts. The run config, the DeepSpeed config and the task together,
checked for the world the run will have (`resolve.py`: `make_plan` -> `Plan`), and `harness plan` / `harness keys`,
which print it with every value's source (`render.py`), and the multi-node estimate of `harness plan
--gpus-per-node` (`scaling.py`).

May import: config, data, models, distributed, prepare, tasks. Nothing it does starts a process group.
"""
