"""Step rows read ahead, off the training step's critical path.

A streamed dataset is read, tokenized and packed when a step asks for its rows; `Prefetcher` has a
background thread do that for the next `ahead` steps while the current one trains (the tokenizer's
batch encoding and Arrow reads release the GIL). The thread owns the sampler: every `rows` call goes
through it, in the order steps are asked for, so the rows are exactly the sampler's, whatever the
order of the requests (a loop asks for step k + 1 before step k when it forwards ahead; a resumed
run starts anywhere). Rows come pinned for GPUs (`pin_memory`), so their copy to the device can
overlap compute. The thread starts at the first request, so that a resumed run first positions the
sampler (`resume`) and reads nothing before it; `position(k)` is the sampler's position at step k as
the thread read it, whatever it has read beyond.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["Prefetcher"]


class Prefetcher:
    """`sampler.rows(step)` for the steps after the last one asked for, computed ahead in a thread."""

    def __init__(self, sampler, ahead: int = 2, pin_memory: bool = False):
        self.sampler, self.ahead, self.pin_memory = sampler, ahead, pin_memory
        self._ready: dict[int, tuple[torch.Tensor, dict | None]] = {}  # step → (rows, position)
        self._next = 0  # the step the thread reads next
        self._wanted = -1  # the highest step asked for
        self._error: BaseException | None = None
        self._closed = self._started = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read_ahead, name="hf_asyncpp-prefetch", daemon=True)

    def rows(self, step: int) -> torch.Tensor:
        return self._read(step)[0]

    def position(self, step: int) -> dict | None:
        """The sampler's position at step `step`'s first block (read if it is not yet)."""
        return self._read(step)[1]

    def resume(self, step: int, positions: list[dict] | None) -> str | None:
        """The sampler continues at `step` (see its `resume`); the thread then reads from there."""
        if self._started:
            raise RuntimeError("resume() must come before the first request for rows")
        self._next = step
        return self.sampler.resume(step, positions)

    def _read(self, step: int) -> tuple[torch.Tensor, dict | None]:
        with self._changed:
            if step not in self._ready and not self._next <= step <= self._next + self.ahead:
                self._ready.clear()  # behind the thread, or far ahead of it (a resume): restart there
                self._next = step
            self._wanted = max(self._wanted, step)
            for old in [s for s in self._ready if s < step - 1]:  # a loop may ask for step − 1 once more
                del self._ready[old]
            self._changed.notify_all()
            if not self._started:
                self._started = True
                self._thread.start()
            while step not in self._ready and self._error is None:
                self._changed.wait()
            if step in self._ready:  # read before a later step failed
                return self._ready[step]
            raise self._error

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._started:
            self._thread.join()

    def _read_ahead(self) -> None:
        while True:
            with self._changed:
                while not self._closed and self._next > self._wanted + self.ahead:
                    self._changed.wait()
                if self._closed:
                    return
                step = self._next
            try:
                rows = self.sampler.rows(step)
                if self.pin_memory:
                    rows = rows.pin_memory()
                read = (rows, self.sampler.position(step))
            except BaseException as err:  # said to the training thread at its next request
                with self._changed:
                    self._error = err
                    self._changed.notify_all()
                return
            with self._changed:
                if self._next == step:  # not restarted elsewhere meanwhile
                    self._ready[step] = read
                    self._next = step + 1
                self._changed.notify_all()
