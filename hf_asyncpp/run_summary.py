"""What a run's closing lines say about its pipeline: each pipeline rank's measured idle share, and
what a flush costs on the same stages.

Measured idle share: 1 − the rank's stage compute (forward, backward and the loss: metrics.ComputeTimer)
/ the wall time of its training steps, both summed over the steps of this launch (a pipeline rank's dp
replicas averaged). The rest is waiting for activations and gradients (the bubble, and the slowest
stage's pace on the others), communication that is not overlapped, and the optimizer steps. Start-up,
evaluations, checkpoints and logging fall between steps and are not counted.

The flush: the run's own schedule when it is synchronous, else 1F1B (GPipe when 1F1B cannot run the
microbatches), played by the schedules' timing model for one step with each rank's measured compute
(ScheduleSpec.flush_seconds): the time its step takes beyond the busiest rank's compute. An
asynchronous run's step with that time added, or a synchronous run's without it, is the same run
with and without the flush, everything else (optimizer steps, communication) as measured; the idle
shares of that step are what the lines compare.
"""

from __future__ import annotations

from .metrics import idle_fraction

__all__ = ["IdleTally", "idle_summary"]


class IdleTally:
    """This rank's stage compute and training-step wall time, summed over the steps it adds."""

    def __init__(self):
        self.steps = 0
        self.compute_s = 0.0
        self.step_time_s = 0.0

    def add(self, result) -> None:
        """One step's metrics.StepResult."""
        self.steps += 1
        self.compute_s += result.busy_s
        self.step_time_s += result.step_time_s

    def per_step_by_pipeline_rank(self, layout) -> tuple[list[float], list[float]]:
        """(compute, wall time) of a step on each pipeline rank, mean over its steps and dp replicas: a
        collective on every rank."""
        import torch.distributed as dist

        gathered = [None] * layout.world_size
        dist.all_gather_object(gathered, (layout.pp_rank, self.compute_s, self.step_time_s), group=layout.io_group)
        compute, step_time = [0.0] * layout.pp_size, [0.0] * layout.pp_size
        for pp_rank, rank_compute, rank_step_time in gathered:
            compute[pp_rank] += rank_compute / (self.steps * layout.dp_size)
            step_time[pp_rank] += rank_step_time / (self.steps * layout.dp_size)
        return compute, step_time


def _shares(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def idle_summary(spec, n_microbatches: int, steps: int, compute_s: list[float], step_time_s: list[float]) -> list[str]:
    """Two lines for a run of schedule `spec` over `steps` steps whose pipeline rank r computed
    compute_s[r] seconds in a step of step_time_s[r]: the measured idle shares, and those of the same
    run with a flush added (an asynchronous schedule) or taken away (a synchronous one)."""
    from .schedules import get_schedule_spec

    pp_size = len(compute_s)
    flushed = spec if spec.synchronous else get_schedule_spec("1f1b" if n_microbatches >= pp_size else "gpipe")
    flush_s = flushed.flush_seconds(pp_size, n_microbatches, compute_s)
    equal_flush_s = flushed.flush_seconds(pp_size, n_microbatches, [1.0] * pp_size)
    other_step_s = [t - flush_s if spec.synchronous else t + flush_s for t in step_time_s]
    step_s = sum(step_time_s) / pp_size
    measured = [idle_fraction(c, t) for c, t in zip(compute_s, step_time_s)]
    other = [idle_fraction(c, t) for c, t in zip(compute_s, other_step_s)]
    change = (f"takes {flush_s:.3f} s of each {step_s:.3f} s step; without it they would idle" if spec.synchronous
              else f"would add {flush_s:.3f} s to each {step_s:.3f} s step, idling them")
    return [
        f"idle share by pipeline rank over {steps} steps of {spec.name} (1 − forward/backward compute / step wall "
        f"time): {_shares(measured)}",
        f"{flushed.name}'s flush {change} {_shares(other)} (timing model at the measured compute; "
        f"{equal_flush_s / (1.0 + equal_flush_s):.2f} on equal stages)",
    ]
