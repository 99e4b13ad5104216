"""Data: rows read through Hugging Face `datasets` and cleaned by stated rules (`rows.py`), batches sharded across
data-parallel ranks as a pure function of (seed, step) (`batches.py`), and SentencePiece tokenizers (`tokenizer.py`).

May import: config. Nothing distributed: a rank's shard is computed from its data-parallel rank and size.
"""
from .rows import (
    DataSummary,  # also `harness.tasks.DataSummary`, the path plug-ins are told to use
)

__all__ = ["DataSummary"]
