"""Step k's rows on one dp rank: from blocks in memory, or packed on the fly from a stream.

Both are pure functions of the step (with the seed), so a resumed run asks for step k and continues.

In memory (`MinibatchSampler`): with shuffle off and dp = 1, step k uses rows k·G … (k+1)·G − 1
(G = micro_batch_size × n_microbatches), wrapping around at the end. With dp ranks, step k covers
dp·G consecutive rows and dp rank d takes the d-th slice of G; all pp ranks of one dp group read the
same rows. Shuffle permutes the blocks once per epoch with the run's seed.

Streaming (`StreamingSampler`): each dp rank reads its own documents (`split_dataset_by_node`), packs
them, and step k takes that rank's blocks k·G … (k+1)·G − 1; when the stream ends the next epoch
starts it over (a partial block never spans two epochs). Shuffle is the stream's own (shard order and
a buffer, seeded with the run's seed; `set_epoch` reshuffles each epoch). At dp 1 without shuffle the
rows equal `MinibatchSampler`'s over the same files.
"""

from __future__ import annotations

import torch

from .errors import DataError
from .packing import check_vocabulary

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
        """Steps in one pass over the blocks, counting every dp rank's share."""
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


class StreamingSampler:
    """Rows of step k for one dp rank from an `IterableDataset`, packed on the fly.

    Reading forward is O(1) per block (one open iterator and its position), and the last few steps
    served are kept, since a training loop asks for step k+1 (to prefetch) before step k. A step further
    behind (a resumed run, random access) restarts the stream at the epoch that holds it and skips.
    """

    RECENT_STEPS = 4  # steps kept for repeated requests

    def __init__(self, dataset, packer, rows_per_step: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int,
                 shuffle_buffer_size: int = 10_000, vocab_size: int | None = None, name: str = "dataset"):
        from datasets.distributed import split_dataset_by_node

        if shuffle:  # before the split: every rank draws the same shard order, so documents stay disjoint
            dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer_size)
        self.stream = split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_size)
        self.packer, self.rows_per_step, self.dp_rank, self.shuffle = packer, rows_per_step, dp_rank, shuffle
        self.vocab_size, self.name = vocab_size, name  # token ids are checked as a step's rows are read
        self._epoch_sizes: dict[int, int] = {}  # blocks per epoch, learnt as epochs end
        self._recent: dict[int, torch.Tensor] = {}  # step → its rows, the newest RECENT_STEPS steps read
        self._start_epoch(0, first_block=0)

    def _start_epoch(self, epoch: int, first_block: int) -> None:
        if self.shuffle:  # a nonzero epoch reorders shards even in an unshuffled stream: keep that one at 0
            self.stream.set_epoch(epoch)
        self._epoch, self._epoch_first_block, self._position = epoch, first_block, first_block
        self._blocks = self.packer.blocks(self.stream, self.name)

    def _rewind(self, block: int) -> None:
        """Restart at the latest epoch known to begin at or before `block`."""
        epoch, first = 0, 0
        while epoch in self._epoch_sizes and first + self._epoch_sizes[epoch] <= block:
            first += self._epoch_sizes[epoch]
            epoch += 1
        self._start_epoch(epoch, first)

    def _next_block(self) -> list[int]:
        while True:
            block = next(self._blocks, None)
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

    def _remember(self, step: int) -> None:
        """Read step `step`'s rows (the stream is at its first block) into the recent steps."""
        self._recent[step] = torch.tensor([self._next_block() for _ in range(self.rows_per_step)], dtype=torch.long)
        check_vocabulary(self._recent[step], self.vocab_size, f"{self.name} (streamed, dp rank {self.dp_rank})",
                         first_row=step * self.rows_per_step)
        if len(self._recent) > self.RECENT_STEPS:
            del self._recent[next(iter(self._recent))]  # the oldest read
