"""PipeDream-2BW (Narayanan et al., ICML 2021) and the original PipeDream (SOSP 2019).

Both run the same order on rank r (one stage per rank, p ranks, m microbatches per minibatch,
global microbatch j = k·m + i): a warm-up of w_r = min(p − 1 − r, m) forwards once at the start of
training, then strictly alternating F(b + w_r), B(b); the pipeline drains only when training stops.
Step k's segment is

    F(k, w) B(k, 0) F(k, w+1) B(k, 1) … F(k, m−1) B(k, m−w−1) F(k+1, 0) B(k, m−w) … F(k+1, w−1) B(k, m−1)

(the first segment also holds the warm-up; the last one forwards nothing of a next minibatch).

PipeDream-2BW updates each stage once per minibatch, right after its last backward of it. With x_v
the stage's weights after v updates, minibatch k runs forward and backward on x_{max(k−1, 0)} and
the update computes x_{k+1} = x_k − U(g_k(x_{k−1})): a one-step delay at every stage and any depth,
two versions (buffers v mod 2).

PipeDream updates each stage after every backward (one microbatch per update). Microbatch j's
forward on stage r runs after j − w_r of the stage's updates, so it uses x_{max(j − w_r, 0)} and its
gradient is applied w_r updates later: stage-dependent staleness p − 1 − r (for m ≥ p − 1), taken at
a model whose stages have different ages. Stage r keeps w_r + 1 versions (weight stashing).
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action

from .async_order import AsyncOrder

__all__ = ["PIPEDREAM", "PIPEDREAM_2BW", "PipeDream", "PipeDream2BW"]


def warmup(rank: int, pp_size: int, n_microbatches: int) -> int:
    return min(pp_size - 1 - rank, n_microbatches)


class _OneFOneBWithoutFlush(AsyncOrder):
    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        m, w, total = n_microbatches, warmup(rank, pp_size, n_microbatches), n_steps * n_microbatches
        ops = [_Action(rank, FORWARD, j) for j in range(w)] if step == 0 else []
        for b in range(step * m, step * m + m):
            if b + w < total:
                ops.append(_Action(rank, FORWARD, b + w))
            ops.append(_Action(rank, FULL_BACKWARD, b))
        return ops


class PipeDream2BW(_OneFOneBWithoutFlush):
    name = "pipedream-2bw"

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        return 1


class PipeDream(_OneFOneBWithoutFlush):
    name = "pipedream"
    per_microbatch_updates = True

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        return warmup(stage, pp_size, n_microbatches)


PIPEDREAM_2BW = PipeDream2BW()
PIPEDREAM = PipeDream()
