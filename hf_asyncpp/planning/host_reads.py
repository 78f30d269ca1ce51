"""Reads of tensor values by the host, recorded where they happen.

On a GPU a host read of a device value (`item`, `tolist`, `numpy`, `cpu`, `.to("cpu")`, `bool`, `float`,
`int`, an index, `nonzero`, `unique`, `masked_select`) waits for every kernel queued before it: the host
stops queueing ahead. `HostReads` records each with its call site, at the Python level, where the rule
can be checked on any device. Moves to the engine's device (`.to(layout.device)`) are uploads on a GPU
and are not reads; a host copy is written `.cpu()` or `.to("cpu")`.

Over fake tensors, which hold no values, it also answers the reads of values, with zeros: a plan
(plan.py) then takes the path of a run where nothing is wrong (finite norms, no termination asked for)
and counts what that path reads. Real tensors are read as usual, and recorded with `all_tensors=True`
(the multi-rank tests on CPU, where every tensor stands for a device one).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from ..torch_internals import FakeTensor, unset_fake_temporarily

__all__ = ["READS", "HostRead", "HostReads"]

# Tensor methods that read values; the last three are also torch.<name>(tensor).
READS = ("item", "tolist", "cpu", "__float__", "__bool__", "numpy", "__int__", "__index__", "nonzero", "unique",
         "masked_select")
_VALUES = {"item", "tolist", "numpy", "__float__", "__bool__", "__int__", "__index__"}  # answered for fake tensors
_FUNCTIONS = ("nonzero", "unique", "masked_select")


@dataclass
class HostRead:
    kind: str  # the method, e.g. "item", or "to('cpu')"
    site: str  # file:line of the caller, from the package's or the library's root
    stack: tuple[str, ...] = field(default=(), repr=False)  # the callers' functions, innermost first


def _site(frame) -> str:
    path = frame.f_code.co_filename
    for root in ("hf_asyncpp/", "transformers/", "torch/", "tests/"):
        if root in path:
            path = root + path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


def _caller(depth: int) -> tuple[str, tuple[str, ...]]:
    frame = sys._getframe(depth)
    stack, f = [], frame
    while f is not None and len(stack) < 40:
        stack.append(f.f_code.co_qualname)
        f = f.f_back
    return _site(frame), tuple(stack)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


def _read_zeros(tensor: torch.Tensor, read, *args, **kwargs):
    """`read` of zeros shaped like fake tensor `tensor`."""
    with unset_fake_temporarily():
        return read(torch.zeros(tensor.shape, dtype=tensor.dtype), *args, **kwargs)


class HostReads:
    """Within `with HostReads() as reads:`, `reads.records` holds every host read of a fake tensor (of
    every tensor with `all_tensors=True`), in order; `take()` returns those since the last take."""

    def __init__(self, all_tensors: bool = False):
        self.all_tensors = all_tensors
        self.records: list[HostRead] = []
        self._taken = 0
        self._saved: dict[tuple[object, str], object] = {}
        self._inside = False  # a read made inside another (torch's own) counts once

    def _recording(self, kind: str, original, depth: int = 2):
        def read(*args, **kwargs):
            tensor = args[0] if args else None
            fake = isinstance(tensor, FakeTensor)
            if self._inside or not (fake or self.all_tensors):
                return original(*args, **kwargs)
            self._inside = True
            try:
                self.records.append(HostRead(kind, *_caller(depth)))
                if fake and kind in _VALUES:
                    return _read_zeros(tensor, original, *args[1:], **kwargs)
                return original(*args, **kwargs)
            finally:
                self._inside = False
        return read

    def _patch(self, owner, name: str, replacement) -> None:
        self._saved[(owner, name)] = owner.__dict__.get(name)
        setattr(owner, name, replacement)

    def __enter__(self) -> HostReads:
        originals = {name: getattr(torch.Tensor, name) for name in READS + ("to",)}
        for name in READS:
            self._patch(torch.Tensor, name, self._recording(name, originals[name]))
            if name in FakeTensor.__dict__:  # FakeTensor has a `tolist` of its own
                self._patch(FakeTensor, name, self._recording(name, originals[name]))
        to_host = self._recording("to('cpu')", originals["to"], depth=3)

        def to(tensor, *args, **kwargs):
            return (to_host if _to_host(args, kwargs) else originals["to"])(tensor, *args, **kwargs)

        self._patch(torch.Tensor, "to", to)
        for name in _FUNCTIONS:
            self._patch(torch, name, self._recording(name, getattr(torch, name)))
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in reversed(list(self._saved.items())):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def total(self) -> int:
        return len(self.records)

    def take(self) -> Counter[str]:
        """The reads recorded since the last take, counted by call site."""
        new, self._taken = self.records[self._taken:], len(self.records)
        return Counter(r.site for r in new)
