"""Prepared shards (`hf-asyncpp prepare-data`) mapped into memory: the blocks of a pretraining corpus
without reading them.

The shards are Arrow IPC files of fixed-length int32 rows, so each one is a (rows, seq_len) array
in the page cache: `PreparedBlocks` memory-maps them (no copy, no parse) and a step's rows are
gathered from the pages that hold them. A data rank's memory is therefore its steps' rows, not the
corpus — 41B tokens are 164 GB as int32, which no rank could hold — and start-up costs reading the
manifest. The token ids were checked against the model's vocabulary by the manifest's
`vocab_size` at validation (config.py), and an eval set is checked against the blocks' stored
hashes: the corpus is never scanned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["MANIFEST", "PreparedBlocks", "read_manifest"]

MANIFEST = "manifest.json"  # what marks a directory as prepared (written last by prepare.py)


def read_manifest(dataset: str) -> dict | None:
    """The manifest of a prepared directory, or None for any other dataset."""
    path = Path(dataset) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


class PreparedBlocks:
    """Rows [start, stop) of a prepared directory's blocks; indexed like a (rows, seq_len) tensor by
    a LongTensor of row numbers (a gathered int64 tensor) or a slice (a view of the rows)."""

    def __init__(self, directory: str, _arrays: list[np.ndarray] | None = None, start: int = 0,
                 stop: int | None = None, _hashes: list[np.ndarray] | None = None):
        if _arrays is None:
            import pyarrow as pa

            manifest = read_manifest(directory)
            seq_len = manifest["seq_len"]
            _arrays, _hashes = [], []
            for shard in manifest["shards"]:
                table = pa.ipc.open_stream(pa.memory_map(os.path.join(directory, shard["file"]))).read_all()
                for chunk in table.column("input_ids").chunks:  # zero-copy views of the mapped file
                    flat = chunk.values.to_numpy(zero_copy_only=True)[chunk.offset * seq_len:]
                    _arrays.append(flat[:len(chunk) * seq_len].reshape(len(chunk), seq_len))
                _hashes += [chunk.to_numpy(zero_copy_only=True) for chunk in table.column("hash").chunks]
        self.directory, self._arrays, self._hashes = directory, _arrays, _hashes
        self._starts = np.cumsum([0] + [len(a) for a in _arrays])
        self.start, self.stop = start, int(self._starts[-1]) if stop is None else stop

    @property
    def shape(self) -> tuple[int, int]:
        return self.stop - self.start, self._arrays[0].shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("prepared blocks are sliced in steps of 1")
            return PreparedBlocks(self.directory, self._arrays, self.start + start, self.start + max(start, stop),
                                  self._hashes)
        rows = np.asarray(key, dtype=np.int64).reshape(-1) + self.start
        if len(rows) and (rows.min() < self.start or rows.max() >= self.stop):
            raise IndexError(f"rows outside [0, {len(self)})")
        which = np.searchsorted(self._starts, rows, side="right") - 1
        gathered = np.empty((len(rows), self.shape[1]), dtype=np.int64)
        for array in np.unique(which):  # one fancy-index read per shard touched
            mine = which == array
            gathered[mine] = self._arrays[array][rows[mine] - self._starts[array]]
        return torch.from_numpy(gathered)

    def hashes(self) -> torch.Tensor:
        """`packing.block_hashes` of the rows, as prepare-data stored them (no block is read)."""
        return torch.from_numpy(np.concatenate(self._hashes)[self.start:self.stop])

    def materialize(self) -> torch.Tensor:
        """All rows as one tensor (for a small range: a held-out split)."""
        return self[torch.arange(len(self))]
