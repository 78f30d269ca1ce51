"""What a step reports of this rank's updates, recorded as they happen by whichever way they were applied:
per stage the squared gradient norm of each update, the largest weight-version age, the updates skipped
(and of them those of an earlier step's gradient); the stages whose gradient was non-finite. Everything
stays a device tensor until the step's statistics are read (metrics.ReducedStepStats)."""

from __future__ import annotations

import torch

__all__ = ["StepReport"]


class StepReport:
    def __init__(self):
        self._steps = self._reported_steps = 0  # steps started; steps whose skipped updates were taken
        self._skipped: dict[int, int] = {}  # per stage, updates skipped since the last take_skipped
        self._skipped_earlier: dict[int, int] = {}  # of them, those of a reported step's gradient
        self.start_step()

    def start_step(self) -> None:
        self._sq_norms: dict[int, list[torch.Tensor]] = {}  # per updater's stage, each update's squared norm
        self._stage_sq_norms: list[tuple[int, torch.Tensor]] = []  # (stage, its squared norm) per update
        self._ages: dict[int, int] = {}
        self._steps += 1

    @property
    def step(self) -> int:
        """The steps started so far (the one running now is the last)."""
        return self._steps

    # --- recorded by the update ------------------------------------------------------------------

    def record_norms(self, updater_stage: int, per_stage: list[tuple[int, torch.Tensor]], squared: torch.Tensor) -> None:
        """An update's squared gradient norms: per stage it covers, and `squared`, their sum."""
        self._stage_sq_norms.extend(per_stage)
        self._sq_norms.setdefault(updater_stage, []).append(squared)

    def record_age(self, stage: int, age: int) -> None:
        """A gradient of `stage` taken `age` updates before the weights it is applied to."""
        self._ages[stage] = max(self._ages.get(stage, 0), age)

    def record_skip(self, stages: list[int]) -> None:
        for stage in stages:
            self._skipped[stage] = self._skipped.get(stage, 0) + 1

    def record_skip_of_reported_step(self, stages: list[int], gradient_step: int) -> None:
        """A skip decided after the step of its gradient (`gradient_step`) has reported, if it has."""
        if gradient_step <= self._reported_steps:
            for stage in stages:
                self._skipped_earlier[stage] = self._skipped_earlier.get(stage, 0) + 1

    def skipped_now(self, stage: int) -> bool:
        """Whether an update of `stage` was skipped since the last report."""
        return stage in self._skipped

    # --- read by the step's outcome --------------------------------------------------------------

    @property
    def ages(self) -> dict[int, int]:
        return dict(self._ages)

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
        taken = self._skipped, self._skipped_earlier
        self._skipped, self._skipped_earlier = {}, {}
        self._reported_steps = self._steps
        return taken
