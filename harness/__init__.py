"""harness: one run file, every DeepSpeed strategy, launched by accelerate."""
__version__ = "0.1.0"
