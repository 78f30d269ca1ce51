"""Optimizers for the parameters of this rank's stages."""

from __future__ import annotations

import torch

from .muon import Muon
from .param_groups import muon_param_groups

__all__ = ["OPTIMIZER_NAMES", "build_optimizer"]

OPTIMIZER_NAMES = ("sgd", "adamw", "muon")


def build_optimizer(name: str, named_params, learning_rate: float, momentum: float, beta2: float,
                    weight_decay: float, muon_lr_scale: str = "original", muon_nesterov: bool = True):
    """`momentum` is SGD's momentum, Adam's beta1 and Muon's momentum: one knob across optimizers.
    `named_params`: (HF name, parameter) pairs (names decide Muon's AdamW groups)."""
    named_params = list(named_params)
    params = [p for _, p in named_params]
    # Multi-tensor kernels: one launch for all of a stage's parameters instead of a Python loop.
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=momentum, weight_decay=weight_decay, foreach=True)
    if name == "adamw":
        return torch.optim.AdamW(
            params, lr=learning_rate, betas=(momentum, beta2), weight_decay=weight_decay, fused=True
        )
    if name == "muon":
        return Muon(muon_param_groups(named_params), lr=learning_rate, weight_decay=weight_decay, momentum=momentum,
                    nesterov=muon_nesterov, adjust_lr_fn=muon_lr_scale, betas=(momentum, beta2))
    raise ValueError(f"unknown optimizer '{name}'; available: {', '.join(OPTIMIZER_NAMES)}")
