"""Bytes this rank holds for each kind of training state, as sharded (what `--fsdp` saves).

A DTensor counts its local shard only; a plain tensor counts whole; shared memory counts once. Weight
versions are the stashed buffers of asynchronous stages beyond the master, which is one of them
(their sharded storage); their gathered compute copies live
only while microbatches use them and are counted apart, as `compute_copies`, at the moment of the
call. Optimizer state is every tensor in the optimizer's state (steps counters included).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_bytes", "state_bytes"]


def _memory(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a tensor's local part occupies."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.data_ptr(), local.numel() * local.element_size()


def local_bytes(tensors: Iterable[torch.Tensor], counted_already: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of `tensors`, memory held by several of them (shared tensors, the master and its
    version buffer) counted once, and none of the memory of `counted_already`."""
    seen = {_memory(t) for t in counted_already}
    total = 0
    for t in tensors:
        memory = _memory(t)
        if memory not in seen:
            seen.add(memory)
            total += memory[1]
    return total


def state_bytes(params, optimizers, error_feedbacks, versioned_stages) -> dict[str, int]:
    """{kind: bytes on this rank} for parameters (the master copy), gradients, weight versions,
    their compute copies, optimizer state and Error Feedback buffers."""
    optimizer_state = [v for opt in optimizers for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor)]
    return {
        "parameters": local_bytes(params),
        "gradients": local_bytes(p.grad for p in params if p.grad is not None),
        # The master is one of the version buffers: the versions' bytes beyond it.
        "weight_versions": local_bytes((t for v in versioned_stages for b in v.buffers_ for t in b.values()), params),
        "compute_copies": local_bytes(t for v in versioned_stages for c in v.live_compute_copies() for t in c.values()),
        "optimizer_state": local_bytes(optimizer_state),
        "ef_buffers": local_bytes(t for ef in error_feedbacks for t in ef.previous_update.values()),
    }
