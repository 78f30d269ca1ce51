"""An asynchronous pipeline (pipedream-2bw, wpipe, pipedream): stages update when the order says, never
flushing, microbatches bound to stashed weight versions.

A step runs this rank's program for one segment of the continuous order (schedules/async_runtime.py):
forwards into the next minibatch where the order does, and each stage's update happens inside the
segment, at its REDUCE_GRAD, through the stage's `StageUpdate` (update/stage.py: versions, optimizer,
EF, held norm, routing biases). The run's last step drains: its held updates are applied with it.
Parameters are sharded over dp without fully_shard: weight stashing needs one gathered copy per version
(update/versions.py); evaluation runs the masters through a forward-only program of its own.
"""

from __future__ import annotations

import contextlib

import torch

from ..models.pipeline_loss import PipelineLoss
from ..parallel.fsdp import compute_dtype, reduce_dtype, shard_parameters
from ..parallel.mesh import start_communicators
from ..schedules.async_runtime import AsyncPipelineSchedule
from ..schedules.runtime import build_eval_schedule
from ..update.held import HeldNorms
from ..update.stage import StageUpdate
from ..update.versions import VersionedStage
from .base import StepOutcome
from .pipeline import PipelineExecutor

__all__ = ["AsynchronousPipeline"]


class AsynchronousPipeline(PipelineExecutor):
    forwards_ahead = True
    layout_bound = True  # microbatches in flight, replayed by the order on resume

    def __init__(self, config, model_config, layout, spec, model=None):
        links = start_communicators(layout, spec.rank_pairs(layout.pp_size), asynchronous=True)
        dtype = compute_dtype(config.mixed_precision, layout.device, config.fsdp)
        fsdp_managed = config.fsdp and (layout.dp_size > 1 or dtype is not None)
        super().__init__(config, model_config, layout, spec, model, layout.pp_size,
                         spec.stage_indices(layout.pp_size, layout.pp_rank), dtype, fsdp_managed, per_stage_updates=True)
        order, m = spec.order, config.n_microbatches
        reduce = reduce_dtype(config.grad_reduce_dtype, dtype)
        self.versioned = [VersionedStage(module, order.n_buffers(s, layout.pp_size, m), dtype, reduce)
                          for module, s in zip(self.modules, self.stage_ids)]
        self._build_stages(model_config, self.versioned)
        self.held = HeldNorms(self.norms, config.clips_by_global_norm)
        self.stage_updates = {
            s: StageUpdate(i, s, versioned, updater, module.routing_load, self.held, self.update_rule, order, config,
                           layout.pp_size)
            for i, (s, versioned, updater, module) in enumerate(zip(self.stage_ids, self.versioned, self.updaters,
                                                                      self.modules))}
        self.schedule = AsyncPipelineSchedule(self.stages, m, self.timer.timed(self.loss_fn), spec, config.max_steps,
                                              self.stage_updates, links=links,
                                              updates_held=self.held.holds_for_global_norm)
        # A minibatch's routing-bias update comes with its weight update (StageUpdate), from the loads of
        # its own microbatches' forwards (models/routing_bias.py).
        for stage, module in zip(self.stages, self.modules):
            if module.routing_load is not None:
                module.routing_load.count_only_microbatches_of(stage)
        self._eval_schedule = None  # a forward-only program, built at the first evaluation
        self.review_lag = 2 if self.held.holds_for_global_norm else 1
        # Every stage has applied the same minibatches between two steps (not so for WPipe on a pipeline).
        self.evaluates_mid_run = spec.step_boundary(layout.pp_size, m).clean

    def _shard(self, module, dp_mesh) -> None:
        shard_parameters(module, dp_mesh)  # one gathered copy per version: not fully_shard (module docstring)

    def train_step(self, rows, next_rows, previous, drains) -> StepOutcome:
        self.report.start_step()  # a versioned stage frees its gradient as it updates: no zero_grad here
        self.schedule.run_step(rows, next_rows, carry=previous)
        busy = self.timer.take()
        if drains:  # the drain: its held updates are reported with it
            self.settle()
        return self._outcome(busy)

    def settle(self) -> None:
        for index in self.held.held_indices:
            self.stage_updates[self.stage_ids[index]].complete()

    @torch.no_grad()
    def evaluate(self, rows, return_logits):
        """The newest weights (the masters, what an export holds), beside the microbatches in flight, which
        stay as they are: training continues exactly as without the evaluation."""
        if 0 < self.schedule.step_index < self.schedule.n_steps and not self.evaluates_mid_run:
            raise RuntimeError(f"{self.spec.name} straddles its updates across step boundaries: some stages have "
                               "applied the last minibatch and others not, so only the final weights can be evaluated")
        self.settle()  # the masters: every update posted so far
        if self._eval_schedule is None:
            # Its own stages, loss and process group: the training runtime's state and its messages in
            # flight are untouched (NCCL would match an evaluation receive to a training send).
            self._eval_loss_fn = PipelineLoss(self.loss_fn.vocab_size, self.loss_fn.aux_coef)
            self._eval_stages = self._pipeline_stages(self.layout.eval_pp_group)
            self._eval_schedule = build_eval_schedule(self._eval_stages, self.config.n_microbatches, self._eval_loss_fn)
        with contextlib.ExitStack() as masters:
            for versioned in self.versioned:
                masters.enter_context(versioned.evaluating_master())
            return self._evaluate_through(self._eval_schedule, self._eval_loss_fn, rows, return_logits)

    def resume_after(self, step: int) -> None:
        self.schedule.resume_after(step)

    def stop_after(self, step: int) -> int:
        """The pipeline has already forwarded part of the next minibatch, so it runs that step too, as its
        last (draining) one: every forwarded microbatch is trained on."""
        self.schedule.n_steps = step + 1
        return step + 1

    def finish(self, wait_for_sends: bool) -> None:
        self.settle()
        if wait_for_sends:
            self.schedule.finish()

    def torch_stages(self):
        return self.stages + (self._eval_stages if self._eval_schedule is not None else [])

    # --- checkpoint: each stage's weight versions and update count -----------------------------------

    def state(self) -> dict:
        state = {}
        for stage, versioned in zip(self.stage_ids, self.versioned):
            names = list(versioned.buffers_[0])
            for b, buffer in enumerate(versioned.buffers_):
                state.update({f"versions.{stage}.{b}.{n}": buffer[n].detach() for n in names})
            state[f"stage.{stage}"] = {"master_version": versioned.master_version}
        return state

    def masters(self) -> set[str]:
        """A master is one of its version buffers, which load with `state` (bound once the versions are known)."""
        return {n for versioned in self.versioned for n, _ in versioned.inner.named_parameters()}

    def state_to_load(self, saved: dict, destination) -> dict:
        wanted = {}
        for stage, versioned in zip(self.stage_ids, self.versioned):
            if f"stage.{stage}#obj" not in saved:
                raise ValueError(f"it holds no weight versions of stage {stage} (saved with another pp_size or schedule)")
            for b, buffer in enumerate(versioned.buffers_):
                wanted.update({f"versions.{stage}.{b}.{n}": t.detach() for n, t in buffer.items()})
        return wanted

    def restore(self, loaded: dict) -> None:
        for stage, versioned in zip(self.stage_ids, self.versioned):
            versioned.master_version = loaded[f"stage.{stage}"]["master_version"]
            versioned.bind_master(self.stage_updates[stage].buffer(versioned.master_version), copy=False)
            versioned.drop_compute_copies()
