"""Benchmarks: `harness bench sweep|overhead|proxy|suite|seeds|corpus`, a module each (with `report.py`, the sweep's
report; `plain.py`, the PyTorch loop the harness is compared with; `catalog.py`, what the suite measures) and `harness
results` (`results.py`). May import eval, run and everything below them; never the command line."""
