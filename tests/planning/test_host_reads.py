"""HostReads: reads of tensor values by the host, counted by call site; fake tensors read as zeros."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_asyncpp.planning.host_reads import HostReads


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
        assert torch.tensor([1, 2]).tolist() == [1, 2]
    assert reads.total() == 1


def test_take_returns_the_reads_so_far_and_starts_again():
    with FakeTensorMode(), HostReads() as reads:
        torch.ones(1).item()
        first = reads.take()
        torch.ones(1).item()
        torch.ones(1).item()
    assert sum(first.values()) == 1 and sum(reads.take().values()) == 2 and reads.total() == 3
