"""A rank target for `run_ranks`: step an optimizer on FSDP2-style DTensor parameters (Shard(0) over
all ranks) and on the same whole tensors, with the same full gradients, and report how they differ."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hf_asyncpp.optim.lion import Lion
from hf_asyncpp.optim.muon import Muon
from hf_asyncpp.optim.soap import SOAP

__all__ = ["compare_sharded_to_whole"]

OPTIMIZERS = {"soap": SOAP, "lion": Lion, "muon": Muon}
FIRST_MOMENT = {"soap": "exp_avg", "lion": "exp_avg", "muon": "momentum_buffer"}


def compare_sharded_to_whole(rank: int, world_size: int, name: str, options: dict, shapes: list, steps: int) -> list:
    """Per shape: max |sharded − whole| after `steps`, how far the whole parameter moved, and the
    first moment's type and local element count on this rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    reports = []
    for shape in shapes:
        gen = torch.Generator().manual_seed(0)  # every rank draws the same tensors
        start = torch.randn(shape, generator=gen)
        whole = torch.nn.Parameter(start.clone())
        sharded = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
        opt_whole, opt_sharded = OPTIMIZERS[name]([whole], **options), OPTIMIZERS[name]([sharded], **options)
        for _ in range(steps):
            grad = torch.randn(shape, generator=gen)
            whole.grad = grad.clone()
            sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            opt_whole.step()
            opt_sharded.step()
        exp_avg = opt_sharded.state[sharded][FIRST_MOMENT[name]]
        reports.append(dict(shape=shape, max_diff=(sharded.full_tensor() - whole).abs().max().item(),
                            moved=(whole - start).abs().max().item(), exp_avg_is_dtensor=isinstance(exp_avg, DTensor),
                            exp_avg_local=exp_avg.to_local().numel(), numel=whole.numel()))
    dist.destroy_process_group()
    return reports
