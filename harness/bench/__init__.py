"""Benchmarks: `harness bench` (a sweep of launches, `sweep.py`/`run.py`; the device's peak, `device.py`; the report,
`report.py`), the overhead study with its hand-written DeepSpeed and plain PyTorch references (`overhead.py`,
`reference.py`, `plain.py`), the GPU suite (`suite.py`; what it measures, `catalog.py`; the GPU table of
docs/benchmarks.md from its files, `results.py`) and the multi-node estimate of `harness plan --gpus-per-node`
(`scaling.py`).

May import: eval, run and everything below them; never the command line.
"""
