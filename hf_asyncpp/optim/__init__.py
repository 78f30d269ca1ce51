"""Optimizers for the parameters of this rank's stages."""

from __future__ import annotations

import torch

from .lion import Lion
from .muon import Muon
from .param_groups import muon_param_groups
from .soap import SOAP

__all__ = ["OPTIMIZER_NAMES", "build_optimizer", "optimizer_from_config"]

OPTIMIZER_NAMES = ("sgd", "adamw", "muon", "soap", "lion")


def build_optimizer(name: str, named_params, learning_rate: float, momentum: float, beta2: float,
                    weight_decay: float, *, muon_lr_scale: str = "original", muon_nesterov: bool = True,
                    muon_adamw_patterns=None, soap_precondition_frequency: int = 10,
                    soap_max_precond_dim: int = 4096):
    """`momentum` is SGD's momentum, Adam's, SOAP's and Lion's β1 and Muon's momentum: one knob across
    optimizers; `beta2` is β2 (for Lion the momentum's own EMA rate).
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
        groups = muon_param_groups(named_params, muon_adamw_patterns)
        return Muon(groups, lr=learning_rate, weight_decay=weight_decay, momentum=momentum,
                    nesterov=muon_nesterov, adjust_lr_fn=muon_lr_scale, betas=(momentum, beta2))
    if name == "soap":
        return SOAP(params, lr=learning_rate, betas=(momentum, beta2), weight_decay=weight_decay,
                    precondition_frequency=soap_precondition_frequency, max_precond_dim=soap_max_precond_dim)
    if name == "lion":
        return Lion(params, lr=learning_rate, betas=(momentum, beta2), weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer '{name}'; available: {', '.join(OPTIMIZER_NAMES)}")


def optimizer_from_config(config, named_params):
    """`build_optimizer` with every knob taken from a TrainConfig (or anything with its fields)."""
    return build_optimizer(
        config.optimizer, named_params, config.learning_rate, config.momentum, config.beta2, config.weight_decay,
        muon_lr_scale=config.muon_lr_scale, muon_nesterov=config.muon_nesterov,
        muon_adamw_patterns=config.muon_adamw_patterns, soap_precondition_frequency=config.soap_precondition_frequency,
        soap_max_precond_dim=config.soap_max_precond_dim,
    )
