"""Activation checkpointing: keep a block's input, recompute its activations during the backward.

Modes (`activation_checkpointing`):
  - "full": every decoder layer; a stage keeps one hidden-state tensor per layer and microbatch;
  - "selective": each layer's feed-forward block only (the MoE experts, whose per-expert activations
    dominate a layer's memory); attention keeps its activations;
  - "none".

A recomputation runs on the tensors the forward ran on. Under weight stashing a stage's parameters
are bound to a weight version only while its forward runs (update/versions.py), so the
tensors a block held at forward time are captured and bound again for its recomputation; when they
are still bound (synchronous stages, FSDP2's unsharded parameters) the block simply runs again.
Forward hooks that count (router statistics, routing loads) consult `is_recomputing()` so that a
recomputation is not counted as a second forward.
"""

from __future__ import annotations

import threading

from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

__all__ = ["CHECKPOINTING_MODES", "apply_activation_checkpointing", "is_recomputing"]

CHECKPOINTING_MODES = ("none", "full", "selective")

_state = threading.local()


def is_recomputing() -> bool:
    """Whether a checkpointed block is being recomputed (inside a backward) right now."""
    return getattr(_state, "recomputing", False)


def _bound_tensors(module: nn.Module) -> dict:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _checkpoint(module: nn.Module) -> None:
    """Make `module`'s forward a checkpointed one (its state-dict names and hooks are unchanged)."""
    forward = module.forward  # the bound original
    direct = {"on": False}  # set while a recomputation calls the original through functional_call

    def checkpointed_forward(*args, **kwargs):
        if direct["on"]:
            return forward(*args, **kwargs)
        at_forward = _bound_tensors(module)
        calls = {"n": 0}

        def run(*inputs):
            calls["n"] += 1
            if calls["n"] == 1:  # the forward itself
                return forward(*inputs, **kwargs)
            _state.recomputing, direct["on"] = True, True
            try:
                now = _bound_tensors(module)
                if all(now.get(name) is tensor for name, tensor in at_forward.items()):
                    return forward(*inputs, **kwargs)
                return functional_call(module, at_forward, inputs, kwargs, strict=False)
            finally:
                _state.recomputing, direct["on"] = False, False

        return checkpoint(run, *args, use_reentrant=False)

    module.forward = checkpointed_forward


def apply_activation_checkpointing(stage: nn.Module, mode: str) -> None:
    """Checkpoint the decoder layers of a `PipelineStageModule` ("full") or their feed-forward
    blocks ("selective"); "none" leaves the stage as it is."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"unknown activation_checkpointing '{mode}'; choose {', '.join(CHECKPOINTING_MODES)}")
    for layer in stage.model.layers.values() if mode != "none" else ():
        _checkpoint(layer if mode == "full" else layer.mlp)
