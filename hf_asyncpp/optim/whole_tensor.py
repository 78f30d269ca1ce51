"""Whole tensors for optimizers whose update is not elementwise (Muon, SOAP).

Under FSDP2 a parameter, its gradient and its optimizer state are DTensors sharded over dp: each
rank holds a slice. Elementwise updates (SGD, AdamW, Lion) run on the slices as they are. An
orthogonalisation or a Kronecker-factored preconditioner must see the whole matrix: `gather`
all-gathers it (every dp rank computes the same whole-matrix update) and `keep_local_part` cuts
the result back to this rank's slice with no communication. On plain tensors both are identity.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["gather", "keep_local_part"]


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor as a plain tensor (all-gathered over its mesh when it is a DTensor)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def keep_local_part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`whole` laid out like `like`: a DTensor holding this rank's slice (cut locally, since every
    rank holds the same `whole`), or `whole` itself when `like` is a plain tensor."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
