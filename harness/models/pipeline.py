"""A model as a sequence of layers, for pipeline parallelism. Plain PyTorch: nothing distributed here.

A model's `pipeline_layers()` returns the layers its forward pass runs through, in order; each takes the
previous layer's output (a tensor or a tuple of tensors) and returns its own, the first takes the model's
inputs and the last returns the model's output. Two kinds of layer:
- `PipeLayer`: some of the model's own modules (the same objects, so the same weights and names) and a
  function of (layer, inputs) -> outputs;
- `SharedUse`: a use of a parameter that several layers share (e.g. a translation model's one embedding
  matrix, used to embed both sides and to project to the vocabulary): `fn(weight, inputs, training)`.
`harness.distributed.parallel` turns the list into DeepSpeed's PipelineModule (a shared parameter becomes a tied layer,
its gradient summed over the stages that use it).

Rules a layer's outputs follow between stages: every floating-point tensor passed on must be used later and
take part in backward (it receives a gradient; a constant goes as a leaf that requires grad); integer and bool
tensors (token ids, masks) pass along freely.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


class PipeLayer(nn.Module):
    def __init__(self, fn: Callable[["PipeLayer", Any], Any], **modules: nn.Module):
        super().__init__()
        self.fn = fn
        for name, module in modules.items():
            setattr(self, name, module)  # registers the model's own module object

    def forward(self, inputs):
        return self.fn(self, inputs)


@dataclass(frozen=True)
class SharedUse:
    key: str                                  # the shared parameter's name in the plain model, e.g. "embed"
    fn: Callable[[Any, Any, bool], Any]       # (weight, inputs, training) -> outputs
