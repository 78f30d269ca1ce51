"""Host syncs, recorded where they happen: reads of tensor values by the host, and uploads.

On a GPU a host read of a device value (`item`, `tolist`, `numpy`, `cpu`, `.to("cpu")`, `bool`, `float`,
`int`, an index, `nonzero`, `unique`, `masked_select`) waits for every kernel queued before it: the host
stops queueing ahead. So does a blocking copy from pageable host memory to the device: a tensor made
from host values (`torch.tensor`, `torch.as_tensor`), and a host tensor moved to the device without
`non_blocking=True` (a pinned one with it is copied while the device computes). `HostReads` records each
with its call site, at the Python level, where the rule can be checked on any device. The convention
that makes this possible on a CPU: the engine's device is a `torch.device` (`.to(layout.device)`); the
host is named by the string "cpu" (`.cpu()`, `.to("cpu")`, `torch.tensor(..., device="cpu")`: host
values meant to stay there are no upload).

Over fake tensors, which hold no values, it also answers the reads of values, with zeros: a plan
(plan.py) then takes the path of a run where nothing is wrong (finite norms, no termination asked for)
and counts what that path reads; there a real tensor is host memory (the data loader's rows), and
moving one into the fake device world without `non_blocking` is an upload. Real tensors are read as
usual, and recorded with `all_tensors=True` (the multi-rank tests on CPU, where every tensor stands for
a device one: only tensors made from host values count as uploads there).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from ..torch_internals import FakeTensor, local_shard, unset_fake_temporarily

__all__ = ["READS", "UPLOADS", "HostRead", "HostReads", "in_microbatch"]

# Tensor methods that read values; the last three are also torch.<name>(tensor).
READS = ("item", "tolist", "cpu", "__float__", "__bool__", "numpy", "__int__", "__index__", "nonzero", "unique",
         "masked_select")
_VALUES = {"item", "tolist", "numpy", "__float__", "__bool__", "__int__", "__index__"}  # answered for fake tensors
_FUNCTIONS = ("nonzero", "unique", "masked_select")
# Functions making a tensor from host values: an upload unless the host is named as its device.
UPLOADS = ("tensor", "as_tensor")
# The frames a microbatch's compute runs in: a sync under one of them happens m times a step. Except
# under the wait for an update, which a forward's "weight_version" hook (schedules/stage_hooks.py) makes
# before the forward's compute, once per update: what it syncs is counted per update.
MICROBATCH_FRAMES = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "PipelineLoss.__call__",
                     "PipelineStageModule.forward")
UPDATE_AWAITED = "AsyncPipelineSchedule._await_for"


@dataclass
class HostRead:
    kind: str  # the method, e.g. "item", or "to('cpu')"
    site: str  # file:line of the caller, from the package's or the library's root
    stack: tuple[str, ...] = field(default=(), repr=False)  # the callers' functions, innermost first


def in_microbatch(stack: tuple[str, ...], step_frame: str = "PipelineEngine.train_step") -> bool:
    """Whether a sync's callers, up to `step_frame` or an awaited update, include a microbatch's compute."""
    inside = stack[:stack.index(step_frame)] if step_frame in stack else stack
    inside = inside[:inside.index(UPDATE_AWAITED)] if UPDATE_AWAITED in inside else inside
    return any(frame.endswith(MICROBATCH_FRAMES) for frame in inside)


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


def _to_device(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, torch.device) or (isinstance(target, str) and not _to_host(args, kwargs))


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
            if _to_host(args, kwargs):
                return to_host(tensor, *args, **kwargs)
            # Over fake tensors a real one is host memory (a DTensor holds a fake shard: device memory):
            # moved to the device, it waits for the copy.
            if (not self._inside and not self.all_tensors and not isinstance(local_shard(tensor), FakeTensor)
                    and _to_device(args, kwargs) and not kwargs.get("non_blocking", False)):
                self.records.append(HostRead("upload: to(device)", *_caller(2)))
            return originals["to"](tensor, *args, **kwargs)

        self._patch(torch.Tensor, "to", to)
        for name in _FUNCTIONS:
            self._patch(torch, name, self._recording(name, getattr(torch, name)))
        for name in UPLOADS:
            self._patch(torch, name, self._uploading(name, getattr(torch, name)))
        return self

    def _uploading(self, name: str, original):
        """`torch.<name>`, recording an upload when it makes a device tensor from host values."""
        def make(data, *args, **kwargs):
            made = original(data, *args, **kwargs)
            host = isinstance(kwargs.get("device"), str) and _to_host((), kwargs)
            if (not self._inside and not host and not isinstance(data, torch.Tensor)
                    and (self.all_tensors or isinstance(made, FakeTensor))):
                self.records.append(HostRead(f"upload: torch.{name}", *_caller(2)))
            return made
        return make

    def __exit__(self, *exc) -> None:
        for (owner, name), original in reversed(list(self._saved.items())):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def total(self) -> int:
        return len(self.records)

    def take(self) -> list[HostRead]:
        """The syncs recorded since the last take."""
        new, self._taken = self.records[self._taken:], len(self.records)
        return new
