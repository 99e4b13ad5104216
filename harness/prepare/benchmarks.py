"""The benchmark sets the GPU-sized recipes and `harness bench suite` read (`multi30k/`, `flip_ss/`, `flip_gb1/`,
`ett/` in one folder), laid out from the files their authors publish (`harness prepare TASK --from PATH`), and tiny
stand-ins in the same layout that `harness bench suite --smoke` makes when the real ones are absent.

Nothing is fetched: PATH is what you downloaded (a file, an archive or its unpacked folder). Each set is checked
(its files there, their columns or pairs) and written compressed under the names the recipes read.
"""
from __future__ import annotations

import csv
import datetime as dt
import gzip
import io
import math
import random
import zipfile
import zlib
from pathlib import Path

from ..config.run import ConfigError

SOURCES = {  # what `--from` takes: the authors' own releases
    "multi30k": "Multi30k task 1 raw files (github.com/multi30k/dataset, data/task1/raw/: train, val and "
                "test_2016_flickr .en/.de, gzipped or not)",
    "flip_ss": "FLIP's secondary-structure split (github.com/J-SNACKKB/FLIP, splits/ss/splits.zip: sequences, "
               "sampled and mask .fasta)",
    "flip_gb1": "FLIP's GB1 splits (github.com/J-SNACKKB/FLIP, splits/gb1/splits.zip: sampled.csv, low_vs_high.csv, "
                "...; columns sequence,target,set,validation)",
    "ett": "ETDataset's ETTh1.csv (github.com/zhouhaoyi/ETDataset, ETT-small/)",
}
PAIRS = ("train", "val", "test_2016_flickr")
FLIP_SS = ("sequences.fasta", "sampled.fasta", "mask.fasta")
FLIP_COLUMNS = ["sequence", "target", "set", "validation"]
ETT_COLUMNS = ["date", "HUFL", "HULL", "MUFL", "MULL", "LUFL", "LULL", "OT"]


def from_release(task: str, source: str, root: str) -> list[Path]:
    """`harness prepare TASK --from SOURCE --out ROOT`: the set(s) SOURCE holds, written into ROOT; the files
    written."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"--from {source}: no such file or folder")
    try:
        return _lay_out(task, _members(path), Path(root), source)
    except (UnicodeDecodeError, zipfile.BadZipFile, gzip.BadGzipFile, EOFError, csv.Error, zlib.error) as e:
        raise ConfigError(f"--from {source}: unreadable ({type(e).__name__}: {e})") from None


def _lay_out(task: str, files: dict[str, bytes], out: Path, source: str) -> list[Path]:
    if task == "translation":
        return _multi30k(files, out / "multi30k", source)
    if task == "prices":
        return _ett(files, out / "ett", source)
    written = []
    if all(any(Path(n).name == f for n in files) for f in FLIP_SS[:2]):
        written += _flip_ss(files, out / "flip_ss", source)
    written += _flip_gb1(files, out / "flip_gb1")
    if not written:
        raise ConfigError(f"--from {source}: neither {SOURCES['flip_ss']} nor {SOURCES['flip_gb1']}")
    return written


KINDS = (".en", ".de", ".fasta", ".csv", ".gz", ".zip")  # what the sets are made of: a folder's other files are not read


def _members(path: Path) -> dict[str, bytes]:
    """The set's files under `path` (a folder, a zip, or one file), by their names inside it, read whole (these sets
    are a few MB)."""
    if path.is_dir():
        found = {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))
                 if f.is_file() and f.name.endswith(KINDS)}
        zips = {n: b for n, b in found.items() if n.endswith(".zip")}
        for name, data in zips.items():  # FLIP's folders hold their splits zipped
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                found.update({f"{name}/{m}": z.read(m) for m in z.namelist() if not m.endswith("/")})
        return found
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            return {m: z.read(m) for m in z.namelist() if not m.endswith("/")}
    return {path.name: path.read_bytes()}


def _text(name: str, data: bytes) -> str:
    return (gzip.decompress(data) if name.endswith(".gz") else data).decode("utf-8")


def _find(files: dict[str, bytes], name: str) -> tuple[str, bytes] | None:
    """The member named `name` (or `name.gz`), wherever it lies."""
    return next(((n, d) for n, d in files.items() if Path(n).name in (name, f"{name}.gz")), None)


def _write_gz(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.write(text)
    tmp.replace(path)
    return path


def _multi30k(files: dict[str, bytes], out: Path, source: str) -> list[Path]:
    texts = {}
    for split in PAIRS:
        for lang in ("en", "de"):
            found = _find(files, f"{split}.{lang}")
            if found is None:
                raise ConfigError(f"--from {source}: no {split}.{lang}[.gz]; expected {SOURCES['multi30k']}")
            texts[split, lang] = _text(*found)
        en, de = (len(texts[split, lang].splitlines()) for lang in ("en", "de"))  # a last line with or without \n
        if en != de or not en:
            raise ConfigError(f"--from {source}: {split}.en has {en} lines and {split}.de {de}: not one sentence "
                              f"pair a line")
    return [_write_gz(out / f"{split}.{lang}.gz", texts[split, lang]) for split, lang in texts]


def _flip_ss(files: dict[str, bytes], out: Path, source: str = "") -> list[Path]:
    _check_flip_ss(_text(*_find(files, FLIP_SS[0])), _text(*_find(files, FLIP_SS[1])), source)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "splits.zip.tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name in FLIP_SS:
            found = _find(files, name)
            if found is not None:
                z.writestr(name, _text(*found))
    tmp.replace(out / "splits.zip")
    return [out / "splits.zip"]


def _check_flip_ss(sequences: str, sampled: str, source: str) -> None:
    """FLIP's secondary-structure files: most records in both, each state string as long as its sequence, each
    record's split named (`SET=train|test`)."""
    def records(text: str) -> dict[str, tuple[str, str]]:
        out, name = {}, None
        for line in text.splitlines():
            if line.startswith(">"):
                name = line[1:].split()[0] if line[1:].split() else ""
                out[name] = (line, "")
            elif name is not None:
                out[name] = (out[name][0], out[name][1] + line.strip())
        return out

    seqs, states = records(sequences), records(sampled)
    fits = [k for k, (head, residues) in states.items() if k in seqs and len(seqs[k][1]) == len(residues) and
            ("SET=train" in head or "SET=test" in head)]
    if len(fits) < max(1, len(states) / 2):  # (a few odd records are the reader's to count as malformed)
        example = next((k for k in states if k not in fits), None)
        why = "no record" if not states or not seqs else \
            f"{len(states) - len(fits)} of {len(states)} records without a sequence of their length or a SET=, " \
            f"e.g. {example}"
        raise ConfigError(f"--from {source}: {FLIP_SS[0]} and {FLIP_SS[1]} are not FLIP's secondary-structure files "
                          f"({why})")


def _flip_gb1(files: dict[str, bytes], out: Path) -> list[Path]:
    written = []
    for name, data in files.items():
        if not Path(name).name.endswith((".csv", ".csv.gz")):
            continue
        text = _text(name, data)
        if next(csv.reader(io.StringIO(text)), None) == FLIP_COLUMNS:
            written.append(_write_gz(out / (Path(name).name.removesuffix(".gz").removesuffix(".csv") + ".csv.gz"),
                                     text))
    return written


def _ett(files: dict[str, bytes], out: Path, source: str) -> list[Path]:
    found = [(n, d) for n, d in files.items() if Path(n).name.startswith("ETT") and
             Path(n).name.removesuffix(".gz").endswith(".csv")]
    if not any(Path(n).name.startswith("ETTh1.csv") for n, _ in found):
        raise ConfigError(f"--from {source}: no ETTh1.csv[.gz]; expected {SOURCES['ett']}")
    written = []
    for name, data in found:
        text = _text(name, data)
        if next(csv.reader(io.StringIO(text)), None) != ETT_COLUMNS:
            raise ConfigError(f"--from {source}: {name} has not ETDataset's columns {','.join(ETT_COLUMNS)}")
        written.append(_write_gz(out / (Path(name).name.removesuffix(".gz") + ".gz"), text))
    return written


# --- stand-ins for --smoke -----------------------------------------------------------------------------------------

def make_smoke(root: Path, seed: int = 0) -> Path:
    """Tiny made-up sets in the recipes' layout under `root` (made once): enough rows for every split and the
    models' shapes, nothing a figure could be read from."""
    if (root / "ett" / "ETTh1.csv.gz").is_file():
        return root
    rng = random.Random(seed)
    words = {w: w[::-1] + "n" for w in ("a", "dog", "man", "red", "runs", "on", "the", "grass", "girl", "ball")}
    for split, n in zip(PAIRS, (300, 40, 40)):
        en = [" ".join(rng.choice(list(words)) for _ in range(rng.randint(3, 9))) for _ in range(n)]
        _write_gz(root / "multi30k" / f"{split}.en.gz", "\n".join(en) + "\n")
        _write_gz(root / "multi30k" / f"{split}.de.gz", "\n".join(" ".join(words[w] for w in s.split())
                                                                  for s in en) + "\n")
    amino = "ACDEFGHIKLMNPQRSTVWY"
    fasta = {name: [] for name in FLIP_SS}
    for i in range(120):
        seq = "".join(rng.choice(amino) for _ in range(rng.randint(30, 90)))
        where = "SET=test VALIDATION=False" if i % 6 == 0 else f"SET=train VALIDATION={i % 6 == 1}"
        fasta["sequences.fasta"] += [f">s{i}", seq]
        fasta["sampled.fasta"] += [f">s{i} {where}", "".join("CHE"[amino.index(a) % 3] for a in seq)]
        fasta["mask.fasta"] += [f">s{i}", "1" * len(seq)]
    _flip_ss({n: ("\n".join(lines) + "\n").encode() for n, lines in fasta.items()}, root / "flip_ss")
    wild = "".join(rng.choice(amino) for _ in range(60))
    rows = ["sequence,target,set,validation"]
    for i in range(300):
        seq = list(wild)
        for site in (10, 20, 30, 40):
            seq[site] = rng.choice(amino)
        fitness = sum(amino.index(seq[s]) for s in (10, 20, 30, 40)) / 40 + rng.gauss(0, 0.1)
        rows.append(f"{''.join(seq)},{fitness:.4f},{'test' if i % 5 == 0 else 'train'},{i % 5 == 1 or ''}")
    _write_gz(root / "flip_gb1" / "low_vs_high.csv.gz", "\n".join(rows) + "\n")
    lines = [",".join(ETT_COLUMNS)]
    start = dt.datetime(2016, 7, 1)
    for h in range(14_500):  # the standard split's 14,400 hours and a few more
        values = [math.sin(2 * math.pi * (h / 24 + c / 7)) * (1 + c / 10) + rng.gauss(0, 0.1) for c in range(7)]
        when = (start + dt.timedelta(hours=h)).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"{when}," + ",".join(f"{v:.3f}" for v in values))
    _write_gz(root / "ett" / "ETTh1.csv.gz", "\n".join(lines) + "\n")
    return root
