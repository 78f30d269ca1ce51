"""torch's action-list runtime, extended to run an asynchronous schedule one step at a time.

torch's `step()` flushes: it clears every stage's in-flight state and its action list must hold
every forward and backward of the step. Here each `run_step` executes only this rank's segment of a
continuous order (see async_order.py) through torch's own `_step_microbatches`, without clearing
runtime state, so microbatches forwarded in step k are backwarded in step k + 1:

  - torch's per-stage state is keyed by chunk id; global microbatch j uses slot j mod 2m (at most
    2m microbatches are ever in flight on a stage);
  - losses are kept per slot (torch's list would be cleared at the end of every call);
  - before each forward the stage's `VersionedStage` is bound to the version buffer the order
    assigns to that microbatch; autograd keeps the binding for the backward;
  - communication: a receive right before the compute that needs it, a send right after the compute
    that produces it; sends complete asynchronously.

`step()` / `eval()` (torch's flushing entry points) are not used on this schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import FORWARD, _Action, _PipelineScheduleRuntime

from .async_order import AsyncOrder
from .validate import lower_in_order
from .weight_versions import VersionedStage

__all__ = ["AsyncPipelineSchedule"]


class AsyncPipelineSchedule(_PipelineScheduleRuntime):
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, order: AsyncOrder,
                 n_steps: int, update_stage: Callable[[int, int, float], None]):
        """`update_stage(stage_index, version, grad_scale)` is called when a stage's update is due:
        after the backward of a minibatch's last microbatch (grad_scale 1/m), or after every backward
        for per-microbatch orders (grad_scale 1); `version` is the one the gradient was taken at."""
        self.n_slots = 2 * n_microbatches
        super().__init__(stages=stages, n_microbatches=self.n_slots, loss_fn=loss_fn, scale_grads=False)
        self.order, self.m, self.n_steps = order, n_microbatches, n_steps
        self.pp_size = stages[0].group_size
        self.stage_index_to_group_rank = {s: s % self.pp_size for s in range(self._num_stages)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            stage.forward_one_chunk = self._bound_forward(stage, stage.forward_one_chunk)
            stage.backward_one_chunk = self._updating_backward(stage, stage.backward_one_chunk)
        self.update_stage = update_stage
        self._slot_owner: dict[tuple[int, int], int] = {}  # (stage, slot) → global microbatch
        self._losses: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}  # minibatch index → its rows, while it may be forwarded
        self.step_index = 0

    # --- torch hooks --------------------------------------------------------------------------

    def _version_of(self, stage: PipelineStage, chunk_id: int) -> int:
        j = self._slot_owner[(stage.stage_index, chunk_id)]
        return self.order.version(stage.stage_index, self.pp_size, j, self.m)

    def _bound_forward(self, stage: PipelineStage, forward):
        versioned: VersionedStage = stage.submod

        def forward_on_version(chunk_id, *args, **kwargs):
            version = self._version_of(stage, chunk_id)
            versioned.active = self.order.buffer(stage.stage_index, self.pp_size, version, self.m)
            return forward(chunk_id, *args, **kwargs)

        return forward_on_version

    def _updating_backward(self, stage: PipelineStage, backward):
        def backward_then_update(chunk_id, *args, **kwargs):
            result = backward(chunk_id, *args, **kwargs)
            j = self._slot_owner[(stage.stage_index, chunk_id)]
            if self.order.per_microbatch_updates:
                self.update_stage(stage.stage_index, self._version_of(stage, chunk_id), 1.0)
            elif j % self.m == self.m - 1:
                self.update_stage(stage.stage_index, self._version_of(stage, chunk_id), 1.0 / self.m)
            return result

        return backward_then_update

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        if stage.is_last and self._loss_fn is not None:
            self._losses[mb_index] = self._compute_loss(output, target_mbs[mb_index], loss_kwargs)

    def _maybe_get_loss(self, stage, mb_index):
        return self._losses.pop(mb_index) if stage.is_last else None

    # --- one optimizer step's segment ----------------------------------------------------------

    def run_step(self, rows: torch.Tensor | None, next_rows: torch.Tensor | None = None) -> None:
        """Run this rank's segment of step `step_index`. The first stage needs the rows of the
        minibatches it forwards and the last stage their labels: this step's, and the next one's when
        the order forwards ahead (pass `next_rows`; None on the last step)."""
        step, m = self.step_index, self.m
        self._rows.update({k: r for k, r in ((step, rows), (step + 1, next_rows)) if r is not None})
        ops = self.order.segment(self.rank, self.pp_size, m, step, self.n_steps)
        arg_mbs: list = [()] * self.n_slots
        target_mbs: list = [None] * self.n_slots
        last_stage = self._num_stages - 1
        for a in ops:
            j = a.microbatch_index
            slot = j % self.n_slots
            self._slot_owner[(a.stage_index, slot)] = j
            if a.computation_type != FORWARD or a.stage_index not in (0, last_stage):
                continue
            if j // m not in self._rows:
                raise ValueError(f"step {step} forwards microbatch {j} of minibatch {j // m}, whose rows were not given")
            microbatch = self._rows[j // m].chunk(m)[j % m]
            if a.stage_index == 0:
                arg_mbs[slot] = (microbatch,)
            if a.stage_index == last_stage:
                target_mbs[slot] = microbatch
        lowered = [
            _Action(a.stage_index, a.computation_type, a.microbatch_index % self.n_slots)
            for a in lower_in_order(ops, self.stage_index_to_group_rank.__getitem__, self._num_stages)
        ]
        self.pipeline_order_with_comms = {self.rank: lowered}
        # What torch's step() does besides flushing: tell the stages a backward follows.
        for stage in self._stages:
            stage.has_backward = self._has_backward
        self._step_microbatches(arg_mbs, None, target_mbs, return_outputs=False)
        self._rows = {k: r for k, r in self._rows.items() if k > step - 2}
        self.step_index += 1
