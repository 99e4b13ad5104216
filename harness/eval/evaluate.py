"""`harness evaluate` and `harness translate`: a finished run's exported model, one process, a split or new data.

`eval.json` in the run directory keeps the latest result per split and per scored data set: {name: {metric: value}}
(a value that is not a number, e.g. Spearman's rho of constant predictions, as null).

`--split` scores a split of the data prepared from the run's `data.path`; where the run keeps its tokenizer and
statistics (`RUN/data/`, see `harness.prepare`), it refuses when the data prepared now has others (the training
data changed since the run). `--data PATH` reads new data with the task's `read` and the stored artefacts, never
re-fitted, and scores it with the same `evaluate`; each entry names the data, its sha256 (of the file; of a file
pair, the sha256 of their `sha256sum` lines) and the rows kept and skipped.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from ..config.run import ConfigError, RunConfig, closest, flatten
from ..distributed.world import single_world
from ..prepare import CHECKSUMS, META, STORED, differences, fingerprint, read_meta, sha256, stored
from ..run.export import check_finished, load_model, run_config, trained_on_note
from ..tasks.interface import check_metrics
from ..tasks import ReadData, get_task

RESULTS = "eval.json"
SPLITS = ("train", "validation", "test")  # names an entry for new data may not take
SCORED = ("validation", "test")  # the splits a finished run is scored on (`--split`, `harness.evaluate(split=)`)


def _task(run_dir: Path, reader: bool = False, periods: int | None = None, given=None,
          sets: list[str] | tuple = ()) -> tuple[RunConfig, object]:
    """The run's config, with `sets` of its scoring settings over it (`scoring_sets`), and its task (`given`: the
    object the caller passed, used as it is)."""
    check_finished(run_dir)
    if note := trained_on_note(run_dir):
        print(note, file=sys.stderr, flush=True)
    cfg = run_config(run_dir)
    task = given if given is not None else get_task(cfg.run.task)
    if reader and not callable(getattr(task, "read", None)):
        raise ConfigError(f"{run_dir}: task {cfg.run.task!r} has no reader (`read`, see the Task interface in "
                          f"harness/tasks/interface.py), so it cannot score new data; score a split with --split")
    reading = getattr(task, "reader_settings", {}) if reader else {}
    reading = reading if isinstance(reading, dict) else dict.fromkeys(reading)  # (a tuple: keys kept as the run's)
    # how the run read its own data is not how to read the new file (the lm's data.format): back to the reader's
    # value, unless `sets` give one
    resets = [f"{key}={json.dumps(value)}" for key, value in reading.items() if value is not None]
    cfg = _scored(run_dir, cfg, sets, tuple(reading), resets)
    if periods is not None:  # `--periods K`: rolling-origin periods, for this evaluation only
        if cfg.run.task != "prices":
            raise ConfigError(f"--periods {periods}: rolling-origin periods score price forecasts; {run_dir} is a "
                              f"{cfg.run.task!r} run")
        if periods < 1:
            raise ConfigError(f"--periods {periods}: must be >= 1 (1: the whole split, no periods)")
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, periods=periods))
    return cfg, task


def _scored(run_dir: Path, cfg: RunConfig, sets: list[str] | tuple, reading: tuple[str, ...] = (),
            resets: list[str] | tuple = ()) -> RunConfig:
    """The run's config with `resets` and then `sets` of its scoring settings over it (`scoring_sets`)."""
    if not sets and not resets:
        return cfg
    scoring_sets(cfg, sets, reading)
    return run_config(run_dir, [*resets, *sets])


def scoring_sets(cfg: RunConfig, sets: list[str] | tuple, reading: tuple[str, ...] = ()) -> None:
    """`--set` of `harness evaluate` and `translate` changes only how the trained model is scored or decoded (the
    task's settings declared `scoring`, e.g. translation.beam_size), and with --data how its reader reads the new
    data (`reading`: the task's `reader_settings`, e.g. the lm's data.format); anything else is what the run
    trained."""
    section = cfg.task_section
    allowed = [f"{section}.{f.name}" for f in dataclasses.fields(cfg.task) if f.metadata.get("scoring")] \
        if dataclasses.is_dataclass(cfg.task) else []
    allowed += list(reading)
    known = flatten(cfg.to_dict())
    for s in sets:
        key = s.partition("=")[0].strip()
        if key not in allowed:
            choice = f"this run's are {', '.join(allowed)}" if allowed else f"a {cfg.run.task!r} run has none"
            hint = f"did you mean {near}?" if (near := closest(key, allowed)) else "harness keys lists them"
            what = "is what the run trained with" if key in known else \
                f"is no setting of a {cfg.run.task!r} run ({hint})"
            raise ConfigError(f"--set {s}: evaluate and translate take only settings of how the trained model is "
                              f"scored{' or the new data read' * bool(reading)} ({choice}); {key or repr(s)} {what}")


def _model(run_dir: Path, task) -> torch.nn.Module:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return load_model(run_dir, task)[0].to(device)


def _record(run_dir: Path, entries: dict[str, dict]) -> None:
    """The entries added to RUN/eval.json, replacing those of their names; an entry of other data under the same name
    (a file of the same name elsewhere) is said. A run directory that cannot be written (a colleague's, read-only)
    keeps its eval.json, said: the scores are still given."""
    path = run_dir / RESULTS
    results = json.loads(path.read_text()) if path.is_file() else {}
    for key, entry in entries.items():
        before = results.get(key)
        other = before.get("data_sha256") != entry.get("data_sha256") if isinstance(before, dict) and \
            "data_sha256" in before else False  # (the same file named another way is the same data)
        if other and before.get("data") not in (None, entry.get("data")):
            print(f"note: {path}: the entry {key!r} held the scores of {before['data']}; now {entry['data']}'s "
                  f"(--name NAME keeps both)", file=sys.stderr, flush=True)
    results.update(entries)
    tmp = path.with_name(f".{RESULTS}.tmp")
    try:
        tmp.write_text(json.dumps(_strict(results), indent=2) + "\n")
        tmp.replace(path)
    except OSError as e:
        print(f"note: the scores are not recorded in {path}: {e.strerror or e}", file=sys.stderr, flush=True)


def _strict(value):
    """A metric that is not a number (Spearman's rho of constant predictions: NaN) as JSON's null: the file is JSON
    every reader takes (Python alone reads a bare NaN)."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    return None if isinstance(value, float) and not math.isfinite(value) else value


def evaluate_run(run_dir: str | Path, split: str | None, periods: int | None = None, task=None,
                 sets: list[str] | tuple = ()) -> dict[str, float | str]:
    return score_run(run_dir, split, periods, task, sets)[1]


def score_run(run_dir: str | Path, split: str | None, periods: int | None = None, task=None,
              sets: list[str] | tuple = ()) -> tuple[str, dict[str, float | str]]:
    """(the split scored, its metrics); `split` None (no --split given): the test split, or validation where the
    task builds none (the lm's), said."""
    defaulted, split = split is None, split or "test"
    if split not in SCORED:  # another name would score the test split and record it under that name
        raise ConfigError(f"split = {split!r}: a run is scored on {' or '.join(map(repr, SCORED))} (--split, split=)")
    run_dir = Path(run_dir)
    cfg, task = _task(run_dir, periods=periods, given=task, sets=sets)
    saved = stored(run_dir)
    if saved is not None and hasattr(task, "prepare"):
        now = task.prepare(cfg)
        changed = differences(saved, now)
        was = read_meta(saved).get("fingerprint")  # (a prepared directory's; not a protein corpus's shards)
        if was and not changed and (Path(now) / META).is_file() and was != fingerprint(Path(now)):
            print(f"note: the data prepared now from data.path ({cfg.data.path or 'the embedded default'}) is not what "
                  f"the run was trained with (the same tokenizer and statistics, other rows): the {split} split is "
                  f"scored as it is now", file=sys.stderr, flush=True)
        if changed:
            source = cfg.data.path or "the embedded default"
            raise ConfigError(f"{run_dir}: the data prepared now from data.path ({source}) differs from what the run "
                              f"was trained with ({saved}) in {', '.join(changed)}: the training data changed since "
                              f"the run; score a test file with `harness evaluate --run-dir {run_dir} --data PATH`, "
                              f"which uses the stored ones")
    model = _model(run_dir, task)
    world = single_world(next(model.parameters()).device)
    if hasattr(task, "evaluate"):
        metrics = task.evaluate(model, cfg, split, world)
        check_metrics(task, metrics, "evaluate(model, cfg, split, world)")
    else:  # the task's own figures from the mean loss, on the split its build_data gives
        data = task.build_data(cfg)
        samples = {"validation": data.val, "test": getattr(data, "test", None)}[split]
        if samples is None and defaulted:
            print(f"note: task {cfg.run.task!r} builds no test split: scoring the validation split (--split "
                  f"validation; new data: --data PATH)", file=sys.stderr, flush=True)
            split, samples = "validation", data.val
        if samples is None:
            raise ConfigError(f"{run_dir}: task {cfg.run.task!r} builds no test split (its build_data gives training "
                              f"and validation data): score --split validation, or new data with --data")
        _note_cap(run_dir, cfg, split, len(samples))
        metrics = loss_metrics(task, model, cfg, samples, world)
    _record(run_dir, {split: metrics})
    return split, metrics


def _note_cap(run_dir: Path, cfg: RunConfig, split: str, n: int) -> None:
    """A line where the run's evaluations in training read part of the split (train.eval_batches): this scores all
    of it, so its figures differ from eval.jsonl's and best.json's."""
    try:
        batch = json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    read = cfg.train.eval_batches * batch if isinstance(batch, int) else 0
    if split == "validation" and 0 < read < n:
        print(f"note: the run's evaluations in training read {read:,} of the {n:,} validation samples "
              f"(train.eval_batches = {cfg.train.eval_batches} global batches of {batch}); this scores all of them, "
              f"so its figures differ from eval.jsonl's and best.json's", file=sys.stderr, flush=True)


def loss_metrics(task, model, cfg: RunConfig, samples, world) -> dict[str, float]:
    """For a task without a field evaluation of its own (`evaluate`): the mean loss over every sample and the task's
    `metrics(mean loss)`, as the training loop's validation reports them (`run.loop.loss_sum`), and how many items
    they count."""
    from ..run.loop import loss_sum

    total, count = loss_sum(model, task, samples, world, cfg.train.micro_batch_size, desc="scoring")
    if not count:
        raise ConfigError(f"nothing to score: the data holds no {getattr(task, 'items', 'items')}")
    return {**task.metrics(total / count), "loss": total / count, getattr(task, "items", "items"): float(count)}


def evaluate_data(run_dir: str | Path, path: str | Path, name: str | None = None, periods: int | None = None,
                  task=None, sets: list[str] | tuple = ()) -> dict[str, dict[str, float | str]]:
    """`harness evaluate --data PATH [--name NAME]`: {entry name: metrics} for each data set PATH holds (a directory
    may hold several: NAME/part), read with the run's stored tokenizer and statistics; also written to eval.json."""
    run_dir, path = Path(run_dir), Path(path)
    cfg, task = _task(run_dir, reader=True, periods=periods, given=task, sets=sets)
    saved = stored(run_dir)
    if saved is None and hasattr(task, "store"):
        raise ConfigError(f"{run_dir}: holds no stored tokenizer and statistics ({STORED}/{CHECKSUMS}), which "
                          f"reading new data needs; it was trained before runs kept them: train it again")
    base = name or (path.name if path.name not in SPLITS else f"{path.parent.name}/{path.name}")
    if base in SPLITS:
        raise ConfigError(f"--name {base}: the name of a split; name the data otherwise")
    if hasattr(task, "prepared"):  # the model and the reader take vocabulary and statistics from RUN/data/ only
        task.prepared = saved
    import datasets

    datasets.disable_progress_bars()  # the report counts the rows kept and skipped
    parts = task.read(cfg, path, saved)
    parts = parts if isinstance(parts, list) else [parts]
    model = _model(run_dir, task)
    world = single_world(next(model.parameters()).device)
    results = {}
    for part in parts:
        key = f"{base}/{part.part}" if part.part else base
        kept, skipped, noted = _rows(part)
        if not kept:
            raise ConfigError(f"{path}: no row to score survived cleaning ({_counts(part.counts)})")
        if hasattr(task, "evaluate"):
            metrics = task.evaluate(model, cfg, key, world, data=part.data)
            check_metrics(task, metrics, "evaluate(model, cfg, split, world, data)")
        else:
            metrics = loss_metrics(task, model, cfg, part.data, world)
        results[key] = {"data": ", ".join(map(str, part.files)), "data_sha256": checksum(part.files), **metrics,
                        "rows_kept": kept, "rows_skipped": sum(skipped.values()),
                        **({"skipped": _counts(skipped)} if skipped else {}),
                        **({"kept_as": _counts(noted)} if noted else {})}  # e.g. truncated, off_site
    _record(run_dir, results)
    return results


def _rows(part: ReadData) -> tuple[int, dict[str, int], dict[str, int]]:
    """(rows kept, the skipped rows by status, the kept rows by status other than ok)."""
    kept = sum(n for status, n in part.counts.items() if status in part.kept)
    return kept, {status: n for status, n in part.counts.items() if status not in part.kept and n}, \
        {status: n for status, n in part.counts.items() if status in part.kept and status != "ok" and n}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{status} {n:,}" for status, n in sorted(counts.items())) or "no rows"


def checksum(files: list[Path]) -> str:
    """The sha256 of one file; of several, the sha256 of their `sha256sum` lines ("DIGEST  NAME\\n"), in order."""
    if len(files) == 1:
        return sha256(files[0])
    return hashlib.sha256("".join(f"{sha256(f)}  {f.name}\n" for f in files).encode()).hexdigest()


def translate(run_dir: str | Path, sentences: list[str], sets: list[str] | tuple = ()) -> Iterator[str]:
    """The translations of `sentences`, in their order, each batch's as it is decoded (the input is checked first)."""
    sentences = list(sentences)
    if not sentences:
        raise ConfigError("nothing to translate: give the sentences as arguments, or one per line on standard input")
    blank = [i for i, s in enumerate(sentences, 1) if not s.strip()]
    if blank:
        raise ConfigError(f"sentence {blank[0]} of {len(sentences)} is empty: there is nothing to translate in it")
    for i, s in enumerate(sentences, 1):
        if bad := undecodable(s):
            raise ConfigError(f"sentence {i} of {len(sentences)}: {bad}")
    run_dir = Path(run_dir)
    cfg, task = _task(run_dir)
    if not hasattr(task, "translate"):
        raise ConfigError(f"{run_dir}: run.task is {cfg.run.task!r}; `harness translate` needs a translation run")
    cfg = _scored(run_dir, cfg, sets)
    task.prepared = stored(run_dir)  # the run's own tokenizer, where it keeps one
    return task.translate(_model(run_dir, task), cfg, sentences)


def undecodable(text: str) -> str | None:
    """What is wrong with text read from bytes that were not UTF-8 (Python keeps them as lone surrogates: command-line
    arguments, and standard input in some locales), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) & 0xFF
        return (f"not UTF-8 (byte 0x{byte:02x} at character {e.start + 1}); convert the text first, e.g. iconv -f "
                f"latin1 -t utf-8")


def _number(v: float) -> str:
    """Counts as integers; other figures to 6 significant digits, enough to tell close ones apart."""
    return f"{int(v):,}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:.6g}"


def render_table(split: str, metrics: dict[str, float | str]) -> str:
    """Numbers first, in a two-column table; signatures and other strings below it."""
    numbers = {k: v for k, v in metrics.items() if not isinstance(v, str)}
    width, column = max([len("metric"), *(len(k) for k in numbers)]), max(12, len(split))
    lines = [f"| {'metric':{width}} | {split:>{column}} |", f"|{'-' * (width + 2)}|{'-' * (column + 2)}|"]
    lines += [f"| {k:{width}} | {_number(v):>{column}} |" for k, v in numbers.items()]
    lines += [f"{k}: {v}" for k, v in metrics.items() if isinstance(v, str)]
    return "\n".join(lines)
