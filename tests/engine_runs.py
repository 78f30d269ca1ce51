"""The few steps a multi-rank engine test trains: its token rows, its held-out rows, and the loop that
trains them with evaluations on the way (tests/executors, tests/models). Shapes: SEQ tokens per row, MBS
rows per microbatch, M microbatches per step, STEPS steps."""

from __future__ import annotations

SEQ, MBS, M, STEPS = 16, 2, 4, 6


def token_rows(vocab_size: int, dp_size: int) -> list:
    """STEPS steps of rows, each all `dp_size` replicas' rows (replica r's are chunk r of dp_size)."""
    import torch

    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, vocab_size, (dp_size * MBS * M, SEQ), generator=gen) for _ in range(STEPS)]


def train_and_evaluate(engine, layout, vocab_size: int, data_dp: int, evaluate_after) -> tuple[list, list]:
    """STEPS steps of `engine` on this replica's share of the rows of `data_dp` replicas (each step passes
    the next step's rows ahead), evaluating held-out rows after each step in `evaluate_after`, then
    `engine.finish()`: (losses, evaluation losses)."""
    import torch

    dp, d = layout.dp_size, layout.dp_rank
    rows = [r.chunk(dp)[d] for r in token_rows(vocab_size, data_dp)]
    held_out = torch.randint(0, vocab_size, (data_dp * MBS * M, SEQ),
                             generator=torch.Generator().manual_seed(5)).chunk(dp)[d]
    losses, evals = [], []
    for k in range(STEPS):
        losses.append(engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None).loss)
        if k + 1 in evaluate_after:
            evals.append(engine.eval_step(held_out)[0])
    engine.finish()
    return losses, evals
