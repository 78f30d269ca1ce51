"""A single-process staleness emulator: the update sequence of an asynchronous pipeline on one device.

Every asynchronous schedule in this project follows one rule (x_t: the stored weights after t
updates; d_g: the delay of parameter group g):

    x_g(t+1) = x_g(t) − U_g( ∇_g f( {x_h(t − d_h)}_h ; ξ_t ) )      (versions clamp at 0)

The gradient of unit t is taken with each group at the version it had d_g updates ago (weight
stashing makes forward and backward use that same version) and applied at once to the current
weights. PipeDream-2BW is d = 1 for every parameter (unit = minibatch): x(t+1) = x(t) − U(g_t(x(t−1))),
which in terms of the weights a minibatch uses (w_k = x_{k−1}) is the reference study's
w_{k+1} = w_k − U(g_{k−1}(w_{k−1})) (docs/ARCHITECTURE.md, "Update semantics"). Synchronous training is d = 0. WPipe gives one group of chunks
d = 1 and the other d = 0; the original PipeDream gives stage s d_s = p − 1 − s (unit = microbatch),
so its gradients are taken at a model whose stages have different ages.

The emulator swaps old versions into the parameters around forward + backward and restores the
current ones before the optimizer steps, so the optimizer state consumes the stale gradients in
order, exactly as in the pipeline. Nothing is pending when training stops: after N units all N
updates have been applied (the pipeline's drain).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

__all__ = ["StalenessEmulator"]


class StalenessEmulator:
    """Wraps an optimizer; `with emulator.stale_weights(): loss.backward()` then `emulator.step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, delays: dict[torch.nn.Parameter, int]):
        self.optimizer = optimizer
        self.delays = {p: int(d) for p, d in delays.items() if d > 0}
        if any(d < 0 for d in delays.values()):
            raise ValueError("delays must be >= 0")
        # history[p]: the last d + 1 versions of p, oldest first; history[p][-1] is the current one.
        self.history: dict[torch.nn.Parameter, deque] = {
            p: deque([p.detach().clone()], maxlen=d + 1) for p, d in self.delays.items()
        }
        self.units = 0

    def version_age(self, param: torch.nn.Parameter | None = None) -> int:
        """How many updates behind the current weights this unit's gradient of `param` (default: of
        the most delayed parameter) is taken."""
        if param is None:
            return min(max(self.delays.values(), default=0), self.units)
        return min(self.delays.get(param, 0), self.units)

    @contextlib.contextmanager
    def stale_weights(self):
        """Run forward and backward of the next unit inside: each parameter holds version t − d."""
        current = {}
        for p, versions in self.history.items():
            current[p] = p.data
            p.data = versions[0]  # the oldest kept: t − d, or 0 before d updates have happened
        try:
            yield
        finally:
            for p, data in current.items():
                p.data = data

    def restart(self) -> None:
        """Forget the older versions: the next unit's gradient is taken at the current weights, and
        the delays build up again from here, as at the start of training (a sync start's steps)."""
        for p, versions in self.history.items():
            versions.clear()
            versions.append(p.detach().clone())
        self.units = 0

    def step(self, **step_args) -> None:
        """Step the wrapped optimizer (`step_args`: its step's, e.g. Error Feedback's `extrapolate`)."""
        self.optimizer.step(**step_args)
        self._count_unit()

    def skip(self) -> None:
        """A unit whose update is not applied (a non-finite gradient): the weights stay, but they
        count as a version, as in the pipeline, where a stage publishes its unchanged master."""
        self._count_unit()

    def _count_unit(self) -> None:
        for p, versions in self.history.items():
            versions.append(p.detach().clone())
        self.units += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
