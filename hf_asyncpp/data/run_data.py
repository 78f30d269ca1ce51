"""The data a run trains and evaluates on: one sampler for this dp rank and the held-out blocks.

`training_data(config, ...)` loads `config.dataset` (map-style, or streamed with `streaming: true`)
and `config.eval_dataset`; a rank whose stages never look at a token takes `token_free_data` instead; `TrainingData.from_datasets(...)` takes datasets already in memory, as a
`transformers.Trainer`-style front end holds them. Both go through the same packing and samplers.
Held-out blocks are the eval dataset whole or, for a map-style train set, its last `eval_fraction`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..evaluation import evaluation_batches, split_held_out
from .errors import DataError
from .packing import BlockPacker, check_disjoint, check_vocabulary
from .prefetch import Prefetcher
from .prepared import PreparedBlocks, read_manifest
from .samplers import MinibatchSampler, StreamingSampler
from .sources import load_source

__all__ = ["TokenFreeRows", "TrainingData", "token_free_data", "training_data"]


@dataclass
class TrainingData:
    sampler: MinibatchSampler | Prefetcher | TokenFreeRows  # .rows(step) → (rows_per_step, seq_len), this dp rank
    held_out: torch.Tensor | None  # (n, seq_len) validation blocks, or None

    @property
    def steps_per_epoch(self) -> float:
        """Steps in one pass over the training blocks (all dp ranks); infinite for a stream, whose
        length is unknown, and for a rank that holds no tokens."""
        return getattr(self.sampler, "steps_per_epoch", math.inf)

    def epoch(self, step: int) -> float:
        """Passes over the training blocks after `step` steps (transformers' `state.epoch`; 0 while
        the length is unknown)."""
        return step / self.steps_per_epoch

    @classmethod
    def from_datasets(cls, train_dataset, eval_dataset, tokenizer, config, dp_rank: int, dp_size: int,
                      vocab_size: int | None = None) -> TrainingData:
        """Datasets in memory: `datasets.Dataset`, `datasets.IterableDataset` (streamed) or a (rows, seq_len)
        tensor, each holding `input_ids` rows of seq_len tokens or a `config.text_column` to pack. Token
        ids must lie below `vocab_size` (checked when given)."""
        return _build(train_dataset, eval_dataset, tokenizer, config, dp_rank, dp_size, vocab_size)


class TokenFreeRows:
    """The sampler of a rank whose stages never look at a token (a middle pipeline stage): step k's
    "rows" are zeros of the step's shape, which is all such a rank uses them for."""

    def __init__(self, rows_per_step: int, seq_len: int):
        self._rows = torch.zeros((), dtype=torch.long).expand(rows_per_step, seq_len)

    def rows(self, step: int) -> torch.Tensor:
        return self._rows

    def position(self, step: int) -> None:
        return None

    def resume(self, step: int, positions: list[dict] | None) -> None:
        return None


def token_free_data(config, n_held_out: int | None) -> TrainingData:
    """What a middle pipeline stage's rank holds instead of the data: the shapes (`n_held_out`
    held-out blocks, from a rank that read them), no tokens."""
    held_out = None if n_held_out is None else torch.zeros((), dtype=torch.long).expand(n_held_out, config.seq_len)
    return TrainingData(TokenFreeRows(config.rows_per_step, config.seq_len), held_out)


def training_data(config, tokenizer, dp_rank: int, dp_size: int, vocab_size: int | None = None) -> TrainingData:
    """The run's data as the config names it (files, "shakespeare" or a Hub id); token ids must lie
    below `vocab_size` (checked when given)."""
    if read_manifest(config.dataset) is not None and not config.streaming:  # prepared: mapped, never loaded
        train = PreparedBlocks(config.dataset)
    else:
        train = load_source(config.dataset, config.dataset_config_name, config.dataset_split,
                            streaming=config.streaming, revision=config.dataset_revision)
    eval_rows = None
    if config.eval_dataset is not None:
        eval_rows = load_source(config.eval_dataset, config.dataset_config_name, config.eval_dataset_split,
                                revision=config.dataset_revision)
    return _build(train, eval_rows, tokenizer, config, dp_rank, dp_size, vocab_size,
                  f"dataset '{config.dataset}'", f"eval_dataset '{config.eval_dataset}'")


def _build(train_dataset, eval_dataset, tokenizer, config, dp_rank: int, dp_size: int, vocab_size: int | None,
           train_name: str = "train_dataset", eval_name: str = "eval_dataset") -> TrainingData:
    from datasets import IterableDataset

    packer = BlockPacker(tokenizer, config.seq_len, config.text_column, num_proc=config.preprocessing_num_workers)
    if eval_dataset is not None and config.eval_fraction > 0:
        raise ValueError("an eval dataset replaces eval_fraction: set eval_fraction to 0 or drop the eval dataset")
    held_out = None if eval_dataset is None else packer.tensor(eval_dataset, eval_name)
    if held_out is not None:
        check_vocabulary(held_out, vocab_size, eval_name)
    if isinstance(train_dataset, IterableDataset):
        if config.eval_fraction > 0:
            raise ValueError("eval_fraction cannot split a streamed dataset (its length is unknown); "
                             "give an eval dataset instead")
        source = {"dataset": train_name, "config_name": config.dataset_config_name, "split": config.dataset_split,
                  "revision": config.dataset_revision}  # the stream's saved positions hold only in it
        sampler = StreamingSampler(train_dataset, packer, config.rows_per_step, dp_rank, dp_size,
                                   config.shuffle, config.seed, config.shuffle_window, vocab_size, train_name, source)
        if held_out is not None:
            _check_evaluation_size(held_out, config, dp_size)
        # Packing a stream costs time per step: the next steps are read ahead in a thread.
        return TrainingData(Prefetcher(sampler, pin_memory=torch.cuda.is_available()), held_out)
    if isinstance(train_dataset, PreparedBlocks):  # vocabulary checked by its manifest; too large to scan
        blocks = train_dataset
        if held_out is not None:
            check_disjoint(blocks, held_out, train_name, eval_name, blocks.hashes())
    else:
        blocks = packer.tensor(train_dataset, train_name)
        check_vocabulary(blocks, vocab_size, train_name)
        if held_out is not None:
            check_disjoint(blocks, held_out, train_name, eval_name)
    if eval_dataset is None:
        blocks, held_out = split_held_out(blocks, config.eval_fraction)
        if isinstance(held_out, PreparedBlocks):
            held_out = held_out.materialize()
    if held_out is not None:
        _check_evaluation_size(held_out, config, dp_size)
    sampler = MinibatchSampler(blocks, config.rows_per_step, dp_rank, dp_size, config.shuffle, config.seed)
    return TrainingData(sampler, held_out)


def _check_evaluation_size(held_out, config, dp_size: int) -> None:
    """A held-out set too small for one evaluation batch is said before training, not at the first evaluation."""
    try:
        evaluation_batches(held_out.shape[0], config.rows_per_step, dp_size)
    except ValueError as err:
        raise DataError(str(err)) from None
