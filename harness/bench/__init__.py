"""Benchmarks, `harness bench sweep|overhead|proxy|suite|seeds`: a sweep of launches (`sweep.py`, `run.py`; the
device's peak, `device.py`; the report, `report.py`), the harness against its one reference, a plain PyTorch loop
(`plain.py`: timed in `overhead.py`, counted in `proxy.py`), the GPU suite (`suite.py`, `catalog.py`; its table in
docs/benchmarks.md, `results.py`) and the seeds study (`seeds.py`).

May import: eval, run and everything below them; never the command line.
"""
