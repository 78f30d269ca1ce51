"""Optimizers for the parameters of this rank's stages."""

from __future__ import annotations

import torch

__all__ = ["OPTIMIZER_NAMES", "build_optimizer"]

OPTIMIZER_NAMES = ("sgd", "adamw")


def build_optimizer(name: str, params, learning_rate: float, momentum: float, beta2: float, weight_decay: float):
    """`momentum` is SGD's momentum and Adam's beta1: one knob across optimizers."""
    params = list(params)
    # Multi-tensor kernels: one launch for all of a stage's parameters instead of a Python loop.
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=momentum, weight_decay=weight_decay, foreach=True)
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=learning_rate, betas=(momentum, beta2), weight_decay=weight_decay, fused=True
        )
    raise ValueError(f"unknown optimizer '{name}'; available: {', '.join(OPTIMIZER_NAMES)}")
