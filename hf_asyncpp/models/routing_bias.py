"""Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert routing bias nudged after each update.

DeepSeek-V3's router picks experts by `sigmoid(logits) + e_score_correction_bias`; the bias only
steers selection, not the gating weights. After every optimizer step each expert's bias moves by
the update rate γ toward balance: +γ if the expert received fewer tokens than the mean over experts
in that step, −γ if more (DeepSeek-V3 report, §2.1.2; γ = 0.001 for most of its training).
transformers runs the biased routing but never updates the bias; this module does, counting the
tokens each router sends to each expert over a minibatch's microbatches and all dp replicas.

When the bias moves follows the weights' update rule (the bias is a persistent buffer of the stage):

  - synchronous schedules: after the step's update, from the loads of the step's minibatch
    (`update_biases`, the newest n_microbatches forward calls);
  - asynchronous schedules: minibatch k's bias update is computed from the loads of minibatch k's
    own forwards and applied together with minibatch k's weight update (PipeDream, which updates per
    microbatch: with the update of its last microbatch, so γ stays a per-minibatch step), so b_{v+1} = b_v + γ·sign(mean − load_k) whenever
    weight version v + 1 is x_v − U(g_k). The bias is versioned with the weights
    (update/versions.py): a microbatch routes, forward and backward, with the bias of the
    weight version it is bound to. A stage's microbatches are forwarded in the order of their ids, so
    the pipeline takes the oldest n_microbatches recorded calls (`take_oldest`) when minibatch k's
    update is due, while forwards of minibatch k + 1 are already recorded behind them. Only the
    forwards the training stage runs for microbatches count (`count_only_microbatches_of`, a hook
    of the stage): evaluation runs the same module through stages of its own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .recompute import is_recomputing

__all__ = ["RoutingLoadCounter", "nudge_biases"]


@torch.no_grad()
def nudge_biases(routers: list[nn.Module], loads: torch.Tensor, rate: float, dp_group) -> None:
    """One bias update: `loads` (routers × experts, this rank's token counts) summed over the dp
    group, then each expert's bias moves by `rate` toward the mean load (+ below it, − above it)."""
    if not routers:
        return
    if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(loads, group=dp_group)
    for router, load in zip(routers, loads):
        bias = router.e_score_correction_bias
        bias += rate * torch.sign(load.mean() - load).to(bias.dtype)


class RoutingLoadCounter:
    """Per-expert token counts of every bias-balanced router inside `module`, per forward call."""

    def __init__(self, module: nn.Module, router_class: type):
        self.routers = [
            m for m in module.modules() if isinstance(m, router_class) and hasattr(m, "e_score_correction_bias")
        ]
        self._calls: dict[int, list[torch.Tensor]] = {id(r): [] for r in self.routers}
        self._only_microbatches = False  # set by count_only_microbatches_of
        self._in_microbatch = False
        self._minibatch_skipped = False  # an update of the current minibatch was skipped (non-finite)
        for router in self.routers:
            router.register_forward_hook(self._record)

    @torch.compiler.disable  # eager under compile_layers (models/compile.py): counting is a side effect
    def _record(self, router, args, output):
        if (self._only_microbatches and not self._in_microbatch) or is_recomputing():
            return
        chosen = output[2].reshape(-1)
        # A fixed number of bins, exact in float64: bincount's output length depends on the values,
        # which the device cannot know without telling the host (a sync per forward).
        counts = chosen.new_zeros(router.num_experts, dtype=torch.float64)
        self._calls[id(router)].append(counts.index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float64)))

    def count_only_microbatches_of(self, stage) -> None:
        """From now on count only the forwards the pipeline stage `stage` (a schedules/stage_hooks.py
        `HookedStage` whose submodule holds these routers) runs for microbatches, through its
        "routing_loads" hook: not forwards through other stages over the same module (evaluation)."""
        if not self.routers:
            return
        self._only_microbatches = True
        stage.subscribe("routing_loads", self._counting_microbatch)

    @contextlib.contextmanager
    def _counting_microbatch(self, call):
        self._in_microbatch = True
        try:
            yield
        finally:
            self._in_microbatch = False

    def reset(self) -> None:
        for calls in self._calls.values():
            calls.clear()

    def n_recorded(self) -> int:
        return min((len(c) for c in self._calls.values()), default=0)

    def take_oldest(self, n: int) -> torch.Tensor:
        """The loads (routers × experts) of the oldest n recorded forward calls, which are dropped."""
        if not self.routers:
            return torch.zeros(0)
        if self.n_recorded() < n:
            raise RuntimeError(f"a routing-bias update needs the loads of {n} microbatches, but only "
                               f"{self.n_recorded()} forwards were counted")
        loads = torch.stack([sum(self._calls[id(r)][:n]) for r in self.routers])
        for calls in self._calls.values():
            del calls[:n]
        return loads

    def take_newest(self, n: int) -> torch.Tensor:
        """The loads (routers × experts) of the newest n recorded forward calls; all are dropped."""
        loads = torch.stack([sum(self._calls[id(r)][-n:]) for r in self.routers])
        self.reset()
        return loads

    def after_update(self, applied: bool, ends_minibatch: bool, n_microbatches: int, rate: float, dp_group) -> None:
        """Asynchronous schedules, after one of the stage's weight updates (`applied` False: skipped):
        when it ends a minibatch, that minibatch's bias update from the loads of its own forwards (the
        oldest n_microbatches counted) — none if any of its updates was skipped."""
        self._minibatch_skipped |= not applied
        if not ends_minibatch:
            return
        loads = self.take_oldest(n_microbatches)
        if not self._minibatch_skipped:
            nudge_biases(self.routers, loads, rate, dp_group)
        self._minibatch_skipped = False

    @torch.no_grad()
    def update_biases(self, rate: float, n_microbatches: int, dp_group) -> None:
        """Synchronous schedules: apply one step's update from the last n_microbatches forward calls of
        each router (torch's stage runs one extra forward on its first step to infer shapes; counting
        only the last n calls keeps that out)."""
        if not self.routers:
            return
        nudge_biases(self.routers, self.take_newest(n_microbatches), rate, dp_group)
