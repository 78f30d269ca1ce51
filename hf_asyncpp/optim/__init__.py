"""Optimizers for the parameters of this rank's stages."""

from __future__ import annotations

import torch

from ..config import OptimizerConfig
from .lion import Lion
from .muon import Muon
from .param_groups import muon_param_groups, weight_decay_groups
from .soap import SOAP

__all__ = ["OPTIMIZER_NAMES", "build_optimizer", "lr_scheduler_from_config", "optimizer_from_config"]

OPTIMIZER_NAMES = ("sgd", "adamw", "muon", "soap", "lion")


def build_optimizer(name: str, named_params, learning_rate: float, momentum: float, beta2: float,
                    weight_decay: float, *, eps: float = 1e-8, decay_names=None, muon_lr_scale: str = "original",
                    muon_nesterov: bool = True, muon_adamw_patterns=None, soap_precondition_frequency: int = 10,
                    soap_max_precond_dim: int = 4096):
    """`momentum` is SGD's momentum, Adam's, SOAP's and Lion's β1 and Muon's momentum: one knob across
    optimizers; `beta2` is β2 (for Lion the momentum's own EMA rate); `eps` is Adam's, SOAP's and
    Muon's AdamW part's ε.
    `named_params`: (HF name, parameter) pairs (names decide Muon's AdamW groups); `decay_names`: the
    names weight decay applies to (param_groups.decay_parameter_names; None: all)."""
    named_params = list(named_params)
    groups = muon_param_groups(named_params, muon_adamw_patterns) if name == "muon" else \
        [dict(params=[p for _, p in named_params])]
    params = weight_decay_groups(groups, named_params, weight_decay, decay_names)
    # Multi-tensor kernels: one launch for all of a stage's parameters instead of a Python loop.
    if name == "sgd":
        return torch.optim.SGD(params, lr=learning_rate, momentum=momentum, foreach=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=learning_rate, betas=(momentum, beta2), eps=eps, fused=True)
    if name == "muon":
        return Muon(params, lr=learning_rate, momentum=momentum, nesterov=muon_nesterov,
                    adjust_lr_fn=muon_lr_scale, betas=(momentum, beta2), eps=eps)
    if name == "soap":
        return SOAP(params, lr=learning_rate, betas=(momentum, beta2), eps=eps,
                    precondition_frequency=soap_precondition_frequency, max_precond_dim=soap_max_precond_dim)
    if name == "lion":
        return Lion(params, lr=learning_rate, betas=(momentum, beta2))
    raise ValueError(f"unknown optimizer '{name}'; available: {', '.join(OPTIMIZER_NAMES)}")


def optimizer_from_config(config: OptimizerConfig, named_params, decay_names=None):
    """`build_optimizer` with every knob taken from the optimization section (a TrainConfig is one)."""
    return build_optimizer(
        config.optimizer, named_params, config.learning_rate, config.momentum, config.beta2, config.weight_decay,
        eps=config.adam_epsilon, decay_names=decay_names, muon_lr_scale=config.muon_lr_scale,
        muon_nesterov=config.muon_nesterov, muon_adamw_patterns=config.muon_adamw_patterns,
        soap_precondition_frequency=config.soap_precondition_frequency, soap_max_precond_dim=config.soap_max_precond_dim,
    )


def lr_scheduler_from_config(config: OptimizerConfig, optimizer, updates_per_step: int = 1):
    """transformers' LR schedule `lr_scheduler_type` (with `lr_scheduler_kwargs`) over max_steps steps
    of `updates_per_step` updates each (PipeDream updates once per microbatch)."""
    from transformers import get_scheduler

    return get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.warmup_steps * updates_per_step,
                         num_training_steps=config.max_steps * updates_per_step,
                         scheduler_specific_kwargs=config.lr_scheduler_kwargs)
