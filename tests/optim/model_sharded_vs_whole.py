"""A rank target for `run_ranks`: train a tiny HF model with an optimizer from `build_optimizer`
three ways — whole, FSDP2 (`fully_shard` per decoder layer and on the root, as `fully_shard_stage`
does), and `shard_parameters` (the async schedules' layout, gradients cut from the whole model's) —
on the same batch, and report how the sharded parameters differ from the whole ones."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

__all__ = ["compare_model_sharded_to_whole"]


def compare_model_sharded_to_whole(rank: int, world_size: int, optimizer: str, preset: str, overrides: dict,
                                   steps: int) -> dict:
    """{name: dict(fsdp=max |diff|, shard_parameters=max |diff|, moved=max |change|, local_rows=…)}."""
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.optim import build_optimizer
    from hf_asyncpp.parallel.fsdp import shard_parameters

    mesh = init_device_mesh("cpu", (world_size,))
    config = build_config(preset, **overrides)
    models = []
    for _ in range(3):
        torch.manual_seed(0)  # same weights in all three
        models.append(AutoModelForCausalLM.from_config(config))
    whole, fsdp, by_shards = models
    start = {n: p.detach().clone() for n, p in whole.named_parameters()}
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(fsdp, mesh=mesh, reshard_after_forward=False)
    shard_parameters(by_shards, mesh)
    optimizers = [build_optimizer(optimizer, m.named_parameters(), 0.02, 0.9, 0.95, 0.1) for m in models]
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for model in (whole, fsdp):  # every rank the same batch: FSDP2's dp mean is the whole gradient
            model(input_ids=tokens, labels=tokens).loss.backward()
        for w, s in zip(whole.parameters(), by_shards.parameters()):
            s.grad = distribute_tensor(w.grad, mesh, s.placements, src_data_rank=None)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    report = {}
    for (name, w), f, s in zip(whole.named_parameters(), fsdp.parameters(), by_shards.parameters()):
        report[name] = dict(fsdp=(f.full_tensor() - w).abs().max().item(),
                            shard_parameters=(s.full_tensor() - w).abs().max().item(),
                            moved=(w - start[name]).abs().max().item(), local_rows=s.to_local().shape[0])
    dist.barrier()  # gloo teardown without a barrier sometimes aborts
    dist.destroy_process_group()
    return report
