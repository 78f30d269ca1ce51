"""A synchronous pipeline (gpipe, 1f1b, interleaved-1f1b, zbv): every step flushes.

A step: forward and backward of the minibatch's microbatches through the schedule's program
(schedules/runtime.py), gradients accumulating; then one update of all local stages together, clipped
by the norm over the whole pipeline (update/together.py), whose one host read also reads the previous step's
statistics; then DeepSeek-V3's routing biases from the step's loads (models/routing_bias.py), left as
they are when the update was skipped. FSDP2 shards every stage fully over dp (compute dtype, gradient
reduce-scatter).
"""

from __future__ import annotations

import torch

from ..parallel.fsdp import compute_dtype, fully_shard_stage, reduce_dtype, unshard_parameters
from ..parallel.mesh import start_communicators
from ..schedules import build_schedule
from ..update.together import SynchronousUpdate
from .base import StepOutcome
from .pipeline import PipelineExecutor

__all__ = ["SynchronousPipeline"]


class SynchronousPipeline(PipelineExecutor):
    def __init__(self, config, model_config, layout, spec, model=None):
        # Every communicator set up and used once, first (mesh.start_communicators); each pair of
        # neighbouring ranks on its own group (its own NCCL stream).
        links = start_communicators(layout, spec.rank_pairs(layout.pp_size), asynchronous=False)
        dtype = compute_dtype(config.mixed_precision, layout.device, config.fsdp)
        self._reduce_dtype = reduce_dtype(config.grad_reduce_dtype, dtype)
        fsdp_managed = config.fsdp and (layout.dp_size > 1 or dtype is not None)
        super().__init__(config, model_config, layout, spec, model, layout.pp_size,
                         spec.stage_indices(layout.pp_size, layout.pp_rank), dtype, fsdp_managed, per_stage_updates=False)
        self._build_stages(model_config, self.modules)
        self.schedule = build_schedule(spec, self.stages, config.n_microbatches, self.timer.timed(self.loss_fn), links)
        self._routing_loads = [(s, m.routing_load) for s, m in zip(self.stage_ids, self.modules)
                               if m.routing_load is not None]
        self.update = SynchronousUpdate(self.norms, self.update_rule)

    def _shard(self, module, dp_mesh) -> None:
        fully_shard_stage(unshard_parameters(module), dp_mesh, self.dtype, self._reduce_dtype)

    def train_step(self, rows, next_rows, previous, drains) -> StepOutcome:
        self.report.start_step()
        updater = self.updaters[0]
        updater.optimizer.zero_grad(set_to_none=True)
        for _, counter in self._routing_loads:
            counter.reset()
        args = (rows,) if self.holds_first_stage else ()
        self.schedule.step(*args, target=rows if self.holds_last_stage else None, return_outputs=False)
        # The step's one host read: its norm, with the previous step's statistics.
        self.update.apply(updater, read_along=previous)
        busy = self.timer.take()  # after the read: on a GPU the step's compute has finished
        for stage in self.stage_ids:
            self.report.record_age(stage, 0)
        for stage, counter in self._routing_loads:
            if not self.report.skipped_now(stage):  # a skipped minibatch leaves the routing biases too
                counter.update_biases(self.config.router_bias_update_rate, self.config.n_microbatches,
                                      self.layout.dp_group)
        return self._outcome(busy)

    @torch.no_grad()
    def evaluate(self, rows, return_logits):
        return self._evaluate_through(self.schedule, self.loss_fn, rows, return_logits)
