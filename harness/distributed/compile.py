"""`train.compile`: each Transformer block compiled on its own, as torchtitan does (torchtitan/models/llama3/
infra/parallelize.py, `apply_compile`), not the whole model at once.

- The repeated layers of a model (the members of an `nn.ModuleList` that share one class: the harness's `Block`s,
  a Hugging Face model's decoder layers) get a compiled `forward`, with `fullgraph=True` so nothing inside breaks
  into pieces silently. Blocks of one class share one compiled graph (torch inlines built-in modules and takes the
  parameters as inputs): a 12-layer model compiles its block once, not twelve times, and not the whole model.
- Only the `forward` is compiled, not the module's `__call__`: the hooks DeepSpeed puts on modules (ZeRO-3's
  parameter fetch, its gradient hooks) run eagerly around it, with communication where it always was.
- Shapes do not recompile every step: without `data.length_buckets` the lengths are dynamic from the first compile
  (`dynamic=True`: one graph for every length); with buckets, each batch is padded to one of a few lengths
  (`data/batches.py`, `BucketedCollate`) and each length compiles once, static (what CUDA graphs need).
- Training calls only: evaluation and decoding (grad off, a length per decoded token) run the block eagerly.
- A block class that cannot compile (a graph break under fullgraph, a backend failure) runs eagerly from its first
  call, with one line naming it and why; nothing else changes.
- `CompileWatch` reads torch's own compilation records: the seconds spent compiling (the loop reports them apart
  from step time) and a recompile storm (one block's code compiled far more often than its shapes explain),
  reported once with the reason torch gives.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch
from torch import nn

from ..config.run import one_line

Say = Callable[[str], None]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each member of an nn.ModuleList whose members share one class and hold parameters: the
    model's repeated layers, outermost first (a list inside a block belongs to the block)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            members = list(child.children()) if isinstance(child, nn.ModuleList) else []
            if members and len({type(m) for m in members}) == 1 and any(True for _ in members[0].parameters()):
                found.extend((f"{path}.{i}", m) for i, m in enumerate(members))
            else:
                visit(f"{path}.", child)

    visit("", model)
    return found


class BlockCompiler:
    """Each block's forward wrapped in its own torch.compile (blocks of one class reuse one graph from torch's cache),
    their failure shared by class: the first block of a class that cannot compile says so once and every block of
    the class runs eagerly."""

    def __init__(self, dynamic: bool, say: Say):
        self.dynamic, self.say = dynamic, say
        self.failed: dict[type, str] = {}
        self.names: dict[type, list[str]] = {}

    def wrap(self, name: str, block: nn.Module) -> None:
        cls = type(block)
        self.names.setdefault(cls, []).append(name)
        eager = block.forward
        compiled = torch.compile(eager, dynamic=self.dynamic, fullgraph=True)

        @functools.wraps(eager)
        def forward(*args, **kwargs):
            if cls in self.failed or not torch.is_grad_enabled():
                return eager(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # raised before the compiled code runs
                self._fail(cls, e)
                return eager(*args, **kwargs)

        block.forward = forward

    def _fail(self, cls: type, e: Exception) -> None:
        reason = one_line(e, None).split(" Explanation:")[0]  # torch's first sentence; the rest explains it
        self.failed[cls] = reason
        names = self.names[cls]
        where = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        self.say(f"train.compile: {cls.__name__} ({where}) cannot compile, runs eagerly: "
                 f"{type(e).__name__}: {reason[:200]}")


def compile_blocks(model: nn.Module, buckets: tuple[int, ...], say: Say) -> None:
    """Compile `model`'s repeated blocks in place (see the module's docstring): static shapes, one compile per
    bucket, with `buckets`; dynamic lengths without. A model with no repeated layers is compiled whole, graph breaks
    allowed, said in one line."""
    dynamic = not buckets
    # each static shape is a compile of the same code: torch's limit (8) must not cut the buckets short
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(buckets) + 2)
    blocks = repeated_blocks(model)
    compiler = BlockCompiler(dynamic, say)
    if not blocks:
        say(f"train.compile: {type(model).__name__} has no repeated blocks (an nn.ModuleList of one layer class); "
            f"its forward is compiled whole")
        model.forward = torch.compile(model.forward, dynamic=dynamic)
        return
    for name, block in blocks:
        compiler.wrap(name, block)


class CompileWatch:
    """What torch compiled since the run began, from its compilation records (`torch._dynamo.utils.
    get_compilation_metrics`, each a frame compiled: seconds, the code, why it recompiled). `expected` is the
    number of compiles per code object the run's shapes explain (2 for dynamic lengths: a first, static compile is
    allowed; the number of buckets + 1 with buckets); a code compiled more often than twice that is a storm,
    reported once."""

    def __init__(self, expected: int, say: Say):
        from torch._dynamo.utils import clear_compilation_metrics

        clear_compilation_metrics()
        self.expected, self.say = expected, say
        self.seconds, self.graphs = 0.0, 0
        self.per_code: Counter[str] = Counter()
        self.seen: set[str] = set()
        self.stormed = False

    def update(self, step: int, until: float = float("inf")) -> float:
        """Read the records of compiles that ended by `until` (wall-clock seconds) and not read before: the seconds
        they spent compiling (also added to `seconds`)."""
        from torch._dynamo.utils import get_compilation_metrics

        new, reason = 0.0, ""
        for m in get_compilation_metrics():
            key = f"{m.compile_id}:{m.start_time_us}"
            end_us = m.end_time_us or (m.start_time_us or 0) + (m.duration_us or 0)
            if key in self.seen or end_us / 1e6 > until:
                continue
            self.seen.add(key)
            new += (m.duration_us or 0) / 1e6
            if m.fail_type is None:
                self.graphs += 1
                if m.co_name is None:  # a backward graph (torch 2.11 records it apart, with no code): its frame counts
                    continue
                code = f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})"
                self.per_code[code] += 1
                reason = m.recompile_reason or reason
        self.seconds += new
        if not self.stormed:
            code, n = max(self.per_code.items(), key=lambda kv: kv[1], default=("", 0))
            if n > 2 * self.expected:
                self.stormed = True
                self.say(f"train.compile: {code} compiled {n} times by step {step} (expected at most "
                         f"{self.expected}); its shapes or guards keep changing, so steps recompile"
                         f"{f' (last reason: {reason.strip()[:200]})' if reason else ''}: set data.length_buckets, "
                         f"or train.compile=false")
        return new


def check_compile(device_type: str) -> str | None:
    """Why torch.compile cannot work on this machine, or None: the Python version torch supports for it, and the
    backend's own compiler (Triton for CUDA, a C++ compiler for the CPU backend)."""
    from torch._dynamo.utils import is_compile_supported

    if not is_compile_supported(device_type):
        return f"torch {torch.__version__} cannot compile for {device_type} on this Python"
    if device_type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "its CUDA backend needs Triton, which is not installed (pip install triton)"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - whatever the probe raises, the compile would too
        return f"its CPU backend needs a C++ compiler ({type(e).__name__}: {one_line(e, 200)})"
    return None
