"""Measurements of a step: compute time per rank (hence idle / bubble fraction), the step's
statistics reduced over all ranks (`ReducedStepStats`, read through `StepResult`), tokens/s, and the
metrics.jsonl writer."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from numbers import Number
from pathlib import Path

__all__ = ["ComputeTimer", "MetricsWriter", "ReducedStepStats", "StepResult", "idle_fraction", "memory_peaks",
           "numeric_scalars", "theoretical_bubble"]


class ComputeTimer:
    """Time this rank spends inside stage compute (forward, backward, weight-backward, and the loss,
    which torch's schedule evaluates outside the stage's forward).

    idle fraction = 1 − busy / step time: waiting for activations or gradients (the bubble),
    communication that is not overlapped, and the step's tail (gradient sync, optimizer step).
    On CPU a compute call's wall time is its work. On a GPU the call only launches kernels, so its time
    is taken between CUDA events recorded around it on the compute stream (a receive's wait is queued
    before the start event) and read at `take` without waiting for them (a host wait on an event is a
    sync): the calls the device has finished count there, those still running at a later take. A step's
    host read (its gradient norm) has waited for the stream, so what ran before it has finished.
    """

    def __init__(self, stages, device=None):
        """Times every compute call of `stages` (schedules/stage_hooks.py: its "compute_time" hook)."""
        self.busy_s = 0.0
        self._on_gpu = device is not None and device.type == "cuda"
        self._events: list = []  # (start, end) per compute call not yet counted, on a GPU
        self._paused = False
        for stage in stages:
            stage.subscribe("compute_time", lambda call: self.measuring())

    @contextlib.contextmanager
    def measuring(self):
        """Adds the time of what runs inside to busy time."""
        if self._paused:
            yield
        elif self._on_gpu:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()  # read at take: no wait for the device per call
                self._events.append((start, end))
        else:
            start = time.perf_counter()
            try:
                yield
            finally:
                self.busy_s += time.perf_counter() - start

    def timed(self, function):
        """`function`, with its time added to busy time."""
        def timed_call(*args, **kwargs):
            with self.measuring():
                return function(*args, **kwargs)

        return timed_call

    @contextlib.contextmanager
    def paused(self):
        """Compute inside is not busy time of a training step (an evaluation through the same stages)."""
        on, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = on

    def take(self) -> float:
        """The busy time measured since the last take (on a GPU: of the calls finished by now)."""
        finished = 0
        for _, end in self._events:  # one stream: the first unfinished call's successors are not finished
            if not end.query():
                break
            finished += 1
        self.busy_s += sum(start.elapsed_time(end) for start, end in self._events[:finished]) / 1000.0
        del self._events[:finished]
        busy, self.busy_s = self.busy_s, 0.0
        return busy


def memory_peaks(device) -> tuple[float, float]:
    """(peak bytes, peak reserved bytes) of this process so far, read from the host's own bookkeeping (no
    sync): on a GPU the caching allocator's `max_memory_allocated` / `max_memory_reserved`, on a CPU the
    peak resident set size and 0."""
    if device.type == "cuda":
        import torch

        return float(torch.cuda.max_memory_allocated(device)), float(torch.cuda.max_memory_reserved(device))
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, 0.0  # KiB on Linux


def idle_fraction(busy_s: float, step_time_s: float) -> float:
    """The share of a step spent outside stage compute."""
    return max(0.0, 1.0 - busy_s / step_time_s) if step_time_s > 0 else 0.0


def theoretical_bubble(pp_size: int, n_microbatches: int) -> float:
    """(p − 1) / (m + p − 1): the idle share of a flushed pipeline with equal stages."""
    return (pp_size - 1) / (n_microbatches + pp_size - 1)


def _is_number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


def numeric_scalars(record: dict) -> dict:
    """The numbers of a logged record without its `step`, as trackers and `Trainer.log` take them. A
    per-rank or per-stage list becomes one scalar per entry, named by it (`idle_fraction_per_rank` →
    `idle_fraction_rank_0`, `idle_fraction_rank_1`, …): the project's own measurements reach the
    trackers too. Strings, booleans and None stay in metrics.jsonl only."""
    scalars = {}
    for key, value in record.items():
        if key == "step":
            continue
        if _is_number(value):
            scalars[key] = value
        elif isinstance(value, list) and (per := next((p for p in ("_per_rank", "_per_stage") if key.endswith(p)), None)):
            name, unit = key[: -len(per)], per[len("_per_"):]
            scalars.update({f"{name}_{unit}_{i}": v for i, v in enumerate(value) if _is_number(v)})
    return scalars


class MetricsWriter:
    """Appends one JSON object per logged step to <output_dir>/metrics.jsonl (main process)."""

    def __init__(self, output_dir: str | Path, resume_after_step: int | None = None):
        """A fresh file, or (resuming) the existing one without records of steps after the checkpoint."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_after_step is not None and self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_after_step]
        self._file = open(self.path, "w")
        self._file.write("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ReducedStepStats:
    """One step's statistics summed over all ranks by a single asynchronous all-reduce.

    Layout: [LM-loss sum, aux-loss sum, microbatch count, squared gradient norm, microbatches with a
    non-finite loss, termination requests, idle_0 … idle_{W−1}, peak memory_0 … _{W−1}, reserved memory_0
    … _{W−1} (bytes), then per stage: weight-version age, non-finite gradient (0/1), skipped updates, of
    them those of an earlier step's gradient]. The last-stage ranks contribute losses, the dp-rank-0
    replica of every stage its squared norm and its stages' ages and gradient findings (replicas hold
    the same averaged gradient), every rank its idle fraction, its memory peaks (`memory_peaks`) and
    whether it was asked to terminate.
    `value()` waits for the reduction, which by then has usually long finished; nothing else does, so
    no rank waits for another between steps.

    Nothing is read on the host to build it, nor copied from host memory (on a GPU a blocking upload is a
    sync too): what the host knows (counts, ages, idle time) is written into the device vector as
    constants (a fill per value that is not 0), and the losses and norms, device tensors, are written
    there too. Its values are read once, by `value()` or along with another value (`read_with`).
    """

    _HEAD = 6

    def __init__(self, loss_records, layout, n_stages: int, grad_sq_norm=None,
                 idle_fraction: float = 0.0, version_age_by_stage: dict[int, int] | None = None,
                 nonfinite_grad_stages=(), skipped_by_stage: dict[int, int] | None = None,
                 termination_requested: bool = False, skipped_earlier_by_stage: dict[int, int] | None = None,
                 memory: tuple[float, float] = (0.0, 0.0)):
        """`grad_sq_norm`: a float64 device scalar (or None); `nonfinite_grad_stages`: stage → a 0/1
        float64 device scalar, or the stages that were non-finite."""
        import torch
        import torch.distributed as dist

        world_size = layout.world_size
        self._world_size, self._n_stages = world_size, n_stages
        # What the host knows, written on the device.
        v = [0.0] * (self._HEAD + 3 * world_size + 4 * n_stages)
        v[2] = float(len(loss_records))
        v[5] = float(termination_requested)
        v[self._HEAD + layout.rank] = idle_fraction
        v[self._HEAD + world_size + layout.rank], v[self._HEAD + 2 * world_size + layout.rank] = memory
        per_stage = self._HEAD + 3 * world_size
        for stage, age in (version_age_by_stage or {}).items():
            v[per_stage + stage] = age
        if not isinstance(nonfinite_grad_stages, dict):
            for stage in nonfinite_grad_stages:
                v[per_stage + n_stages + stage] = 1
        for stage, count in (skipped_by_stage or {}).items():
            v[per_stage + 2 * n_stages + stage] = count
        for stage, count in (skipped_earlier_by_stage or {}).items():
            v[per_stage + 3 * n_stages + stage] = count
        vector = torch.zeros(len(v), dtype=torch.float64, device=layout.device)
        for index, value in enumerate(v):
            if value:
                vector[index:index + 1].fill_(value)
        # What the device holds, written there.
        if loss_records:
            lm = torch.stack([pair[0] for pair in loss_records]).to(vector.device, torch.float64)
            aux = torch.stack([pair[1] for pair in loss_records]).to(vector.device, torch.float64)
            lm_sum, aux_sum = vector[0], vector[1]
            for i in range(len(loss_records)):  # in microbatch order, as a sum on the host adds them
                lm_sum, aux_sum = lm_sum + lm[i], aux_sum + aux[i]
            vector[0], vector[1] = lm_sum, aux_sum
            vector[4] = (~(torch.isfinite(lm) & torch.isfinite(aux))).sum()
        if grad_sq_norm is not None:
            vector[3] = grad_sq_norm
        if isinstance(nonfinite_grad_stages, dict):
            for stage, flag in nonfinite_grad_stages.items():
                vector[per_stage + n_stages + stage] = flag
        self._vector = vector
        self._work = dist.all_reduce(self._vector, async_op=True)
        self._values: dict | None = None

    def done(self) -> bool:
        return self._values is not None or self._work.is_completed()

    def read_with(self, extra):
        """The values of device tensor `extra` (flattened, as float64), read in the same transfer as this
        step's reduced statistics (which `value` then returns without reading)."""
        import torch

        extra = extra.reshape(-1).to(self._vector.device, torch.float64)
        if self._values is not None:
            return extra.tolist()
        self._work.wait()
        values = torch.cat([extra, self._vector]).tolist()
        self._unpack(values[extra.numel():])
        return values[:extra.numel()]

    def value(self, key: str):
        if self._values is None:
            self._work.wait()
            self._unpack(self._vector.tolist())
        return self._values[key]

    def _unpack(self, v: list[float]) -> None:
        count = max(v[2], 1.0)
        w = self._world_size
        stages = self._HEAD + 3 * w
        s = self._n_stages
        self._values = {
            "loss": v[0] / count,
            "aux_loss": v[1] / count,
            "grad_norm": v[3] ** 0.5,
            "nonfinite_loss_microbatches": int(v[4]),
            "termination_requested": v[5] > 0,
            "idle_fraction_per_rank": [round(x, 4) for x in v[self._HEAD:self._HEAD + w]],
            "peak_memory_gib_per_rank": [round(x / 2**30, 3) for x in v[self._HEAD + w:self._HEAD + 2 * w]],
            "reserved_memory_gib_per_rank": [round(x / 2**30, 3) for x in v[self._HEAD + 2 * w:stages]],
            "weight_version_age_per_stage": [int(x) for x in v[stages:stages + s]],
            "nonfinite_grad_stages": [i for i, x in enumerate(v[stages + s:stages + 2 * s]) if x > 0],
            "skipped_updates_per_stage": [int(x) for x in v[stages + 2 * s:stages + 3 * s]],
            "skipped_earlier_updates_per_stage": [int(x) for x in v[stages + 3 * s:]],
        }


@dataclass
class StepResult:
    """What one step did. Losses, idle fractions and the gradient norm come from every rank through
    one asynchronous all-reduce (so asynchronous schedules never wait on each other); reading them
    waits for it."""

    step: int
    lr: float
    tokens: int  # tokens consumed by this step, all dp ranks
    step_time_s: float
    busy_s: float  # this rank's time inside stage compute
    reduced: "ReducedStepStats"
    # A rank was asked to terminate (SIGTERM) by the previous step: every rank sees it at this step.
    termination_requested: bool = False

    @property
    def idle_fraction(self) -> float:
        """This rank's share of the step outside stage compute."""
        return idle_fraction(self.busy_s, self.step_time_s)

    @property
    def loss(self) -> float:
        """Language-model cross entropy, mean over the minibatch's microbatches and dp replicas."""
        return self.reduced.value("loss")

    @property
    def aux_loss(self) -> float:
        """Load-balancing loss before its coefficient (0 for models without one)."""
        return self.reduced.value("aux_loss")

    @property
    def grad_norm(self) -> float:
        """Global L2 norm of the gradient before clipping, over all stages."""
        return self.reduced.value("grad_norm")

    @property
    def idle_fraction_per_rank(self) -> list[float]:
        return self.reduced.value("idle_fraction_per_rank")

    @property
    def peak_memory_gib_per_rank(self) -> list[float]:
        """Per rank, its peak so far (memory_peaks): device memory allocated on a GPU, resident memory on a CPU."""
        return self.reduced.value("peak_memory_gib_per_rank")

    @property
    def reserved_memory_gib_per_rank(self) -> list[float]:
        """Per rank, the most device memory its caching allocator has reserved so far (0 on a CPU)."""
        return self.reduced.value("reserved_memory_gib_per_rank")

    @property
    def weight_version_age_per_stage(self) -> list[int]:
        """Per stage: updates between the weights this step's gradient was taken at and the weights
        it was applied to (0 synchronous; 1 for PipeDream-2BW after its first step)."""
        return self.reduced.value("weight_version_age_per_stage")

    @property
    def skipped_updates_per_stage(self) -> list[int]:
        """Per stage: updates not applied in this step because their gradient was non-finite."""
        return self.reduced.value("skipped_updates_per_stage")
