"""One epoch of a dp rank's stream as blocks, and the position that continues it exactly.

The stream is read in windows of `window` rows. A window's documents (packing.py: a row's tokens and
an EOS, or its input_ids) are permuted when shuffling, seeded by (seed, epoch, window index), then
cut into blocks after the tokens the previous window left over. A position names a window — the
stream's `state_dict()` before it, its index, the rows before it, the leftover tokens before it — and
how many of its blocks were taken. Continuing from a position loads that state and reads, tokenizes
and permutes that one window again: a constant cost, whatever the step.

Why windows rather than datasets' shuffle buffer: `IterableDataset.state_dict()` does not hold the
buffer, so a resumed shuffled stream refills an empty buffer from the saved read position (the rows
that were in the buffer are lost for the epoch) and restarts its random generator (the order after
the resume differs). A window holds nothing that its position cannot rebuild.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from itertools import islice

import numpy as np

from .errors import DataError

__all__ = ["StreamBlocks"]


class _BufferOfOne(logging.Filter):
    """datasets warns, as a resumed stream starts, that loading a state loses its shuffle buffer's
    rows; the shuffle by shard order only (buffer_size 1, samplers.py) has none to lose. Applied only
    while a resume of such a stream reads its first window."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "shuffle buffer" not in record.getMessage()


@contextlib.contextmanager
def _buffer_of_one_quiet(shuffled: bool):
    logger, quiet = logging.getLogger("datasets.iterable_dataset"), _BufferOfOne()
    if shuffled:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


_START = {"stream": None, "window": 0, "rows": 0, "carry": [], "taken": 0}  # an epoch's first block


class StreamBlocks:
    """`next_block()` over one epoch of `stream` (None at its end); `position()` continues it."""

    def __init__(self, stream, packer, epoch: int, window: int, shuffle: bool, seed: int, name: str,
                 position: dict | None = None):
        self.packer, self.epoch, self.window, self.shuffle, self.seed, self.name = (
            packer, epoch, window, shuffle, seed, name)
        if position is not None and position["stream"] is not None:  # a copy: later epochs start afresh
            stream = copy.deepcopy(stream)
            stream.load_state_dict(position["stream"])
        self._stream, self._rows = stream, iter(stream)
        start = position or _START
        # The window being taken from (none yet: `start` describes the first one to read) ...
        self._state, self._window, self._first_row = start["stream"], start["window"], start["rows"]
        self._carry_before = np.asarray(start["carry"], dtype=np.int64)
        self._blocks, self._taken, self._ended = np.zeros((0, packer.seq_len), dtype=np.int64), 0, False
        # ... and the next one.
        self._next_state, self._next_window, self._next_first_row = self._state, self._window, self._first_row
        self._carry = self._carry_before
        if position is not None:
            with _buffer_of_one_quiet(shuffle):
                self._read_window()
            if len(self._blocks) < position["taken"]:
                raise DataError(f"{name}: the stream no longer holds the blocks its saved position names "
                                "(the data changed since the checkpoint); resume with the same data")
            self._taken = position["taken"]

    def position(self) -> dict:
        """Where the next block comes from (JSON-serialisable)."""
        return {"stream": self._state, "window": self._window, "rows": self._first_row,
                "carry": self._carry_before.tolist(), "taken": self._taken}

    def next_block(self) -> np.ndarray | None:
        while self._taken == len(self._blocks):
            if self._ended:
                return None
            self._read_window()
        self._taken += 1
        return self._blocks[self._taken - 1]

    def _read_window(self) -> None:
        self._state, self._window, self._first_row = self._next_state, self._next_window, self._next_first_row
        rows = list(islice(self._rows, self.window))
        self._ended = len(rows) < self.window
        self._next_state, self._next_window = self._stream.state_dict(), self._window + 1
        self._next_first_row = self._first_row + len(rows)
        documents = []
        if rows:
            documents = self.packer.documents({key: [row[key] for row in rows] for key in rows[0]},
                                              self._first_row, self.name)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch, self._window]).permutation(len(documents))
            documents = [documents[i] for i in order]
        self._carry_before = self._carry
        self._blocks, self._carry = self.packer.cut(self._carry, documents)
        self._taken = 0
