"""Error Feedback for delayed updates: an optimizer-agnostic correction of stale steps.

With u_t the update the base optimizer makes at step t (learning rate and weight decay included,
x_t − x_t') and u_{t−1} the previous one (0 at first), the weights move by

    u_t + λ (u_t − u_{t−1})

instead of u_t. With z_t the trajectory of the updates alone (z_{t+1} = z_t − u_t, from the same start),
the stored weights are then x_t = z_t − λ u_{t−1}: one extrapolated step past it (with λ = 1 under a
one-step delay, a linear extrapolation of the un-delayed trajectory; docs/ARCHITECTURE.md, "Update
semantics"). `step(extrapolate=False)`, a run's last update under `ef_last_update: trajectory`, moves
them by u_t − λ u_{t−1} instead, taking the previous extrapolation back: they end at z_T.
One extra update-sized buffer per parameter, made from the parameter (a clone, or `zeros_like`
at first), so under FSDP2 it is a DTensor sharded exactly like it; it is part of `state_dict()`. While
it steps, a second one holds the pre-step weights, from which this step's update is taken.
"""

from __future__ import annotations

import torch

from ..torch_internals import _foreach_add_, _foreach_sub_

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Wraps any torch optimizer; `step()` applies the base update plus λ × its change (`extrapolate=False`:
    the base update less λ × the previous one, landing on the trajectory)."""

    def __init__(self, optimizer: torch.optim.Optimizer, ef_lambda: float = 1.0):
        self.optimizer, self.ef_lambda = optimizer, ef_lambda
        self.previous_update: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, extrapolate: bool = True) -> None:
        params = self._params()
        before = [p.detach().clone() for p in params]
        self.optimizer.step()
        # Multi-tensor ops (a few passes over the stage's weights, not a Python loop per tensor);
        # this step's updates then become the stored previous ones (no copy).
        updates = before
        _foreach_sub_(updates, params)  # u_t = x_t − x_t', in place of the copies
        previous = [self.previous_update.get(p) for p in params]
        for i, p in enumerate(params):
            if previous[i] is None:
                previous[i] = self.previous_update[p] = torch.zeros_like(p)
        if extrapolate:
            # x −= λ (u_t − u_{t−1}), written x += λ (u_{t−1} − u_t) with the difference made in place of
            # u_{t−1}, which is not needed after: two update-sized buffers at the peak (the stored
            # previous updates and this step's), not three. Bitwise the same: negating is exact.
            _foreach_sub_(previous, updates)
        # Without extrapolating: x += λ u_{t−1}, the previous step's extrapolation taken back (x_T = z_T).
        _foreach_add_(params, previous, alpha=self.ef_lambda)
        self.previous_update.update(zip(params, updates))

    def state_dict(self) -> dict:
        params = self._params()
        return {
            "optimizer": self.optimizer.state_dict(),
            "ef_lambda": self.ef_lambda,
            "previous_update": {i: self.previous_update[p] for i, p in enumerate(params) if p in self.previous_update},
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.ef_lambda = state["ef_lambda"]
        params = self._params()
        self.previous_update = {params[i]: t.clone() for i, t in state["previous_update"].items()}
