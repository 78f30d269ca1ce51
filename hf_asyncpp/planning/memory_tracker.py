"""The peak of live tensor memory of one process, and what it held at that peak.

Every storage an operator creates is seen by a dispatch mode (fake tensors too: their storages have
sizes but no memory) and followed until it is freed. The allocations and frees form one log; the peak
is a point in that log, and the storages live there are named afterwards by what they were labelled
while they lived (`label`: master weights, weight versions, gradients, optimizer state, ...). Storages
never labelled are what the microbatches held between operators ("activation": created during a
forward) or what an operator needed for itself ("temporary": created anywhere else). Each storage
remembers the operator that created it, so the temporaries at the peak are named by operator
(`peak_temporaries`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..torch_internals import TorchDispatchMode, local_shard, tree_flatten

__all__ = ["MemoryTracker"]


class MemoryTracker(TorchDispatchMode):
    """Enter it (above a FakeTensorMode, if any) around the code to measure; `track` the tensors that
    exist already (parameters built before), `label` live tensors by kind whenever they are at hand."""

    def __init__(self, fake_mode=None):
        super().__init__()
        # Only the tensors of `fake_mode` count (real ones when None): a fake mode of its own inside
        # (the stages' inputs and outputs worked out on fake copies, models/stage_io.py) holds nothing.
        self.fake_mode = fake_mode
        self._ids = WeakIdKeyDictionary()  # storage → its id here
        self._bytes: dict[int, int] = {}  # id → bytes
        self._label: dict[int, str] = {}  # id → kind, last labelled
        self._born_in_forward: set[int] = set()
        self._made_by: dict[int, str] = {}  # id → the operator that created it
        self._op = "tracked"  # the operator running now (tensors made before the tracker: "tracked")
        self._log: list[int] = []  # +id allocated, -id freed (ids start at 1)
        self.live_bytes = self.peak_bytes = 0
        self._peak_at = 0  # log length at the peak
        self.in_forward = 0  # > 0 while a stage's forward runs (the caller's hooks count it)

    # --- following storages -----------------------------------------------------------------------

    def _storage_id(self, t: torch.Tensor) -> int | None:
        local = local_shard(t)
        if local.device.type == "meta" or getattr(local, "fake_mode", None) is not self.fake_mode:
            return None
        storage = local.untyped_storage()
        known = self._ids.get(storage)
        if known is not None:
            return known
        sid = len(self._bytes) + 1
        self._ids[storage] = sid
        self._bytes[sid] = storage.nbytes()
        self._made_by[sid] = self._op
        if self.in_forward:
            self._born_in_forward.add(sid)
        self._log.append(sid)
        self.live_bytes += self._bytes[sid]
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self._peak_at = self.live_bytes, len(self._log)
        weakref.finalize(storage, self._freed, sid)
        return sid

    def _freed(self, sid: int) -> None:
        self._log.append(-sid)
        self.live_bytes -= self._bytes[sid]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op = str(func.overloadpacket)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._storage_id(t)
        self._op = "tracked"
        return out

    def track(self, tensors: Iterable[torch.Tensor], kind: str | None = None) -> None:
        """Follow (and label) tensors made before the tracker was entered."""
        for t in tensors:
            sid = self._storage_id(t)
            if sid is not None and kind is not None:
                self._label[sid] = kind

    label = track  # a live tensor is followed already; labelling it names its storage

    # --- the peak ---------------------------------------------------------------------------------

    def _live_at_peak(self) -> set[int]:
        live: set[int] = set()
        for event in self._log[: self._peak_at]:
            if event > 0:
                live.add(event)
            else:
                live.discard(-event)
        return live

    def _kind(self, sid: int) -> str:
        return self._label.get(sid) or ("activation" if sid in self._born_in_forward else "temporary")

    def peak_parts(self) -> dict[str, int]:
        """{kind: bytes} of the storages live at the peak."""
        parts: dict[str, int] = {}
        for sid in self._live_at_peak():
            parts[self._kind(sid)] = parts.get(self._kind(sid), 0) + self._bytes[sid]
        return parts

    def peak_temporaries(self) -> dict[str, int]:
        """{operator: bytes} of the temporaries live at the peak, largest first."""
        by_op: dict[str, int] = {}
        for sid in self._live_at_peak():
            if self._kind(sid) == "temporary":
                by_op[self._made_by[sid]] = by_op.get(self._made_by[sid], 0) + self._bytes[sid]
        return dict(sorted(by_op.items(), key=lambda item: -item[1]))
