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

from .torch_internals import fsdp_unsharded, receive_buffers

__all__ = ["held_tensors", "local_bytes", "state_bytes"]


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


def held_tensors(params, updaters, versioned_stages=(), torch_stages=(), modules=()) -> dict[str, list[torch.Tensor]]:
    """A rank's tensors by kind of state: parameter, gradient (with a low-precision compute copy's fp32
    sums, and FSDP2's unsharded gradients before their reduction), optimizer_state, ef_buffer,
    weight_version (every buffer, the masters' included), compute_copy (live gathered copies: a
    versioned stage's, FSDP2's under `modules`), receive_buffer (torch stages' P2P receive buffers)."""
    def tensors(values) -> list[torch.Tensor]:
        return [v for v in values if isinstance(v, torch.Tensor)]

    versioned_stages = list(versioned_stages)
    fsdp_copies, fsdp_grads = fsdp_unsharded(modules)
    return {
        "parameter": list(params),
        "gradient": tensors([*(p.grad for p in params), *fsdp_grads,
                             *(t for v in versioned_stages for b in range(len(v.buffers_)) for t in v.gradient_sums(b).values())]),
        "optimizer_state": tensors(v for u in updaters for s in u.optimizer.state.values() for v in s.values()),
        "ef_buffer": tensors(t for u in updaters for t in getattr(u.stepper, "previous_update", {}).values()),
        "weight_version": [t for v in versioned_stages for b in v.buffers_ for t in b.values()],
        "compute_copy": [*(t for v in versioned_stages for c in v.live_compute_copies() for t in c.values()), *fsdp_copies],
        "receive_buffer": [t for stage in torch_stages for t in receive_buffers(stage)],
    }


def state_bytes(held: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """{kind: bytes on this rank} of what an executor holds (executors.Executor.held_tensors): parameters
    (the master copy), gradients, weight versions beyond the masters, their compute copies, optimizer
    state and Error Feedback buffers."""
    return {
        "parameters": local_bytes(held["parameter"]),
        "gradients": local_bytes(held["gradient"]),
        # The master is one of the version buffers: the versions' bytes beyond it.
        "weight_versions": local_bytes(held["weight_version"], held["parameter"]),
        "compute_copies": local_bytes(held["compute_copy"]),
        "optimizer_state": local_bytes(held["optimizer_state"]),
        "ef_buffers": local_bytes(held["ef_buffer"]),
    }
