"""Measurements of a step: compute time per rank (hence idle / bubble fraction), tokens/s, and
the metrics.jsonl writer."""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["ComputeTimer", "MetricsWriter", "theoretical_bubble"]

_COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class ComputeTimer:
    """Wall time this rank spends inside stage compute (forward, backward, weight-backward, and
    the loss, which torch's schedule evaluates outside the stage's forward).

    idle fraction = 1 − busy / step time: waiting for activations or gradients (the bubble),
    communication that is not overlapped, and the step's tail (gradient sync, optimizer step).
    """

    def __init__(self, stages):
        self.busy_s = 0.0
        for stage in stages:
            for name in _COMPUTE_METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self.timed(getattr(stage, name)))

    def timed(self, method):
        """`method`, with its wall time added to busy time."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - start

        return timed

    def take(self) -> float:
        busy, self.busy_s = self.busy_s, 0.0
        return busy


def theoretical_bubble(pp_size: int, n_microbatches: int) -> float:
    """(p − 1) / (m + p − 1): the idle share of a flushed pipeline with equal stages."""
    return (pp_size - 1) / (n_microbatches + pp_size - 1)


class MetricsWriter:
    """Appends one JSON object per logged step to <output_dir>/metrics.jsonl (main process)."""

    def __init__(self, output_dir: str | Path, fresh: bool = True):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w" if fresh else "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
