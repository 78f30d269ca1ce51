"""Rows → seq_len token blocks, the one packing rule for files, in-memory datasets and streams.

A dataset whose rows hold `input_ids` of exactly seq_len tokens gives one block per row, as given.
Otherwise the `text_column` of every row is tokenized (no special tokens), an EOS appended, and the
token stream cut into consecutive seq_len blocks; the tail shorter than a block is dropped. Blocks
come lazily, batch by batch, so a stream is packed on the fly with the same result as a whole file.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .errors import DataError

__all__ = ["BlockPacker", "block_hashes", "build_token_blocks", "check_disjoint", "check_vocabulary"]


class BlockPacker:
    """Packs the rows of a `datasets.Dataset` / `IterableDataset` into blocks of seq_len tokens."""

    def __init__(self, tokenizer, seq_len: int, text_column: str = "text", batch_size: int = 1000,
                 num_proc: int | None = None):
        self.tokenizer, self.seq_len, self.text_column, self.batch_size = tokenizer, seq_len, text_column, batch_size
        self.num_proc = num_proc  # processes tokenizing a map-style dataset (None: this one)
        self._tokenize = _TokenizeRows(tokenizer, text_column)  # the one rule: a row's tokens, then an EOS

    def blocks(self, dataset, name: str = "dataset") -> Iterator[np.ndarray]:
        """The dataset's blocks in row order, each an array of seq_len token ids."""
        carry = np.zeros(0, dtype=np.int64)  # tokens not yet cut into a block
        row = 0  # rows of the dataset seen so far
        for batch in dataset.iter(batch_size=self.batch_size):
            documents = self.documents(batch, row, name)
            row += len(documents)
            blocks, carry = self.cut(carry, documents)
            yield from blocks

    def documents(self, batch: dict, first_row: int, name: str = "dataset") -> list:
        """Each row's tokens: its `input_ids` as given (checked to be seq_len long), or its text's
        tokens and an EOS. `first_row` numbers the batch's first row in error messages."""
        if "input_ids" in batch:
            return list(self._given_rows(batch["input_ids"], first_row, name))
        if self.text_column not in batch:
            raise DataError(f"{name} has no '{self.text_column}' column (columns: {', '.join(batch)}); "
                            "set text_column, or give rows of input_ids")
        return self._tokenize(batch)["ids"]

    def cut(self, carry: np.ndarray, documents: list) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, the tokens left over): `carry` and the documents concatenated and cut into
        consecutive seq_len blocks."""
        tokens = np.concatenate([carry] + [np.asarray(d, dtype=np.int64) for d in documents])
        n_full = len(tokens) // self.seq_len
        return tokens[:n_full * self.seq_len].reshape(n_full, self.seq_len), tokens[n_full * self.seq_len:].copy()

    def _given_rows(self, rows, first_row: int, name: str) -> Iterator[list[int]]:
        for number, ids in enumerate(rows, start=first_row):
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            if len(ids) != self.seq_len:
                raise self._wrong_length(name, number, len(ids))
            yield ids

    def _wrong_length(self, name: str, row: int, length: int) -> DataError:
        return DataError(f"{name}: row {row} holds {length} input_ids, but rows of input_ids are used as given and "
                         f"seq_len is {self.seq_len}: set seq_len {length}, or give the rows as text to be packed")

    def tensor(self, dataset, name: str = "dataset") -> torch.Tensor:
        """All blocks of a finite dataset (or a (rows, seq_len) tensor, checked) as an int64 tensor.
        Text is tokenized once: by `datasets.Dataset.map`, whose result datasets caches on disk (keyed
        by the data, the tokenizer and this function), so a second run or a restart only reads it."""
        if isinstance(dataset, torch.Tensor):
            if dataset.ndim != 2 or dataset.shape[1] != self.seq_len:
                raise DataError(f"{name} is a tensor of shape {tuple(dataset.shape)}, expected (n, {self.seq_len})")
            return dataset.long()
        from datasets import Dataset

        columns = dataset.column_names if isinstance(dataset, Dataset) else ()  # an IterableDataset: row by row
        if "input_ids" in columns:
            blocks = self._given_blocks(dataset, name)
        elif self.text_column in columns:
            blocks = self._packed_from_cache(dataset)
        else:
            blocks = torch.from_numpy(np.array(list(self.blocks(dataset, name)), dtype=np.int64).reshape(-1, self.seq_len))
        if not len(blocks):
            raise DataError(f"{name} yields no block of {self.seq_len} tokens")
        return blocks

    def _given_blocks(self, dataset, name: str) -> torch.Tensor:
        """The `input_ids` rows of a map-style dataset (prepared shards, say) as blocks, read as one
        Arrow column rather than row by row."""
        import pyarrow.compute as pc

        column = dataset.with_format("arrow")[:].column("input_ids").combine_chunks()
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != self.seq_len)
        if len(wrong):
            raise self._wrong_length(name, int(wrong[0]), int(lengths[wrong[0]]))
        ids = np.array(column.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        return torch.from_numpy(ids).view(-1, self.seq_len)

    def _packed_from_cache(self, dataset) -> torch.Tensor:
        """`blocks(dataset)` for the text of a map-style dataset, with the tokens from a cached map:
        every row's ids and an EOS, concatenated in row order and cut into blocks (the tail dropped)."""
        tokenized = dataset.map(self._tokenize, batched=True,
                                batch_size=self.batch_size, num_proc=self.num_proc,
                                remove_columns=dataset.column_names, desc="tokenizing")
        ids = tokenized.data.column("ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        n_blocks = len(ids) // self.seq_len
        return torch.from_numpy(np.array(ids[:n_blocks * self.seq_len], dtype=np.int64)).view(n_blocks, self.seq_len)


def build_token_blocks(dataset: str, tokenizer, seq_len: int, text_column: str = "text") -> torch.Tensor:
    """All samples of a source (files, "shakespeare", a Hub id) as a (rows, seq_len) tensor, in file order."""
    from .sources import load_source

    return BlockPacker(tokenizer, seq_len, text_column).tensor(load_source(dataset), f"dataset '{dataset}'")


class _TokenizeRows:
    """The map function: each row's tokens followed by an EOS. A class with plain fields, so that
    datasets' fingerprint (and with it the cache) follows the tokenizer and the column."""

    def __init__(self, tokenizer, text_column: str):
        self.tokenizer, self.text_column = tokenizer, text_column

    def __call__(self, batch):
        encoded = self.tokenizer(list(batch[self.text_column]), add_special_tokens=False, verbose=False)
        return {"ids": [ids + [self.tokenizer.eos_token_id] for ids in encoded["input_ids"]]}


def check_vocabulary(blocks: torch.Tensor, vocab_size: int | None, name: str, first_row: int = 0) -> None:
    """Refuse token ids outside [0, vocab_size): the embedding would index out of range mid-step."""
    if vocab_size is None or blocks.numel() == 0:
        return
    bad = (blocks >= vocab_size) | (blocks < 0)
    if bad.any():
        row = int(bad.any(dim=1).nonzero()[0])
        token = int(blocks[row][bad[row]][0])
        raise DataError(f"{name}: block {first_row + row} holds token id {token}, outside the model's vocabulary "
                        f"of {vocab_size} ids: the data was tokenized for another model; tokenize it with this run's "
                        "tokenizer, or use a model_config whose vocab_size covers it")


def block_hashes(blocks: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of each block's tokens (a seeded weighted sum, wrapping around): equal blocks
    hash equal; prepare-data stores them beside the blocks so a corpus is compared without reading it."""
    weights = torch.randint(-2**62, 2**62, (blocks.shape[1],), generator=torch.Generator().manual_seed(0))
    return (blocks.long() * weights).sum(dim=1)


def check_disjoint(train, held_out: torch.Tensor, train_name: str, eval_name: str,
                   train_hashes: torch.Tensor | None = None) -> None:
    """Refuse a held-out set that repeats training blocks: its loss would not measure generalization.
    Blocks are compared by `block_hashes` (the training blocks' given as `train_hashes`, when known),
    then exactly; `train` is anything a LongTensor of rows indexes (a tensor, prepared blocks)."""
    train_hash = block_hashes(train) if train_hashes is None else train_hashes
    eval_hash = block_hashes(held_out)
    candidates = torch.isin(eval_hash, train_hash)
    for row in candidates.nonzero().flatten().tolist():
        same_hash = (train_hash == eval_hash[row]).nonzero().flatten()
        if (train[same_hash] == held_out[row]).all(dim=1).any():
            shared = int(candidates.sum())
            raise DataError(f"{eval_name} repeats blocks of {train_name} (block {row}, and up to {shared} in all): "
                            "held-out data must not be trained on; give an eval set disjoint from the training data")