"""Validation: a held-out split of the token blocks, and its loss over the whole pipeline.

The held-out blocks never reach training: the whole `eval_dataset`, or the last `eval_fraction` of the
blocks (in file order, before any shuffling).
Evaluation runs them in batches of one step's rows per dp rank (each dp rank its own slice, as in
training), forward only, through the same stages; every batch's loss is the mean over its microbatches
and dp replicas (one all-reduce), and the validation loss is the mean over batches (equal sizes, so
the mean over tokens). Perplexity is exp(validation loss).

`validation_summary` is that arithmetic, in one place: the token-weighted mean of per-batch mean
losses and its exp. The `evaluate` metric shipped at `PERPLEXITY_METRIC_PATH`
(`evaluate.load(PERPLEXITY_METRIC_PATH)`, offline) computes it too, for front ends built on `evaluate`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

__all__ = ["PERPLEXITY_METRIC_PATH", "evaluate", "split_held_out", "validation_summary"]

PERPLEXITY_METRIC_PATH = str(Path(__file__).parent / "metrics_module" / "pipeline_perplexity")


def split_held_out(blocks: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training blocks, held-out blocks or None)."""
    if fraction <= 0:
        return blocks, None
    n_eval = max(1, round(blocks.shape[0] * fraction))
    return blocks[:-n_eval], blocks[-n_eval:]


def evaluation_batches(n_blocks: int, rows_per_step: int, dp_size: int) -> int:
    """How many whole evaluation batches (a step's rows on every dp rank) `n_blocks` held-out blocks
    make; ValueError for none (checked when the data is read, before training starts)."""
    n_batches = n_blocks // (rows_per_step * dp_size)
    if n_batches == 0:
        raise ValueError(f"the held-out split has {n_blocks} blocks, fewer than one evaluation batch "
                         f"({rows_per_step * dp_size}: micro_batch_size × n_microbatches × dp); raise eval_fraction "
                         "or give a larger eval_dataset")
    return n_batches


def evaluate(engine, held_out: torch.Tensor, rows_per_step: int, dp_rank: int, dp_size: int) -> dict:
    """Validation loss, aux loss and perplexity of the held-out blocks (the same on every rank)."""
    n_batches = evaluation_batches(held_out.shape[0], rows_per_step, dp_size)
    losses, aux = [], []
    for b in range(n_batches):
        start = (b * dp_size + dp_rank) * rows_per_step
        loss, aux_loss, _ = engine.eval_step(held_out[start:start + rows_per_step])
        losses.append(loss)
        aux.append(aux_loss)
    tokens = [rows_per_step * dp_size * held_out.shape[1]] * n_batches  # every batch: all dp ranks' rows
    return {**validation_summary(losses, tokens), "eval_aux_loss": sum(aux) / n_batches, "eval_tokens": sum(tokens)}


def validation_summary(losses, tokens) -> dict:
    """{"eval_loss": the token-weighted mean of per-batch mean losses, "eval_perplexity": its exp}."""
    losses, tokens = [float(x) for x in losses], [int(n) for n in tokens]
    if len(losses) != len(tokens) or sum(tokens) <= 0:
        raise ValueError(f"need one token count per loss and some tokens; got {len(losses)} losses, "
                         f"{len(tokens)} counts summing to {sum(tokens)}")
    loss = sum(x * n for x, n in zip(losses, tokens)) / sum(tokens)
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss)}
