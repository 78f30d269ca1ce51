"""From accumulated gradients to an update: dp averaging, the gradient norm, clipping, the optimizer
step — or its skip, when the norm is non-finite (the weights, optimizer and EF state and the LR
schedule then stay as they are).

`max_grad_norm` clips by the global norm over all stages and dp ranks (`grad_clip_scope: global`):
the same rule for every schedule. A synchronous step all-reduces the stages' squared norms at once
(its stages wait for each other anyway). Emulated stages run in one process and sum theirs. A stage
of an asynchronous pipeline posts its squared norm (an all-reduce on a group of its own, which no
P2P message queues behind) and holds the update, gradient kept, until the runtime needs it: before
the stage's first forward on the version it makes, or before the stage's next update
(schedules/async_order.GlobalClipping says when). PipeDream-2BW's one-step delay leaves every
stage the time for the others' norms to arrive; the cost is one more gradient copy per stage while
an update is held. `grad_clip_scope: stage` clips each asynchronous stage by its own norm instead,
and applies its update at once.

A held update reads nothing on the host until it is applied: its squared norm stays a device tensor
through the all-reduce, and what the step reports of it (the norm, the stages whose gradient was
non-finite) stays on the device, written into the step's statistics (metrics.ReducedStepStats) and read
with them. On a GPU the host can then queue the next forward while the backward still runs, instead of
waiting for it there. A synchronous step reads its norm in the same transfer as the previous step's
statistics; an asynchronous stage reads it once per update, when the update is applied, and one of
those reads a step carries the previous step's statistics too (where: async_order.statistics_read).
So at pp 2, m 4 a step reads once on every rank under gpipe, 1F1B, interleaved 1F1B, ZBV and
PipeDream-2BW, twice under WPipe, four times under PipeDream (tests/test_host_syncs.py). The
per-update read stays because a skip cannot cheaply be decided on the device: it must leave the
weights, the optimizer's state (AdamW's moments decay even on a zero gradient), EF's buffers, the
routing biases and the host-side LR schedule as they were, which would take a kept copy of all of
them (`torch.where`) and an LR schedule on the device. The emulator reads each update's norms once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .config import OptimizerConfig, TrainConfig
from .optim import lr_scheduler_from_config, optimizer_from_config
from .optim.error_feedback import ErrorFeedback
from .optim.param_groups import decay_parameter_names
from .torch_internals import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["GradNorm", "Updater", "Updates"]


class GradNorm(NamedTuple):
    """An update's gradient norm as the host read it (`value`: whether to skip the update) and where it
    was computed (`on_device`, a float64 scalar): clipping scales by the coefficient computed there, so
    the value read is never copied back (on a GPU a blocking upload is a sync)."""

    value: float
    on_device: torch.Tensor


class Updater:
    """The optimizer and LR schedule of parameters that are updated together (the engine's modules
    `module_indices`, which hold stages `stages`)."""

    def __init__(self, config: TrainConfig, module_indices: list[int], stages: list[int], modules: list, order):
        self.module_indices, self.stages = module_indices, stages
        self.stage = stages[0]
        named_params = [np for module in modules for np in module.named_parameters()]
        self.params = [p for _, p in named_params]
        self.optimizer = optimizer_from_config(config, named_params, decay_parameter_names(modules))
        # What applies an update: the optimizer, or Error Feedback around it.
        self.stepper = ErrorFeedback(self.optimizer, config.ef_lambda) if config.ef else self.optimizer
        # The LR schedule advances once per update: m times a step when stages update per microbatch.
        per_step = config.n_microbatches if order is not None and order.per_microbatch_updates else 1
        self.lr_scheduler = lr_scheduler_from_config(config, self.optimizer, per_step)
        self.updates_planned = config.max_steps * per_step
        # Updates skipped (non-finite norm) so far: the LR schedule does not count them, the run's length does.
        # A checkpoint keeps it (checkpoint/training_state.py), as it keeps the schedule.
        self.skipped_updates = 0
        self.trajectory_last_update = config.ef and config.ef_last_update == "trajectory"

    @property
    def next_update_is_last(self) -> bool:
        """Whether the next update decided is the run's last of these parameters (its max_steps-th step's
        last): the LR schedule counts the updates applied, and a resumed run restores it. A run a callback
        stops before max_steps has its last update decided before the stop is known."""
        return self.lr_scheduler.last_epoch + self.skipped_updates + 1 == self.updates_planned

    @property
    def extrapolates_next_update(self) -> bool:
        """Whether Error Feedback applies its extrapolation λ(u_t − u_{t−1}) to the next update: always, but
        to the run's last under ef_last_update trajectory (then the final weights lie on the trajectory)."""
        return not (self.trajectory_last_update and self.next_update_is_last)


class _Held:
    """An update held until its global norm is in: the all-reduce of the squared norm of `unit`, posted
    in step `step` by `stages`."""

    def __init__(self, unit: int, squared: torch.Tensor, work, stages: list[int], step: int):
        self.unit, self.squared, self.work, self.stages, self.step = unit, squared, work, stages, step


class Updates:
    """Applies this rank's updates, and records what a step reports of them: per stage the squared
    gradient norm of each update, the largest version age, the updates skipped; the stages whose
    gradient was non-finite."""

    def __init__(self, config: OptimizerConfig, layout, modules: list, stage_ids: list[int], gradients_averaged: bool):
        """`gradients_averaged`: FSDP has averaged the gradients over dp already (reduce-scatter)."""
        self.max_norm, self.layout, self.modules, self.stage_ids = config.max_grad_norm, layout, modules, stage_ids
        self.global_norm = config.clips_by_global_norm
        self.gradients_averaged = gradients_averaged or layout.dp_size == 1
        self._held: dict[int, _Held] = {}  # local module index → its held update
        self._steps = self._reported_steps = 0  # steps started; steps whose skipped updates were taken
        self.skipped: dict[int, int] = {}  # per stage, updates skipped since the last take_skipped
        self._skipped_earlier: dict[int, int] = {}  # of them, those of a reported step's gradient
        self.start_step()

    def start_step(self) -> None:
        self._sq_norms: dict[int, list[torch.Tensor]] = {}  # per updater's stage, each update's squared norm
        self._stage_sq_norms: list[tuple[int, torch.Tensor]] = []  # (stage, its squared norm) per update
        self.ages: dict[int, int] = {}
        self._steps += 1

    # --- what a step reports (device tensors: nothing is read on the host) -------------------------

    def grad_sq_norm(self) -> torch.Tensor | None:
        """The squared gradient norm this rank reports for the step, a float64 device scalar (None
        without an update): per updater the mean over its updates (m of them with per-microbatch
        updates), summed — in the order a sum of the values on the host would add them."""
        total = None
        for norms in self._sq_norms.values():
            summed = norms[0]
            for norm in norms[1:]:
                summed = summed + norm
            mean = summed / len(norms)
            total = mean if total is None else total + mean
        return total

    def nonfinite_stages(self) -> dict[int, torch.Tensor]:
        """Per stage updated in the step, whether its gradient was non-finite in one of its updates: a
        0/1 float64 device scalar."""
        flags: dict[int, torch.Tensor] = {}
        for stage, squared in self._stage_sq_norms:
            flag = (~torch.isfinite(squared)).double()
            flags[stage] = flag if stage not in flags else torch.maximum(flags[stage], flag)
        return flags

    def take_skipped(self) -> tuple[dict[int, int], dict[int, int]]:
        """Per stage, the updates skipped since the last call (call once per step, at its report), and
        among them those of an earlier step's gradient: held for their global norm past that step's
        report (the next step, an evaluation or a checkpoint decided them)."""
        taken = self.skipped, self._skipped_earlier
        self.skipped, self._skipped_earlier = {}, {}
        self._reported_steps = self._steps
        return taken

    @property
    def holds_for_global_norm(self) -> bool:
        """Whether a posted update waits for the pipeline's global norm (so may be decided, applied or
        skipped, after its step has reported)."""
        return self.global_norm and self.layout.pp_size > 1

    # --- the three ways to a norm ----------------------------------------------------------------

    def apply_synchronous(self, updater: Updater, read_along=None) -> bool:
        """A synchronous step: the norm over this rank's stages and, all-reduced, the pipeline's. Its
        host read carries `read_along` (the previous step's ReducedStepStats, read_with) in the same
        transfer: the step's one read."""
        squared = self._prepare(updater)
        if self.layout.pp_size > 1:
            squared = squared.to(self.layout.device, copy=True)  # the recorded value stays this rank's
            dist.all_reduce(squared, group=self.layout.pp_group)
        return self.step(updater, self._read_norm(squared, read_along))

    def apply_together(self, updaters: list[Updater], steppers: list) -> list[bool]:
        """Stages emulated in one process, each through its own stepper: clipped by the norm of all of
        them (or each by its own); returns which were applied."""
        squared = [self._prepare(updater) for updater in updaters]
        if self.global_norm:  # added in order, as a sum of the values on the host adds them
            total = squared[0]
            for s in squared[1:]:
                total = total + s
            squared = [total] * len(updaters)
        norms = torch.stack([s.sqrt() for s in squared])
        values = norms.tolist()
        return [self.step(u, GradNorm(value, norm), stepper)
                for u, value, norm, stepper in zip(updaters, values, norms, steppers)]

    def post(self, index: int, unit: int, updater: Updater, carry=None) -> GradNorm | None:
        """A stage of an asynchronous pipeline has the gradient of `unit`: its own norm, to apply the update
        with now; or, clipping globally, None: the pipeline's norm is on its way, and `complete` returns it.
        `carry`: statistics the norm's host read also reads (`read_with`)."""
        if index in self._held:
            raise RuntimeError(f"stage {self.stage_ids[index]} posts unit {unit} while unit "
                               f"{self._held[index].unit} is still held: complete it first")
        squared = self._prepare(updater)
        if not self.holds_for_global_norm:
            return self._read_norm(squared, carry)
        if len(self.modules) > 1:  # config_checks refuses it first, naming the order's deadlock
            raise RuntimeError("clipping by the global norm all-reduces one norm per update on each rank: it needs "
                               "one stage per rank (grad_clip_scope: stage clips each stage by its own)")
        total = squared.to(self.layout.device, copy=True).reshape(1)  # the recorded value stays this rank's
        work = dist.all_reduce(total, group=self.layout.norm_pp_group, async_op=True)
        self._held[index] = _Held(unit, total, work, updater.stages, self._steps)
        return None

    def complete(self, index: int, through_unit: int | None = None, carry=None) -> GradNorm | None:
        """The norm of local module `index`'s held update (if it is of a unit <= `through_unit`), waited
        for: its update is to be applied with it now (None: no such update held)."""
        held = self._held.get(index)
        if held is None or (through_unit is not None and held.unit > through_unit):
            return None
        del self._held[index]
        held.work.wait()
        norm = self._read_norm(held.squared, carry)
        if held.step <= self._reported_steps and not math.isfinite(norm.value):  # its step has reported
            for stage in held.stages:
                self._skipped_earlier[stage] = self._skipped_earlier.get(stage, 0) + 1
        return norm

    @property
    def held_indices(self) -> list[int]:
        """The local modules whose update is held for its norm, in index order."""
        return sorted(self._held)

    @staticmethod
    def _read_norm(squared: torch.Tensor, carry=None) -> GradNorm:
        """The host read of an update's norm (from its squared norm, a float64 device scalar), with the
        statistics `carry` (a step's ReducedStepStats) in the same transfer, if given."""
        norm = squared.sqrt().reshape(())
        return GradNorm(carry.read_with(norm)[0] if carry is not None else norm.item(), norm)

    # --- the update --------------------------------------------------------------------------------

    def _prepare(self, updater: Updater) -> torch.Tensor:
        """Average the gradients over dp; this rank's squared norm of them, a float64 scalar on the
        gradients' device that nothing has read on the host (recorded per stage for the step's report).
        dp replicas then hold the same gradient."""
        if not self.gradients_averaged:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in updater.params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.layout.dp_group)
            flat /= self.layout.dp_size
            for p, synced in zip(updater.params, _unflatten_dense_tensors(flat, grads)):
                p.grad = synced
        squared = None
        for index in updater.module_indices:
            grads = [p.grad for p in self.modules[index].parameters() if p.grad is not None]
            if not grads:
                norm = torch.zeros((), device=self.layout.device)
            else:
                norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if isinstance(norm, DTensor):  # sharded gradients: the norm over all dp shards
                norm = norm.full_tensor()
            stage_squared = norm.double() ** 2
            self._stage_sq_norms.append((self.stage_ids[index], stage_squared))
            squared = stage_squared if squared is None else squared + stage_squared
        self._sq_norms.setdefault(updater.stage, []).append(squared)
        return squared

    def step(self, updater: Updater, norm: GradNorm, stepper=None) -> bool:
        """Clip to max_grad_norm by `norm` and step the optimizer (through `stepper`: the emulator's,
        when emulating) and the LR schedule; a non-finite `norm` skips the update (the pipeline still
        publishes its unchanged master as the next version, and the emulator counts one); the run's last
        update takes Error Feedback's extrapolation back under ef_last_update trajectory (the decision:
        Updater.extrapolates_next_update). Returns whether the update was applied."""
        stepper = stepper or updater.stepper
        if not math.isfinite(norm.value):
            for param in updater.params:
                param.grad = None
            if hasattr(stepper, "skip"):
                stepper.skip()
            updater.skipped_updates += 1
            for stage in updater.stages:
                self.skipped[stage] = self.skipped.get(stage, 0) + 1
            return False
        if self.max_norm > 0:
            # The coefficient max_norm / (norm + 1e-6), clamped to 1, in float32, computed where the norm is.
            torch.nn.utils.clip_grads_with_norm_(updater.params, self.max_norm, norm.on_device.float(), foreach=True)
        if updater.extrapolates_next_update:
            stepper.step()
        else:  # only Error Feedback (through the emulator, when emulating) has an extrapolation to leave out
            stepper.step(extrapolate=False)
        updater.lr_scheduler.step()
        return True
