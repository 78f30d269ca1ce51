"""The action-list runtime (runtime.py), extended to run an asynchronous schedule one step at a time.

A synchronous `step()` flushes: it clears every stage's in-flight state and its action list holds
every forward and backward of the step. Here each `run_step` executes only this rank's program for
one segment of a continuous order (async_order.py: `SegmentPrograms`, with its communication planned
by comm_plan.py), without clearing runtime state, so microbatches forwarded in step k are backwarded
in step k + 1:

  - a stage's per-microbatch state is keyed by chunk id; global microbatch j uses slot j mod n_slots, the
    fewest slots the order's plays allow (async_order.held_spans; the planner checks that no slot is
    reused, nor received into, while another microbatch holds it). A slot may serve several
    microbatches in one step, one after another: each forward takes the next microbatch of its
    slot in program order, and its rows (first stage) and labels (last stage) by that id;
  - losses are kept per slot until the slot's backward;
  - before each forward (the stage's "weight_version" hook, stage_hooks.py) the stage's
    `VersionedStage` is bound to the version buffer the order assigns to that microbatch; autograd
    keeps the binding for the backward;
  - a stage's update is the program's REDUCE_GRAD action, run after the batch that sends the
    backward's gradient on, through the stage's `StageUpdater` (update/stage.py); clipping by the
    global norm may hold it (update/held.py), and the runtime asks for it where `GlobalClipping` says
    it is needed: before the stage's first forward on the version it makes, and before the stage's
    next update;
  - sends are never waited for within a step (a send whose receiver is in its next step would tie
    the two ranks' steps together); at the end of step k those of steps ≤ k − 2 are (a receive is
    posted at most one step after its send), so no more than two steps of sent tensors are kept, and
    `finish()` waits for the last ones.

The flushing entry points (`step()` / `eval()`) are not this schedule's.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

from ..torch_internals import FORWARD, _Action
from ..update.held import GlobalClipping, norm_reads, statistics_read
from ..update.stage import StageUpdater
from ..update.versions import VersionedStage
from .async_order import SegmentPrograms, replay_after
from .comm_plan import is_compute
from .registry import ScheduleSpec
from .runtime import ProgramRuntime
from .stage_hooks import ComputeCall, HookedStage

__all__ = ["AsyncPipelineSchedule", "SENDS_KEPT_FOR_STEPS"]

# Sends are waited for this many steps after the step that posted them: every receive of an
# asynchronous order is posted in its send's step or the next, so the wait never stalls a peer.
SENDS_KEPT_FOR_STEPS = 2


class AsyncPipelineSchedule(ProgramRuntime):
    def __init__(self, stages: list[HookedStage], n_microbatches: int, loss_fn: Callable, spec: ScheduleSpec,
                 n_steps: int, stage_updates: dict[int, StageUpdater], links: dict | None = None,
                 updates_held: bool = False):
        """`stage_updates`: per local stage index, what updates it (update/stage.py): the runtime calls
        `gradient_ready` when the stage's update is due, `complete` when its updates up to a unit must
        have been applied, and reads `held_unit` to plan a step's norm reads. The previous step's
        statistics go with the one norm read of a step that `statistics_read` names. `spec`: an
        asynchronous schedule (its order and placement). `updates_held`: updates wait for the global norm
        (update/held.py). `stages`: each forward is bound to its version by the stage's "weight_version"
        hook (stage_hooks.py)."""
        order, self.pp_size = spec.order, stages[0].group_size
        self.n_slots = order.n_slots(self.pp_size, n_microbatches)
        super().__init__(stages, self.n_slots, loss_fn, scale_grads=False, links=links)
        self.order, self.m = order, n_microbatches
        self.set_stage_ranks(spec.stage_ranks(self.pp_size))
        for stage in self._stages:
            stage.subscribe("weight_version", self._on_its_version)
        self.stage_updates = stage_updates
        self.clipping = GlobalClipping(order, self.pp_size, n_microbatches)
        self._slot_forwards: dict[tuple[int, int], deque[int]] = {}  # (stage, slot) → this step's forwards, in order
        self._forwarding: int | None = None  # the global microbatch of the forward running now
        self.updates_held = updates_held
        self._carry = None  # the previous step's statistics, for the step's statistics read
        self._statistics_read_at: _Action | None = None
        self._rows: dict[int, torch.Tensor] = {}  # minibatch index → its rows, while it may be forwarded
        self.step_index = 0
        self._programs = self._plan_from(0, n_steps, replay=None)

    def _plan_from(self, step: int, n_steps: int, replay) -> SegmentPrograms:
        return SegmentPrograms(self.order, self.pp_size, self.m, n_steps, self.stage_index_to_group_rank.__getitem__,
                               self._num_stages, step, replay, keep=[self.rank])

    @property
    def n_steps(self) -> int:
        return self._programs.n_steps

    @n_steps.setter
    def n_steps(self, n_steps: int) -> None:
        self._programs.n_steps = n_steps

    # --- hooks: the stages' (stage_hooks.py) and the runtime's ----------------------------------

    def _version_of(self, stage_index: int, j: int) -> int:
        return self.order.version(stage_index, self.pp_size, j, self.m)

    @contextlib.contextmanager
    def _on_its_version(self, call: ComputeCall):
        """Each stage's "weight_version" hook (stage_hooks.HOOKS): the forward runs the next
        microbatch of its slot, after the updates it awaits, on the weight version the order assigns it."""
        stage = call.stage
        j = self._forwarding = self._slot_forwards[(stage.stage_index, call.chunk_id)].popleft()
        action = _Action(stage.stage_index, FORWARD, j)
        self._await_for(action, self._carried_by(action))
        versioned: VersionedStage = stage.submod
        versioned.active = self.order.buffer(stage.stage_index, self.pp_size, self._version_of(stage.stage_index, j),
                                             self.m)
        if stage.is_first:
            call.args = (self._microbatch(j),)
        yield

    def _reduce_grad(self, action: _Action) -> None:
        """REDUCE_GRAD of stage s after the backward of global microbatch j: the stage's update."""
        s, j = action.stage_index, action.microbatch_index
        grad_scale = 1.0 if self.order.per_microbatch_updates else 1.0 / self.m
        carry = self._carried_by(action)
        if self._await_for(action, carry):
            carry = None  # read along with the norm just awaited
        self.stage_updates[s].gradient_ready(self.clipping.unit_posted(action), self._version_of(s, j), grad_scale, carry)

    def _carried_by(self, action: _Action):
        """The statistics the norm read at `action` carries: the previous step's, at the step's one
        statistics read (update/held.statistics_read), else None."""
        return self._carry if action == self._statistics_read_at else None

    def _await_for(self, action: _Action, carry=None) -> bool:
        """Apply the updates `action` needs applied (GlobalClipping); whether one was."""
        unit = self.clipping.unit_awaited(action)
        return unit is not None and self.stage_updates[action.stage_index].complete(unit, carry)

    def _microbatch(self, j: int) -> torch.Tensor:
        if j // self.m not in self._rows:
            raise ValueError(f"step {self.step_index} forwards microbatch {j} of minibatch {j // self.m}, whose rows "
                             "were not given")
        return self._rows[j // self.m].chunk(self.m)[j % self.m]

    def _after_forward(self, stage, output, target_mbs, chunk: int) -> None:
        if stage.is_last and self._loss_fn is not None:  # right after the forward of `_forwarding`
            self._losses[chunk] = self._compute_loss(output, self._microbatch(self._forwarding))

    # --- one optimizer step's segment ----------------------------------------------------------

    def run_step(self, rows: torch.Tensor | None, next_rows: torch.Tensor | None = None, carry=None) -> None:
        """Run this rank's program for step `step_index`. The first stage needs the rows of the
        minibatches it forwards and the last stage their labels: this step's, and the next one's when
        the order forwards ahead (pass `next_rows`; None on the last step). `carry`: the previous step's
        statistics, read along with the step's statistics read."""
        step = self.step_index
        self._carry = carry
        self._rows.update({k: r for k, r in ((step, rows), (step + 1, next_rows)) if r is not None})
        program = self._programs.program(self.rank, step)
        self._slot_forwards = {}
        for a in program:
            if is_compute(a) and a.computation_type == FORWARD:
                j = a.microbatch_index
                self._slot_forwards.setdefault((a.stage_index, j % self.n_slots), deque()).append(j)
                if a.stage_index in (0, self._num_stages - 1):
                    self._microbatch(j)  # its rows were given
        # The one host read of a steady step: an update's norm, with the previous step's statistics.
        held = {s: u.held_unit for s, u in self.stage_updates.items() if u.held_unit is not None}
        reads = norm_reads(program, self.clipping if self.updates_held else None, held)
        self._statistics_read_at = statistics_read(reads, self.updates_held)
        # Forwards take their rows and labels by microbatch id (_on_its_version, _after_forward).
        flat, batches = self._lowered(program, slot=lambda j: j % self.n_slots)
        self._run_program(flat, batches, [()] * self.n_slots, None, return_outputs=False)
        self._carry = None
        self._rows = {k: r for k, r in self._rows.items() if k > step - 2}
        self.retire_sends(programs_back=SENDS_KEPT_FOR_STEPS)
        self.step_index += 1

    def resume_after(self, step: int) -> None:
        """Continue a run whose steps 0..step−1 were done before it was saved (weights, versions and
        optimizer state already loaded): the next `run_step` is step `step`, preceded by the replay
        of the actions whose updates were still due, which rebuilds the in-flight state exactly."""
        self.step_index = step
        replay = replay_after(self.order, self.pp_size, self.m, step - 1, self.n_steps) if step > 0 else None
        self._programs = self._plan_from(step, self.n_steps, replay)

    def finish(self) -> None:
        """Wait for the sends still in flight (call once training has run its last step)."""
        self.wait_for_sends()
