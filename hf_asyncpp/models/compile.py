"""Compiling each decoder layer with `torch.compile` (`compile_layers`).

Per layer, not per stage: every decoder layer of a model has the same code and shapes, so one graph
serves all of a stage's layers and compilation time does not grow with the stage's depth; the
pipeline's own machinery (stage boundaries, P2P, weight versions) stays eager. A layer's `forward`
is replaced by its compiled version in place, so parameter names and checkpoints are unchanged.
Forward hooks with side effects (router statistics, routing loads) run eagerly
(`torch.compiler.disable`): a Python list growing layer by layer would make every layer recompile.

Weight stashing calls the stage through `torch.func.functional_call` with one weight version's tensors
(update/versions.py). The compiled layer reads its weights as graph inputs, not constants,
so every version runs through the same graph on its own tensors (tests/models/test_compile.py checks
the numerics of synchronous and asynchronous pipelines against eager ones).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["compile_layers"]


def compile_layers(stage: nn.Module, checkpointing: str = "none") -> None:
    """Compile the forward of every decoder layer of a `PipelineStageModule`, and under "selective"
    activation checkpointing that of each layer's feed-forward block too. Call it before
    `apply_activation_checkpointing`: the checkpoint then wraps the compiled forward (recomputing
    through the same graph), where compiling around the checkpoint would leave the layer eager."""
    for layer in stage.model.layers.values():
        layer.forward = torch.compile(layer.forward)
        if checkpointing == "selective":
            layer.mlp.forward = torch.compile(layer.mlp.forward)
