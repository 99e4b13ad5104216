"""Prepared data: what `harness prepare <task>` writes and training reads back.

A task's raw source (an embedded default inside an installed package, the user's files, a directory such as
`../shared/data/multi30k`, or a hub name) is cleaned, split and tokenized once into
`<cache>/prepared/<task>-<hash>/`: one `datasets` folder per split, the tokenizer, and `meta.json` (row counts
by status, normalisation statistics, the settings that produced it). The hash covers those settings, so a
changed setting or preparation version prepares anew and an unchanged one is reused.

A run keeps its own copy of what scoring new data needs (`store`, when training starts): `RUN/data/` holds the
tokenizer and `meta.json` (normalisation statistics, classes) of the prepared directory it trained on, and
`checksums.json` (the sha256 of every file there, and what `differences` compares). `harness evaluate --data`
reads new data with these, never re-fitted; `harness evaluate --split` refuses when the data prepared now from
`data.path` has another tokenizer or other statistics than the stored ones (the training data changed since).

May import: config, data, models (a Hugging Face tokenizer). Never tasks or anything above them.
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

from ..config.run import ConfigError
from ..data.corpus import Corpus, is_corpus, sha256
from ..data.rows import DataSummary

META = "meta.json"
STORED = "data"  # RUN/data/: the run's copy of its tokenizer and statistics
CHECKSUMS = "checksums.json"


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
        meta = {"task": task, "settings": settings, **meta, "fingerprint": _content_digest(tmp)}
        (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: keep its copy
            if not (final / META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# `datasets`' own bookkeeping beside a split's arrow files: its cache fingerprints, not the data
_BOOKKEEPING = {META, "state.json", "dataset_info.json"}


def _content_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(f for f in directory.rglob("*") if f.is_file() and f.name not in _BOOKKEEPING):
        digest.update(f"{f.relative_to(directory)}:{sha256(f)}\n".encode())
    return digest.hexdigest()[:16]


def fingerprint(directory: Path) -> str:
    """What training reads from a prepared directory, as one digest of its splits' rows and its tokenizer, by content:
    the same data moved, re-read after a `touch` or prepared again gives the same one (the directory's name hashes
    paths and times). Recorded in meta.json when prepared; computed for a directory prepared before it was (a
    protein corpus: its own fingerprint)."""
    meta = read_meta(directory) if (directory / META).is_file() else {}
    if meta.get("fingerprint"):
        return meta["fingerprint"]
    return Corpus(directory).fingerprint if is_corpus(directory) else _content_digest(directory)  # (a corpus's:
    # from its manifest's checksums, not by reading its shards)


def save_split(directory: Path, name: str, dataset) -> None:
    dataset.save_to_disk(str(directory / name))


def load_split(directory: Path, name: str):
    import datasets

    path = directory / name
    if not path.is_dir():
        raise ConfigError(f"{directory}: the prepared data has no {name!r} split (its source gives none)" + (
            ": score --split validation, or new data with --data" if name == "test" else ""))
    return datasets.load_from_disk(str(path))


def read_meta(directory: Path) -> dict[str, Any]:
    return json.loads((directory / META).read_text())


def summary(meta: dict[str, Any]) -> DataSummary:
    return DataSummary({split: Counter(counts) for split, counts in meta["counts"].items()})


# --- the run's stored artefacts (RUN/data/) ----------------------------------------------------------------------

def _files(root: Path) -> list[str]:
    return sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file() and f.name != CHECKSUMS)


def store(directory: Path, out: Path, names: tuple[str, ...], compare: tuple[str, ...],
          keys: tuple[str, ...], extra: dict[str, Any] | None = None) -> Path:
    """Copy `meta.json` (with `extra` added) and the files or folders `names` that exist in the prepared `directory`
    into `out` (RUN/data/), with `checksums.json`: {"sha256": {file: digest}, "compare": the files of `compare` that
    exist, "keys": `keys`}, the files and meta.json keys `differences` checks against a directory prepared later.
    Written whole or not at all."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name in names:
            src = directory / name
            if src.is_dir():
                shutil.copytree(src, tmp / name)
            elif src.is_file():
                shutil.copy2(src, tmp / name)
        own = read_meta(directory)  # (a directory prepared before meta.json held its fingerprint: computed)
        (tmp / META).write_text(json.dumps({**own, "fingerprint": own.get("fingerprint") or fingerprint(directory),
                                            **(extra or {})}, indent=2, default=str))
        sums = {name: sha256(tmp / name) for name in _files(tmp)}
        (tmp / CHECKSUMS).write_text(json.dumps({"sha256": sums, "compare": [n for n in compare if n in sums],
                                                 "keys": list(keys)}, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def stored(run_dir: Path) -> Path | None:
    """RUN/data/ after checking every file against its recorded sha256; None for a run that has none."""
    out = Path(run_dir) / STORED
    if not (out / CHECKSUMS).is_file():
        return None
    sums = json.loads((out / CHECKSUMS).read_text())["sha256"]
    for name, digest in sums.items():
        if not (out / name).is_file() or sha256(out / name) != digest:
            raise ConfigError(f"{out / name}: missing or changed since the run stored it (its sha256 is in "
                              f"{out / CHECKSUMS}); the run's tokenizer and statistics cannot be trusted")
    return out


def differences(out: Path, directory: Path) -> list[str]:
    """What differs between stored artefacts `out` and a prepared `directory`: compared files by sha256 and
    meta.json keys by value (empty: the same tokenizer and statistics)."""
    spec = json.loads((out / CHECKSUMS).read_text())
    changed = [n for n in spec["compare"]
               if not (directory / n).is_file() or sha256(directory / n) != spec["sha256"][n]]
    mine, theirs = read_meta(out), read_meta(directory)
    return changed + [f"{META} {k}" for k in spec["keys"] if mine.get(k) != theirs.get(k)]


def store_run_data(task, cfg, run_dir: Path) -> str | None:
    """Rank 0, when training starts: the task's artefacts into RUN/data/ (`task.store`); a resumed run keeps the
    ones it started with and gets a note (returned) when the data prepared now differs from them."""
    out = Path(run_dir) / STORED
    if not (out / CHECKSUMS).is_file():
        task.store(cfg, out)
        return None
    changed = differences(out, task.prepare(cfg)) if hasattr(task, "prepare") else []
    return (f"note: the data prepared now differs from what the run started with in {', '.join(changed)}; {out} "
            f"keeps the artefacts it started with") if changed else None
