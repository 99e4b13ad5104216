"""What a run continues from, checked before anything is loaded or written: the checkpoint --resume names
(`resume_checkpoint`) resumes only into the model and the optimizer it was saved from (`check_same_model`,
`check_same_optimizer`) and onto the data it trained on (`data_identity`, `check_data_unchanged`); model.init_from's
export fits this run's model and tokenizer (`check_init_from`). The checkpoints themselves are `checkpoint.py`'s
(their folder and records `resume.py`'s), the export `export.py`'s.
"""
from __future__ import annotations

from pathlib import Path

from ..config.run import ConfigError, flatten, read_toml
from ..plan.resolve import Plan
from ..prepare import META, fingerprint
from ..tasks.registry import moved_plugin


# Settings of the built-in models that give another function of the same parameters: a checkpoint resumed across
# a change of one loaded, and its weights trained on as other heads
REGROUPING = ("model.n_heads",)


def check_same_model(plan: Plan, found: Path) -> None:
    """A checkpoint resumes only into the model it was saved from: the saving run's config (RUN/config.toml beside
    RUN/checkpoints/) and this one build models compared by parameter name and shape on the meta device, before
    anything is loaded or written. Refused in one line naming the settings that differ."""
    import torch

    from . import resume
    from .export import run_config
    from .trust import TRUST, trusting

    source = found.parent.parent
    if found.parent.name != "checkpoints" or not (source / "config.toml").is_file():
        return  # a checkpoint without its run's config: DeepSpeed's load is the check
    ours, raw = plan.run.cfg, read_toml(source / "config.toml")
    saved_task = raw.get("run", {}).get("task")
    if saved_task != ours.run.task and not moved_plugin(saved_task, ours.run.task):  # (the project moved: the same)
        raise ConfigError(f"--resume {found}: saved by a {saved_task!r} run, but {plan.run.describe('run.task')}")
    # the task is this run's own (the user named it), and remote model code only where this run trusts it too
    now = TRUST.get()
    with trusting(checkpoint=now.checkpoint, task=ours.run.task, run_dir=now.run_dir or (
            ours.model.trust_remote_code and raw.get("model", {}).get("trust_remote_code") is True)):
        theirs = run_config(source)
    with torch.device("meta"):
        shapes = [{n: list(p.shape) for n, p in plan.task.build_model(c).named_parameters()} for c in (theirs, ours)]
    saved = resume.saved_shapes(found)
    old, new = flatten(theirs.to_dict()), flatten(ours.to_dict())
    built_in = type(plan.task).__module__.startswith("harness.tasks.")  # (a plug-in's model may not read n_heads)
    regrouped = [k for k in REGROUPING if built_in and not ours.model.hf and old.get(k) != new.get(k)]
    if shapes[0] == shapes[1] and saved in (None, shapes[1]) and not regrouped:
        return
    shaping = ("model.", f"{ours.task_section}.", "data.seq_len", "data.path", "data.vocab")
    keys = [f"{k} {old.get(k)!r} there, {new[k]!r} here ({plan.run.source.get(k, 'default')})" for k in new
            if k.startswith(shaping) and old.get(k) != new[k]]
    if shapes[0] == shapes[1] and not regrouped:  # the same settings build another model: its code changed since
        shapes[0], keys = saved, [f"the model's code ({type(plan.task).__name__}), or the data or config.json it is "
                                  f"built from, changed since it was saved"]
    differ = [f"{n} {shapes[0].get(n)} -> {shapes[1].get(n)}" for n in sorted(shapes[0].keys() | shapes[1].keys())
              if shapes[0].get(n) != shapes[1].get(n)]
    params = f"parameters {', '.join(differ[:3])}{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}" \
        if differ else "the same parameters, read as other heads"
    raise ConfigError(f"--resume {found}: its model is not this run's ({'; '.join(keys) or 'the data it was built for'}"
                      f"; {params}): resume with the settings and code it was saved with, or start a new run "
                      f"(--overwrite, or another run.output_dir)")


def check_same_optimizer(plan: Plan, found: Path) -> None:
    """A checkpoint's optimizer state loads only into the optimizer that saved it (its groups' settings and state by
    name: another one had stopped at its first step, e.g. KeyError 'momentum' for SGD after AdamW). Refused in one
    line; a checkpoint saved before layout.json named its optimizer is left to DeepSpeed's load."""
    from .resume import saved_layout

    saved, ds = (saved_layout(found) or {}).get("optimizer"), plan.ds
    if not isinstance(saved, str) or saved.lower() == ds.optimizer_kind.lower():
        return
    where = f"DeepSpeed's optimizer section, {ds.origin}" if ds.sections.optimizer else \
        plan.run.describe("optimizer.name")
    raise ConfigError(f"--resume {found}: holds the state of {saved}; this run's optimizer is {ds.optimizer_kind}, "
                      f"from {where}, which cannot take it up. Resume with the optimizer it was saved with, or start a "
                      f"new run with this one from its exported weights (a run exports as it finishes): "
                      f"model.init_from = its run directory, with another run.output_dir")


def check_history(plan: Plan, found: Path) -> None:
    """Another run's checkpoint resumes into a run directory whose records, if any, all come after it (a requeued
    job that started from it and saved nothing yet: they are dropped past its step anyway); records at or before
    its step are another run's history, which had been kept and the resumed run's added to it (one run's curves over
    two runs' steps). Refused in one line. (A directory with checkpoints of its own goes on from them:
    `resume_checkpoint`.)"""
    from .resume import is_own, step_of
    from .tracking import read_jsonl

    run_dir = plan.run_dir
    if is_own(found, run_dir):
        return
    step = step_of(found)
    held = [name for name in ("metrics.jsonl", "eval.jsonl")
            if any(isinstance(r.get("step"), int) and r["step"] <= step for r in read_jsonl(run_dir / name))]
    if held:
        raise ConfigError(f"--resume {found}: another run's checkpoint, into {run_dir}, whose records "
                          f"({', '.join(held)}) hold steps up to {step} of a run of its own: the two runs' records "
                          f"would mix; to go on from {found.name}, name a new run.output_dir")


def data_identity(plan: Plan) -> dict | None:
    """What a checkpoint records of the data, so that a resume on other data is refused: a prepared corpus's path and
    fingerprint (the task's `data_identity`), else the content of the directory its `prepare` gives (a case study's
    rows and tokenizer); None for data read as it is."""
    task, cfg = plan.task, plan.run.cfg
    found = task.data_identity(cfg) if hasattr(task, "data_identity") else None
    prepared = _prepared(plan) if found is None else None
    if prepared is not None:
        found = {"path": cfg.data.path or "the embedded default", "fingerprint": fingerprint(prepared)}
    return found


def _prepared(plan: Plan) -> Path | None:
    """The prepared directory (with meta.json) the task's `prepare` gives; None where it has none (a plug-in's
    `prepare` may give anything)."""
    now = plan.task.prepare(plan.run.cfg) if hasattr(plan.task, "prepare") else None
    return Path(now) if isinstance(now, (str, Path)) and (Path(now) / META).is_file() else None


def _stored_changes(plan: Plan, run_dir: Path) -> tuple[Path | None, list[str]]:
    """The artefacts run `run_dir` stored (RUN/data/: tokenizer, statistics) and what differs in those this run's data
    is prepared with now (`prepare.differences`); (None, []) where either has none."""
    from ..prepare import differences, stored

    kept = stored(run_dir)
    now = _prepared(plan) if kept is not None else None
    return kept, differences(kept, now) if now is not None else []


def check_data_unchanged(plan: Plan, found: Path, changed_ok: bool) -> None:
    """Before a resume: the data prepared now is what checkpoint `found` trained on (its `data.json`). A checkpoint
    saved before checkpoints recorded their data: the tokenizer and statistics its run stored (RUN/data/) against
    those prepared now, so a resume onto a new tokenizer whose ids mean other pieces is refused too (preparation
    rules and draws change between versions)."""
    from . import resume

    if resume.saved_data(found) is not None:
        resume.check_same_data(found, data_identity(plan), changed_ok, lambda: _data_settings_changed(plan, found))
        return
    kept, changed = _stored_changes(plan, found.parent.parent)  # the checkpoint's own run's
    if changed and not changed_ok:
        raise ConfigError(f"--resume {found}: the data prepared now differs from what its run trained with (kept in "
                          f"{kept}) in {', '.join(changed)}: the ids its model learned would mean other pieces; pass "
                          f"--data-changed-ok to resume on the new data anyway")


def _data_settings_changed(plan: Plan, found: Path) -> str:
    """The data settings of checkpoint `found`'s run (its config.toml, as its latest start wrote it) that differ now,
    for a refusal whose digests alone do not say what changed; "" where none or none can be read."""
    if found.parent.name != "checkpoints":  # a checkpoint folder on its own: no run's config beside it
        return ""
    try:
        old = flatten(read_toml(found.parent.parent / "config.toml"))
    except (OSError, ValueError, ConfigError):
        return ""
    new = flatten(plan.run.cfg.to_dict())
    keys = [f"{k} {old[k]!r} there, {new[k]!r} here" for k in new if k.startswith("data.") and k in old
            and old[k] != new[k]]
    return f" (the data settings that differ: {'; '.join(keys)})" if keys else ""


def check_init_from(plan: Plan, say: bool) -> None:
    """model.init_from, before a run's first step: a run of this task that exported its weights, which fit this run's
    model (`_check_fits`), with the tokenizer this run's data is prepared with where the task keeps one (an
    embedding's rows mean its tokenizer's pieces). Its layout is not compared: the export is whole, under the plain
    model's names, whatever the run was split into."""
    from .export import MODEL_FILE, trained_on_note

    cfg, key = plan.run.cfg, plan.run.describe("model.init_from")
    source = Path(cfg.model.init_from)
    if source.resolve() == plan.run_dir.resolve():
        raise ConfigError(f"{key} is this run's own directory, whose files a new run replaces: name another "
                          f"run.output_dir, or continue that run with --resume auto")
    if not source.is_dir():
        raise ConfigError(f"{key}: {'a file, not a' if source.exists() else 'no such'} run directory")
    if not (source / "config.toml").is_file():
        raise ConfigError(f"{key}: not a run directory (it holds no config.toml): name a finished run's "
                          f"run.output_dir")
    if not (source / MODEL_FILE).is_file():
        raise ConfigError(f"{key}: that run has not exported its weights (no {MODEL_FILE}; a run exports them as it "
                          f"finishes): finish it on its own layout, `--resume auto` with --set train.max_steps=N for a "
                          f"step N it has saved to end it there")
    raw = read_toml(source / "config.toml")  # read, not resolved: resolving imports the task it names
    task = raw.get("run", {}).get("task", "lm")
    if task != cfg.run.task and not moved_plugin(task, cfg.run.task):
        raise ConfigError(f"{key}: a run of task {task!r}, but {plan.run.describe('run.task')}")
    _check_fits(plan, key, source, raw)
    kept, changed = _stored_changes(plan, source)
    changed = [n for n in changed if not n.startswith(f"{META} ")]  # its statistics may differ: new data
    if changed:
        raise ConfigError(f"{key}: its tokenizer ({', '.join(changed)} in {kept}) is not the one this run's data is "
                          f"prepared with: the ids its model learned would mean other pieces")
    if say and (note := trained_on_note(source)):
        print(note, flush=True)


def _check_fits(plan: Plan, key: str, source: Path, raw: dict) -> None:
    """model.init_from's export fits this run's model by name and shape (on the meta device: nothing loaded), and
    a built-in model reads it with the heads it was trained with."""
    from ..plan.render import meta_model
    from .export import MODEL_FILE, exported_shapes, misfit

    cfg = plan.run.cfg
    shapes, _ = exported_shapes(source / MODEL_FILE)
    only_there, only_here, differ = misfit(shapes, model := meta_model(plan))
    old, new = flatten(raw), flatten(cfg.to_dict())
    settings = [f"{k} {old[k]!r} there, {new[k]!r} here" for k in new if k in old and old[k] != new[k] and (
        k.startswith("model.") and k not in ("model.init_from", "model.dropout", "model.zero_init")
        or k == "data.seq_len")]
    built_in = type(plan.task).__module__.startswith("harness.tasks.")  # (a plug-in's model may not read n_heads)
    regrouped = [k for k in REGROUPING if built_in and old.get(k, new[k]) != new[k]]
    if not (only_there or only_here or differ or regrouped):
        return
    mine, task_keys = model.state_dict(), [f"{k} {old[k]!r} there, {new[k]!r} here" for k in new
                                           if k.startswith(f"{cfg.task_section}.") and k in old and old[k] != new[k]]
    named = [*settings, *(f"{k} {list(shapes[k])} there, {list(mine[k].shape)} here" for k in differ),
             *(f"{k} only there" for k in only_there), *(f"{k} only here" for k in only_here), *task_keys]
    what = "its weights do not fit this run's model" if only_there or only_here or differ else \
        "its weights would be read as other heads"
    raise ConfigError(f"{key}: {what} ({'; '.join(named[:3])}{f' and {len(named) - 3} more' if len(named) > 3 else ''}"
                      f"): start from a run of the same model settings")


def resume_checkpoint(resume: str, run_dir: Path, say: bool) -> Path | None:
    """The checkpoint --resume names: `auto`'s (None where the run saved none yet: it starts from step 0), or the
    latest of a run directory or its checkpoints/ folder, or a step_* checkpoint given."""
    from .resume import is_complete, is_own, latest, resume_target

    if resume == "auto":
        found = resume_target(run_dir / "checkpoints", say)
        if found is None and say:  # (a mistyped run.output_dir had started a new run without a word)
            why = f"{run_dir} holds no checkpoint (its run stopped before it saved one)" if \
                (run_dir / "metrics.jsonl").is_file() else f"no run in {run_dir} yet" + \
                ("" if run_dir.exists() else " (it does not exist)")
            print(f"note: --resume auto: {why}; starting from step 0", flush=True)
        return found
    path = Path(resume)
    found = latest(path / "checkpoints") or latest(path) or (
        path if path.is_dir() and is_complete(path) else None)
    if found is None:
        raise ConfigError(f"--resume {resume}: no checkpoint there (expected a run directory, its checkpoints/ "
                          f"folder, or a step_* checkpoint)")
    if not is_own(found, run_dir) and (mine := latest(run_dir / "checkpoints")) is not None:
        # a job started from another run's checkpoint, requeued with the same command (torchtitan's
        # checkpoint.initial_load_path is read only where the run has no checkpoint of its own)
        if say:
            print(f"note: --resume {resume}: {run_dir} holds checkpoints of its own (latest {mine.name}), saved since "
                  f"it started from there: going on from them (another run.output_dir starts from {found.name} again)",
                  flush=True)
        return mine
    return found
