"""An asynchronous schedule on one rank: the stages it would have at depth `emulate_pp_size` run one
after another in this process, each under its schedule's delay (emulation.py). No pipeline, no
communicators but the I/O ones, fp32 compute; dp replicas (if any) average their gradients."""

from __future__ import annotations

import torch

from ..emulation import EmulatedPipeline
from ..parallel.mesh import start_communicators
from ..update.together import EmulatedUpdates
from .base import Executor, StepOutcome

__all__ = ["EmulatedRun"]


class EmulatedRun(Executor):
    layout_bound = True  # kept weight versions per stage of its depth

    def __init__(self, config, model_config, layout, spec, model=None):
        start_communicators(layout, [], asynchronous=True)
        depth = self.emulated_depth = config.emulate_pp_size or 1
        super().__init__(config, model_config, layout, spec, model, depth, list(range(spec.n_stages(depth))),
                         dtype=None, fsdp_managed=False, per_stage_updates=True)
        updates = EmulatedUpdates(self.norms, self.update_rule, config.clips_by_global_norm)
        self.emulated = EmulatedPipeline(self.modules, self.stage_ids, spec.order, depth, config.n_microbatches,
                                         self.updaters, updates, config.router_bias_update_rate, layout.dp_group)

    def train_step(self, rows, next_rows, previous, drains) -> StepOutcome:
        self.report.start_step()
        for updater in self.updaters:
            updater.optimizer.zero_grad(set_to_none=True)
        for stage, age in self.emulated.run_step(rows, self.loss_fn).items():
            self.report.record_age(stage, age)
        return self._outcome(None)  # one process, no pipeline: all of the step is compute

    @torch.no_grad()
    def evaluate(self, rows, return_logits):
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
        return self.loss_fn.take(self.config.n_microbatches), torch.cat(kept) if kept else None

    def resume_after(self, step: int) -> None:
        self.emulated.steps_run = step  # a sync start's synchronous steps are counted from the run's start

    # --- checkpoint: the kept weight and routing-bias versions (EmulatedPipeline.state) ----------------

    def state(self) -> dict:
        return self.emulated.state()

    def state_to_load(self, saved: dict, destination) -> dict:
        for stage in self.stage_ids:
            if f"emulated.{stage}#obj" not in saved:
                raise ValueError(f"it holds no emulated state of stage {stage} (saved by another kind of run)")
        params = {n: p for module in self.modules for n, p in module.named_parameters()}
        wanted = {}
        for key in saved:  # kept versions laid out like their parameters; routing biases whole
            parts = key.split(".", 4)
            if parts[0] == "emulated" and not key.endswith("#obj"):  # (its counts load with the other objects)
                wanted[key] = destination(key, params.get(parts[4]) if parts[2] == "versions" else None)
        return wanted

    def restore(self, loaded: dict) -> None:
        self.emulated.restore(loaded)
