"""One training step over the pipeline: the engine both front ends drive.

A step on one rank: feed the minibatch (first stage) and its labels (last stage) to the schedule,
which runs forward/backward of n_microbatches microbatches over this rank's stages; average
gradients over the dp group; clip by the global norm (all stages, all dp ranks); step the optimizer
and the LR schedule — unless that norm is non-finite: then the update is skipped (updates.py,
resilience.py). Asynchronous pipelines update each stage when the order says (its REDUCE_GRAD), held
until the global norm is in where clipping needs it. The minibatch loss is the mean of the microbatch
losses (torch's runtime divides gradients by n_microbatches), as in gradient accumulation.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from .config import TrainConfig
from .emulation import EmulatedPipeline
from .memory import state_bytes
from .metrics import ComputeTimer, ReducedStepStats, StepResult, idle_fraction
from .models import build_model, build_stage_modules, build_stages, plan_stages
from .models.split import release_foreign_modules
from .models.stage_io import stage_io
from .models.construct import has_safetensors
from .models.compile import compile_layers
from .models.recompute import apply_activation_checkpointing
from .models.pipeline_loss import PipelineLoss
from .optim.error_feedback import ErrorFeedback
from .parallel.fsdp import compute_dtype, fully_shard_stage, reduce_dtype, shard_parameters, unshard_parameters
from .parallel.mesh import ParallelLayout, broadcast_from_first_replica, start_communicators
from .resilience import NonFiniteGuard, TerminationRequest
from .schedules import ScheduleError, build_schedule, get_schedule_spec
from .schedules.async_order import replay_after
from .schedules.runtime import build_eval_schedule
from .schedules.async_runtime import AsyncPipelineSchedule
from .schedules.stage_hooks import HookedStage
from .schedules.weight_versions import VersionedStage
from .updates import Updater, Updates

__all__ = ["PipelineEngine", "build_full_model"]


def build_full_model(config: TrainConfig, model_config) -> torch.nn.Module:
    """The whole HF model, identically on every rank: from init_from, or initialized from the seed
    exactly as the stages a pipeline builds for itself (models/construct.py)."""
    if config.init_from:
        return AutoModelForCausalLM.from_pretrained(config.init_from, config=model_config, dtype=torch.float32).train()
    return build_model(model_config, config.seed)


class PipelineEngine:
    def __init__(self, config: TrainConfig, model_config, layout: ParallelLayout, model: torch.nn.Module | None = None):
        self.config, self.layout = config, layout
        self.spec = get_schedule_spec(config.schedule).starting_synchronously(config.sync_steps)
        order, m = self.spec.order, config.n_microbatches
        # An asynchronous schedule on one rank is emulated: the stages it would have at depth
        # emulate_pp_size run in this process (emulation.py). Otherwise this rank's stages of a pipeline.
        emulating = order is not None and layout.pp_size == 1
        depth = (config.emulate_pp_size or 1) if emulating else layout.pp_size
        n_stages = self.spec.n_stages(depth)
        # Every communicator of the run set up and used once, now, before any other operation on them
        # (mesh.start_communicators). Each pair of neighbouring ranks talks on its own group (its own
        # NCCL stream): mesh.link_groups.
        links = start_communicators(layout, [] if emulating else self.spec.rank_pairs(layout.pp_size),
                                    asynchronous=order is not None)
        self.plan = plan_stages(model_config, n_stages, config.stage_balance, config.stage_boundaries)
        self.stage_ids = list(range(n_stages)) if emulating else self.spec.stage_indices(layout.pp_size, layout.pp_rank)
        # FSDP2 over dp (parallel/fsdp.py): parameters, gradients, optimizer state, weight versions
        # and EF buffers hold 1/dp each. At dp 1 it still provides the bf16 compute policy.
        dtype = None if emulating else compute_dtype(config.mixed_precision, layout.device, config.fsdp)
        reduce = reduce_dtype(config.grad_reduce_dtype, dtype)
        self.fsdp_managed = config.fsdp and not emulating and (layout.dp_size > 1 or dtype is not None)
        if model is None and (not config.init_from or has_safetensors(config.init_from)):
            # Only this rank's stages are allocated, and only their tensors of init_from read: when
            # sharded over dp, only this replica's rows of them.
            read_rows = self.fsdp_managed and layout.dp_size > 1 and config.init_from
            self.modules = build_stages(model_config, self.plan, self.stage_ids, layout.device, config.seed,
                                        config.init_from, layout.mesh["dp"] if read_rows else None)
        else:  # a model given (the Trainer's, tests'), or a checkpoint without safetensors
            given = model is not None
            model = model if given else build_full_model(config, model_config)
            self.modules = [m.to(layout.device) for m in build_stage_modules(model, self.plan, self.stage_ids)]
            release_foreign_modules(model, self.plan, self.stage_ids)  # the caller may keep `model`
            if given:  # the caller's processes may have drawn different weights (no seed set)
                broadcast_from_first_replica(self.modules, layout)
        for module in self.modules:
            if config.compile_layers:  # first: the checkpoint wraps the compiled forward
                compile_layers(module, config.activation_checkpointing)
            apply_activation_checkpointing(module, config.activation_checkpointing)
        self.holds_first_stage = 0 in self.stage_ids
        self.holds_last_stage = n_stages - 1 in self.stage_ids
        if self.fsdp_managed:
            dp_mesh = layout.mesh["dp"]
            for module in self.modules:
                # Weight stashing needs one gathered copy per version; fully_shard keeps just one
                # (and takes whole parameters: the rows read are gathered once).
                if order:
                    shard_parameters(module, dp_mesh)
                else:
                    fully_shard_stage(unshard_parameters(module), dp_mesh, dtype, reduce)
        self.loss_fn = PipelineLoss(model_config.vocab_size, getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)
        self.params = [p for module in self.modules for p in module.parameters()]
        # What steps together: each stage on its own for asynchronous schedules (stages update at
        # different times), all local stages at once for synchronous ones.
        groups = [[i] for i in range(len(self.modules))] if order else [list(range(len(self.modules)))]
        self.updaters = [
            Updater(config, g, [self.stage_ids[i] for i in g], [self.modules[i] for i in g], order)
            for g in groups
        ]
        self.updates = Updates(config, layout, self.modules, self.stage_ids, self.fsdp_managed)
        # Asynchronous pipeline: microbatches bound to stashed weight versions (weight_versions.py).
        self.versioned = (
            [VersionedStage(mod, order.n_buffers(s, depth, m), dtype, reduce)
             for mod, s in zip(self.modules, self.stage_ids)]
            if order and not emulating else []
        )
        # Every stage's inputs and outputs, known up front (models/stage_io.py): no metadata round.
        self._stage_io = [] if emulating else stage_io(model_config, self.plan, config.micro_batch_size, config.seq_len,
                                                       dtype)
        self.stages = [] if emulating else self._pipeline_stages(layout.pp_group)
        links = links if self.stages else None
        self.timer = ComputeTimer(self.stages, layout.device)
        timed_loss = self.timer.timed(self.loss_fn)
        self.emulated = EmulatedPipeline(self.modules, self.stage_ids, order, depth, m, self.updaters,
                                         self.updates.apply_together, config.router_bias_update_rate,
                                         layout.dp_group) if emulating else None
        if emulating:
            self.schedule = None
        elif self.versioned:
            self.schedule = AsyncPipelineSchedule(self.stages, m, timed_loss, self.spec, config.max_steps,
                                                  update_stage=self._update_stage, await_update=self._await_update,
                                                  links=links, updates_held=self.updates.holds_for_global_norm,
                                                  statistics_carried=self._statistics_carried)
        else:
            self.schedule = build_schedule(self.spec, self.stages, m, timed_loss, links)
        self._routing_load_counters = [(s, m.routing_load) for s, m in zip(self.stage_ids, self.modules)
                                       if m.routing_load is not None]
        # Asynchronous pipeline: a minibatch's routing-bias update comes with its weight update
        # (_update_stage), from the loads of its own microbatches' forwards (models/routing_bias.py).
        for stage, module in zip(self.stages if self.versioned else (), self.modules):
            if module.routing_load is not None:
                module.routing_load.count_only_microbatches_of(stage)
        self._unfinished: list[ReducedStepStats] = []
        self.guard = NonFiniteGuard(config.nonfinite_policy, config.nonfinite_skip_limit, n_stages - 1)
        self.termination = TerminationRequest()  # the loop installs its SIGTERM handler
        # Steps not yet reviewed, oldest first: each is reviewed at the next step's end, or where an update
        # may be decided after its step's report (held for the global norm), at the end of the one after.
        self._awaiting_review: list[tuple[int, ReducedStepStats]] = []
        self._review_lag = 2 if self.versioned and self.updates.holds_for_global_norm else 1
        self._eval_schedule = None  # asynchronous pipelines: a forward-only program, built at the first evaluation
        self.step_count = 0
        self.last_step = config.max_steps  # the run's final step count (stop_after may bring it forward)

    def _pipeline_stages(self, group) -> list[HookedStage]:
        """torch's PipelineStage of each local stage on `group`, told its inputs and outputs; what runs
        around its compute subscribes to its hooks (schedules/stage_hooks.py)."""
        return [HookedStage(submod, s, len(self.plan), self.layout.device, *self._stage_io[s], group=group)
                for submod, s in zip(self.versioned or self.modules, self.stage_ids)]

    # --- the step -------------------------------------------------------------------------------

    def run_microbatches(self, rows: torch.Tensor) -> None:
        """Forward and backward of one minibatch through a synchronous schedule; gradients accumulate."""
        rows = rows.to(self.layout.device)
        args = (rows,) if self.holds_first_stage else ()
        target = rows if self.holds_last_stage else None
        self.schedule.step(*args, target=target, return_outputs=False)  # logits are not kept

    def _update_stage(self, stage: int, unit: int, version: int, grad_scale: float) -> None:
        """Local stage `stage` has the gradient of update unit `unit`, taken at weight `version`
        (called by the asynchronous runtime when the order says the stage's update is due): its
        gradient moves to the master, and the update is applied now or once its global norm is in."""
        index = self.stage_ids.index(stage)
        versioned, updater = self.versioned[index], self.updaters[index]
        versioned.move_gradients_to_master(self.version_buffer(stage, version), grad_scale)
        self.updates.ages[stage] = max(self.updates.ages.get(stage, 0), versioned.master_version - version)
        self.updates.post(index, unit, updater, lambda norm: self._apply_stage_update(index, norm))

    def _await_update(self, stage: int, unit: int) -> None:
        """The asynchronous runtime needs stage `stage`'s update of `unit` (and those before) applied."""
        self.updates.complete(self.stage_ids.index(stage), through_unit=unit)

    def _apply_stage_update(self, index: int, norm: float) -> None:
        """Step local stage `index` clipped by `norm`, into the buffer of its next version (written
        there, weight_versions.py), with the minibatch's routing-bias update; its gradient is freed."""
        versioned, updater, stage = self.versioned[index], self.updaters[index], self.stage_ids[index]
        next_buffer = self.version_buffer(stage, versioned.master_version + 1)
        versioned.bind_master(next_buffer)
        applied = self.updates.step(updater, norm)
        self._update_routing_biases(index, versioned.master_version, applied)
        versioned.publish_master(next_buffer)
        updater.optimizer.zero_grad(set_to_none=True)

    def settle_updates(self) -> None:
        """Apply every update still held for its global norm (collective: call on every rank before
        reading the weights or their state — a checkpoint, an evaluation, the export)."""
        self.updates.complete_all()
        if self.versioned:
            self.schedule.updates_settled()

    @contextlib.contextmanager
    def _statistics_carried(self):
        """Inside, the next update's norm read also reads the previous step's statistics (one transfer):
        the asynchronous runtime enters it around one norm read a step (async_order.statistics_read).
        Every rank has posted their all-reduce by then: the checker plays that read where it happens
        (tests/schedules/test_validate.py)."""
        self.updates.carry(self._awaiting_review[-1][1] if self._awaiting_review else None)
        try:
            yield
        finally:
            self.updates.carry(None)

    def version_buffer(self, stage: int, version: int) -> int:
        """The buffer that holds weight version `version` of asynchronous stage `stage`."""
        return self.spec.order.buffer(stage, self.layout.pp_size, version, self.config.n_microbatches)

    def _update_routing_biases(self, index: int, unit: int, applied: bool) -> None:
        """Asynchronous pipeline, local stage `index` has just applied (or skipped) the update of unit
        `unit`: the routing-bias update of the minibatch it ends, published with the weights as the
        next version (models/routing_bias.py)."""
        counter, m = self.modules[index].routing_load, self.config.n_microbatches
        if counter is not None:
            ends_minibatch = not self.spec.order.per_microbatch_updates or unit % m == m - 1
            counter.after_update(applied, ends_minibatch, m, self.config.router_bias_update_rate, self.layout.dp_group)

    def train_step(self, rows: torch.Tensor, next_rows: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on minibatch `rows`. Asynchronous schedules on a pipeline also forward
        into the next minibatch: pass its rows as `next_rows` (None on the last step, which drains)."""
        start = time.perf_counter()
        self.timer.take()  # drop compute time of anything run since the last step (e.g. evaluation)
        self.updates.start_step()
        for updater in () if self.versioned else self.updaters:  # a versioned stage frees its gradient as it updates
            updater.optimizer.zero_grad(set_to_none=True)
        synchronous = not (self.versioned or self.emulated)  # which update routing biases here, per step
        for _, counter in self._routing_load_counters if synchronous else ():
            counter.reset()
        lr = self.updaters[0].optimizer.param_groups[0]["lr"]
        # Weight-version age: updates between the weights a gradient was taken at and those it updates.
        rows = rows.to(self.layout.device, non_blocking=True)  # pinned rows (data/prefetch.py) overlap compute
        if self.emulated:  # one process, no pipeline: all of the step is compute
            self.updates.ages = self.emulated.run_step(rows, self.loss_fn)
            busy = time.perf_counter() - start
        elif self.versioned:
            # Stages update inside the segment, when their update is due (see _update_stage).
            self.schedule.run_step(rows, None if next_rows is None else next_rows.to(self.layout.device))
            busy = self.timer.take()
            if self.step_count + 1 == self.last_step:  # the drain: its held updates are reported with it
                self.settle_updates()
        else:
            self.run_microbatches(rows)
            busy = self.timer.take()
            # The step's one host read: its norm, with the previous step's statistics (reviewed below).
            unread = self._awaiting_review[-1][1] if self._awaiting_review else None
            self.updates.apply_synchronous(self.updaters[0], read_along=unread)
            self.updates.ages = dict.fromkeys(self.stage_ids, 0)
        for stage, counter in self._routing_load_counters if synchronous else ():
            if stage not in self.updates.skipped:  # a skipped minibatch leaves the routing biases too
                counter.update_biases(self.config.router_bias_update_rate, self.config.n_microbatches, self.layout.dp_group)
        self.step_count += 1
        step_time = time.perf_counter() - start
        updates = self.updates
        replica = self.layout.dp_rank == 0  # dp replicas hold the same gradients: one reports them
        skipped, skipped_earlier = updates.take_skipped()
        reduced = ReducedStepStats(
            self.loss_fn.take(self.config.n_microbatches), self.layout, len(self.plan),
            grad_sq_norm=updates.grad_sq_norm() if replica else None,
            idle_fraction=idle_fraction(busy, step_time),
            version_age_by_stage=updates.ages if replica else {},
            nonfinite_grad_stages=updates.nonfinite_stages() if replica else (),
            skipped_by_stage=skipped if replica else {},
            termination_requested=self.termination.requested,
            skipped_earlier_by_stage=skipped_earlier if replica else {},
        )
        self._unfinished = [r for r in self._unfinished if not r.done()] + [reduced]
        # The previous steps' reductions have finished on every rank by now: decide on what they report.
        previous = self._awaiting_review[-1][1] if self._awaiting_review else None
        self._awaiting_review.append((self.step_count, reduced))
        self._review(keep=self._review_lag)
        terminate = previous.value("termination_requested") if previous else False
        return StepResult(self.step_count, lr, rows.numel() * self.layout.dp_size, step_time, busy, reduced, terminate)

    def _review(self, keep: int = 0) -> None:
        """Apply the non-finite policy (raises NonFiniteError to stop) to the steps awaiting review but
        the newest `keep`, each with the next step's statistics, which carry the outcome of its updates
        decided after its report. Identical on every rank: it reads the all-reduces."""
        while len(self._awaiting_review) > keep:
            step, reduced = self._awaiting_review.pop(0)
            later = self._awaiting_review[0][1] if self._awaiting_review and self._review_lag > 1 else None
            self.guard.review(step, reduced, later)

    @property
    def forwards_ahead(self) -> bool:
        """Whether a step also forwards into the next minibatch (asynchronous pipelines): then
        train_step needs its rows as `next_rows`."""
        return bool(self.versioned)

    def resume_after(self, step: int) -> None:
        """Continue after `step` completed steps whose training state was just loaded."""
        self.step_count = step
        if self.versioned:
            self.schedule.resume_after(step)
        if self.emulated:
            self.emulated.steps_run = step  # a sync start's synchronous steps are counted from the run's start

    def stop_after(self, step: int) -> int:
        """End the run early: returns the step count it can end at, `step` where nothing is in flight.
        An asynchronous pipeline has already forwarded part of the next minibatch, so it runs that
        step too, as its last (draining) one: every forwarded microbatch is trained on."""
        self.last_step = step + 1 if self.versioned else step
        if self.versioned:
            self.schedule.n_steps = self.last_step
        return self.last_step

    def finish(self, wait_for_sends: bool = True) -> None:
        """Wait for every step's statistics reduction and in-flight send, and review the last step
        (call before tearing down process groups). A run stopped between steps of an asynchronous
        pipeline (SIGTERM) passes `wait_for_sends=False`: its last sends feed steps that never run."""
        self.settle_updates()
        if self.versioned and wait_for_sends:
            self.schedule.finish()
        for reduced in self._unfinished:
            reduced.value("loss")
        self._unfinished = []
        self._review()

    @torch.no_grad()
    def eval_step(self, rows: torch.Tensor, return_logits: bool = False) -> tuple[float, float, torch.Tensor | None]:
        """(LM loss, aux loss) of a minibatch without updating anything, and with `return_logits` the
        logits on the rank that holds the last stage (None elsewhere; otherwise each microbatch's logits
        are freed after its loss, as in training: a minibatch's rows × seq × vocab would sit beside the
        model on the last stage's device). Asynchronous pipelines evaluate their newest
        weights (the masters, what an export holds) beside the microbatches in flight, which stay
        as they are: training continues exactly as without the evaluation."""
        rows = rows.to(self.layout.device)
        if self.emulated:
            return self._eval_emulated(rows, return_logits)
        if not self.versioned:
            return self._eval_through(self.schedule, self.loss_fn, rows, return_logits)
        if 0 < self.step_count < self.last_step and not self.evaluates_mid_run:
            raise RuntimeError(f"{self.spec.name} straddles its updates across step boundaries: some stages have "
                               "applied the last minibatch and others not, so only the final weights can be evaluated")
        self.settle_updates()  # the masters: every update posted so far
        if self._eval_schedule is None:
            # Its own stages, loss and process group: the training runtime's state and its messages
            # in flight are untouched (NCCL would match an evaluation receive to a training send).
            self._eval_loss_fn = PipelineLoss(self.loss_fn.vocab_size, self.loss_fn.aux_coef)
            stages = self._pipeline_stages(self.layout.eval_pp_group)
            self._eval_schedule = build_eval_schedule(stages, self.config.n_microbatches, self._eval_loss_fn)
        with contextlib.ExitStack() as masters:
            for versioned in self.versioned:
                masters.enter_context(versioned.evaluating_master())
            return self._eval_through(self._eval_schedule, self._eval_loss_fn, rows, return_logits)

    @property
    def evaluates_mid_run(self) -> bool:
        """Whether weights between two steps can be evaluated: every stage has applied the same
        minibatches there (not so for orders whose updates straddle step boundaries: WPipe)."""
        return not self.versioned or self._units_end_at_step_boundaries()

    def _units_end_at_step_boundaries(self) -> bool:
        try:
            after = self.config.sync_steps  # the first asynchronous step's boundary
            replay_after(self.spec.order, self.layout.pp_size, self.config.n_microbatches, after, after + 2)
            return True
        except ScheduleError:
            return False

    def _eval_through(self, schedule, loss_fn: PipelineLoss, rows: torch.Tensor, return_logits: bool):
        for module in self.modules:
            module.eval()
        try:
            args = (rows,) if self.holds_first_stage else ()
            output = schedule.eval(*args, target=rows if self.holds_last_stage else None, return_outputs=return_logits)
        finally:
            for module in self.modules:
                module.train()
        reduced = ReducedStepStats(loss_fn.take(self.config.n_microbatches), self.layout, len(self.plan))
        logits = output[0] if isinstance(output, tuple) else output
        return reduced.value("loss"), reduced.value("aux_loss"), logits

    def _eval_emulated(self, rows: torch.Tensor, return_logits: bool):
        for module in self.modules:
            module.eval()
        kept = []
        try:
            for mb in rows.chunk(self.config.n_microbatches):
                output = self.emulated.forward(mb)
                self.loss_fn(output, mb)
                if return_logits:
                    kept.append(output[0] if isinstance(output, tuple) else output)
        finally:
            for module in self.modules:
                module.train()
        reduced = ReducedStepStats(self.loss_fn.take(self.config.n_microbatches), self.layout, len(self.plan))
        return reduced.value("loss"), reduced.value("aux_loss"), torch.cat(kept) if kept else None

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per kind of state (memory.py): parameters, gradients, weight
        versions, optimizer state, EF buffers."""
        return state_bytes(self.params, [u.optimizer for u in self.updaters],
                           [u.stepper for u in self.updaters if isinstance(u.stepper, ErrorFeedback)], self.versioned)

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers under their HF names, whole (sharded
        parameters are gathered over dp: call on every rank)."""
        self.settle_updates()
        state = {}
        for module in self.modules:
            state.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                          for k, v in module.state_dict().items()})
        return state
