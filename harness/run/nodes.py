"""What the nodes of one run must share, checked as its ranks start: the same resolved run and DeepSpeed config
on every rank, paths aside (`check_same_plan`), and a run directory that every node sees (`check_shared`).
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from ..config.run import ConfigError, flatten
from ..distributed.world import World
from ..plan.resolve import Plan


SHARED_WAIT_ENV = "HARNESS_SHARED_WAIT_S"  # how long a node looks for the others' tokens (a slow NFS cache)


def shared_wait_s() -> float:
    """$HARNESS_SHARED_WAIT_S, seconds (default 30), checked before launch by `preflight`."""
    raw = os.environ.get(SHARED_WAIT_ENV, "30")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ConfigError(f"{SHARED_WAIT_ENV}={raw!r}: the seconds each node looks for the others' files in the run "
                          f"directory, a number 0 or more (default 30)")
    return value


# May differ by node, a copy staged on each node's own disk: the data (compared by its content once read, loop._data),
# the run directory (check_shared finds the nodes' tokens in it) and NVMe offload's folder
NODE_PATHS = ("data.path", "data.val_path", "data.mix", "run.output_dir")
SAMPLED = 2**20  # bytes of an export read from each end to tell its weights (model.init_from) on each node


def _export_digest(path: Path) -> str:
    """An export told by its header (names, shapes, step) and its first and last MiB of weights, read alike on every
    node; one that is not there or cannot be read (a resume no longer reads it) is said to be so."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            header = int.from_bytes(f.read(8), "little")
            if header > size - 8:
                return f"no safetensors file ({size} bytes)"
            head = f.read(header + SAMPLED)
            f.seek(max(8 + len(head), size - SAMPLED))
            return f"an export whose weights are {hashlib.sha256(head + f.read()).hexdigest()[:12]}"
    except OSError:
        return "no readable export"


def _meaning(key: str, value):
    """What a setting means whichever node reads it: a local model.hf directory by its config.json, model.init_from's
    export by its header and first and last MiB, a plug-in task by its file's name and class."""
    if key == "model.hf" and isinstance(value, str) and (Path(value) / "config.json").is_file():
        digest = hashlib.sha256((Path(value) / "config.json").read_bytes()).hexdigest()[:12]
        return f"a model whose config.json is {digest}"
    if key == "model.init_from" and value:
        return _export_digest(Path(value) / "model.safetensors")
    if key == "run.task" and isinstance(value, str) and ".py:" in value:
        file, cls = value.rsplit(":", 1)
        return f"{Path(file).name}:{cls}"
    return value


def check_same_plan(plan: Plan) -> None:
    """Every rank resolved the same run and DeepSpeed config, paths aside (`NODE_PATHS`, `_meaning`). A node started
    with another --set, --ds or run file had trained its share of the weights with other settings (an lr apart, said
    nowhere) or hung before the first step (ZeRO stages apart). Collective: called as the process group starts, before
    its subgroups (`init_world`'s `agree`)."""
    import json
    import socket

    from ..distributed.world import all_gather_objects

    mine = {"ZeRO stage": plan.ds.zero_stage, "precision": plan.ds.precision,  # said first: what --ds names
            **{k: _meaning(k, v) for k, v in flatten(plan.run.cfg.to_dict()).items() if k not in NODE_PATHS},
            **{f"DeepSpeed {k}": v for k, v in flatten(plan.ds.config).items() if not k.endswith("nvme_path")}}
    digests = all_gather_objects(hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    everyone = all_gather_objects((mine, socket.gethostname()))  # in full, only where they differ
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    (first, _), (theirs, host) = everyone[0], everyone[other]
    keys = [k for k in dict.fromkeys([*first, *theirs]) if first.get(k, ()) != theirs.get(k, ())]

    def value(d: dict, key: str) -> str:
        return repr(d[key]) if key in d else "unset"

    said = "; ".join(f"{k} = {value(theirs, k)} there, {value(first, k)} on rank 0" for k in keys[:3]) + \
        ("; ..." if keys[3:] else "")
    raise ConfigError(f"rank {other} (on {host}) resolved another run than rank 0: {said}; start every node with the "
                      f"same run file, --ds and --set (data paths and the run directory's may differ)")


def check_shared(plan: Plan, world: World) -> None:
    """Under several nodes, the run directory must be one that every node sees: every node writes checkpoints into
    it and reads them back on resume, and a node-local folder of the same name would lose them silently. Local rank
    0 of each node writes a token named by a nonce of rank 0's into `RUN/.nodes/`, then looks for every node's
    (up to $HARNESS_SHARED_WAIT_S, default 30 s); a node that misses one refuses on every rank. Collective, but
    only where torchrun says the world spans nodes (LOCAL_WORLD_SIZE < WORLD_SIZE)."""
    import secrets
    import socket

    from ..distributed.world import all_gather_objects, barrier

    # torchrun's names, else DeepSpeed's own launcher's (pdsh: deepspeed/launcher/launch.py)
    local_size = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world.world_size
    if int(local_size) >= world.world_size:
        return
    node = os.environ.get("GROUP_RANK") or os.environ.get("CROSS_RANK") or socket.gethostname()
    local0 = os.environ.get("LOCAL_RANK", "0") == "0"
    seen = all_gather_objects((node, secrets.token_hex(8) if world.rank == 0 else None))
    nodes, nonce = sorted({n for n, _ in seen}, key=str), seen[0][1]
    folder = plan.run_dir / ".nodes"
    if local0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{nonce}-{node}").write_text(socket.gethostname())
    barrier()
    missing = []
    if local0:
        deadline = time.time() + shared_wait_s()
        while (missing := [n for n in nodes if not (folder / f"{nonce}-{n}").exists()]) and time.time() < deadline:
            time.sleep(0.5)
    problems = [p for p in all_gather_objects((node, socket.gethostname(), missing) if missing else None) if p]
    if local0:
        (folder / f"{nonce}-{node}").unlink(missing_ok=True)
    if problems:
        node, host, missing = problems[0]
        raise ConfigError(f"{plan.run.describe('run.output_dir')}: {plan.run_dir.absolute()} is not on storage every "
                          f"node shares: node {node} ({host}) does not see what node {', '.join(map(str, missing))} "
                          f"wrote there. Every node writes checkpoints into it and reads them back on resume: put it "
                          f"on a shared file system (NFS, Lustre, GPFS), the same path on every node")
