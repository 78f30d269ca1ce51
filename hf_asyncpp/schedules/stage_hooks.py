"""torch's PipelineStage with one explicit, ordered list of hooks around its compute.

torch's runtime runs every compute action of a program through three methods of the stage:
`forward_one_chunk` (a microbatch's forward), `backward_one_chunk` (its full backward, or the input
half of a split one) and `backward_weight_one_chunk` (the weight half). `HookedStage` overrides the
three to enter the hooks subscribed to it around torch's own method, in the order `HOOKS` states,
whatever order they were subscribed in. Everything the project does around a stage's compute
subscribes here; nothing replaces a stage's methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import PipelineStage
from ..torch_internals import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    _ComputationType,
)

__all__ = ["HOOKS", "ComputeCall", "HookedStage"]

# The hooks around a compute call, outermost first, each with the kinds of call it wraps.
HOOKS: dict[str, frozenset[_ComputationType]] = {
    # schedules/async_runtime.py: takes the microbatch the forward runs, applies the updates it
    # awaits (an optimizer step, maybe a host read of the global norm), binds its weight version and
    # the first stage's rows. Outermost: everything inside runs on that version and those rows.
    "weight_version": frozenset({FORWARD}),
    # models/routing_bias.py: marks the call as a microbatch's forward, so its routers' loads count
    # (forwards through the same module by other stages, an evaluation's, do not).
    "routing_loads": frozenset({FORWARD}),
    # metrics.py: innermost, so busy time is torch's compute alone, without an update applied
    # before it or the other hooks' bookkeeping.
    "compute_time": frozenset({FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}),
}


@dataclass
class ComputeCall:
    """One compute call of a stage, as its hooks see it."""

    stage: HookedStage
    kind: _ComputationType  # FORWARD, FULL_BACKWARD, BACKWARD_INPUT or BACKWARD_WEIGHT
    chunk_id: int  # torch's microbatch slot
    args: tuple = ()  # a forward's inputs from outside the stage (first stage): a hook may replace them


Hook = Callable[[ComputeCall], contextlib.AbstractContextManager]


class HookedStage(PipelineStage):
    """A `PipelineStage` whose compute calls run inside the hooks subscribed to it (`HOOKS`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.hooks: dict[str, Hook] = {}  # position in HOOKS → the hook subscribed there

    def subscribe(self, position: str, hook: Hook) -> None:
        """Run `hook(call)`, a context manager, around this stage's compute calls of the kinds
        `HOOKS[position]` names, at that position."""
        if position not in HOOKS:
            raise ValueError(f"no hook position {position!r}; the positions are {list(HOOKS)}")
        if position in self.hooks:
            raise ValueError(f"stage {self.stage_index} already has a {position!r} hook")
        self.hooks[position] = hook

    @contextlib.contextmanager
    def _hooked(self, call: ComputeCall):
        with contextlib.ExitStack() as entered:
            for position, kinds in HOOKS.items():
                if position in self.hooks and call.kind in kinds:
                    entered.enter_context(self.hooks[position](call))
            yield call

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: dict | None = None,
                          save_forward_output: bool = True):
        with self._hooked(ComputeCall(self, FORWARD, fwd_chunk_id, args)) as call:
            return super().forward_one_chunk(fwd_chunk_id, call.args, kwargs, save_forward_output=save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        with self._hooked(ComputeCall(self, FULL_BACKWARD if full_backward else BACKWARD_INPUT, bwd_chunk_id)):
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self._hooked(ComputeCall(self, BACKWARD_WEIGHT, bwd_chunk_id)):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
