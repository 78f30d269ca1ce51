"""Reads of a tensor's values by the host, counted where they happen.

On a GPU each of them (`item`, `tolist`, `numpy`, `bool`, `int`, `float` of a device tensor) waits for
everything queued before it: the host stops queueing ahead. `HostReads` counts them by call site. Over
fake tensors, which hold no values, it also answers them, with zeros: a plan (plan.py) then takes the
path of a run where nothing is wrong (finite norms, no termination asked for) and counts what that
path reads.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

__all__ = ["HostReads"]

_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
_PACKAGE = __name__.rpartition(".")[0].rpartition(".")[0]


def _read_zeros(t: torch.Tensor, read, *args, **kwargs):
    """`read` of zeros shaped like fake tensor `t`."""
    with unset_fake_temporarily():
        return read(torch.zeros(t.shape, dtype=t.dtype), *args, **kwargs)


def _call_site() -> str:
    """The innermost frame outside torch and this module: the code that asked for the value."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            return f"{frame.filename.rpartition(_PACKAGE + '/')[2]}:{frame.lineno} ({frame.name})"
    return "?"


class HostReads:
    """Within `with HostReads() as reads:`, `reads.sites` counts host reads of fake tensors (of every
    tensor with `all_tensors=True`) by call site; `reads.total()` sums them."""

    def __init__(self, all_tensors: bool = False):
        self.all_tensors = all_tensors
        self.sites: Counter[str] = Counter()
        self._saved: dict[tuple[type, str], object] = {}
        self.counting = True

    def _wrap(self, name: str, original):
        def read(tensor, *args, **kwargs):
            fake = isinstance(tensor, FakeTensor)
            if self.counting and (fake or self.all_tensors):
                self.sites[_call_site()] += 1
            return (_read_zeros if fake else lambda t, r, *a, **k: r(t, *a, **k))(tensor, original, *args, **kwargs)
        return read

    def __enter__(self) -> HostReads:
        originals = {name: torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name)) for name in _READS}
        # FakeTensor has a `tolist` of its own: replaced too (a fake tensor is never read for real).
        for cls in (torch.Tensor, FakeTensor):
            for name in _READS:
                if cls is torch.Tensor or name in cls.__dict__:
                    self._saved[(cls, name)] = cls.__dict__.get(name)
                    setattr(cls, name, self._wrap(name, originals[name]))
        return self

    def __exit__(self, *exc) -> None:
        for (cls, name), original in self._saved.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._saved.clear()

    def total(self) -> int:
        return sum(self.sites.values())

    def take(self) -> Counter[str]:
        """The reads counted since the last take, by call site; counting restarts."""
        sites, self.sites = self.sites, Counter()
        return sites


