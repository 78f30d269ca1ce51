"""MemoryTracker: the peak of live tensor bytes, and what was live at that moment by kind."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_asyncpp.planning.memory_tracker import MemoryTracker

MiB = 2**20


def test_the_peak_is_the_most_bytes_live_at_once_and_its_parts_are_what_was_live_then():
    tracker = MemoryTracker()
    with tracker:
        weights = torch.zeros(MiB // 4)  # 1 MiB, labelled below
        tracker.label([weights], "parameters")
        a = torch.zeros(2 * MiB // 4)  # 2 MiB
        b = torch.zeros(3 * MiB // 4)  # 3 MiB: the peak is 6 MiB here
        del a, b
        c = torch.zeros(4 * MiB // 4)  # 4 MiB: 5 MiB live, below the peak
        view = c[:10]  # a view shares its storage: no new bytes
    assert tracker.peak_bytes == 6 * MiB
    assert tracker.live_bytes == 5 * MiB
    assert tracker.peak_parts() == {"parameters": MiB, "temporary": 5 * MiB}
    del view


def test_the_temporaries_at_the_peak_are_named_by_the_operator_that_made_them():
    weights = torch.ones(MiB // 4)
    tracker = MemoryTracker()
    with tracker:
        tracker.track([weights], "parameters")
        doubled = weights * 2  # 1 MiB by aten.mul
        stacked = torch.cat([weights, weights, weights])  # 3 MiB by aten.cat: the peak is 5 MiB here
        del stacked
        copied = weights.clone()  # 1 MiB by aten.clone, after the peak
    assert tracker.peak_temporaries() == {"aten.cat": 3 * MiB, "aten.mul": MiB}  # largest first
    assert list(tracker.peak_temporaries()) == ["aten.cat", "aten.mul"]
    del doubled, copied


def test_forward_allocations_count_as_activations_and_tensors_made_before_can_be_tracked():
    made_before = torch.ones(MiB // 4)
    tracker = MemoryTracker()
    with tracker:
        tracker.track([made_before], "parameters")
        tracker.in_forward += 1
        kept = made_before * 2
        tracker.in_forward -= 1
    assert tracker.peak_parts() == {"parameters": MiB, "activation": MiB}
    assert kept.numel()


def test_fake_tensors_count_their_bytes_and_only_those_of_the_given_mode():
    """A fake mode of its own inside (models/stage_io.py works out stage shapes that way) holds nothing
    of the run being measured."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    mode = FakeTensorMode()
    tracker = MemoryTracker(mode)
    with mode, tracker:
        x = torch.zeros(1024, 1024)  # 4 MiB of fake fp32, no memory
        with unset_fake_temporarily(), FakeTensorMode():
            torch.zeros(4096, 1024) + 1  # 32 MiB in another fake mode
        y = x + 1
    assert tracker.peak_bytes == 8 * MiB
    assert y.shape == x.shape
