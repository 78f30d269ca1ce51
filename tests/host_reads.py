"""Counting host reads of tensors: what waits for the device on a GPU.

On a GPU a host read of a device value (`item`, `tolist`, `numpy`, `cpu`, `.to("cpu")`, `bool`, `float`,
`int`, an index, `nonzero`, `unique`, `masked_select`) waits for every kernel queued before it. CPU
tensors have no queue, so the rule is checked where it lives: the Python-level reads, recorded with the
call site that made them. Moves to the engine's device (`.to(layout.device)`) are uploads on a GPU and
are not counted; a host copy is written `.cpu()` or `.to("cpu")`.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

READS = ("item", "tolist", "cpu", "__float__", "__bool__", "numpy", "__int__", "__index__", "nonzero", "unique",
         "masked_select")
_FUNCTIONS = ("nonzero", "unique", "masked_select")  # also called as torch.<name>(tensor)


@dataclass
class HostRead:
    kind: str  # the method, e.g. "item"
    site: str  # file:line of the caller
    stack: tuple[str, ...] = field(default=(), repr=False)  # the callers' functions, innermost first


def _site(frame) -> str:
    path = frame.f_code.co_filename
    for root in ("hf_asyncpp/", "transformers/", "torch/", "tests/"):
        if root in path:
            path = root + path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


def _caller(depth: int = 2):
    frame = sys._getframe(depth)
    stack = []
    f = frame
    while f is not None and len(stack) < 40:
        stack.append(f.f_code.co_qualname)
        f = f.f_back
    return _site(frame), tuple(stack)


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


@contextlib.contextmanager
def host_reads_recorded(reads: list[HostRead] | None = None):
    """Every Python-level host read of a tensor inside the block is appended to the list yielded (or
    `reads`), with its call site; the read itself is done as usual."""
    import torch

    reads = [] if reads is None else reads
    originals = {name: getattr(torch.Tensor, name) for name in READS + ("to",)}
    functions = {name: getattr(torch, name) for name in _FUNCTIONS}
    active = [True]

    def recording(name, original, depth=2):
        def read(*args, **kwargs):
            if active[0]:
                active[0] = False  # a read made inside another (torch's own) counts once
                try:
                    reads.append(HostRead(name, *_caller(depth)))
                    return original(*args, **kwargs)
                finally:
                    active[0] = True
            return original(*args, **kwargs)
        return read

    def to(self, *args, **kwargs):
        if active[0] and _to_host(args, kwargs):
            return recording("to('cpu')", originals["to"], 3)(self, *args, **kwargs)
        return originals["to"](self, *args, **kwargs)

    for name in READS:
        setattr(torch.Tensor, name, recording(name, originals[name]))
    torch.Tensor.to = to
    for name in _FUNCTIONS:
        setattr(torch, name, recording(name, functions[name]))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, function in functions.items():
            setattr(torch, name, function)
