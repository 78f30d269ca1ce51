"""How a run fails: together, with one message, and never leaving a bad state on disk.

Three things stop a multi-rank run besides its end, and each is decided so that every rank takes the
same decision at the same step boundary (a rank that decides alone leaves the others waiting in a
receive):

  - a non-finite loss or gradient norm (`NonFiniteGuard`): the update it would have made is never
    applied (engine.py skips it where the gradient norm is non-finite: globally for synchronous
    schedules, per stage for asynchronous ones, where a non-finite loss reaches every stage through the
    backward); the policy then stops the run, or lets it continue up to a number of skipped steps;
  - a termination request (SIGTERM, `TerminationRequest`): the run saves a checkpoint and ends cleanly;
    the run asks for one itself while a save still fits before the job's time limit (`TimeLimit`);
  - a rank that died or stalled: the others' next message times out (`comm_timeout_s`) or fails at
    once (a closed connection), and `lost_peers_reported` turns that into a `PeerLostError`.

The first two travel in each step's statistics all-reduce (metrics.ReducedStepStats) and are read one
step later, when that reduction has long finished: no rank waits for another to decide. (Non-finite
values under an asynchronous pipeline clipped by the global norm: two steps later, since an update
held for that norm is decided in the next step and its outcome travels in that step's all-reduce.)
`RunFailure` is what the front ends report as `error: ...` with exit status 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from .log import get_logger

__all__ = ["NONFINITE_POLICIES", "LocalFailure", "NonFiniteError", "NonFiniteGuard", "PeerLostError", "RunFailure",
           "TerminationRequest", "TimeLimit", "first_nonfinite", "lost_peers_reported"]

logger = get_logger(__name__)

NONFINITE_POLICIES = ("stop", "skip")


class RunFailure(RuntimeError):
    """Raised on every rank at the same point: the run stops with exit status 1 and this message."""


class LocalFailure(RunFailure):
    """Raised on this rank only (e.g. rank 0 cannot write metrics.jsonl): it exits with the message,
    and the others stop as for a lost peer."""


class NonFiniteError(RunFailure):
    """A non-finite loss or gradient norm under policy `stop`, or more skipped steps than allowed."""


class PeerLostError(RunFailure):
    """Another rank died or stopped answering within comm_timeout_s."""


def first_nonfinite(named_tensors) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity (a DTensor: in this
    rank's shard), or None. Checked before anything is written: nothing non-finite reaches a disk.
    One host read per device holding such tensors, whatever their number (each read is a sync)."""
    import torch
    from torch.distributed.tensor import DTensor

    checked: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}  # device → (position, all finite)
    names = []
    for name, tensor in named_tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(local, torch.Tensor) and local.is_floating_point():
            checked.setdefault(local.device, []).append((len(names), torch.isfinite(local).all()))
            names.append(name)
    bad = [position for flags in checked.values()
           for (position, _), finite in zip(flags, torch.stack([f for _, f in flags]).tolist()) if not finite]
    return names[min(bad)] if bad else None


def _is_communication_error(err: BaseException) -> bool:
    """Whether `err` is a collective or point-to-point operation that failed (timeout, closed peer)."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(s in text for s in ("gloo", "by peer", "Timed out")))


@contextlib.contextmanager
def lost_peers_reported(rank: int, timeout_s: float):
    """Inside: a message or collective that failed (a dead or stalled peer) surfaces as PeerLostError
    saying so, instead of the backend's own error. Both front ends run the pipeline inside it."""
    try:
        yield
    except Exception as err:
        if not _is_communication_error(err):
            raise
        raise PeerLostError(
            f"rank {rank} lost contact with the other ranks: {str(err).strip().splitlines()[0]} — another rank "
            f"died or did not answer within comm_timeout_s ({timeout_s:g} s). Complete checkpoints are kept; "
            "rerun with resume_from_checkpoint: latest to continue from the newest one") from err


class NonFiniteGuard:
    """Decides, from a step's reduced statistics, whether the run goes on after non-finite values.

    `review(step, stats, later)` sees what every rank reported for step `step`: microbatches with a
    non-finite loss, stages whose gradient was non-finite, and the updates of the step's gradients that
    were skipped. An update held for the pipeline's global norm may be decided after its step has
    reported: its outcome then comes with the next step's statistics (`later`, "earlier" skips there),
    and is counted with the step of its gradient. Under `stop` any finding raises `NonFiniteError`;
    under `skip` a step whose gradient had an update skipped is counted and the run stops once more
    than `skip_limit` steps were skipped. (Under an asynchronous schedule the loss of a microbatch is
    reported with the step that forwarded it, its gradient and skipped updates with the step of its
    backward, which may be the next.) The message names the step, the stages and which tensors were
    non-finite.
    """

    def __init__(self, policy: str, skip_limit: int, last_stage: int):
        self.policy, self.skip_limit, self.last_stage = policy, skip_limit, last_stage
        self.skipped_steps: list[int] = []

    @staticmethod
    def skipped_stages(stats, later=None) -> list[int]:
        """The stages whose update of step `stats`'s gradient was skipped: decided in that step, or
        (held for the global norm) by the time `later`, the next step's statistics, reported."""
        counts = [total - earlier for total, earlier in zip(stats.value("skipped_updates_per_stage"),
                                                            stats.value("skipped_earlier_updates_per_stage"))]
        if later is not None:
            counts = [own + late for own, late in zip(counts, later.value("skipped_earlier_updates_per_stage"))]
        return [stage for stage, count in enumerate(counts) if count]

    def describe(self, step: int, stats, later=None) -> str | None:
        """What was non-finite in step `step`, and which updates it cost, or None."""
        losses, stages = stats.value("nonfinite_loss_microbatches"), stats.value("nonfinite_grad_stages")
        skipped = self.skipped_stages(stats, later)
        if not losses and not stages and not skipped:
            return None
        parts = []
        if losses:
            parts.append(f"in the loss of {losses} microbatch{'es' * (losses > 1)} (computed on stage {self.last_stage})")
        if stages:
            parts.append(f"in the gradient of {_stages(stages)}")
        found = f"NaN or infinity {' and '.join(parts)}" if parts else "a NaN or infinite global gradient norm"
        what = (f"the update of {_stages(skipped)} was skipped" if skipped else
                "no update of this step's gradients was skipped (a loss's gradient counts with the step of its backward)")
        return f"step {step}: {found}; {what}"

    def review(self, step: int, stats, later=None) -> None:
        """Raise NonFiniteError when the policy says stop (identically on every rank)."""
        message = self.describe(step, stats, later)
        if message is None:
            return
        if self.policy == "stop":
            raise NonFiniteError(f"{message}. nonfinite_policy is stop: the run stops; the weights hold no "
                                 "non-finite value and the last checkpoint is kept")
        if not self.skipped_stages(stats, later):  # reported; only skipped updates count
            logger.warning(message)
            return
        self.skipped_steps.append(step)
        if len(self.skipped_steps) > self.skip_limit:
            raise NonFiniteError(f"{message}. That is {len(self.skipped_steps)} steps with skipped updates "
                                 f"(steps {', '.join(map(str, self.skipped_steps))}), more than nonfinite_skip_limit "
                                 f"({self.skip_limit}): the run stops; the last checkpoint is kept")
        logger.warning(f"{message} ({len(self.skipped_steps)} of {self.skip_limit} allowed)")

    def state_dict(self) -> dict:
        return {"skipped_steps": list(self.skipped_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = list(state.get("skipped_steps", []))


def _stages(stages) -> str:
    return f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}"


class TerminationRequest:
    """SIGTERM (a preemption, a scheduler's time limit) asks the run to save a checkpoint and end.

    While `installed()` is active the signal only sets `requested`, which this rank adds to the next
    step's statistics all-reduce; every rank reads the sum one step later, so all of them stop at the
    same step boundary even when the signal reached just one.
    """

    def __init__(self):
        self.requested = False

    def request(self, reason: str) -> None:
        """Ask for the stop (this rank; every rank stops with it one step later)."""
        if not self.requested:
            # A warning: said by the rank that asked, whichever it is.
            logger.warning(f"{reason}: saving a checkpoint at the next step boundary, then stopping")
        self.requested = True

    def _handle(self, signum, frame) -> None:
        self.request("SIGTERM")

    def installed(self):
        return signals_handled(self._handle, signal.SIGTERM)


@contextlib.contextmanager
def signals_handled(handler, *signals: signal.Signals):
    """`handler` takes `signals` while the context is active, then their previous handlers again. A
    signal ignored from the start stays ignored (under nohup, SIGHUP is not meant to stop anything);
    outside the main thread (a notebook's worker, say) the signals stay as they are."""
    taken = [s for s in signals if signal.getsignal(s) is not signal.SIG_IGN]
    try:
        previous = {s: signal.signal(s, handler) for s in taken}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


class TimeLimit:
    """The job's end, and the step boundary where the run must stop to save before it.

    A scheduler's SIGTERM gives a fixed lead (moe_10b.sbatch: 120 s) that a large model's save may not
    fit. Knowing when the job ends (`SLURM_JOB_END_TIME`, seconds since the epoch: set by Slurm 23.02
    and later, and by the launch file from `squeue` before that), the run stops on its own while
    the save still fits: a stop asked for at a step boundary is seen by every rank one step later
    (resilience: the statistics all-reduce), so two steps and one save must fit before the end, the
    save counted SAFETY times over and MARGIN_S kept for the processes to exit. The save's time is
    the latest measured one (checkpoint/saving.py: staging plus writing, the slowest rank's); before
    any, the state's size at ASSUMED_WRITE_RATE.
    """

    ENV = "SLURM_JOB_END_TIME"
    SAFETY, MARGIN_S = 1.5, 30.0
    ASSUMED_WRITE_RATE = 200e6  # bytes per second per rank: a slow shared file system's share

    def __init__(self, end_time: float):
        self.end_time = end_time

    @classmethod
    def from_environment(cls) -> "TimeLimit | None":
        """The job's time limit, where the environment says it (None otherwise)."""
        value = os.environ.get(cls.ENV, "").strip()
        try:
            return cls(float(value)) if value else None
        except ValueError:
            logger.warning(f"{cls.ENV}={value!r} is not a time in seconds since the epoch: no time-limit stop")
            return None

    def save_estimate_s(self, measured_s: float | None, state_bytes: int) -> float:
        return measured_s if measured_s is not None else state_bytes / self.ASSUMED_WRITE_RATE

    def due(self, step_time_s: float, save_s: float, now: float | None = None) -> bool:
        """Whether a stop asked for now is the last one whose save still ends before the limit."""
        now = time.time() if now is None else now
        return now + 2 * step_time_s + self.SAFETY * save_s + self.MARGIN_S >= self.end_time

    def reason(self, save_s: float) -> str:
        left = self.end_time - time.time()
        return f"the job ends in {left:.0f} s ({self.ENV}) and a checkpoint takes about {save_s:.0f} s to save"
