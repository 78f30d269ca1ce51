"""One training step over the pipeline: the engine both front ends drive.

A step on one rank: feed the minibatch (first stage) and its labels (last stage) to the schedule,
which runs forward/backward of n_microbatches microbatches over this rank's stages; average
gradients over the dp group; clip by the global norm (all stages, all dp ranks); step the optimizer
and the LR schedule — unless that norm is non-finite: then the update is skipped (resilience.py). The
minibatch loss is the mean of the microbatch losses (torch's runtime divides gradients by
n_microbatches), as in gradient accumulation.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from .config import TrainConfig
from .emulation import EmulatedPipeline
from .memory import state_bytes
from .metrics import ComputeTimer, ReducedStepStats, StepResult, idle_fraction
from .models import build_model, build_stage_modules, build_stages, plan_stages
from .models.split import release_foreign_modules
from .models.construct import has_safetensors
from .models.compile import compile_layers
from .models.recompute import apply_activation_checkpointing
from .models.pipeline_loss import PipelineLoss
from .optim import lr_scheduler_from_config, optimizer_from_config
from .optim.error_feedback import ErrorFeedback
from .optim.param_groups import decay_parameter_names
from .parallel.fsdp import compute_dtype, fully_shard_stage, reduce_dtype, shard_parameters, unshard_parameters
from .parallel.mesh import ParallelLayout, broadcast_from_first_replica
from .resilience import NonFiniteGuard, TerminationRequest
from .schedules import ScheduleError, build_schedule, get_schedule_spec
from .schedules.async_order import replay_after
from .schedules.runtime import build_eval_schedule
from .schedules.async_runtime import AsyncPipelineSchedule
from .schedules.weight_versions import VersionedStage

__all__ = ["PipelineEngine", "build_full_model"]


def build_full_model(config: TrainConfig, model_config) -> torch.nn.Module:
    """The whole HF model, identically on every rank: from init_from, or initialized from the seed
    exactly as the stages a pipeline builds for itself (models/construct.py)."""
    if config.init_from:
        return AutoModelForCausalLM.from_pretrained(config.init_from, config=model_config, dtype=torch.float32).train()
    return build_model(model_config, config.seed)


class _Updater:
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
        self.plan = plan_stages(model_config, n_stages, config.stage_balance, config.stage_boundaries)
        self.stage_ids = list(range(n_stages)) if emulating else self.spec.stage_indices(layout.pp_size, layout.pp_rank)
        # FSDP2 over dp (parallel/fsdp.py): parameters, gradients, optimizer state, weight versions
        # and EF buffers hold 1/dp each. At dp 1 it still provides the bf16 compute policy.
        dtype = None if emulating else compute_dtype(config.mixed_precision, layout.device)
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
        # different times and clip by their own norm), all local stages at once for synchronous ones.
        groups = [[i] for i in range(len(self.modules))] if order else [list(range(len(self.modules)))]
        self.updaters = [
            _Updater(config, g, [self.stage_ids[i] for i in g], [self.modules[i] for i in g], order)
            for g in groups
        ]
        # Asynchronous pipeline: microbatches bound to stashed weight versions (weight_versions.py).
        self.versioned = (
            [VersionedStage(mod, order.n_buffers(s, depth, m), dtype, reduce)
             for mod, s in zip(self.modules, self.stage_ids)]
            if order and not emulating else []
        )
        self.stages = [] if emulating else [
            PipelineStage(submod, s, n_stages, layout.device, group=layout.pp_group)
            for submod, s in zip(self.versioned or self.modules, self.stage_ids)
        ]
        self.timer = ComputeTimer(self.stages)
        timed_loss = self.timer.timed(self.loss_fn)
        self.emulated = EmulatedPipeline(self.modules, self.stage_ids, order, depth, m, self.updaters,
                                         config.router_bias_update_rate, layout.dp_group) if emulating else None
        if emulating:
            self.schedule = None
        elif self.versioned:
            self.schedule = AsyncPipelineSchedule(
                self.stages, m, timed_loss, order, config.max_steps, update_stage=self._update_stage
            )
        else:
            self.schedule = build_schedule(self.spec, self.stages, m, timed_loss)
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
        self._awaiting_review: tuple[int, ReducedStepStats] | None = None  # the last step, reviewed at the next
        self._eval_schedule = None  # asynchronous pipelines: a forward-only program, built at the first evaluation
        # This step's updates: per stage, the squared gradient norm of each, the largest version age,
        # the updates skipped; the stages whose gradient was non-finite.
        self._step_sq_norms: dict[int, list[float]] = {}
        self._step_ages: dict[int, int] = {}
        self._step_skipped: dict[int, int] = {}
        self._step_nonfinite_stages: set[int] = set()
        self.step_count = 0
        self.last_step = config.max_steps  # the run's final step count (stop_after may bring it forward)

    # --- the step -------------------------------------------------------------------------------

    def run_microbatches(self, rows: torch.Tensor) -> None:
        """Forward and backward of one minibatch through a synchronous schedule; gradients accumulate."""
        rows = rows.to(self.layout.device)
        args = (rows,) if self.holds_first_stage else ()
        target = rows if self.holds_last_stage else None
        self.schedule.step(*args, target=target, return_outputs=False)  # logits are not kept

    def _apply_update(self, updater: "_Updater", stepper=None) -> bool:
        """Average gradients over dp, clip, step the optimizer (through `stepper`: the emulator, when
        emulating) and the LR schedule. A non-finite gradient norm skips the update: weights,
        optimizer and EF state and the LR schedule stay as they are (the pipeline still publishes its
        unchanged master as the next version, and the emulator counts one), so the run continues as
        if this update had never been computed. Returns whether the update was applied."""
        self._average_gradients_over_dp(updater.params)
        local_sq, norm = self._gradient_norm(updater)
        self._step_sq_norms.setdefault(updater.stage, []).append(local_sq)
        stepper = stepper or updater.stepper
        if not math.isfinite(norm):
            for param in updater.params:
                param.grad = None
            if hasattr(stepper, "skip"):
                stepper.skip()
            for stage in updater.stages:
                self._step_skipped[stage] = self._step_skipped.get(stage, 0) + 1
            return False
        if self.config.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(updater.params, self.config.max_grad_norm,
                                                 torch.tensor(norm, dtype=torch.float32), foreach=True)
        stepper.step()
        updater.lr_scheduler.step()
        return True

    def _update_stage(self, stage: int, version: int, grad_scale: float) -> None:
        """One update of local stage `stage` from the gradient taken at weight `version` (called by
        the asynchronous runtime when the order says the stage's update is due)."""
        index = self.stage_ids.index(stage)
        versioned, updater = self.versioned[index], self.updaters[index]
        versioned.move_gradients_to_master(self.version_buffer(stage, version), grad_scale)
        self._step_ages[stage] = max(self._step_ages.get(stage, 0), versioned.master_version - version)
        # The update is written in the buffer of the next version (weight_versions.py).
        next_buffer = self.version_buffer(stage, versioned.master_version + 1)
        versioned.bind_master(next_buffer)
        applied = self._apply_update(updater)
        self._update_routing_biases(index, versioned.master_version, applied)
        versioned.publish_master(next_buffer)

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

    def _average_gradients_over_dp(self, params: list[torch.nn.Parameter]) -> None:
        if self.layout.dp_size == 1 or self.fsdp_managed:  # FSDP reduce-scattered and averaged them
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.layout.dp_group)
        flat /= self.layout.dp_size
        for p, synced in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
            p.grad = synced

    def _gradient_norm(self, updater: "_Updater") -> tuple[float, float]:
        """(this rank's squared gradient norm, the L2 norm to clip by and to judge finiteness by);
        records the stages whose gradient is non-finite. dp replicas hold the same averaged gradients.
        Synchronous schedules take the global norm over all stages, so every rank decides alike; the
        asynchronous ones each stage's own norm, since a pipeline-wide norm would make every stage
        wait for the others at every step, which is the bubble they exist to remove."""
        local_sq = torch.zeros((), dtype=torch.float64)
        for index in updater.module_indices:
            grads = [p.grad for p in self.modules[index].parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
            if isinstance(norm, DTensor):  # sharded gradients: the norm over all dp shards
                norm = norm.full_tensor()
            stage_sq = norm.double().cpu() ** 2
            if not torch.isfinite(stage_sq):
                self._step_nonfinite_stages.add(self.stage_ids[index])
            local_sq = local_sq + stage_sq
        total_sq = local_sq
        if self.spec.synchronous and self.layout.pp_size > 1:
            total_sq = local_sq.to(self.layout.device).clone()
            dist.all_reduce(total_sq, group=self.layout.pp_group)
        return local_sq.item(), total_sq.sqrt().item()

    def train_step(self, rows: torch.Tensor, next_rows: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on minibatch `rows`. Asynchronous schedules on a pipeline also forward
        into the next minibatch: pass its rows as `next_rows` (None on the last step, which drains)."""
        start = time.perf_counter()
        self.timer.take()  # drop compute time of anything run since the last step (e.g. evaluation)
        self._step_sq_norms, self._step_ages, self._step_skipped, self._step_nonfinite_stages = {}, {}, {}, set()
        for updater in self.updaters:
            updater.optimizer.zero_grad(set_to_none=True)
        synchronous = not (self.versioned or self.emulated)  # which update routing biases here, per step
        for _, counter in self._routing_load_counters if synchronous else ():
            counter.reset()
        lr = self.updaters[0].optimizer.param_groups[0]["lr"]
        # Weight-version age: updates between the weights a gradient was taken at and those it updates.
        rows = rows.to(self.layout.device, non_blocking=True)  # pinned rows (data/prefetch.py) overlap compute
        if self.emulated:  # one process, no pipeline: all of the step is compute
            self._step_ages = self.emulated.run_step(rows, self.loss_fn, self._apply_update)
            busy = time.perf_counter() - start
        elif self.versioned:
            # Stages update inside the segment, when their update is due (see _update_stage).
            self.schedule.run_step(rows, None if next_rows is None else next_rows.to(self.layout.device))
            busy = self.timer.take()
        else:
            self.run_microbatches(rows)
            busy = self.timer.take()
            self._apply_update(self.updaters[0])
            self._step_ages = dict.fromkeys(self.stage_ids, 0)
        for stage, counter in self._routing_load_counters if synchronous else ():
            if stage not in self._step_skipped:  # a skipped minibatch leaves the routing biases too
                counter.update_biases(self.config.router_bias_update_rate, self.config.n_microbatches, self.layout.dp_group)
        self.step_count += 1
        step_time = time.perf_counter() - start
        # Per stage the mean over its updates in this step (m of them with per-microbatch updates).
        grad_sq_norm = sum(sum(norms) / len(norms) for norms in self._step_sq_norms.values())
        replica = self.layout.dp_rank == 0  # dp replicas hold the same gradients: one reports them
        reduced = ReducedStepStats(
            self.loss_fn.take(self.config.n_microbatches), self.layout, len(self.plan),
            grad_sq_norm=grad_sq_norm if replica else None,
            idle_fraction=idle_fraction(busy, step_time),
            version_age_by_stage=self._step_ages if replica else {},
            nonfinite_grad_stages=self._step_nonfinite_stages if replica else (),
            skipped_by_stage=self._step_skipped if replica else {},
            termination_requested=self.termination.requested,
        )
        self._unfinished = [r for r in self._unfinished if not r.done()] + [reduced]
        # The previous step's reduction has finished on every rank by now: decide on what it reports.
        previous, self._awaiting_review = self._awaiting_review, (self.step_count, reduced)
        terminate = self._review(*previous) if previous else False
        return StepResult(self.step_count, lr, rows.numel() * self.layout.dp_size, step_time, busy, reduced, terminate)

    def _review(self, step: int, reduced: ReducedStepStats) -> bool:
        """Apply the non-finite policy to step `step` (raises NonFiniteError to stop); returns whether
        any rank was asked to terminate by then. Identical on every rank: it reads the all-reduce."""
        self.guard.review(step, reduced)
        return reduced.value("termination_requested")

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
        if self.versioned and wait_for_sends:
            self.schedule.finish()
        for reduced in self._unfinished:
            reduced.value("loss")
        self._unfinished = []
        if self._awaiting_review:
            previous, self._awaiting_review = self._awaiting_review, None
            self._review(*previous)

    @torch.no_grad()
    def eval_step(self, rows: torch.Tensor) -> tuple[float, float, torch.Tensor | None]:
        """(LM loss, aux loss) of a minibatch without updating anything, and the logits on the rank
        that holds the last stage (None elsewhere). Asynchronous pipelines evaluate their newest
        weights (the masters, what an export holds) beside the microbatches in flight, which stay
        as they are: training continues exactly as without the evaluation."""
        rows = rows.to(self.layout.device)
        if self.emulated:
            return self._eval_emulated(rows)
        if not self.versioned:
            return self._eval_through(self.schedule, self.loss_fn, rows)
        if 0 < self.step_count < self.last_step and not self._units_end_at_step_boundaries():
            raise RuntimeError(f"{self.spec.name} straddles its updates across step boundaries: some stages have "
                               "applied the last minibatch and others not, so only the final weights can be evaluated")
        if self._eval_schedule is None:
            # Its own stages, loss and process group: the training runtime's state and its messages
            # in flight are untouched (NCCL would match an evaluation receive to a training send).
            self._eval_loss_fn = PipelineLoss(self.loss_fn.vocab_size, self.loss_fn.aux_coef)
            stages = [PipelineStage(v, s, len(self.plan), self.layout.device, group=self.layout.eval_pp_group)
                      for v, s in zip(self.versioned, self.stage_ids)]
            self._eval_schedule = build_eval_schedule(stages, self.config.n_microbatches, self._eval_loss_fn)
        with contextlib.ExitStack() as masters:
            for versioned in self.versioned:
                masters.enter_context(versioned.evaluating_master())
            return self._eval_through(self._eval_schedule, self._eval_loss_fn, rows)

    def _units_end_at_step_boundaries(self) -> bool:
        try:
            after = self.config.sync_steps  # the first asynchronous step's boundary
            replay_after(self.spec.order, self.layout.pp_size, self.config.n_microbatches, after, after + 2)
            return True
        except ScheduleError:
            return False

    def _eval_through(self, schedule, loss_fn: PipelineLoss, rows: torch.Tensor):
        for module in self.modules:
            module.eval()
        try:
            args = (rows,) if self.holds_first_stage else ()
            output = schedule.eval(*args, target=rows if self.holds_last_stage else None)
        finally:
            for module in self.modules:
                module.train()
        reduced = ReducedStepStats(loss_fn.take(self.config.n_microbatches), self.layout, len(self.plan))
        logits = output[0] if isinstance(output, tuple) else output
        return reduced.value("loss"), reduced.value("aux_loss"), logits

    def _eval_emulated(self, rows: torch.Tensor):
        for module in self.modules:
            module.eval()
        try:
            outputs = [self.emulated.forward(mb) for mb in rows.chunk(self.config.n_microbatches)]
            for output, mb in zip(outputs, rows.chunk(self.config.n_microbatches)):
                self.loss_fn(output, mb)
        finally:
            for module in self.modules:
                module.train()
        reduced = ReducedStepStats(self.loss_fn.take(self.config.n_microbatches), self.layout, len(self.plan))
        logits = torch.cat([o[0] if isinstance(o, tuple) else o for o in outputs])
        return reduced.value("loss"), reduced.value("aux_loss"), logits

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per kind of state (memory.py): parameters, gradients, weight
        versions, optimizer state, EF buffers."""
        return state_bytes(self.params, [u.optimizer for u in self.updaters],
                           [u.stepper for u in self.updaters if isinstance(u.stepper, ErrorFeedback)], self.versioned)

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers under their HF names, whole (sharded
        parameters are gathered over dp: call on every rank)."""
        state = {}
        for module in self.modules:
            state.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                          for k, v in module.state_dict().items()})
        return state
