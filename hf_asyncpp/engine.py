"""One training step over the pipeline: the engine both front ends drive.

The engine holds what every kind of run shares — the statistics each step reduces over every rank,
their review by the non-finite guard, the termination request, the step count — and drives the
executor of its kind of run (executors/), chosen once here: a synchronous pipeline, an asynchronous
one, or an asynchronous schedule emulated on one rank. A step on one rank: the executor runs forward and
backward of the minibatch's n_microbatches microbatches over this rank's stages and its updates (clipped
by the global norm over all stages and dp ranks, skipped when that is non-finite: update/rule.py,
resilience.py); the engine reduces what the step reports. The minibatch loss is the mean of the
microbatch losses, as in gradient accumulation.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

from .config import TrainConfig
from .executors import build_full_model, executor_class
from .memory import state_bytes
from .metrics import ReducedStepStats, StepResult, idle_fraction, memory_peaks
from .parallel.mesh import ParallelLayout
from .resilience import NonFiniteGuard, TerminationRequest
from .schedules import get_schedule_spec

__all__ = ["PipelineEngine", "build_full_model"]


class PipelineEngine:
    def __init__(self, config: TrainConfig, model_config, layout: ParallelLayout, model: torch.nn.Module | None = None):
        self.config, self.layout = config, layout
        self.spec = get_schedule_spec(config.schedule).starting_synchronously(config.sync_steps)
        self.executor = executor_class(self.spec, layout)(config, model_config, layout, self.spec, model)
        self.plan = self.executor.plan
        self._unfinished: list[ReducedStepStats] = []
        self.guard = NonFiniteGuard(config.nonfinite_policy, config.nonfinite_skip_limit, len(self.plan) - 1)
        self.termination = TerminationRequest()  # the loop installs its SIGTERM handler
        # Steps not yet reviewed, oldest first: each is reviewed at the next step's end, or where an update
        # may be decided after its step's report (held for the global norm), at the end of the one after.
        self._awaiting_review: list[tuple[int, ReducedStepStats]] = []
        self._review_lag = self.executor.review_lag
        self.step_count = 0
        self.last_step = config.max_steps  # the run's final step count (stop_after may bring it forward)

    @property
    def forwards_ahead(self) -> bool:
        """Whether a step also forwards into the next minibatch (asynchronous pipelines): then
        train_step needs its rows as `next_rows`."""
        return self.executor.forwards_ahead

    @property
    def evaluates_mid_run(self) -> bool:
        """Whether weights between two steps can be evaluated (not for orders whose updates straddle step
        boundaries: WPipe)."""
        return self.executor.evaluates_mid_run

    def train_step(self, rows: torch.Tensor, next_rows: torch.Tensor | None = None) -> StepResult:
        """One optimizer step on minibatch `rows`. Asynchronous schedules on a pipeline also forward
        into the next minibatch: pass its rows as `next_rows` (None on the last step, which drains)."""
        start = time.perf_counter()
        lr = self.executor.learning_rate
        # Pinned rows (data/prefetch.py) are copied while the device computes; a blocking copy from
        # pageable memory would wait for the device (a sync on a GPU).
        rows = rows.to(self.layout.device, non_blocking=True)
        next_rows = None if next_rows is None else next_rows.to(self.layout.device, non_blocking=True)
        unread = self._awaiting_review[-1][1] if self._awaiting_review else None  # read along with the step's read
        outcome = self.executor.train_step(rows, next_rows, unread, drains=self.step_count + 1 == self.last_step)
        self.step_count += 1
        step_time = time.perf_counter() - start
        busy = step_time if outcome.busy_s is None else outcome.busy_s
        reduced = ReducedStepStats(
            outcome.losses, self.layout, len(self.plan), grad_sq_norm=outcome.grad_sq_norm,
            idle_fraction=idle_fraction(busy, step_time), version_age_by_stage=outcome.ages,
            nonfinite_grad_stages=outcome.nonfinite_stages, skipped_by_stage=outcome.skipped,
            termination_requested=self.termination.requested, skipped_earlier_by_stage=outcome.skipped_earlier,
            memory=memory_peaks(self.layout.device),
        )
        self._unfinished = [r for r in self._unfinished if not r.done()] + [reduced]
        # The previous steps' reductions have finished on every rank by now: decide on what they report.
        self._awaiting_review.append((self.step_count, reduced))
        self._review(keep=self._review_lag)
        terminate = unread.value("termination_requested") if unread else False
        return StepResult(self.step_count, lr, rows.numel() * self.layout.dp_size, step_time, busy, reduced, terminate)

    def _review(self, keep: int = 0) -> None:
        """Apply the non-finite policy (raises NonFiniteError to stop) to the steps awaiting review but
        the newest `keep`, each with the next step's statistics, which carry the outcome of its updates
        decided after its report. Identical on every rank: it reads the all-reduces."""
        while len(self._awaiting_review) > keep:
            step, reduced = self._awaiting_review.pop(0)
            later = self._awaiting_review[0][1] if self._awaiting_review and self._review_lag > 1 else None
            self.guard.review(step, reduced, later)

    def settle_updates(self) -> None:
        """Apply every update still held for its global norm (collective: call on every rank before
        reading the weights or their state — a checkpoint, an evaluation, the export)."""
        self.executor.settle()

    def resume_after(self, step: int) -> None:
        """Continue after `step` completed steps whose training state was just loaded."""
        self.step_count = step
        self.executor.resume_after(step)

    def stop_after(self, step: int) -> int:
        """End the run early: returns the step count it can end at, `step` where nothing is in flight
        (an asynchronous pipeline runs the step it has forwarded into, as its last)."""
        self.last_step = self.executor.stop_after(step)
        return self.last_step

    def finish(self, wait_for_sends: bool = True) -> None:
        """Wait for every step's statistics reduction and in-flight send, and review the last step
        (call before tearing down process groups). A run stopped between steps of an asynchronous
        pipeline (SIGTERM) passes `wait_for_sends=False`: its last sends feed steps that never run."""
        self.executor.finish(wait_for_sends)
        for reduced in self._unfinished:
            reduced.value("loss")
        self._unfinished = []
        self._review()

    @torch.no_grad()
    def eval_step(self, rows: torch.Tensor, return_logits: bool = False) -> tuple[float, float, torch.Tensor | None]:
        """(LM loss, aux loss) of a minibatch without updating anything, and with `return_logits` the
        logits on the rank that holds the last stage (None elsewhere; otherwise each microbatch's logits
        are freed after its loss, as in training: a minibatch's rows × seq × vocab would sit beside the
        model on the last stage's device)."""
        losses, logits = self.executor.evaluate(rows.to(self.layout.device), return_logits)
        reduced = ReducedStepStats(losses, self.layout, len(self.plan))
        return reduced.value("loss"), reduced.value("aux_loss"), logits

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds per kind of state (memory.py): parameters, gradients, weight
        versions, optimizer state, EF buffers."""
        return state_bytes(self.executor.held_tensors())

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers under their HF names, whole (sharded
        parameters are gathered over dp: call on every rank)."""
        self.settle_updates()
        state = {}
        for module in self.executor.modules:
            state.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                          for k, v in module.state_dict().items()})
        return state
