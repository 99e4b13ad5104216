"""Prepared data: what `harness prepare <task>` writes and training reads back.

A task's raw source (an embedded default inside an installed package, the user's files, a directory such as
`../shared/data/multi30k`, or a hub name) is cleaned, split and tokenized once into
`<cache>/prepared/<task>-<hash>/`: one `datasets` folder per split, the tokenizer, and `meta.json` (row counts
by status, normalisation statistics, the settings that produced it). The hash covers those settings, so a
changed setting or preparation version prepares anew and an unchanged one is reused.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError
from ..data import DataSummary

META = "meta.json"


def cache_dir() -> Path:
    return Path(os.environ.get("HARNESS_CACHE", Path.home() / ".cache" / "harness"))


def package_file(package: str, relpath: str, extra: str = "data") -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations))) / relpath if spec and spec.submodule_search_locations \
        else None
    if path is None or not path.is_file():
        raise ConfigError(f"the embedded default data needs the `{package}` package ({relpath}); install it with "
                          f"`pip install -e \".[{extra}]\"`, or set data.path to your own data")
    return path


def prepared(task: str, settings: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> Path:
    """The prepared directory for these settings; `build(tmp)` fills a fresh one when there is none yet.

    `build` writes splits and tokenizer into `tmp` and returns the meta dict (with "counts"); the directory
    appears under its final name only when complete, so racing processes never read a half-written one.
    """
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    final = cache_dir() / "prepared" / f"{task}-{key}"
    if (final / META).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    import datasets

    datasets.disable_progress_bars()  # the counts in meta.json, printed by the callers, say what they would
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        meta = build(tmp)
        (tmp / META).write_text(json.dumps({"task": task, "settings": settings, **meta}, indent=2, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep its copy
            if not (final / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_split(directory: Path, name: str, dataset) -> None:
    dataset.save_to_disk(str(directory / name))


def load_split(directory: Path, name: str):
    import datasets

    path = directory / name
    if not path.is_dir():
        raise ConfigError(f"{directory}: the prepared data has no {name!r} split")
    return datasets.load_from_disk(str(path))


def read_meta(directory: Path) -> dict[str, Any]:
    return json.loads((directory / META).read_text())


def summary(meta: dict[str, Any]) -> DataSummary:
    return DataSummary({split: Counter(counts) for split, counts in meta["counts"].items()})
