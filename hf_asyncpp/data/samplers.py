"""Step k's rows on one dp rank: from blocks in memory, or packed on the fly from a stream.

Both are pure functions of the step (with the seed). In memory, a resumed run asks for step k and
continues; a stream would have to read everything before step k, so it continues from the position a
checkpoint saved instead (`position` / `resume`).

In memory (`MinibatchSampler`): with shuffle off and dp = 1, step k uses rows k·G … (k+1)·G − 1
(G = micro_batch_size × n_microbatches), wrapping around at the end. With dp ranks, step k covers
dp·G consecutive rows and dp rank d takes the d-th slice of G; all pp ranks of one dp group read the
same rows. Shuffle permutes the blocks once per epoch with the run's seed.

Streaming (`StreamingSampler`): each dp rank reads its own documents (`split_dataset_by_node`), packs
them, and step k takes that rank's blocks k·G … (k+1)·G − 1; when the stream ends the next epoch
starts it over (a partial block never spans two epochs). Shuffle is the shard order (datasets',
seeded with the run's seed; `set_epoch` reshuffles each epoch) and the documents of each window
(stream_blocks.py). At dp 1 without shuffle the rows equal `MinibatchSampler`'s over the same files.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import DataError
from .packing import check_vocabulary
from .stream_blocks import StreamBlocks

__all__ = ["MinibatchSampler", "StreamingSampler"]


class MinibatchSampler:
    """Rows of step k for one dp rank; a pure function of (step, seed), so it resumes anywhere."""

    def __init__(self, blocks: torch.Tensor, rows_per_step: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int):
        if blocks.shape[0] < rows_per_step * dp_size:
            raise DataError(
                f"the dataset has {blocks.shape[0]} blocks, fewer than one step needs ({rows_per_step * dp_size})"
            )
        self.blocks, self.rows_per_step = blocks, rows_per_step
        self.dp_rank, self.dp_size, self.shuffle, self.seed = dp_rank, dp_size, shuffle, seed
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def steps_per_epoch(self) -> float:
        """Steps of one pass over the blocks (all dp ranks together)."""
        return self.blocks.shape[0] / (self.rows_per_step * self.dp_size)

    def _order(self, epoch: int) -> torch.Tensor:
        """The epoch's block order; the last two are kept (a step reads at most two epochs, and the
        loop reads each step twice: as the next step's rows, then as its own)."""
        if epoch not in self._orders:
            n = self.blocks.shape[0]
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)) \
                if self.shuffle else torch.arange(n)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def rows(self, step: int) -> torch.Tensor:
        n = self.blocks.shape[0]
        start = (step * self.dp_size + self.dp_rank) * self.rows_per_step
        positions = torch.arange(start, start + self.rows_per_step)
        epochs, offsets = positions // n, positions % n
        index = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            selected = epochs == epoch
            index[selected] = self._order(epoch)[offsets[selected]]
        return self.blocks[index]

    def position(self, step: int) -> None:
        """Nothing to save: the rows are a pure function of the step."""
        return None

    def resume(self, step: int, positions: list[dict] | None) -> None:
        """Nothing to restore: step `step`'s rows are computed directly."""
        return None


class StreamingSampler:
    """Rows of step k for one dp rank from an `IterableDataset`, packed on the fly.

    Reading forward is O(1) per block (one open iterator and its position), and the last few steps
    served are kept, since a training loop asks for step k+1 (to prefetch) before step k. `position(k)`
    is what continues the stream at step k's first block, and `resume(k, positions)` continues there
    (stream_blocks.py), reading one window again. A step behind the stream without a position (random
    access, a checkpoint without one) restarts the stream at the epoch that holds it and skips.
    """

    RECENT_STEPS = 4  # steps kept for repeated requests

    def __init__(self, dataset, packer, rows_per_step: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int,
                 shuffle_window: int, vocab_size: int | None = None, name: str = "dataset",
                 source: dict | None = None):
        from datasets.distributed import split_dataset_by_node

        if shuffle:  # before the split: every rank draws the same shard order, so documents stay disjoint
            dataset = dataset.shuffle(seed=seed, buffer_size=1)  # shard order only: rows are shuffled by window
        self.stream = split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_size)
        self.packer, self.rows_per_step, self.dp_rank, self.dp_size = packer, rows_per_step, dp_rank, dp_size
        self.shuffle, self.seed = shuffle, seed
        self.window = shuffle_window if shuffle else packer.batch_size  # rows read (and permuted) at once
        self.vocab_size, self.name = vocab_size, name  # token ids are checked as a step's rows are read
        # What a saved position is a position in: it holds only in the same stream, packed the same way.
        self.source = dict(source or {"dataset": name}, shards=dataset.num_shards, text_column=packer.text_column,
                           seq_len=packer.seq_len, shuffle=shuffle, seed=seed, window=self.window)
        self._epoch_sizes: dict[int, int] = {}  # blocks per epoch, learnt as epochs end
        self._recent: dict[int, torch.Tensor] = {}  # step → its rows, the newest RECENT_STEPS steps read
        self._positions: dict[int, dict] = {}  # step → the position of its first block, for the same steps
        self._start_epoch(0, first_block=0)

    def _start_epoch(self, epoch: int, first_block: int, position: dict | None = None) -> None:
        if self.shuffle:  # a nonzero epoch reorders shards even in an unshuffled stream: keep that one at 0
            self.stream.set_epoch(epoch)
        self._epoch, self._epoch_first_block, self._position = epoch, first_block, first_block
        self._blocks = StreamBlocks(self.stream, self.packer, epoch, self.window, self.shuffle, self.seed, self.name,
                                    position)

    def _rewind(self, block: int) -> None:
        """Restart at the latest epoch known to begin at or before `block`."""
        epoch, first = 0, 0
        while epoch in self._epoch_sizes and first + self._epoch_sizes[epoch] <= block:
            first += self._epoch_sizes[epoch]
            epoch += 1
        self._start_epoch(epoch, first)

    def _next_block(self):
        while True:
            block = self._blocks.next_block()
            if block is not None:
                self._position += 1
                return block
            size = self._position - self._epoch_first_block
            if size < self.rows_per_step:  # also stops an empty stream from cycling forever
                raise DataError(f"dp rank {self.dp_rank}'s share of the streamed dataset has {size} blocks, "
                                 f"fewer than one step needs ({self.rows_per_step})")
            self._epoch_sizes[self._epoch] = size
            self._start_epoch(self._epoch + 1, self._position)

    def rows(self, step: int) -> torch.Tensor:
        if step not in self._recent:
            target = step * self.rows_per_step
            if target < self._position:
                self._rewind(target)
            keep_from = target - (self.RECENT_STEPS - 1) * self.rows_per_step  # skipped steps worth keeping
            while self._position <= target:
                if self._position >= keep_from and self._position % self.rows_per_step == 0:
                    self._remember(self._position // self.rows_per_step)
                else:
                    self._next_block()
        return self._recent[step].clone()

    def position(self, step: int) -> dict:
        """What continues this dp rank's stream at step `step` (JSON-serialisable), for a checkpoint."""
        if step not in self._positions:
            self.rows(step)
        return self._positions[step]

    def resume(self, step: int, positions: list[dict] | None) -> str | None:
        """Continue at `step` from a checkpoint's positions (one per dp rank, as `position` gave them).
        Another stream's positions are refused (DataError); none, or positions of another dp size or
        step size, leave the stream to be read again from its start up to the step: the returned warning
        says so."""
        if not positions:
            return (f"the checkpoint holds no position in the streamed {self.name}: it is read again from its "
                    f"start up to step {step}")
        saved = positions[0]
        if saved["source"] != self.source:
            raise DataError(f"the checkpoint was taken reading {_described(saved['source'])}; this run reads "
                            f"{_described(self.source)}: resume with the same data, or start in a new output_dir")
        if (saved["dp_size"], saved["rows_per_step"]) != (self.dp_size, self.rows_per_step):
            return (f"the checkpoint's stream positions are for dp_size {saved['dp_size']} and "
                    f"{saved['rows_per_step']} rows per step, this run has {self.dp_size} and {self.rows_per_step}: "
                    f"each dp rank reads its share of {self.name} again from its start up to step {step}")
        mine = next(p for p in positions if p["dp_rank"] == self.dp_rank)
        if mine["step"] != step:
            raise DataError(f"the checkpoint after step {step} holds the stream position of step {mine['step']}")
        self._recent.clear()
        self._positions.clear()
        self._start_epoch(mine["epoch"], mine["epoch_first_block"], mine["blocks"])
        self._position = step * self.rows_per_step
        return None

    def _remember(self, step: int) -> None:
        """Read step `step`'s rows (the stream is at its first block) into the recent steps."""
        self._positions[step] = {"source": self.source, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                                 "rows_per_step": self.rows_per_step, "step": step, "epoch": self._epoch,
                                 "epoch_first_block": self._epoch_first_block, "blocks": self._blocks.position()}
        self._recent[step] = torch.from_numpy(np.stack([self._next_block() for _ in range(self.rows_per_step)]))
        check_vocabulary(self._recent[step], self.vocab_size, f"{self.name} (streamed, dp rank {self.dp_rank})",
                         first_row=step * self.rows_per_step)
        if len(self._recent) > self.RECENT_STEPS:
            oldest = next(iter(self._recent))
            del self._recent[oldest], self._positions[oldest]


def _described(source: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in source.items() if value is not None)
