"""Updates held for the pipeline's global gradient norm: when one must be applied, and the one record of
which each stage holds.

`max_grad_norm` clips by the global norm over all stages and dp ranks (`grad_clip_scope: global`). A stage
of an asynchronous pipeline posts its squared norm (an all-reduce on a group of its own, which no P2P
message queues behind) and holds the update, gradient kept, until the runtime needs it: before the
stage's first forward on the version it makes, or before the stage's next update (`GlobalClipping` says
when; schedules/validate.check_program plays the same rule). PipeDream-2BW's one-step delay leaves every
stage the time for the others' norms to arrive; the cost is one more gradient copy per stage while an
update is held. `grad_clip_scope: stage` clips each asynchronous stage by its own norm instead, and
applies its update at once.

A held update reads nothing on the host until it is applied: its squared norm stays a device tensor
through the all-reduce. An asynchronous stage reads its norm once per update, when the update is applied,
and one of those reads a step carries the previous step's statistics too (`statistics_read`). So at pp 2,
m 4 a step reads once on every rank under gpipe, 1F1B, interleaved 1F1B, ZBV and PipeDream-2BW, twice
under WPipe, four times under PipeDream (tests/test_host_syncs.py). The per-update read stays because a
skip cannot cheaply be decided on the device: it must leave the weights, the optimizer's state, EF's
buffers, the routing biases and the host-side LR schedule as they were, which would take a kept copy of
all of them (`torch.where`) and an LR schedule on the device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..torch_internals import FORWARD, REDUCE_GRAD, _Action
from .gradients import GradientNorms, GradNorm, read_norm

if TYPE_CHECKING:
    from .updater import Updater

__all__ = ["GlobalClipping", "HeldNorms", "norm_reads", "statistics_read"]


class GlobalClipping:
    """When a stage's update may be applied under clipping by the global gradient norm (all stages).

    The update of unit u needs every stage's squared norm of u. A stage posts its own after its last
    backward of u (the REDUCE_GRAD action; an all-reduce that nothing waits for yet) and applies the
    update, clipped, only when it must: before its first forward on the version the update makes,
    or before its next update (one update is pending per stage at most). A forward on version v needs
    the stage's v-th update, that of unit v − 1. So no stage waits as long as every stage's norm of u
    is posted before the first stage needs u's update: the one-step delay of PipeDream-2BW leaves
    that slack; a stage with delay 0 (PipeDream's last one, WPipe's second group) has none, and waits
    for the others' norms, or, when the missing norm is its own rank's later action, can never go on
    (schedules/validate.check_program finds it)."""

    def __init__(self, order, pp_size: int, n_microbatches: int):
        """`order`: the schedule's asynchronous order (schedules/async_order.AsyncOrder)."""
        self.order, self.pp_size, self.m = order, pp_size, n_microbatches

    def unit_posted(self, update: _Action) -> int:
        """The unit whose norm the stage's REDUCE_GRAD action `update` posts."""
        return self.order.unit(update.microbatch_index, self.m)

    def unit_awaited(self, action: _Action) -> int | None:
        """The unit whose global norm (and so update, on this stage) must be complete before `action`
        runs, if any: a forward's version's last update, or an update's predecessor."""
        if action.computation_type == FORWARD:
            version = self.order.version(action.stage_index, self.pp_size, action.microbatch_index, self.m)
            return version - 1 if version > 0 else None
        if action.computation_type == REDUCE_GRAD:
            unit = self.unit_posted(action)
            return unit - 1 if unit > 0 else None
        return None


def norm_reads(program, clipping: GlobalClipping | None, held: dict[int, int]) -> list[_Action]:
    """The actions of a rank's step program before which the host reads an update's gradient norm: with
    `clipping`, updates held for the global norm, those that await a held unit (`held`: stage → the unit
    it holds when the program starts, as its HeldNorms says; updated as the program runs); without, every
    update, read at once."""
    reads = []
    for entry in program:
        if not isinstance(entry, _Action):
            continue
        if clipping is None:
            if entry.computation_type == REDUCE_GRAD:
                reads.append(entry)
            continue
        awaited, unit = clipping.unit_awaited(entry), held.get(entry.stage_index)
        if awaited is not None and unit is not None and unit <= awaited:
            reads.append(entry)
            del held[entry.stage_index]
        if entry.computation_type == REDUCE_GRAD:
            held[entry.stage_index] = clipping.unit_posted(entry)
    return reads


def statistics_read(reads: list[_Action], held_for_global_norm: bool) -> _Action | None:
    """The norm read (of `norm_reads`) that also reads the previous step's statistics, in the same
    transfer: the step's first one for updates held for the global norm (it already waits for every
    stage's norm), its last for updates applied at once (read right after the stage's own backward:
    the last leaves the other ranks the most time to have ended the previous step). None: no norm is
    read in the step, and the statistics are read at its end."""
    if not reads:
        return None
    return reads[0] if held_for_global_norm else reads[-1]


class _Held:
    """An update held until its global norm is in: the all-reduce of the squared norm of `unit`, posted
    in step `step` by `stages`."""

    def __init__(self, unit: int, squared: torch.Tensor, work, stages: list[int], step: int):
        self.unit, self.squared, self.work, self.stages, self.step = unit, squared, work, stages, step


class HeldNorms:
    """The norms of this rank's asynchronous stages' updates: read at once (a stage's own norm, or no
    clipping across stages), or held for the pipeline's (`holds_for_global_norm`); per local module index,
    the update it holds, if any."""

    def __init__(self, norms: GradientNorms, global_norm: bool):
        self.norms, self.layout = norms, norms.layout
        self.holds_for_global_norm = global_norm and self.layout.pp_size > 1
        self._held: dict[int, _Held] = {}  # local module index → its held update

    def post(self, index: int, unit: int, updater: Updater, carry=None) -> GradNorm | None:
        """Local module `index` has the gradient of `unit`: its own norm, to apply the update with now; or,
        clipping globally, None: the pipeline's norm is on its way, and `complete` returns it. `carry`:
        statistics the norm's host read also reads."""
        if index in self._held:
            raise RuntimeError(f"stage {self.norms.stage_ids[index]} posts unit {unit} while unit "
                               f"{self._held[index].unit} is still held: complete it first")
        squared = self.norms.prepare(updater)
        if not self.holds_for_global_norm:
            return read_norm(squared, carry)
        if len(self.norms.modules) > 1:  # config_checks refuses it first, naming the order's deadlock
            raise RuntimeError("clipping by the global norm all-reduces one norm per update on each rank: it needs "
                               "one stage per rank (grad_clip_scope: stage clips each stage by its own)")
        total = squared.to(self.layout.device, copy=True).reshape(1)  # the recorded value stays this rank's
        work = dist.all_reduce(total, group=self.layout.norm_pp_group, async_op=True)
        self._held[index] = _Held(unit, total, work, updater.stages, self.norms.report.step)
        return None

    def complete(self, index: int, through_unit: int | None = None, carry=None) -> GradNorm | None:
        """The norm of local module `index`'s held update (if it is of a unit <= `through_unit`), waited
        for: its update is to be applied with it now (None: no such update held). A skip decided after its
        gradient's step has reported is reported as such."""
        held = self._held.get(index)
        if held is None or (through_unit is not None and held.unit > through_unit):
            return None
        del self._held[index]
        held.work.wait()
        norm = read_norm(held.squared, carry)
        if not math.isfinite(norm.value):
            self.norms.report.record_skip_of_reported_step(held.stages, held.step)
        return norm

    def held_unit(self, index: int) -> int | None:
        """The unit whose update local module `index` holds (None: none)."""
        held = self._held.get(index)
        return None if held is None else held.unit

    @property
    def held_indices(self) -> list[int]:
        """The local modules whose update is held for its norm, in index order."""
        return sorted(self._held)
