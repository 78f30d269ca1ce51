"""WPipe (Yang et al., ICLR 2022): group-based interleaved pipeline, two weight groups updated alternately.

The model is cut into 2p stages. Group 1 (G1) is stages 0 … p−1, group 2 (G2) is stages p … 2p−1;
rank r holds G1 stage r and G2 stage p + r (loop placement, activations go r0 → … → r(p−1) → r0 → …).
The order on rank r for minibatch k, microbatch i, is given by time slots (t_F = t_B; the paper's
constraints, reconstructed and checked here):

    Fa(k, i): 4mk + 2i + r              Fb(k, i): 4mk + 2m + 2i + r
    Bb(k, i): 4mk + 2m + 2p − 1 + 2i − r   Ba(k, i): 4mk + 4m + 2p − 1 + 2i − r

(a: the G1 stage, b: the G2 stage). Conflict-free and without a steady-state bubble for m ≥ p − 1:
each slot pairs one group's forward with the other group's backward. G2 updates after Bb(k, m−1),
before any Fb(k+1, ·): its gradients are never stale (delay 0, one weight buffer). G1 updates after
Ba(k, m−1), after all Fa(k+1, ·) already ran on the old weights: delay 1 (two buffers), exactly as
PipeDream-2BW. Per group, with x the stored weights after v updates:

    G2 (stages p … 2p−1, the second half of the layers):  b_{k+1} = b_k − U(∇_b f(a_{k−1}, b_k; ξ_k))
    G1 (stages 0 … p−1, the first half):                  a_{k+1} = a_k − U(∇_a f(a_{k−1}, b_k; ξ_k))

so half of the parameters see 2BW's one-step delay and half see none, and only G1 keeps a second
weight copy: half of 2BW's delayed gradients and redundant weights. Step k's segment on rank r is
the slots [4mk + r, 4m(k+1) + r): it forwards only minibatch k, so no lookahead rows are needed.
"""

from __future__ import annotations

from ..torch_internals import FORWARD, FULL_BACKWARD, _Action

from .async_order import AsyncOrder

__all__ = ["WPIPE", "WPipe"]


class WPipe(AsyncOrder):
    name = "wpipe"

    def delay(self, stage: int, pp_size: int, n_microbatches: int) -> int:
        return 1 if stage < pp_size else 0

    def segment(self, rank: int, pp_size: int, n_microbatches: int, step: int, n_steps: int) -> list[_Action]:
        p, m = pp_size, n_microbatches
        if m < p - 1:
            raise ValueError(f"WPipe needs at least pp_size − 1 = {p - 1} microbatches per step")
        lower = 4 * m * step + rank if step > 0 else float("-inf")
        upper = 4 * m * (step + 1) + rank if step < n_steps - 1 else float("inf")
        timed = []
        for k in range(max(step - 1, 0), min(step + 1, n_steps)):
            for i in range(m):
                j, base = k * m + i, 4 * m * k + 2 * i
                timed += [
                    (base + rank, _Action(rank, FORWARD, j)),
                    (base + 2 * m + rank, _Action(p + rank, FORWARD, j)),
                    (base + 2 * m + 2 * p - 1 - rank, _Action(p + rank, FULL_BACKWARD, j)),
                    (base + 4 * m + 2 * p - 1 - rank, _Action(rank, FULL_BACKWARD, j)),
                ]
        return [action for t, action in sorted(timed, key=lambda x: x[0]) if lower <= t < upper]


WPIPE = WPipe()
