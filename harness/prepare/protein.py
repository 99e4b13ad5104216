"""Protein data: sequences from one of four sources, cleaned, split without leakage and tokenized once.

Sources (`data.path`): the embedded default (modlamp's AMP vs UniProt), a FLIP directory such as
`../shared/data/flip_ss`, a user's file, or `hub:NAME`; `protein_sources` reads them.

Cleaning rules, counted per split in meta["counts"] (kept: ok, truncated, whole, off_site):
- empty: no residues once whitespace is removed (sequences are upper-cased; a stop codon's trailing "*" dropped);
- malformed: a letter outside the amino-acid alphabet (20 standard + B Z X U O), a missing label, a label that
  is not a class (classify), not one state per residue (residue; DSSP's 8 states are reduced to 3) or not a
  finite number (regress), or a row that cannot be parsed or holds bytes that are not UTF-8;
- truncated: longer than `data.seq_len` residues: cut to its first seq_len (kept; per-residue labels are cut
  with it, so the cut residues are not trained on);
- whole: a validation or test chain with per-residue labels longer than `data.seq_len`: kept whole, and scored in
  overlapping windows by the task, so every resolved residue of every chain counts, however long;
- duplicate: the same sequence again in the same split (the first copy is kept; for regress it carries the mean
  of every copy's value, as a repeated measurement);
- conflict: the same sequence with different class labels (every copy dropped);
- leak: a validation or test sequence that is also in an earlier split (dropped there).
With `protein.sites = "varying"` (a mutational library: every training sequence has one length) the model reads only
the positions where the kept training sequences differ (meta["sites"]: the length, those 0-based columns and the
first training sequence as the reference); nothing is truncated (data.seq_len does not apply), and a validation,
test or scored sequence is
- other_length: of another length than the training sequences (dropped: its sites cannot be found);
- off_site: different from the reference at a position outside the sites (kept; the model cannot see that
  difference, so such a row can give the model the same input as a training row or as another off_site row; the
  summary and `evaluate --data` say how many).
Without given splits, each DISTINCT sequence is drawn into train/validation/test (stratified by label, seeded
with SPLIT_SEED, not train.seed: every run is scored on the same test set), so copies never cross splits.
The residue-level SentencePiece vocabulary (one id per residue, plus <mask> and <cls>) is trained on the kept
training sequences only; regression values are z-scored with the kept training values' mean and standard
deviation (meta["values"]), which the task undoes when it reports.
With `protein.train_subsample = N` only N of the kept training and validation rows stay, each in its split (drawn by
`protein.subsample_seed`; counted as not_sampled), before the sites, the vocabulary and the value statistics are
found: a low-N study sees only its N rows; the test split stays whole.
Class labels that look like measurements (every one a number and some not whole, or more than MAX_CLASSES
distinct numbers) are refused for classify with a line pointing to regress.
"""
from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from ..config.run import ConfigError, RunConfig
from ..data.rows import KEPT, NA_STRINGS
from ..data.tokenizer import Tokenizer, train_tokenizer
from . import load_split, package_file, prepared, read_meta, save_split
from .protein_sources import (
    DEFAULT,
    SPLITS,
    Row,
    check_flip,
    file_format,
    read_scored,
    read_source,
    source_kind,
)

VERSION = 4  # the cache key includes it (3: "NA" labels missing, validation flags of any case; 4: a "*" end dropped)
MAX_CLASSES = 100
SPLIT_SEED = 0
TOKENIZER = "spm.model"
USER_SYMBOLS = ("<mask>", "<cls>")
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
ALPHABET = frozenset(AMINO_ACIDS + "BZXUO")  # IUPAC ambiguity codes, selenocysteine, pyrrolysine
STATES = "CHE"  # coil, helix, strand -> 0, 1, 2
DSSP_TO_3 = {**{s: "H" for s in "HGI"}, **{s: "E" for s in "EB"}, **{s: "C" for s in "CTSL-_ "}}
IGNORE = -100  # per-residue label of an unresolved residue (and of <cls> and padding, in the task)
STORED = COMPARED = (TOKENIZER,)  # what a run keeps (RUN/data/) besides meta.json, and compares with `--split`
SCORING_KEYS = ("labels", "classes", "values", "vocab_size", "sites")  # meta.json values that scoring depends on


def label_kind(cfg: RunConfig) -> str:
    """'class' (one label per sequence), 'residue' (one state per residue) or 'value' (one number per sequence)."""
    kind = source_kind(cfg.data.path)
    if kind == "flip" or (kind in ("file", "hub") and cfg.task.objective == "residue"):
        return "residue"
    return "value" if kind in ("file", "hub") and cfg.task.objective == "regress" else "class"


def check(cfg: RunConfig) -> None:
    """Preflight: the source exists and can give what the objective needs."""
    d, kind = cfg.data, source_kind(cfg.data.path)
    if kind == "default":
        package_file(*DEFAULT)
    elif kind == "flip":
        check_flip(Path(d.path))
    elif kind == "file":
        for key, p in (("data.path", d.path), ("data.val_path", d.val_path)):
            if p and not Path(p).is_file():
                raise ConfigError(f"{p}: {key} not found")
            if p:
                file_format(p)
    obj = cfg.task.objective
    if obj == "residue" and kind == "default":
        raise ConfigError("protein.objective = 'residue' needs per-residue labels; the embedded default has one "
                          "label per sequence: set data.path (e.g. ../shared/data/flip_ss)")
    if obj in ("classify", "regress") and kind == "flip":
        raise ConfigError(f"{d.path} holds per-residue labels: use protein.objective = 'residue' (or 'mlm')")
    if obj == "regress" and kind == "default":
        raise ConfigError("protein.objective = 'regress' needs a number per sequence; the embedded default has "
                          "classes: set data.path (e.g. ../shared/data/flip_gb1/sampled.csv.gz)")
    if not 0 <= d.val_fraction < 1 or not 0 <= cfg.task.test_fraction < 1 \
            or d.val_fraction + cfg.task.test_fraction >= 1:
        raise ConfigError(f"data.val_fraction = {d.val_fraction} and protein.test_fraction = "
                          f"{cfg.task.test_fraction} must be in [0, 1) and leave some training data")


def settings(cfg: RunConfig) -> dict[str, Any]:
    """Everything the prepared data depends on (a file's size and time too, so an edited file re-prepares)."""
    d, p = cfg.data, cfg.task

    def identity(path: str) -> str:
        if not path or path.startswith("hub:"):
            return path
        f = Path(path).resolve()
        files = sorted(f.iterdir()) if f.is_dir() else [f]
        return f"{f}:" + ",".join(f"{x.name}/{x.stat().st_size}/{x.stat().st_mtime_ns}" for x in files)

    return {"version": VERSION, "source": identity(d.path) or str(package_file(*DEFAULT)),
            "val_path": identity(d.val_path), "labels": label_kind(cfg),
            "seq_len": None if p.sites == "varying" else d.seq_len,  # with sites nothing is cut
            "val_fraction": d.val_fraction, "test_fraction": p.test_fraction,
            "fields": [p.sequence_field, p.label_field], "sites": p.sites,
            **({"subsample": [p.train_subsample, p.subsample_seed]} if p.train_subsample else {})}


def prepare(cfg: RunConfig) -> Path:
    return prepared("protein", settings(cfg), lambda tmp: build(tmp, cfg))


def _features():
    import datasets

    return datasets.Features({"sequence": datasets.Value("string"), "ids": datasets.Sequence(datasets.Value("int32")),
                              "label": datasets.Value("int64"), "states": datasets.Sequence(datasets.Value("int64")),
                              "value": datasets.Value("float64")})


def load(directory: Path, split: str):
    """A prepared split: columns sequence, ids (residue ids), label (class index or -1), states (per residue),
    value (the regression target as read, nan without one)."""
    import datasets

    if split not in SPLITS:
        raise ConfigError(f"no split {split!r}; choose one of {', '.join(SPLITS)}")
    if not (directory / split).is_dir():
        return datasets.Dataset.from_dict({k: [] for k in _features()}, features=_features())
    return load_split(directory, split)


def tokenizer(directory: Path) -> Tokenizer:
    return Tokenizer.load(directory / TOKENIZER)


def letter_ids(tok: Tokenizer) -> dict[str, int]:
    """Each residue letter's id: <unk>'s for a letter the training split never held."""
    ids = {}
    for letter in ALPHABET:
        try:
            ids[letter] = tok.piece_id(letter)
        except KeyError:
            ids[letter] = tok.unk_id
    return ids


def encode(tok: Tokenizer, sequences: list[str]) -> list[list[int]]:
    """One id per residue, looked up residue by residue: SentencePiece itself would fold a run of unknown
    residues (absent from the training split) into a single <unk>, shifting per-residue labels."""
    known = letter_ids(tok)
    return [[known[c] for c in s] for s in sequences]


# ---- cleaning, splitting, counting ----------------------------------------------------------------------------

def clean(row: Row, kind: str, seq_len: int) -> tuple[str, str, Any]:
    """(status, sequence, label) by the rules in the module docstring; label is a class string, a list of state
    ids (IGNORE where unresolved) for kind 'residue', or a float for kind 'value'."""
    seq, label, resolved, status = row
    if status:
        return status, "", None
    if not isinstance(seq, str):
        return "malformed", "", None
    seq = "".join(seq.split()).upper().removesuffix("*")  # "*": a translated ORF's stop, as `prepare --input`
    if not seq:
        return "empty", "", None
    if not set(seq) <= ALPHABET:
        return "malformed", "", None
    if kind == "residue":
        label, resolved = (x.strip() if isinstance(x, str) and len(x) != len(seq) else x for x in (label, resolved))
        if not isinstance(label, str) or len(label) != len(seq) or not set(label.upper()) <= DSSP_TO_3.keys():
            return "malformed", "", None
        if resolved is not None and (not isinstance(resolved, str) or len(resolved) != len(seq)
                                     or not set(resolved) <= {"0", "1"}):
            return "malformed", "", None
        label = [STATES.index(DSSP_TO_3[s]) if (resolved is None or r == "1") else IGNORE
                 for s, r in zip(label.upper(), resolved or "1" * len(seq))]
    else:
        label = _value(label) if kind == "value" else _class(label)
        if label is None:
            return "malformed", "", None
    if len(seq) > seq_len:
        return "truncated", seq[:seq_len], label[:seq_len] if kind == "residue" else label
    return "ok", seq, label


def _class(label) -> str | None:
    """A class label as a string ("1", "1.0" and 1 are the same class); None when missing ("NA" too, as for prices:
    it had become a class of its own)."""
    if label is None or isinstance(label, bool) or (isinstance(label, float) and math.isnan(label)):
        return None
    text = str(label).strip()
    if "\ufffd" in text or text in NA_STRINGS:  # undecodable bytes, a missing value
        return None
    try:
        number = float(text)
        return str(int(number)) if number.is_integer() else text
    except ValueError:
        return text or None


def fit(counts: dict[str, dict], kept: dict[str, list], seq_len: int) -> None:
    """Per-residue chains longer than seq_len, once duplicates and leaks are known on whole chains: cut for
    training ('truncated'), kept whole for evaluation ('whole'); counts move from 'ok' accordingly."""
    for split, rows in kept.items():
        c = counts[split]
        for i, (seq, label) in enumerate(rows):
            if len(seq) > seq_len:
                status = "truncated" if split == "train" else "whole"
                c["ok"], c[status] = c["ok"] - 1, c.get(status, 0) + 1
                if split == "train":
                    rows[i] = (seq[:seq_len], label[:seq_len])
        counts[split] = {k: v for k, v in c.items() if v}


def _value(label) -> float | None:
    """A regression target as a finite float; None when missing or not a number."""
    try:
        number = float(str(label).strip()) if label is not None and not isinstance(label, bool) else math.nan
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _numeric(label: str) -> float | None:
    try:
        return float(label)
    except ValueError:
        return None


def refuse_measurements(classes: list[str], source: str) -> None:
    """Classify's labels must be classes: numbers that are not whole, or very many of them, are measurements (judged
    on the numbers, so that a stray word among them does not hide it)."""
    numbers = [x for x in map(_numeric, classes) if x is not None]
    if numbers and len(numbers) >= 0.9 * len(classes) and \
            (any(not x.is_integer() for x in numbers) or len(classes) > MAX_CLASSES):
        raise ConfigError(f"{source}: the labels look like measurements ({len(classes)} distinct numbers, e.g. "
                          f"{', '.join(classes[:3])}), not classes: use protein.objective = 'regress'")


def carve(rows: list[tuple[str, str, Any]], fractions: dict[str, float], seed: int = SPLIT_SEED) -> list[str]:
    """The split of each cleaned row: distinct sequences drawn into `fractions`' splits (the rest to train),
    stratified by class label, so every copy of a sequence lands in the same split."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (status, seq, _) in enumerate(rows):
        groups[seq if status in KEPT else f"\0dropped{i}"].append(i)
    strata: dict[str, list[str]] = defaultdict(list)
    for key, members in groups.items():
        labels = {rows[i][2] if isinstance(rows[i][2], str) else "" for i in members}  # residue labels: one stratum
        strata[labels.pop() if len(labels) == 1 else "\0conflict"].append(key)
    rng, out = random.Random(seed), ["train"] * len(rows)
    for stratum in sorted(strata):
        keys = strata[stratum]
        rng.shuffle(keys)
        start = 0
        for split, frac in fractions.items():
            n = round(frac * len(keys))
            for key in keys[start:start + n]:
                for i in groups[key]:
                    out[i] = split
            start += n
    return out


def assign(cleaned: dict[str, list], cfg: RunConfig) -> dict[str, list]:
    """Every split's cleaned rows: a source without validation/test splits gives them by `carve`."""
    if "all" not in cleaned and {"validation", "test"} <= cleaned.keys():
        return cleaned
    source = cleaned.pop("all") if "all" in cleaned else cleaned.pop("train")
    fractions = {s: f for s, f in (("test", cfg.task.test_fraction), ("validation", cfg.data.val_fraction))
                 if s not in cleaned and f > 0}
    where = carve(source, fractions)
    out = {split: cleaned.get(split, []) for split in SPLITS}
    for split in ("train", *fractions):
        out[split] = out[split] + [r for r, s in zip(source, where) if s == split]
    return out


def deduplicate(splits: dict[str, list], kind: str) -> tuple[dict[str, dict], dict[str, list]]:
    """(counts, kept (sequence, label) pairs) per split: duplicates, conflicts and leaks dropped and counted."""
    counts, kept, seen = {}, {}, set()
    for split in SPLITS:
        rows, labels, values = splits.get(split, []), defaultdict(set), defaultdict(list)
        for status, seq, label in rows:
            if status in KEPT and kind == "class":
                labels[seq].add(label)
            if status in KEPT and kind == "value":
                values[seq].append(label)
        c, mine, here = Counter(), [], set()
        for status, seq, label in rows:
            if status in KEPT:
                if seq in seen:
                    status = "leak"
                elif len(labels[seq]) > 1:
                    status = "conflict"
                elif seq in here:
                    status = "duplicate"
                else:
                    here.add(seq)
                    mine.append((seq, sum(values[seq]) / len(values[seq]) if kind == "value" else label))
            c[status] += 1
        seen |= here
        counts[split], kept[split] = dict(c), mine
    return counts, kept


def build(tmp: Path, cfg: RunConfig) -> dict[str, Any]:
    """Read, clean, split and count the source; train the residue vocabulary on train; save every split."""
    kind, seq_len, by_site = label_kind(cfg), cfg.data.seq_len, cfg.task.sites == "varying"
    raw, info = read_source(cfg)
    whole = math.inf if kind == "residue" or by_site else seq_len  # per-residue chains: cut after leaks are found
    cleaned = assign({split: [clean(r, kind, whole) for r in rows] for split, rows in raw.items()}, cfg)
    counts, kept = deduplicate(cleaned, kind)
    if kind == "residue":
        fit(counts, kept, seq_len)
    if cfg.task.train_subsample:
        subsample(counts, kept, cfg.task.train_subsample, cfg.task.subsample_seed)
    if not kept["train"]:
        raise ConfigError(f"{cfg.data.path or 'the default data'}: no training sequence survived cleaning: "
                          f"{counts['train']}")
    sites = varying_sites(kept["train"], cfg.data.path) if by_site else None
    for split in ("validation", "test") if by_site else ():
        kept[split] = on_sites(kept[split], counts[split], sites)
    classes, values = [], {}
    if kind == "class":
        found = {label for rows in kept.values() for _, label in rows}
        classes = sorted(found, key=lambda x: (0, int(x), "") if x.lstrip("-").isdigit() else (1, 0, x))
        refuse_measurements(classes, cfg.data.path or "the default data")
    if kind == "value":
        train = [v for _, v in kept["train"]]
        mean = sum(train) / len(train)
        values = {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in train) / len(train)) or 1.0}
    tok = train_tokenizer((s for s, _ in kept["train"]), tmp / TOKENIZER, vocab_size=64, model_type="char",
                          user_symbols=USER_SYMBOLS)
    seen = {c for q, _ in kept["train"] for c in q}  # the residues the tokenizer learned: the others read as <unk>
    _say_unseen(cfg.data.path or "the default data", {split: kept[split] for split in SPLITS[1:]}, seen)
    for split in SPLITS:
        if kept[split]:  # `datasets` cannot load back a saved empty split; `load` makes one
            save_split(tmp, split, rows_of(tok, kept[split], kind, classes, sites))
    return {"counts": counts, "labels": kind, "classes": classes, "values": values, "vocab_size": tok.vocab_size,
            "sites": sites,
            "residues": {s: sum(len(q) for q, _ in kept[s]) for s in SPLITS}, **info}


def subsample(counts: dict[str, dict], kept: dict[str, list], n: int, seed: int) -> None:
    """Keep n of the training and validation rows together (protein.train_subsample), each in its own split."""
    pool = [(split, i) for split in ("train", "validation") for i in range(len(kept[split]))]
    if n > len(pool):
        raise ConfigError(f"protein.train_subsample = {n} is more than the {len(pool):,} training and validation rows "
                          f"that survived cleaning ({len(kept['train']):,} + {len(kept['validation']):,})")
    chosen = set(random.Random(seed).sample(pool, n))
    for split in ("train", "validation"):
        rows = kept[split]
        kept[split] = [r for i, r in enumerate(rows) if (split, i) in chosen]
        dropped = len(rows) - len(kept[split])
        if dropped:  # the draw takes kept rows: counted out of the kept statuses (ok first; rows keep no status)
            counts[split]["not_sampled"] = dropped
        for status in KEPT:
            take = min(dropped, counts[split].get(status, 0))
            counts[split][status], dropped = counts[split].get(status, 0) - take, dropped - take


def read_scoring(cfg: RunConfig, stored: Path, path: Path) -> tuple[Any, dict[str, int], list[Path]]:
    """New data for `harness evaluate --data` (`protein_sources.read_scored`), as a prepared test split: cleaned by
    the rules above as a test split is (duplicates dropped; no leak rule: the run keeps no training sequences), a
    class the run does not know counted as `unknown_class`, rows of a FLIP file outside its test set as `not_test`;
    residue ids from the run's stored vocabulary. Returns (rows, the count of every status, the files read)."""
    meta, tok = read_meta(stored), tokenizer(stored)
    kind, classes, sites = meta["labels"], meta["classes"], meta.get("sites")
    rows, others, files = read_scored(path, cfg)
    whole = math.inf if kind == "residue" or sites else cfg.data.seq_len
    read = [clean(r, kind, whole) for r in rows]
    if kind == "class":
        _check_classes(path, [label for st, _, label in read if st in KEPT], classes)
    cleaned = [("unknown_class", "", None) if st in KEPT and kind == "class" and label not in classes
               else (st, seq, label) for st, seq, label in read]
    counts, kept = deduplicate({"test": cleaned}, kind)
    if kind == "residue":
        fit(counts, kept, cfg.data.seq_len)
    if sites:
        kept["test"] = on_sites(kept["test"], counts["test"], sites)
    counts = {**counts["test"], **({"not_test": others} if others else {})}
    _say_unseen(f"--data {path}", {"data": kept["test"]}, {c for c, i in letter_ids(tok).items() if i != tok.unk_id})
    return rows_of(tok, kept["test"], kind, classes, sites), counts, files


def _say_unseen(where: str, splits: dict[str, list], seen: set[str]) -> None:
    """A note counting the residues of each split that read as <unk>: letters the training split never held."""
    unseen = {split: Counter(c for q, _ in rows for c in q if c not in seen) for split, rows in splits.items()}
    if any(unseen.values()):
        print(f"note: {where}: residues the training split never holds read as <unk>: "
              + "; ".join(f"{split} {sum(n.values()):,} ({', '.join(sorted(n))})" for split, n in unseen.items() if n),
              flush=True)


def _check_classes(path: Path, labels: list, classes: list) -> None:
    """New data for a classifier whose labels are mostly measurements (fractional numbers), not its classes: a
    regression set, refused rather than scored on the rows whose value happens to be a class's name ("0")."""
    unknown = [label for label in labels if label not in classes]
    fractional = [x for x in unknown if _fractional(x)]
    if labels and len(unknown) > len(labels) / 2 and fractional:
        raise ConfigError(f"--data {path}: its labels are measurements (e.g. {fractional[0]}), not this run's classes "
                          f"({', '.join(map(str, classes[:5]))}); score a regression data set with a run trained "
                          f"with protein.objective = \"regress\"")


def _fractional(x) -> bool:
    try:
        return not float(x).is_integer()
    except (TypeError, ValueError):  # a word: no measurement
        return False


def varying_sites(train: list[tuple[str, Any]], source: str) -> dict[str, Any]:
    """meta["sites"] of the kept training (sequence, label) pairs: {"length", "columns" (0-based), "reference"}."""
    lengths = sorted({len(q) for q, _ in train})
    if len(lengths) > 1:
        raise ConfigError(f"{source or 'the default data'}: protein.sites = 'varying' needs training sequences of "
                          f"one length (a mutational library); they have {len(lengths)} lengths, {lengths[0]} to "
                          f"{lengths[-1]} residues: use protein.sites = 'all'")
    columns = [j for j in range(lengths[0]) if len({q[j] for q, _ in train}) > 1]
    if not columns:
        raise ConfigError(f"{source or 'the default data'}: every training sequence is the same, so protein.sites = "
                          f"'varying' leaves no position to read: use protein.sites = 'all'")
    return {"length": lengths[0], "columns": columns, "reference": train[0][0]}


def on_sites(rows: list[tuple[str, Any]], counts: dict[str, int], sites: dict[str, Any]) -> list[tuple[str, Any]]:
    """The rows a model reading `sites` can score: other_length ones dropped, off_site ones counted (every row
    given was counted "ok": nothing is truncated with sites); `counts` is updated in place."""
    reference, columns = sites["reference"], set(sites["columns"])
    out = [(q, label) for q, label in rows if len(q) == sites["length"]]
    off = sum(any(a != b for j, (a, b) in enumerate(zip(q, reference)) if j not in columns) for q, _ in out)
    for status, n in (("other_length", len(rows) - len(out)), ("off_site", off)):
        if n:
            assert counts.get("ok", 0) >= n, counts
            counts["ok"], counts[status] = counts["ok"] - n, counts.get(status, 0) + n
    for status in [s for s, n in counts.items() if not n]:
        del counts[status]
    return out


def rows_of(tok: Tokenizer, kept: list[tuple[str, Any]], kind: str, classes: list[str],
            sites: dict[str, Any] | None = None):
    """Kept (sequence, label) pairs as a prepared split (the columns `load` documents); with `sites`, the ids are
    those of the residues at its columns only (the sequence stays whole)."""
    import datasets

    seqs = [q for q, _ in kept]
    residues = seqs if sites is None else ["".join(q[j] for j in sites["columns"]) for q in seqs]
    return datasets.Dataset.from_dict({
        "sequence": seqs, "ids": encode(tok, residues),
        "label": [classes.index(lab) if kind == "class" else -1 for _, lab in kept],
        "states": [lab if kind == "residue" else [] for _, lab in kept],
        "value": [lab if kind == "value" else math.nan for _, lab in kept]}, features=_features())
