"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in the
eigenbasis of Shampoo's Kronecker factors.

For a matrix G (A × B): L = EMA(G Gᵀ) and R = EMA(Gᵀ G) with rate `shampoo_beta` (β2 when None);
Q_L, Q_R their eigenbases. Each step rotates the gradient, G' = Q_Lᵀ G Q_R, runs Adam on G' (bias
correction, eps) and rotates the result back, Q_L (m' / (√v' + eps)) Q_Rᵀ, then decays the weights
(decoupled, after the update, as the reference code does). The bases come from a full eigh when a
parameter is first seen, then from one power-iteration step and QR every `precondition_frequency`
updates; on each refresh the first moment is rotated from the old basis into the new one and the
second moment is permuted with the bases' columns (sorted by estimated eigenvalue, as in the paper).
A side longer than `max_precond_dim` keeps the identity basis.

Shapes: 2-D matrices are rotated on both sides; fused expert tensors (E, A, B) are E independent
matrices (each expert its own factors, batched); other parameters (norms, biases) get plain Adam.

The first step of a parameter only initialises its factors and bases from that gradient and does
not move it (no update, no weight decay), as in the paper's reference code: the gradient is never
projected with a basis computed from itself. Steps are counted per parameter (the reference counts
per group; the same whenever every parameter has a gradient at every step). The first moment is kept
in the rotated basis (the reference keeps it in the parameter's and rotates it every step): equal in
exact arithmetic, a few float32 ulps apart in practice, and it saves a gather per step under FSDP2.

FSDP2: the factors need the whole matrix, so the gradient is all-gathered and every dp rank builds
the same factors and bases from the same input: factors and bases are replicated on every rank (they
are per matrix and each rank needs them whole). The Adam moments are sharded like the parameter;
they are gathered only where the whole is needed (rotating the update back; re-rotating on a basis
refresh), and each rank applies only its slice of the update. Parameters with no rotated side run
plain Adam on their shard, gathering nothing; on plain tensors nothing is communicated at all.
"""

from __future__ import annotations

import math

import torch

from .whole_tensor import gather, keep_local_part

__all__ = ["SOAP"]

_SIDES = (("left", -2), ("right", -1))  # (state-key prefix, dimension): L / Q_L act on rows, R / Q_R on columns


def rotate(x: torch.Tensor, bases, back: bool = False) -> torch.Tensor:
    """Q_Lᵀ x Q_R (or Q_L x Q_Rᵀ when `back`) for a matrix or a stack (E, A, B); a None basis is the identity.
    Two transposed products, as the reference's tensordot makes them, so equal inputs round equally."""
    for q in bases:
        x = x.mT if q is None else x.mT @ (q.mT if back else q)
    return x


def _eigenbasis(factor: torch.Tensor) -> torch.Tensor:
    """Eigenvectors by decreasing eigenvalue; the tiny diagonal (the reference's) only matters for a zero factor."""
    eye = torch.eye(factor.shape[-1], dtype=factor.dtype, device=factor.device)
    return torch.linalg.eigh(factor + 1e-30 * eye).eigenvectors.flip(-1)


def _power_step(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step on the old basis, columns sorted by estimated eigenvalue, then QR.
    Returns the new basis and the column order (the second moment follows it)."""
    product = factor @ basis
    estimated = (basis * product).sum(dim=-2)  # diag(Qᵀ F Q)
    order = torch.argsort(estimated, dim=-1, descending=True)
    power = product.gather(-1, order.unsqueeze(-2).expand_as(product))
    return torch.linalg.qr(power).Q, order


class SOAP(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: float | None = None, eps: float = 1e-8, weight_decay: float = 0.01,
                 precondition_frequency: int = 10, max_precond_dim: int = 10000):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"SOAP needs lr, eps and weight_decay >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in (*betas, betas[1] if shampoo_beta is None else shampoo_beta)):
            raise ValueError(f"SOAP's betas and shampoo_beta must lie in [0, 1), got {betas} and {shampoo_beta}")
        if precondition_frequency < 1 or max_precond_dim < 1:
            raise ValueError("SOAP's precondition_frequency and max_precond_dim must be at least 1, "
                             f"got {precondition_frequency} and {max_precond_dim}")
        defaults = dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)
        return loss

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        preconditioned = p.ndim in (2, 3) and min(p.shape[-2:]) <= group["max_precond_dim"]
        # The factors need the whole gradient; plain Adam is elementwise and stays on this rank's shard.
        grad = (gather(p.grad) if preconditioned else p.grad).float()
        if not state:
            self._init_state(p, grad, group, preconditioned)
            return
        beta1, beta2 = group["betas"]
        state["step"] += 1
        bases = self._bases(state) if preconditioned else ()
        rotated = keep_local_part(rotate(grad, bases), p) if bases else grad
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(rotated, 1 - beta1)
        exp_avg_sq.lerp_(rotated.square(), 1 - beta2)
        ratio = exp_avg / exp_avg_sq.sqrt().add_(group["eps"])
        update = keep_local_part(rotate(gather(ratio), bases, back=True), p) if bases else ratio
        step_size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
        p.add_(update.to(p.dtype), alpha=-step_size)
        if group["weight_decay"] != 0:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        self._accumulate(state, grad, group)
        if bases and state["step"] % group["precondition_frequency"] == 0:
            self._refresh_bases(p, state, bases)

    def _init_state(self, p: torch.Tensor, grad: torch.Tensor, group: dict, preconditioned: bool) -> None:
        state = self.state[p]
        state.update(step=0, exp_avg=torch.zeros_like(p, dtype=torch.float32),
                     exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
        if preconditioned:
            for side, dim in _SIDES:
                n = grad.shape[dim]
                if n <= group["max_precond_dim"]:
                    state[f"{side}_factor"] = grad.new_zeros(*grad.shape[:-2], n, n)
        self._accumulate(state, grad, group)
        for side, _ in _SIDES:
            if f"{side}_factor" in state:
                state[f"{side}_basis"] = _eigenbasis(state[f"{side}_factor"])

    @staticmethod
    def _bases(state: dict) -> tuple:
        """(Q_L, Q_R) of a preconditioned matrix, None for a side left unrotated."""
        return tuple(state.get(f"{side}_basis") for side, _ in _SIDES)

    @staticmethod
    def _accumulate(state: dict, grad: torch.Tensor, group: dict) -> None:
        beta = group["betas"][1] if group["shampoo_beta"] is None else group["shampoo_beta"]
        if "left_factor" in state:
            state["left_factor"].lerp_(grad @ grad.mT, 1 - beta)
        if "right_factor" in state:
            state["right_factor"].lerp_(grad.mT @ grad, 1 - beta)

    def _refresh_bases(self, p: torch.Tensor, state: dict, old_bases: tuple) -> None:
        # The first moment goes back to the parameter's basis and into the new one; the second moment
        # is only permuted with the columns (the paper's choice: rotating it has no exact form).
        exp_avg = rotate(gather(state["exp_avg"]), old_bases, back=True)
        exp_avg_sq = gather(state["exp_avg_sq"])
        for side, dim in _SIDES:
            if f"{side}_factor" not in state:
                continue
            basis, order = _power_step(state[f"{side}_factor"], state[f"{side}_basis"])
            state[f"{side}_basis"] = basis
            index = order.unsqueeze(-1 if dim == -2 else -2).expand_as(exp_avg_sq)
            exp_avg_sq = exp_avg_sq.gather(dim, index)
        state["exp_avg"].copy_(keep_local_part(rotate(exp_avg, self._bases(state)), p))
        state["exp_avg_sq"].copy_(keep_local_part(exp_avg_sq, p))
