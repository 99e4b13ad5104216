"""A checkpoint's `checksums.json`: every other file's size and the SHA-256 of each GiB of it, recorded once the
checkpoint is whole (`record_sums`; `write_sums` on one process) and checked before the checkpoint is read (`verify`,
`damage`; `check_records`, on one process, for the small records the checks before launch read). The ranks hash
shares of equal bytes side by side.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..config.run import ConfigError, one_line
from ..distributed.world import World, all_gather_objects
from .resume import DATA, LAYOUT, PLACE, SHAPES, UNIVERSAL, resume_before, write_atomic

SUMS = "checksums.json"  # every other file of the checkpoint: size and SHA-256 (`record_sums`, `verify`)
CHUNK = 1 << 30  # bytes a rank hashes as one piece: a file far larger than the rest is hashed by several ranks


def _pieces(size: int) -> int:
    """How many CHUNK-sized pieces a file of `size` bytes is hashed in (an empty file: one)."""
    return max(1, -(-size // CHUNK))


def _listing(path: Path) -> dict[str, int]:
    """Every file of checkpoint `path` (subfolders too) but its checksums, by relative name, with its size."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file() and
            p.name != SUMS}


def _shares(sizes: dict[str, int], ranks: int) -> list[list[tuple[str, int]]]:
    """Each rank's pieces (name, chunk index) of the files, the largest first to the least loaded rank: the same on
    every rank, given the same sizes."""
    pieces = sorted(((min(CHUNK, size - i * CHUNK), name, i) for name, size in sizes.items()
                     for i in range(_pieces(size))), key=lambda p: (-p[0], p[1], p[2]))
    load, shares = [0] * ranks, [[] for _ in range(ranks)]
    for nbytes, name, i in pieces:
        r = load.index(min(load))
        load[r] += nbytes
        shares[r].append((name, i))
    return shares


def _digest(file: Path, chunk: int) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        f.seek(chunk * CHUNK)
        left = CHUNK
        while left and (block := f.read(min(left, 1 << 24))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _write_sums(path: Path, sizes: dict[str, int], digests: dict[tuple[str, int], str]) -> None:
    sums = {name: {"size": size, "sha256": [digests[name, i] for i in range(_pieces(size))]}
            for name, size in sizes.items()}
    write_atomic(path / SUMS, json.dumps(sums, indent=1) + "\n")


def record_sums(path: Path, world: World) -> str | None:
    """Collective, on a checkpoint every rank has written: each file's size and the SHA-256 of each GiB of it in
    `checksums.json` (rank 0 writes it), the ranks hashing shares of equal bytes side by side. What failed, or None
    (the checkpoint is then read unchecked, as one saved before checksums were recorded)."""
    try:
        listing = _listing(path) if world.is_main else None
    except OSError as e:  # (said by every rank below: none is left waiting in the gather)
        listing = f"listing {path.name}: {type(e).__name__}: {one_line(e)}"
    sizes = all_gather_objects(listing)[0]  # rank 0's view, on every rank
    if isinstance(sizes, str):
        return sizes
    try:
        mine = {(name, i): _digest(path / name, i) for name, i in _shares(sizes, world.world_size)[world.rank]}
    except OSError as e:
        mine = f"reading {path.name} back on rank {world.rank}: {type(e).__name__}: {one_line(e)}"
    gathered = all_gather_objects(mine)
    failed = next((m for m in gathered if isinstance(m, str)), None)
    if failed is None and world.is_main:
        try:
            _write_sums(path, sizes, {k: v for m in gathered for k, v in m.items()})
        except OSError as e:
            failed = f"writing {path.name}/{SUMS}: {type(e).__name__}: {one_line(e)}"
    return failed


def write_sums(path: Path) -> None:
    """`record_sums` on one process (a universal conversion, which rank 0 makes alone)."""
    sizes = _listing(path)
    _write_sums(path, sizes, {(name, i): _digest(path / name, i) for name, i in _shares(sizes, 1)[0]})


def verify(path: Path, world: World) -> None:
    """Collective, before DeepSpeed reads a checkpoint: every file `checksums.json` lists is there, of its size, and
    each GiB of it of its SHA-256 (the ranks check shares of equal bytes side by side), else every rank stops with
    the line naming the checkpoint before. Bytes changed since the save (a copy between clusters, a failing disk) had
    loaded silently. One without checksums (saved before they were recorded, or on a stop signal) is read as it is."""
    found = damage(path, world)
    if found and path.name.endswith(UNIVERSAL):  # made from a checkpoint by a resume: it can be made again
        raise ConfigError(f"{path}, a conversion of a checkpoint for another layout, is damaged: {found}; remove it "
                          f"and resume again, which converts the checkpoint afresh")
    if found and found.startswith("its "):  # the record itself: the files may be whole
        raise ConfigError(f"checkpoint {path} is damaged: {found}; remove it to read the checkpoint unchecked, or "
                          f"go back: {resume_before(path)}")
    if found:
        raise ConfigError(f"checkpoint {path} is damaged: {found} (checked against the {SUMS} saved with it); "
                          f"{resume_before(path)}")


def damage(path: Path, world: World) -> str | None:
    """Collective: what is wrong with checkpoint `path` against its checksums (`verify`), the same on every rank."""
    sums = all_gather_objects(_read_sums(path) if world.is_main else None)[0]  # rank 0's reading, on every rank
    found = None
    if isinstance(sums, str):
        found = sums
    elif sums is not None:
        sizes = {name: entry["size"] for name, entry in sums.items()}
        mine = _shares(sizes, world.world_size)[world.rank]
        found = next((why for name, i in mine if (why := _changed(path, name, i, sums[name]))), None)
    return next((f for f in all_gather_objects(found) if f), None)


def check_records(path: Path) -> None:
    """The small records the checks before launch read (layout, shapes, data, place) against the checkpoint's
    checksums, on one process: a changed one had sent the user after a wrong cause (another layout, changed code)."""
    sums = _read_sums(path)
    if isinstance(sums, dict):
        for name in (LAYOUT, SHAPES, DATA, PLACE):
            if name in sums and (why := _changed(path, name, 0, sums[name])):
                raise ConfigError(f"checkpoint {path} is damaged: {why} (checked against the {SUMS} saved with it); "
                                  f"{resume_before(path)}")


def _read_sums(path: Path) -> dict | str | None:
    """A checkpoint's checksums; None where it has none; what is wrong with them where they cannot be used."""
    try:
        sums = json.loads((path / SUMS).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        return f"its {SUMS} cannot be read ({type(e).__name__})"
    if not isinstance(sums, dict) or not sums or not all(_entry_ok(n, e) for n, e in sums.items()):
        return f"its {SUMS} cannot be read (not the sizes and SHA-256 digests of files within it)"
    return sums


def _entry_ok(name: str, e: Any) -> bool:
    return isinstance(e, dict) and isinstance(e.get("size"), int) and e["size"] >= 0 and \
        isinstance(e.get("sha256"), list) and len(e["sha256"]) == _pieces(e["size"]) and \
        all(isinstance(h, str) for h in e["sha256"]) and not Path(name).is_absolute() and ".." not in Path(name).parts


def _changed(path: Path, name: str, chunk: int, recorded: dict) -> str | None:
    """What is wrong with piece `chunk` of one file of checkpoint `path` against its record, or None."""
    file = path / name
    try:
        if not file.is_file():
            return f"{name} is gone"
        if file.stat().st_size != recorded["size"]:
            return f"{name} is {file.stat().st_size:,} bytes, saved as {recorded['size']:,}"
        where = f" in its GiB number {chunk + 1}" if chunk else ""
        return None if _digest(file, chunk) == recorded["sha256"][chunk] else \
            f"{name} has changed since it was saved (another SHA-256{where})"
    except Exception as e:  # noqa: BLE001 - any failure is this file's line, said by every rank, not one rank gone
        return f"{name} cannot be read ({type(e).__name__}: {one_line(e, 200)})"
