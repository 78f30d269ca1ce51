"""Rows → seq_len token blocks, the one packing rule for files, in-memory datasets and streams.

A dataset whose rows hold `input_ids` of exactly seq_len tokens gives one block per row, as given.
Otherwise the `text_column` of every row is tokenized (no special tokens), an EOS appended, and the
token stream cut into consecutive seq_len blocks; the tail shorter than a block is dropped. Blocks
come lazily, batch by batch, so a stream is packed on the fly with the same result as a whole file.
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["BlockPacker", "build_token_blocks"]


class BlockPacker:
    """Packs the rows of a `datasets.Dataset` / `IterableDataset` into blocks of seq_len tokens."""

    def __init__(self, tokenizer, seq_len: int, text_column: str = "text", batch_size: int = 1000):
        self.tokenizer, self.seq_len, self.text_column, self.batch_size = tokenizer, seq_len, text_column, batch_size

    def blocks(self, dataset) -> Iterator[list[int]]:
        """The dataset's blocks in row order, each a list of seq_len token ids."""
        pending: list[int] = []  # tokenized text not yet cut into a block
        for batch in dataset.iter(batch_size=self.batch_size):
            if "input_ids" in batch:
                yield from self._given_rows(batch["input_ids"])
                continue
            if self.text_column not in batch:
                raise ValueError(f"dataset has no '{self.text_column}' column (columns: {', '.join(batch)})")
            encoded = self.tokenizer(list(batch[self.text_column]), add_special_tokens=False, verbose=False)
            for ids in encoded["input_ids"]:
                pending.extend(ids)
                pending.append(self.tokenizer.eos_token_id)
            n_full = len(pending) // self.seq_len
            for b in range(n_full):
                yield pending[b * self.seq_len:(b + 1) * self.seq_len]
            del pending[:n_full * self.seq_len]

    def _given_rows(self, rows) -> Iterator[list[int]]:
        for ids in rows:
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            if len(ids) != self.seq_len:
                raise ValueError(f"dataset rows hold input_ids of length {len(ids)}, expected (n, {self.seq_len})")
            yield ids

    def tensor(self, dataset, name: str = "dataset") -> torch.Tensor:
        """All blocks of a finite dataset (or a (rows, seq_len) tensor, checked) as an int64 tensor."""
        if isinstance(dataset, torch.Tensor):
            if dataset.ndim != 2 or dataset.shape[1] != self.seq_len:
                raise ValueError(f"{name} is a tensor of shape {tuple(dataset.shape)}, expected (n, {self.seq_len})")
            return dataset.long()
        blocks = list(self.blocks(dataset))
        if not blocks:
            raise ValueError(f"{name} yields no block of {self.seq_len} tokens")
        return torch.tensor(blocks, dtype=torch.long)


def build_token_blocks(dataset: str, tokenizer, seq_len: int, text_column: str = "text") -> torch.Tensor:
    """All samples of a source (files, "shakespeare", a Hub id) as a (rows, seq_len) tensor, in file order."""
    from .sources import load_source

    return BlockPacker(tokenizer, seq_len, text_column).tensor(load_source(dataset), f"dataset '{dataset}'")
