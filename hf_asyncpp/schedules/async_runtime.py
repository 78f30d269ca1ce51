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
  - communication: a receive right before the compute that needs it; sends are issued by this class
    right after the compute that produces them and never waited for within a step (torch's runtime
    would wait for a call's sends at its end, and a send whose receiver is in its next step would
    then tie the two ranks' steps together — a deadlock for WPipe's loop placement). `finish()`
    waits for the last ones. Every message carries a tag naming (direction, receiving stage, slot):
    with two stages per rank, activations and gradients share a pair of ranks and would otherwise
    be matched in posting order, which an asynchronous order does not keep aligned.

`step()` / `eval()` (torch's flushing entry points) are not used on this schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import FORWARD, _Action, _batch_p2p, _PipelineScheduleRuntime, _wait_batch_p2p

from .async_order import AsyncOrder, replay_after
from .validate import lower_in_order
from .weight_versions import VersionedStage

__all__ = ["AsyncPipelineSchedule"]


class AsyncPipelineSchedule(_PipelineScheduleRuntime):
    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, order: AsyncOrder,
                 n_steps: int, update_stage: Callable[[int, int, float], None]):
        """`update_stage(stage_index, version, grad_scale)` is called when a stage's update is due:
        after the backward of a minibatch's last microbatch (grad_scale 1/m), or after every backward
        for per-microbatch orders (grad_scale 1); `version` is the one the gradient was taken at."""
        # Chunk slots: in-flight microbatch ids on a stage span less than m + p (2m for 2BW-like orders).
        self.n_slots = max(2 * n_microbatches, n_microbatches + stages[0].group_size + 1)
        super().__init__(stages=stages, n_microbatches=self.n_slots, loss_fn=loss_fn, scale_grads=False)
        self.order, self.m, self.n_steps = order, n_microbatches, n_steps
        self.pp_size = stages[0].group_size
        self.stage_index_to_group_rank = {s: s % self.pp_size for s in range(self._num_stages)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            stage.forward_one_chunk = self._bound_forward(stage, stage.forward_one_chunk)
            stage.backward_one_chunk = self._updating_backward(stage, stage.backward_one_chunk)
            stage.get_fwd_recv_ops = self._tagged(stage.get_fwd_recv_ops, "F", stage.stage_index)
            stage.get_bwd_recv_ops = self._tagged(stage.get_bwd_recv_ops, "B", stage.stage_index)
        self.update_stage = update_stage
        self._slot_owner: dict[tuple[int, int], int] = {}  # (stage, slot) → global microbatch
        self._losses: dict[int, torch.Tensor] = {}
        self._rows: dict[int, torch.Tensor] = {}  # minibatch index → its rows, while it may be forwarded
        self._in_flight: set[tuple[int, int]] = set()  # (stage, microbatch) forwarded, not yet backwarded
        self._pending_sends: list = []  # issued sends (lists of Work) not yet known to be complete
        self._replay: list[_Action] = []  # run before the next segment when resuming (async_order.replay_after)
        self.step_index = 0

    # --- torch hooks --------------------------------------------------------------------------

    def _tag(self, direction: str, receiving_stage: int, slot: int) -> int:
        return 1 + (receiving_stage * 2 + (direction == "B")) * self.n_slots + slot

    def _tagged(self, make_ops, direction: str, receiving_stage: int):
        """`make_ops(slot)` with every P2P op tagged for the message it carries."""

        def tagged_ops(slot, *args, **kwargs):
            tag = self._tag(direction, receiving_stage, slot)
            return [dist.P2POp(op.op, op.tensor, group=op.group, tag=tag, group_peer=op.group_peer)
                    for op in make_ops(slot, *args, **kwargs)]

        return tagged_ops

    def _version_of(self, stage: PipelineStage, chunk_id: int) -> int:
        j = self._slot_owner[(stage.stage_index, chunk_id)]
        return self.order.version(stage.stage_index, self.pp_size, j, self.m)

    def _bound_forward(self, stage: PipelineStage, forward):
        versioned: VersionedStage = stage.submod

        def forward_on_version(chunk_id, *args, **kwargs):
            version = self._version_of(stage, chunk_id)
            versioned.active = self.order.buffer(stage.stage_index, self.pp_size, version, self.m)
            output = forward(chunk_id, *args, **kwargs)
            if not stage.is_last and self.stage_index_to_group_rank[stage.stage_index + 1] != self.rank:
                send = self._tagged(stage.get_fwd_send_ops, "F", stage.stage_index + 1)
                self._pending_sends.append(_batch_p2p(send(chunk_id)))
            return output

        return forward_on_version

    def _updating_backward(self, stage: PipelineStage, backward):
        def backward_then_update(chunk_id, *args, **kwargs):
            result = backward(chunk_id, *args, **kwargs)
            if not stage.is_first and self.stage_index_to_group_rank[stage.stage_index - 1] != self.rank:
                send = self._tagged(stage.get_bwd_send_ops, "B", stage.stage_index - 1)
                self._pending_sends.append(_batch_p2p(send(chunk_id)))
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
        ops = self._replay + self.order.segment(self.rank, self.pp_size, m, step, self.n_steps)
        self._replay = []
        arg_mbs: list = [()] * self.n_slots
        target_mbs: list = [None] * self.n_slots
        last_stage = self._num_stages - 1
        for a in ops:
            j = a.microbatch_index
            slot = j % self.n_slots
            if a.computation_type == FORWARD:
                live = self._slot_owner.get((a.stage_index, slot))
                if live is not None and live != j and (a.stage_index, live) in self._in_flight:
                    raise RuntimeError(f"stage {a.stage_index}: slot {slot} of microbatch {live} reused by {j}")
                self._in_flight.add((a.stage_index, j))
            else:
                self._in_flight.discard((a.stage_index, j))
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
        if not self._stages_forward_initialized:
            # torch infers shapes on its first call from slot 0's microbatch, which a resumed run's
            # first segment may not use: any microbatch of this segment serves (only shapes matter).
            arg_mbs[0] = arg_mbs[0] or next((a for a in arg_mbs if a), ())
            target_mbs[0] = target_mbs[0] if target_mbs[0] is not None else next(
                (t for t in target_mbs if t is not None), None)
        lowered = [
            _Action(a.stage_index, a.computation_type, a.microbatch_index % self.n_slots)
            for a in lower_in_order(ops, self.stage_index_to_group_rank.__getitem__, self._num_stages, sends=False)
        ]
        self.pipeline_order_with_comms = {self.rank: lowered}
        # What torch's step() does besides flushing: tell the stages a backward follows.
        for stage in self._stages:
            stage.has_backward = self._has_backward
        self._step_microbatches(arg_mbs, None, target_mbs, return_outputs=False)
        self._rows = {k: r for k, r in self._rows.items() if k > step - 2}
        self._pending_sends = [works for works in self._pending_sends if not all(w.is_completed() for w in works)]
        self.step_index += 1

    def resume_after(self, step: int) -> None:
        """Continue a run whose steps 0..step−1 were done before it was saved (weights, versions and
        optimizer state already loaded): the next `run_step` is step `step`, preceded by the replay
        of the actions whose updates were still due, which rebuilds the in-flight state exactly."""
        self.step_index = step
        if step > 0:
            self._replay = replay_after(self.order, self.pp_size, self.m, step - 1, self.n_steps)[self.rank]

    def finish(self) -> None:
        """Wait for the sends still in flight (call once training has run its last step)."""
        while self._pending_sends:
            _wait_batch_p2p(self._pending_sends.pop())
