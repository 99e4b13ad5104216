"""The consolidated model: one ordinary safetensors file of full fp32 weights, whatever the strategy.

Under ZeRO-3 each rank holds a shard and the module's parameters are empty placeholders; saving
`engine.module.state_dict()` there writes empty tensors. Under tensor parallelism each rank holds a slice of
the split layers, under pipeline parallelism only its stage. `parallel.full_state_dict` gathers each
parameter's full fp32 (master) value under the plain model's name instead. Under mixed precision that is the
optimizer's fp32 master copy, not the 16-bit weights.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from torch import nn

from ..config.run import ConfigError, RunConfig, TrainingStopped, one_line, read_toml
from ..distributed.world import World, all_gather_objects
from ..tasks import resolve
from ..tasks.registry import moved_plugin
from .trust import TRUST, check_run_dir

MODEL_FILE = "model.safetensors"


FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a disk or quota full, a file past its limit
HF_DIR = "hf"  # beside model.safetensors for a Hugging Face model: what from_pretrained loads


def export_model(engine, run_dir: Path, world: World, task=None, cfg: RunConfig | None = None,
                 step: int | None = None, weights_step: int | None = None) -> Path | None:
    """Collective: every rank calls it; rank 0 writes `RUN/model.safetensors` atomically (in its metadata `step`, the
    step the run had reached, and `weights_step`, the step whose weights these are: the best's with
    train.select_best), and for a Hugging Face model `RUN/hf/` (config, weights, tokenizer: `from_pretrained` loads it
    with no code of ours). A write that fails (a full disk) raises TrainingStopped on every rank."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from ..distributed.parallel import full_state_dict
    from ..models import hf

    state = full_state_dict(engine, world)
    path, failed = run_dir / MODEL_FILE, None
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if world.is_main:
            steps = {"step": str(step), "weights_step": str(weights_step or step)} if step else {}
            save_file(_unshared(state), str(tmp), metadata={"format": "pt", **steps})
            readable(tmp)
            os.replace(tmp, path)
            if hf.is_hf(engine.module):
                hf.save(engine.module, state, _tokenizer(task, cfg), run_dir / HF_DIR, _generation(task, cfg))
                for f in (run_dir / HF_DIR).rglob("*"):
                    readable(f)
    except (OSError, RuntimeError, SafetensorError) as e:
        tmp.unlink(missing_ok=True)
        full = getattr(e, "errno", None) in FULL or any(os.strerror(n) in str(e) for n in FULL)  # (safetensors'
        # own error holds the OS's words alone)
        failed = (f"{type(e).__name__}: {one_line(e)}", full)
    failed = all_gather_objects(failed)[0]  # every rank stops, not only the one that wrote
    if failed:
        why, full = failed  # (any other error had been said to be a full disk, with advice to make room)
        fix = f"{shutil.disk_usage(run_dir).free / 2**30:.2f} GiB free there. The last checkpoint is kept: make room " \
            f"and run" if full else "The last checkpoint is kept: once that is put right, run"
        raise TrainingStopped(f"the model could not be exported to {run_dir} ({why}); {fix} the same command with "
                              f"--resume auto, which exports it")
    return path if world.is_main else None


def readable(path: Path) -> None:
    """The permissions the user's umask gives any new file: safetensors writes its files 0600, which colleagues on
    a shared file system cannot read (every other file of a run is created as the umask says)."""
    if path.is_file():
        mask = os.umask(0)
        os.umask(mask)
        path.chmod(0o666 & ~mask)


def _unshared(state: dict) -> dict:
    """Tied weights (e.g. T5's embeddings and output layer) share one storage, which safetensors refuses: each name
    gets its own copy, so the file loads into the model by every name it has."""
    seen, out = set(), {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    return out


def check_finished(run_dir: Path) -> None:
    """A finished run directory: its config and exported weights, one line naming what is missing."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: {'a file, not a' if run_dir.exists() else 'no such'} run directory")
    for name in ("config.toml", MODEL_FILE):
        if not (run_dir / name).is_file():
            raise ConfigError(f"{run_dir}: no {name}; is it a finished run directory? (an unfinished run can be "
                              f"continued with `harness train ... --resume auto`)")


def trained_on_note(run_dir: Path) -> str | None:
    """A line where the run has trained on since its export (resumed for more steps and stopped before their end):
    the weights scored are not the run's last."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(run_dir / MODEL_FILE), framework="pt") as f:
            meta = f.metadata() or {}
        exported, weights = int(meta.get("step", 0)), int(meta.get("weights_step", meta.get("step", 0)))
        latest = int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    except (OSError, ValueError, SafetensorError):  # no checkpoint, a damaged export (loading it says so)
        return None
    if not exported or latest <= exported:
        return None
    return (f"note: {run_dir / MODEL_FILE} is the export of step {exported}; the run has trained to step {latest} "
            f"since and not finished: these are step {weights}'s weights (`harness train ... --resume auto` "
            f"finishes it and exports again)")


def run_config(run_dir: str | Path, sets: list[str] | tuple = ()) -> RunConfig:
    """A run directory's resolved config (with `sets` over it, checked as --set is); a Hugging Face model named by the
    run's own `hf/` export, so its original source need not exist any more."""
    from dataclasses import replace

    run_dir = Path(run_dir)
    raw = read_toml(run_dir / "config.toml")
    check_run_dir(run_dir, raw)  # before resolving imports the task it names
    moved = moved_plugin(raw.get("run", {}).get("task", ""), TRUST.get().task)  # the plug-in where it is now
    cfg = resolve(str(run_dir / "config.toml"), [*[f"run.task={json.dumps(moved)}"] * bool(moved), *sets]).cfg
    if cfg.model.hf and (run_dir / HF_DIR / "config.json").is_file():
        cfg = replace(cfg, model=replace(cfg.model, hf=str(run_dir / HF_DIR)))
    return cfg


def load_model(run_dir: str | Path, task=None) -> tuple[nn.Module, RunConfig]:
    """Rebuild the task's model from a run directory and load the exported weights, on one process. A task that
    prepares data builds it from the run's stored artefacts (`RUN/data/`: vocabulary, classes) where the run has them,
    so the training data need not exist any more either; a `task` given is used as it is."""
    from safetensors.torch import load_file

    from ..prepare import stored
    from ..tasks import get_task

    from safetensors import SafetensorError

    check_finished(Path(run_dir))
    cfg = run_config(run_dir)
    if task is None:
        task = get_task(cfg.run.task)
        if hasattr(task, "prepared"):
            task.prepared = stored(Path(run_dir))
    model = task.build_model(cfg)
    try:
        state, mine = load_file(str(Path(run_dir) / MODEL_FILE)), model.state_dict()
    except SafetensorError as e:
        raise ConfigError(f"{Path(run_dir) / MODEL_FILE}: not a whole safetensors file ({e}); remove it, and "
                          f"`harness train ... --resume auto` exports the run's last checkpoint again") from None
    only_run, only_model, differ = misfit({k: v.shape for k, v in state.items()}, model)
    if only_run or only_model:
        raise ConfigError(f"{run_dir}: its weights do not fit the model this version of the harness builds from its "
                          f"config (only in the run: {', '.join(only_run[:4]) or 'none'}; only in the model: "
                          f"{', '.join(only_model[:4]) or 'none'}): it was trained by another version; train it again")
    differ = [f"{k} {tuple(state[k].shape)} vs {tuple(mine[k].shape)}" for k in differ]
    if differ:  # e.g. its config.toml edited after training
        raise ConfigError(f"{run_dir}: its weights' shapes differ from the model its config.toml builds ("
                          f"{'; '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}): was config.toml changed?")
    model.load_state_dict(state, strict=False)  # (the keys checked above; the rest name the same modules again)
    return model.eval(), cfg


def misfit(shapes: dict, model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """How weights (name -> shape, as an export holds them) fail to fit `model`: the names only they hold, those only
    the model holds (a module used twice is exported once, under its first name) and those of other shapes."""
    from ..distributed.parallel import state_names

    expected, mine = state_names(model), model.state_dict()
    return (sorted(shapes.keys() - expected), sorted(expected - shapes.keys()),
            [k for k in sorted(shapes.keys() & expected) if tuple(shapes[k]) != tuple(mine[k].shape)])


def exported_shapes(path: Path) -> tuple[dict[str, tuple], int]:
    """An export's weights by name and shape, read from its header alone, and the step they are of (0: not said)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{path}: not a whole safetensors file ({one_line(e)})") from None
    return shapes, int(meta.get("weights_step", meta.get("step", 0)) or 0)


def start_weights(run_dir: Path, model: nn.Module) -> int:
    """The step of model.init_from's export, checked to fit `model` (the run's meta-device twin) as it was before
    launch: the file may have been replaced or removed since."""
    path = run_dir / MODEL_FILE
    try:
        shapes, step = exported_shapes(path)
    except ConfigError as e:
        raise ConfigError(f"model.init_from = {str(run_dir)!r}: {path} is gone or changed since the start: {e}") \
            from None
    if any(misfit(shapes, model)):
        raise ConfigError(f"model.init_from = {str(run_dir)!r}: {path} changed since the start: its weights no longer "
                          f"fit this run's model")
    return step


def export_hf(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """`harness export --run-dir R --hf OUT`: a finished run's model as a Hugging Face directory. A directory that
    holds files is refused (an earlier export's tokenizer files would stay beside the new ones and change what
    from_pretrained loads), or with `overwrite` emptied first where it is a Hugging Face model's (its config.json)."""
    from ..models import hf
    from ..tasks import get_task

    out = Path(out)
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError(f"--hf {out}: {blocked} is a file; name a directory to write")
    if out.resolve() == (Path(run_dir) / HF_DIR).resolve():
        raise ConfigError(f"--hf {out}: the run's own export, which the run reads its model's config and tokenizer "
                          f"from; it is already this model: name another directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not (overwrite and (out / "config.json").is_file()):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ConfigError(f"--hf {out}: holds {shown}; " + (
            "--overwrite replaces a Hugging Face model's directory (config.json) only: it was left as it is"
            if overwrite else "files of an earlier export would stay beside the new ones: name a new or empty "
                              "directory, or replace it with --overwrite"))
    model, cfg = load_model(run_dir)
    if not hf.is_hf(model):
        raise ConfigError(f"{run_dir}: its model ({type(model).__name__}) is the harness's own, not a Hugging Face "
                          f"model; its weights are {Path(run_dir) / MODEL_FILE} (harness.load_model reads them). A "
                          f"run exports to Hugging Face when it trains one: model.hf names a transformers model or "
                          f"config (docs/plugins-and-api.md, e.g. examples/byte_llama.py)")
    if note := trained_on_note(Path(run_dir)):
        print(note, flush=True)
    task = get_task(cfg.run.task)
    tokenizer = _tokenizer(task, cfg)  # read before OUT is emptied: it may be where it is read from
    for old in out.iterdir() if held else ():  # emptied, not replaced: OUT may be a link, a mount, the cwd
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    return hf.save(model, model.state_dict(), tokenizer, out, _generation(task, cfg))


def _generation(task, cfg: RunConfig | None) -> dict | None:
    """How the task decodes with the run's settings, for the export's generation_config (None: the source's)."""
    return task.generation_defaults(cfg) if cfg is not None and hasattr(task, "generation_defaults") else None


def _tokenizer(task, cfg: RunConfig):
    """The task's tokenizer for a Hugging Face export (None where the task has none)."""
    return task.tokenizer(cfg) if hasattr(task, "tokenizer") else None
