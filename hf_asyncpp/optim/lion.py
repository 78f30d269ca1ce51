"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an
interpolated momentum, with decoupled weight decay.

    c = β1·m + (1 − β1)·g;   p ← p·(1 − lr·wd) − lr·sign(c);   m ← β2·m + (1 − β2)·g

β1 only shapes this step's direction; β2 is the momentum's own EMA. The update is elementwise, so
it runs unchanged on FSDP2's DTensor shards (lerp, sign, mul and add are DTensor pointwise ops) and
the momentum is sharded exactly like its parameter. One buffer per parameter, half of AdamW's state.
"""

from __future__ import annotations

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"Lion needs lr >= 0 and weight_decay >= 0, got {lr} and {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion's betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                # Decay first, on the weights the step starts from (decoupled, as in the paper).
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = momentum.lerp(p.grad, 1 - beta1).sign_()
                momentum.lerp_(p.grad, 1 - beta2)
                p.add_(update, alpha=-group["lr"])
        return loss
