"""PipeDream-2BW (Narayanan et al., ICML 2021): 1F1B with no flush, two weight versions per stage.

Order on rank r (one stage per rank, p ranks, m microbatches per minibatch, global microbatch
j = k·m + i): a warm-up of w_r = min(p − 1 − r, m) forwards once at the start of training, then
strictly alternating F(b + w_r), B(b), and the stage's optimizer step S_k right after its last
backward of minibatch k. Step k's segment is therefore

    F(k, w) B(k, 0) F(k, w+1) B(k, 1) … F(k, m−1) B(k, m−w−1) F(k+1, 0) B(k, m−w) … F(k+1, w−1) B(k, m−1) S_k

(the first segment also holds the warm-up; the last one has no forwards of a next minibatch, so the
pipeline drains only when training stops).

Versions (the x-view of DESIGN's rule; x_v is the stage's weights after v updates): minibatch k
runs forward and backward on x_{max(k−1, 0)}, S_k computes x_{k+1} = x_k − U(g_k(x_{k−1})), i.e. a
constant one-step delay at every stage and any depth. Version v lives in buffer v mod 2; S_k writes
x_{k+1} into buffer (k+1) mod 2, whose last users (minibatch k) have all finished their backward.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action

from .async_order import AsyncOrder

__all__ = ["PIPEDREAM_2BW"]


class PipeDream2BW(AsyncOrder):
    name = "pipedream-2bw"
    n_buffers = 2
    updates_per_step = 1

    def warmup(self, rank: int, pp_size: int, n_microbatches: int) -> int:
        return min(pp_size - 1 - rank, n_microbatches)

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        m, w, total = n_microbatches, self.warmup(rank, pp_size, n_microbatches), n_steps * n_microbatches
        ops = [_Action(rank, FORWARD, j) for j in range(w)] if step == 0 else []
        for b in range(step * m, step * m + m):
            if b + w < total:
                ops.append(_Action(rank, FORWARD, b + w))
            ops.append(_Action(rank, FULL_BACKWARD, b))
        return ops

    def version(self, stage: int, pp_size: int, j: int, n_microbatches: int) -> int:
        return max(j // n_microbatches - 1, 0)

    def buffer_written_after(self, stage: int, pp_size: int, step: int) -> int:
        return (step + 1) % 2

    def delay(self, stage: int, pp_size: int) -> int:
        return 1


PIPEDREAM_2BW = PipeDream2BW()
