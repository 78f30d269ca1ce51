"""Weight versions for asynchronous schedules: stashed copies a microbatch is bound to.

The stage's own parameters are the optimizer's master copy: the newest weights, stepped in place.
Forward passes never read them. Each forward runs through `torch.func.functional_call` on one of
a few version buffers (plain leaf tensors), so autograd saves references to that buffer and the
microbatch's backward sees exactly the weights its forward saw (weight stashing). Gradients
accumulate in the buffer's `.grad`; an optimizer step moves them to the master, steps it, and
copies the new master into a buffer no in-flight microbatch is bound to. Nothing a pending backward
still needs is ever written in place.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["VersionedStage"]


class VersionedStage(nn.Module):
    """Runs `inner` on version buffer `active` (None: on the master parameters, e.g. evaluation)."""

    def __init__(self, inner: nn.Module, n_buffers: int):
        super().__init__()
        self.inner = inner
        self.buffers_ = [self._copy_of_master() for _ in range(n_buffers)]
        self.master_version = 0  # updates applied to the master so far
        self.active: int | None = 0

    def _copy_of_master(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.inner.named_parameters()}

    def forward(self, *args):
        if self.active is None:
            return self.inner(*args)
        return functional_call(self.inner, self.buffers_[self.active], args, strict=False)

    @torch.no_grad()
    def move_gradients_to_master(self, buffer: int, scale: float) -> None:
        """master.grad = scale × buffer's accumulated gradient; the buffer's gradient is cleared."""
        versions = self.buffers_[buffer]
        for name, param in self.inner.named_parameters():
            grad = versions[name].grad
            param.grad = None if grad is None else grad.mul_(scale)
            versions[name].grad = None

    @torch.no_grad()
    def publish_master(self, buffer: int) -> None:
        """Count the update just applied to the master and copy the new weights into `buffer`
        (no microbatch may be bound to it)."""
        self.master_version += 1
        versions = self.buffers_[buffer]
        for name, param in self.inner.named_parameters():
            versions[name].copy_(param)
