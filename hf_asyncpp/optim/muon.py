"""Muon for HF MoE models: orthogonalised momentum for matrices, AdamW for everything else.

Matrices (2-D weights) get torch.optim.Muon's update: momentum (nesterov optional), Newton–Schulz
orthogonalisation of the whole matrix (torch's bf16 iteration, batched over stacks), an LR scale by shape
(`original`: sqrt(max(1, A/B)); `match_rms_adamw`: 0.2·sqrt(max(A, B))) and decoupled weight decay.
Fused expert tensors (E, A, B), as transformers 5 stores them, are orthogonalised expert by expert, all
experts in one batched iteration.
Embeddings, lm_head, norms, biases and routers take AdamW (which parameters is decided by
`param_groups.muon_param_groups`, configurable by name pattern). Newton–Schulz must see the whole
matrix: under FSDP2 a shard is not a matrix, so the (sharded) momentum is gathered, every dp rank
orthogonalises the same whole matrix, and each keeps its own rows of the result (whole_tensor.py).
Fused expert tensors are sharded over their first dimension, the experts: a rank's shard is whole
expert matrices, which it orthogonalises alone — no gather, 1/dp of the work (none at all on a
rank left without experts when there are fewer experts than dp ranks).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from ..torch_internals import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr

from .whole_tensor import gather, keep_local_part

__all__ = ["Muon"]


def orthogonalize(update: torch.Tensor, ns_steps: int = 5) -> torch.Tensor:
    """torch.optim.Muon's Newton–Schulz orthogonalisation (its quintic coefficients, in bf16) of a matrix,
    or of every matrix of a stack (E, A, B) at once. The stack's iteration is batched matrix products: a
    few kernels per iteration for all experts, not a few per expert (on a CPU, bitwise the results of
    torch's matrix-by-matrix iteration; tests/optim/test_muon.py holds them equal)."""
    a, b, c = DEFAULT_A, DEFAULT_B, DEFAULT_C
    stack = update.bfloat16()
    stack = stack.unsqueeze(0) if stack.ndim == 2 else stack
    tall = update.size(-2) > update.size(-1)  # iterate on the wide side, as torch does
    if tall:
        stack = stack.mT
    stack = stack / stack.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
    for _ in range(ns_steps):
        gram = stack @ stack.mT
        stack = torch.baddbmm(stack, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), stack, beta=a)
    return (stack.mT if tall else stack).reshape(update.shape)


def _orthogonalized(update: torch.Tensor, like: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """`orthogonalize` of whole matrices, laid out like `like`."""
    if isinstance(update, DTensor) and update.ndim == 3 and all(
            isinstance(pl, Shard) and pl.dim == 0 for pl in update.placements):
        local = orthogonalize(update.to_local(), ns_steps)  # this rank's experts, each whole
        return DTensor.from_local(local, update.device_mesh, update.placements, run_check=False,
                                  shape=update.shape, stride=update.stride())
    return keep_local_part(orthogonalize(gather(update), ns_steps), like=like)


class Muon(torch.optim.Optimizer):
    """Param groups carry `use_muon`; AdamW groups use `betas` = (momentum-like β1, β2) and `eps`."""

    def __init__(self, param_groups, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = "original",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"unknown Muon LR scale '{adjust_lr_fn}'; choose original or match_rms_adamw")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, betas=betas, eps=eps, use_muon=True)
        super().__init__(param_groups, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError("Muon groups take matrices (2-D) or stacks of expert matrices (3-D) only")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                (self._muon if group["use_muon"] else self._adamw)(p, group)

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        update = _orthogonalized(update, p, group["ns_steps"])
        adjusted_lr = _adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape[-2:])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-adjusted_lr)

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
        denominator = (state["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / bias1)
