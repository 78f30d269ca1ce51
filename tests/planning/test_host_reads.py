"""HostReads: host syncs counted at their call sites — reads of tensor values by the host (fake tensors
read as zeros) and blocking uploads (a tensor made from host values, host memory moved to the device
without `non_blocking`)."""

from __future__ import annotations

import torch

from hf_asyncpp.planning.host_reads import HostReads, in_microbatch
from hf_asyncpp.torch_internals import FakeTensorMode, unset_fake_temporarily

DEVICE = torch.device("cpu")  # the engine's device, as a plan names it (the host is the string "cpu")


def test_every_kind_of_read_of_a_fake_tensor_is_counted_at_its_call_site_and_reads_zeros():
    with FakeTensorMode(), HostReads() as reads:
        x = torch.ones(3)
        assert x.sum().item() == 0.0
        assert x.tolist() == [0.0, 0.0, 0.0]
        assert bool(x.sum() > 0) is False
        assert float(x.sum()) == 0.0 and int(x.sum()) == 0
        assert x.numpy().tolist() == [0.0, 0.0, 0.0]
    assert [r.kind for r in reads.records] == ["item", "tolist", "__bool__", "__float__", "__int__", "numpy"]
    assert all(r.site.startswith("tests/planning/test_host_reads.py:") for r in reads.records)


def test_real_tensors_are_read_as_they_are_and_counted_only_when_asked():
    with HostReads() as reads:
        assert torch.tensor(2.5).item() == 2.5
    assert reads.total() == 0
    with HostReads(all_tensors=True) as reads:
        assert torch.tensor([1, 2], device="cpu").tolist() == [1, 2]  # host values kept on the host: no upload
    assert [r.kind for r in reads.records] == ["tolist"]


def test_a_tensor_made_from_host_values_for_the_device_is_an_upload():
    with FakeTensorMode(), HostReads() as reads:
        torch.tensor([1.0, 2.0], device=DEVICE)
        torch.as_tensor(3.0)  # a host scalar the device will need: copied there when used
        torch.tensor(1.0, device="cpu")  # named the host: stays there
        torch.zeros(2, device=DEVICE).fill_(4.0)  # a constant written by a kernel: no copy
    assert [r.kind for r in reads.records] == ["upload: torch.tensor", "upload: torch.as_tensor"]
    with HostReads(all_tensors=True) as reads:
        torch.tensor([1.0], device=DEVICE)
    assert [r.kind for r in reads.records] == ["upload: torch.tensor"]


def test_host_memory_moved_to_the_device_waits_unless_non_blocking():
    with unset_fake_temporarily():
        rows = torch.zeros(2, 3)  # the loader's rows: host memory
    with FakeTensorMode(allow_non_fake_inputs=True), HostReads() as reads:
        rows.to(DEVICE)
        rows.to(DEVICE, non_blocking=True)  # pinned, copied while the device computes
        torch.ones(2).to(DEVICE)  # already on the device
        rows.to(torch.float64)  # a cast, no move
    assert [r.kind for r in reads.records] == ["upload: to(device)"]


def test_a_dtensor_of_fake_shards_is_device_memory_not_host_memory():
    """FSDP2's gradients and their norms are DTensors over fake shards in a plan: moving one is no upload."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from hf_asyncpp.torch_internals import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with FakeTensorMode(allow_non_fake_inputs=True), HostReads() as reads:
            norm = distribute_tensor(torch.ones(()), mesh, [Replicate()])
            norm.to(DEVICE)
        assert [r.kind for r in reads.records] == []
    finally:
        dist.destroy_process_group()


def test_take_returns_the_syncs_so_far_and_starts_again():
    with FakeTensorMode(), HostReads() as reads:
        torch.ones(1).item()
        first = reads.take()
        torch.ones(1).item()
        torch.ones(1).item()
    assert len(first) == 1 and len(reads.take()) == 2 and reads.total() == 3


def test_a_sync_inside_a_microbatch_s_compute_is_told_from_one_of_an_update_it_awaits():
    step = "PipelineEngine.train_step"
    assert in_microbatch(("Tensor.item", "PipelineStage.forward_one_chunk", "ProgramRuntime._perform", step))
    assert not in_microbatch(("Tensor.item", "Updates._read_norm", "ProgramRuntime._perform", step))
    assert not in_microbatch(("Tensor.item", "AsyncPipelineSchedule._await_for", "HookedStage.forward_one_chunk", step))
