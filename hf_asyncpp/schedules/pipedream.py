"""PipeDream-2BW (Narayanan et al., ICML 2021) and the original PipeDream (SOSP 2019).

Both run the same order on rank r (one stage per rank, p ranks, m microbatches per minibatch,
global microbatch j = k·m + i): a warm-up of w_r forwards once at the start of training (2BW:
min(p − 1 − r, m); PipeDream: p − 1 − r, see below), then strictly alternating F(b + w_r), B(b); the
pipeline drains only when training stops.
Step k's segment is

    F(k, w) B(k, 0) F(k, w+1) B(k, 1) … F(k, m−1) B(k, m−w−1) F(k+1, 0) B(k, m−w) … F(k+1, w−1) B(k, m−1)

(the first segment also holds the warm-up; the last one forwards nothing of a next minibatch).

PipeDream-2BW updates each stage once per minibatch, right after its last backward of it. With x_v
the stage's weights after v updates, minibatch k runs forward and backward on x_{max(k−1, 0)} and
the update computes x_{k+1} = x_k − U(g_k(x_{k−1})): a one-step delay at every stage and any depth,
two versions (buffers v mod 2).

PipeDream updates each stage after every backward (one microbatch per update). Microbatch j's
forward on stage r runs after j − w_r of the stage's updates, so it uses x_{max(j − w_r, 0)} and its
gradient is applied w_r updates later: stage-dependent staleness p − 1 − r, taken at a model whose
stages have different ages. Stage r keeps p − r versions (weight stashing).

PipeDream needs m ≥ p − 1 and refuses fewer microbatches. Its staleness is its in-flight count:
stage r must hold p − 1 − r forwards ahead of its backward, whatever m is (it has no minibatches; m
only groups its updates into steps). Capping the warm-up at m, as 2BW does, would silently make
the first stages fresher than PipeDream (delay min(p − 1 − r, m)). The uncapped order itself is
valid (sends pair, no deadlock, `check_versions` passes), but with m < p − 1 stage 0's step k would
forward microbatches of minibatch k + 2 or later, while a step is given the rows of its own and the
next minibatch only (async_runtime.run_step, engine.train_step), an early stop drains one step, and a
resumed run replays into the next minibatch only. 2BW keeps its cap: it updates once per minibatch
with delay 1 at any warm-up, so m < p − 1 costs it idle time, not staleness.
"""

from __future__ import annotations

from ..torch_internals import FORWARD, FULL_BACKWARD, _Action

from .async_order import AsyncOrder

__all__ = ["PIPEDREAM", "PIPEDREAM_2BW", "PipeDream", "PipeDream2BW"]


class _OneFOneBWithoutFlush(AsyncOrder):
    def warmup(self, rank: int, pp_size: int, n_microbatches: int) -> int:
        """Forwards rank `rank` runs before its first backward (its in-flight count from then on)."""
        raise NotImplementedError

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        m, w, total = n_microbatches, self.warmup(rank, pp_size, n_microbatches), n_steps * n_microbatches
        # Warm-up, once at the start of training: the first w forwards.
        ops = [_Action(rank, FORWARD, j) for j in range(w)] if step == 0 else []
        # Steady state and, in the last step, cool-down: F(b + w) B(b) for this step's backwards b.
        for b in range(step * m, step * m + m):
            if b + w < total:
                ops.append(_Action(rank, FORWARD, b + w))
            ops.append(_Action(rank, FULL_BACKWARD, b))
        return ops


class PipeDream2BW(_OneFOneBWithoutFlush):
    name = "pipedream-2bw"

    def warmup(self, rank: int, pp_size: int, n_microbatches: int) -> int:
        return min(pp_size - 1 - rank, n_microbatches)  # never more than one minibatch ahead

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        return 1


class PipeDream(_OneFOneBWithoutFlush):
    name = "pipedream"
    per_microbatch_updates = True

    def warmup(self, rank: int, pp_size: int, n_microbatches: int) -> int:
        if n_microbatches < pp_size - 1:
            raise ValueError(
                f"PipeDream keeps p-1-r microbatches in flight on stage r (its staleness), so stage 0 would "
                f"forward {pp_size - 1} microbatches ahead of its backward, beyond the next minibatch of "
                f"{n_microbatches} (a step is given the rows of its own and the next minibatch only); use "
                f"n_microbatches >= pp_size - 1 = {pp_size - 1}, or pipedream-2bw"
            )
        return pp_size - 1 - rank

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        return self.warmup(stage, pp_size, n_microbatches)


PIPEDREAM_2BW = PipeDream2BW()
PIPEDREAM = PipeDream()
