"""Distribution: everything that touches process groups or DeepSpeed's engine. The world and each rank's place in it,
and the collectives the loop uses (`world.py`); this process's memory (`memory.py`); DeepSpeed applied to a plain model,
ZeRO 0-3, tensor and pipeline parallelism, and consolidated back (`parallel.py`); the optimizer DeepSpeed steps and
the learning-rate schedule (`optim.py`); Hugging Face models built partitioned under ZeRO-3 (`zero3.py`); sequence
parallelism, DeepSpeed Ulysses (`sequence.py`); every change to DeepSpeed's own behaviour, fenced by version
(`ds_patches.py`).

May import: config, models, data. Never tasks, the plan or the run: what it applies to comes in as arguments.
"""
