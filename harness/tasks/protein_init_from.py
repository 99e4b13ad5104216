"""`protein.init_from = RUN_DIR`: the built-in model started from another protein run's exported weights (e.g. an mlm
run). Parameters are taken by name and shape (embedding rows matched by residue, position rows up to the shorter
length); the others, e.g. a new head, keep their fresh initialisation (`init_from`; rank 0 prints which were loaded).
"""
from __future__ import annotations

from pathlib import Path

from ..config.run import ConfigError, RunConfig, read_toml
from ..models.encoder import Encoder
from ..prepare import protein as prep
from .registry import resolve


def source_config(run_dir: Path) -> RunConfig:
    """protein.init_from's run config, checked to be a protein run before it is resolved (resolving imports the task
    it names: a run directory from elsewhere must not run code)."""
    task = read_toml(run_dir / "config.toml").get("run", {}).get("task", "lm")
    if task != "protein":
        raise ConfigError(f"protein.init_from = {str(run_dir)!r} is a {task!r} run, not a protein run")
    return resolve(str(run_dir / "config.toml")).cfg


def init_from(model: Encoder, cfg: RunConfig, run_dir: Path) -> tuple[list[str], list[str]]:
    """Copy another protein run's exported weights into `model` where names match; returns (loaded, fresh)."""
    from safetensors.torch import load_file

    source_cfg = source_config(run_dir)
    theirs = load_file(str(run_dir / "model.safetensors"))
    # Residue ids depend on the vocabulary each run prepared: match embedding (and mlm output) rows by piece.
    ours_tok, their_tok = prep.tokenizer(prep.prepare(cfg)), prep.tokenizer(prep.prepare(source_cfg))
    pieces = {their_tok.sp.id_to_piece(i): i for i in range(their_tok.vocab_size)}
    state, loaded, fresh = model.state_dict(), [], []
    for name, own in state.items():
        src = theirs.get(name)
        if name.startswith("ridge_"):  # protein.blend: this run's own fit, on its own rows and ids
            continue
        if src is None or src.dim() != own.dim() or src.shape[1:] != own.shape[1:]:
            fresh.append(name)
        elif name in ("tok_emb.weight", "mlm_head.weight", "mlm_head.bias"):
            for i in range(min(own.shape[0], ours_tok.vocab_size)):
                j = pieces.get(ours_tok.sp.id_to_piece(i))
                if j is not None and j < src.shape[0]:
                    own[i] = src[j]
            loaded.append(name)
        elif name == "pos_emb.weight":  # a different seq_len: the positions both have
            n = min(own.shape[0], src.shape[0])
            own[:n] = src[:n]
            loaded.append(name)
        elif src.shape == own.shape:
            own.copy_(src)
            loaded.append(name)
        else:
            fresh.append(name)
    model.load_state_dict(state)
    return _short(loaded), _short(fresh)


def _short(names: list[str]) -> list[str]:
    """Parameter names grouped by module: blocks.0.attn.q_proj.weight -> blocks.*, cls_head.weight -> cls_head."""
    out = []
    for name in names:
        top = "blocks.*" if name.startswith("blocks.") else name.rsplit(".", 1)[0]
        if top not in out:
            out.append(top)
    return out
