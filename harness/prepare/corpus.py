"""`harness prepare lm --input PATH... --out DIR`: a corpus of any size tokenized once into shards (`data/corpus.py`
reads them), never held whole in memory.

The inputs (files, directories, globs) are cut into units: a plain text or JSON-lines file in byte ranges of
`UNIT_BYTES` aligned to its lines, any other file whole (a compressed one, a csv) or by row group (parquet). Each
unit becomes its own shards, written under temporary names and renamed when whole, then a record in `units/`: an
interrupted prepare redoes only the units without a record (or whose shards are no longer whole: each shard's size
and checksum are checked, read again only where the file changed since its record or `verified.json` stamped it),
and the same command again redoes none. Units go to
`--workers` processes; `--part I/N` takes every N-th unit only, and `--merge` joins parts into one manifest that
points at their shards. A document is a line of text, a JSON line's or csv row's or parquet row's text field; it is
held out for validation with probability `--val-fraction`, drawn from (seed, unit, document): the same documents
whatever the workers or parts. Rows are skipped by the rules of `data/rows.py` (empty, whitespace-only, undecodable
or fieldless rows, counted), but none is cut at data.max_row_chars; an unreadable file or a truncated compressed one
stops the prepare naming the file and line, or with `--on-error skip` is counted and skipped.

This module claims `--out`, runs the units (`_work`), writes the manifest (`_write_manifest`) and merges parts
(`merge`); the inputs and their units are `inputs.py`'s, reading documents `readers.py`'s, the tokenizers
`tokenizers.py`'s and a unit's shards and record `shards.py`'s.
"""
from __future__ import annotations

import fcntl
import os
import signal
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..config.run import ConfigError
from ..data.corpus import FORMAT, MANIFEST, TMP, VERIFIED, VERSION, Shard, dtype_for, read_stamps
from .inputs import PARQUET, UNIT_BYTES, Unit, expand, parse_part, plan_units, record_or_empty, size_and_mtime
from .readers import BLOCK, first_fields
from .shards import done_records, prepare_unit, write_changed
from .tokenizers import RESIDUES, Bytes, HFTokenizer, Residues


def prepare_corpus(inputs: list[str], out: str, workers: int = 1, tokenizer: str | None = None,
                   text_field: str = "text", val_fraction: float = 0.0, seed: int = 0, part: str | None = None,
                   on_error: str = "stop", unit_bytes: int = UNIT_BYTES) -> dict:
    """Prepare (or continue preparing) `out`; returns its manifest."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    which = parse_part(part)
    root = Path(out)
    files = expand(inputs, exclude=root)
    units = plan_units(files, unit_bytes)
    mine = [u for u in units if which is None or u.id % which[1] == which[0] - 1]
    tok = Residues() if tokenizer == RESIDUES else HFTokenizer(tokenizer) if tokenizer else Bytes()
    settings = {"inputs": [{"path": f, "size": size_and_mtime(f)[0]} for f in files], "tokenizer": tok.spec,
                "text_field": text_field, "val_fraction": val_fraction, "seed": seed, "unit_bytes": unit_bytes,
                "units": len(units), "part": part}
    dtype = dtype_for(tok.spec["vocab_size"])
    with _claim(root, settings):
        fresh = {}
        done = done_records(root, mine, np.dtype(dtype), read_stamps(root), fresh)
        todo = [u for u in mine if u.id not in done]
        if done:  # the same command again (after Ctrl-C, a lost worker, a finished prepare): what it picks up
            print(f"prepare {root.name}: {len(done)} of {len(mine)} unit(s) prepared before, kept; "
                  + (f"preparing the other {len(todo)}" if todo else "nothing left to prepare"), flush=True)
        _work(todo, root, tok, text_field, val_fraction, seed, on_error, workers, done)
        for unit in todo:  # checksums taken while writing: a run need not read these shards again
            fresh.update(done[unit.id]["stamps"])
        return _write_manifest(root, settings, [done[u.id] for u in mine], dtype, fresh)


@contextmanager
def _claim(root: Path, settings: dict):
    """`out` for these settings, held by this prepare alone: new, or a prepare of the same settings to continue, or
    of other settings that prepared nothing yet; anything else is refused. What a killed prepare left half-written is
    removed, on the way in and out."""
    settings_file = root / "units" / "settings.json"
    if not settings_file.is_file() and root.exists() and any(root.iterdir()):
        raise ConfigError(f"{root}: exists and is not a prepared corpus; use another --out")
    (root / "units").mkdir(parents=True, exist_ok=True)
    with open(root / "units" / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"{root}: another prepare is writing it; wait for it to end") from None
        try:
            _remove_partial(root)
            if settings_file.is_file():
                _check_settings(root, record_or_empty(settings_file), settings)
            write_changed(settings_file, settings, root, indent=1)
            yield
        finally:
            _remove_partial(root)


def _inputs_changed(before: list[dict], now: list[dict]) -> str:
    """Which input files differ: added, gone, or of another size (the first of each, and how many)."""
    was, are = ({i["path"]: i["size"] for i in x} for x in (before, now))
    kinds = (("added", [p for p in are if p not in was]), ("gone", [p for p in was if p not in are]),
             ("resized", [p for p in are if p in was and are[p] != was[p]]))
    said = [f"{what} {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") for what, names in kinds
            if names]
    return f"inputs ({'; '.join(said) or 'in another order'})"


def _remove_partial(root: Path) -> None:
    for left in (*root.glob(f"*{TMP}"), *(root / "units").glob(f"*{TMP}")):
        left.unlink(missing_ok=True)


def _check_settings(root: Path, before: dict, settings: dict) -> None:
    """The same settings as the prepare `root` holds, or a prepare that made nothing yet (say, one whose
    --text-field was wrong), whose records then go: anything else is refused."""
    changed = [k for k in settings if k != "inputs" and not _same(k, before.get(k), settings[k])]
    if before.get("inputs") != settings["inputs"]:  # the count of units follows from the inputs: not named beside them
        inputs = _inputs_changed(before.get("inputs") or [], settings["inputs"])
        changed = [inputs, *(k for k in changed if k != "units")]
    if not changed:
        return
    records = sorted((root / "units").glob("[0-9]*.json"))
    made = (root / MANIFEST).is_file() or any(record_or_empty(r).get("shards") for r in records)
    if made:
        was, now = ({i["path"]: i["size"] for i in x} for x in (before.get("inputs") or [], settings["inputs"]))
        grown = was.items() < now.items() and not changed[1:]  # files added, none gone or changed, no other setting
        raise ConfigError(f"{root}: prepared with other {', '.join(changed)}; use another --out (or delete it)" + (
            "; to add the new files without preparing the others again, prepare them alone into another --out and "
            "train on both with data.mix, each weighted by its tokens (docs/corpora.md)" if grown else ""))
    for r in records:
        r.unlink()


def _same(key: str, a, b) -> bool:
    """The same tokenizer named by another path (`./tok`, `tok`) is the same: its kind, size, EOS and mapping."""
    if key == "tokenizer" and isinstance(a, dict) and isinstance(b, dict):
        return {k: v for k, v in a.items() if k != "name"} == {k: v for k, v in b.items() if k != "name"}
    return a == b


def _work(todo: list[Unit], root: Path, tok, text_field: str, val_fraction: float, seed: int, on_error: str,
          workers: int, done: dict) -> None:
    from ..console import progress

    bar = progress(total=sum(map(_weight, todo)), unit="B", unit_scale=True, desc=f"prepare {root.name}",
                   disable=not todo)
    started, tokens, docs, finished_bytes = time.monotonic(), 0, 0, 0
    jobs = [(u, root, tok, text_field, val_fraction, seed, on_error) for u in todo]

    def show(under_way: int) -> None:  # the units finished, and the bytes the units under way have read
        bar.update(max(0, min(bar.total, finished_bytes + under_way) - bar.n))

    def finished(unit: Unit, record: dict) -> None:
        nonlocal tokens, docs, finished_bytes
        done[unit.id] = record
        tokens += sum(s["tokens"] for s in record["shards"])
        docs += sum(s["documents"] for s in record["shards"])
        finished_bytes += _weight(unit)
        bar.set_postfix_str(f"{docs:,} docs, {tokens / max(1e-9, time.monotonic() - started):,.0f} tokens/s")
        show(0)

    try:
        if workers == 1 or len(jobs) <= 1:
            for job in jobs:
                read = 0

                def moved(n: int, weight: int = _weight(job[0])) -> None:
                    nonlocal read
                    read = min(weight, read + n)  # (a unit's last line runs past its range)
                    show(read)
                finished(job[0], prepare_unit(*job, moved=moved))
        else:
            _in_workers(jobs, workers, root, finished, show)
    finally:
        bar.close()  # an error's line then starts a line of its own


def _run_unit(args) -> dict:
    """A unit in a worker, the bytes it reads added to the pool's count as it goes and taken out as it ends (the
    count is then the bytes the units under way have read)."""
    read, weight = 0, _weight(args[0])

    def moved(n: int) -> None:
        nonlocal read
        n = min(n, weight - read)
        if n > 0:
            read += n
            with _UNDER_WAY.get_lock():
                _UNDER_WAY.value += n
    try:
        return prepare_unit(*args, moved=moved)
    finally:
        with _UNDER_WAY.get_lock():
            _UNDER_WAY.value -= read


def _in_workers(jobs: list[tuple], workers: int, root: Path, finished, show) -> None:
    """The units in `workers` processes, each `finished` as it ends; `show(bytes)` once a second, with the bytes the
    units under way have read. A worker killed from outside (the OOM killer) breaks the pool, said in one line
    (multiprocessing.Pool replaced it and waited for its unit for ever); on any error or Ctrl-C the other workers are
    stopped, not waited for."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    spawn = multiprocessing.get_context("spawn")
    under_way = spawn.Value("q", 0)
    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=spawn, initializer=_worker_start,
                               initargs=(os.getpid(), under_way))
    try:
        pending = {pool.submit(_run_unit, job): job[0] for job in jobs}
        while pending:
            ended, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in ended:
                finished(pending.pop(future), future.result())
            show(under_way.value)
    except BrokenProcessPool:
        _stop(pool)
        raise ConfigError(f"a worker of the prepare died (killed from outside, or out of memory: each holds up to "
                          f"{BLOCK >> 20} MB of text and its tokens at a time); {root} keeps the units it finished: "
                          f"run the same command again (with fewer --workers if memory ran out)") from None
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()


def _stop(pool) -> None:
    """Stop a pool's workers now, their units unfinished (`_claim` removes what they leave)."""
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in ([] if stop else processes):
        process.terminate()
    if stop:
        stop()
    for process in processes:  # gone before `_claim` removes their partial files and lets the directory go
        process.join(5)
    pool.shutdown(wait=False, cancel_futures=True)


_UNDER_WAY = None  # in a worker: the pool's count of the bytes its units under way have read (`_worker_start`)


def _worker_start(parent: int, under_way=None) -> None:
    """A worker leaves Ctrl-C to the prepare (which stops the pool) and dies with it: a prepare killed with -9 leaves
    no worker writing on into a directory that the same command, run again, is preparing (Linux: PR_SET_PDEATHSIG).
    `under_way`: the pool's shared count of bytes read (`_run_unit`)."""
    global _UNDER_WAY
    _UNDER_WAY = under_way
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _weight(unit: Unit) -> int:
    """A unit's share of the progress bar: its bytes (a whole file's for a parquet row group)."""
    return unit.end - unit.start if unit.end >= 0 and unit.kind != PARQUET else unit.size


def _write_manifest(root: Path, settings: dict, records: list[dict], dtype: str, stamps: dict) -> dict:
    """The manifest over `records`' shards, and `stamps` (their files checked) as `verified.json`. A part (`--part`)
    may hold no document; a corpus must."""
    counts = Counter()
    for r in records:
        counts.update(r["counts"])
    shards = [s for r in records for s in r["shards"]]
    if not any(s["split"] == "train" for s in shards) and not settings.get("part"):
        if counts["malformed"] and not counts["ok"]:
            found = first_fields([i["path"] for i in settings["inputs"]])
            raise ConfigError(f"{root}: no row has the field {settings['text_field']!r} (--text-field) as text "
                              f"({counts['malformed']} rows without it)" + (f"; fields found: {', '.join(found)}"
                                                                           if found else ""))
        raise ConfigError(f"{root}: the inputs hold no document to train on ({dict(counts) or 'nothing read'})")
    manifest = {"format": FORMAT, "version": VERSION, "dtype": dtype, **settings,
                "counts": {"rows": dict(counts), **{split: {
                    "tokens": sum(s["tokens"] for s in shards if s["split"] == split),
                    "documents": sum(s["documents"] for s in shards if s["split"] == split)}
                    for split in ("train", "validation")}},
                "shards": shards}
    write_changed(root / MANIFEST, manifest, root, indent=1)
    write_changed(root / VERIFIED, stamps, root)
    if settings["tokenizer"]["kind"] == RESIDUES:  # what the protein task reads of a prepared directory
        from . import META

        Residues().write_vocabulary(root)
        split_counts = {split: {"ok": manifest["counts"][split]["documents"]} for split in ("train", "validation")}
        write_changed(root / META, {"task": "protein", "corpus": True, "labels": "none", "classes": [], "values": {},
                                 "vocab_size": settings["tokenizer"]["vocab_size"], "sites": None,
                                 "counts": {**split_counts, "test": {}}}, root, indent=1)
    return manifest


MERGED_KEYS = ("inputs", "tokenizer", "text_field", "val_fraction", "seed", "unit_bytes", "units")


def merge(parts: list[str], out: str) -> dict:
    """One manifest over prepared parts (`--part I/N` each), pointing at their shards: no data copied. The parts
    must cover every unit once: a part missing (or one that is not finished) is refused, naming it."""
    root = Path(out)
    manifests = [_part_manifest(p, root) for p in parts]
    first = manifests[0]
    for p, m in zip(parts[1:], manifests[1:]):
        for key in (*MERGED_KEYS, "dtype"):
            if not _same(key, m.get(key), first.get(key)):
                raise ConfigError(f"--merge {p}: its manifest's {key!r} differs from {parts[0]}'s: parts of one "
                                  f"corpus only")
    _check_cover(parts, manifests, first["units"])
    if root.exists() and any(root.iterdir()) and "merged" not in record_or_empty(root / MANIFEST):
        raise ConfigError(f"--out {out}: exists and is not a merge of parts (it would be overwritten); use another "
                          f"--out")
    root.mkdir(parents=True, exist_ok=True)
    shards = sorted(({**s, "file": os.path.relpath(Path(p) / s["file"], root)} for p, m in zip(parts, manifests)
                     for s in m["shards"]), key=lambda s: (s["unit"], s["split"] != "train"))
    files = {str(f) for shard in (Shard.of(root, s) for s in shards) for f in (shard.path, shard.index)}
    stamps = {k: v for p in parts for k, v in read_stamps(Path(p)).items() if k in files}  # the parts' checks
    counts = sum((Counter(m["counts"]["rows"]) for m in manifests), Counter())
    return _write_manifest(root, {**{k: first[k] for k in MERGED_KEYS}, "part": None,
                                  "merged": [str(Path(p).resolve()) for p in parts]},
                           [{"shards": shards, "counts": counts}], first["dtype"], stamps)


def _part_manifest(part: str, root: Path) -> dict:
    path = Path(part) / MANIFEST
    if Path(part).resolve() == root.resolve():
        raise ConfigError(f"--merge {part}: --out is this part itself; merge into a directory of its own")
    manifest = record_or_empty(path)
    if manifest.get("format") != FORMAT:
        raise ConfigError(f"--merge {part}: no readable {MANIFEST}: not a prepared part (or not finished)")
    return manifest


def _check_cover(parts: list[str], manifests: list[dict], units: int) -> None:
    """Each unit in exactly one part (a part's units are every N-th: `--part I/N`)."""
    owner: dict[int, int] = {}
    for i, m in enumerate(manifests):
        which = parse_part(m.get("part"))
        for u in range(units) if which is None else range(which[0] - 1, units, which[1]):
            if owner.setdefault(u, i) != i:
                raise ConfigError(f"--merge: {parts[i]} and {parts[owner[u]]} both hold unit {u}: the parts overlap")
    missing = sorted(set(range(units)) - set(owner))
    if missing:
        sizes = {parse_part(m.get("part"))[1] for m in manifests if m.get("part")}
        hint = ""
        if len(sizes) == 1:
            n = sizes.pop()
            hint = f": prepare {', '.join(f'--part {i}/{n}' for i in sorted({u % n + 1 for u in missing}))} first"
        raise ConfigError(f"--merge: units {missing[:5]}{' ...' if len(missing) > 5 else ''} of {units} are in none "
                          f"of the parts{hint}")
