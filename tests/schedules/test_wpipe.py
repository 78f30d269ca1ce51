"""WPipe's order, groups and weight versions, checked in one process."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import FORWARD

from hf_asyncpp.schedules import SCHEDULES
from hf_asyncpp.schedules.async_order import check_versions
from hf_asyncpp.schedules.wpipe import WPIPE


def _text(ops, pp_size, m):
    names = []
    for a in ops:
        group = "a" if a.stage_index < pp_size else "b"
        names.append(f"{a.computation_type.value}{group}{a.microbatch_index // m}.{a.microbatch_index % m}")
    return " ".join(names)


def test_rank0_follows_the_time_slot_table_p4_m4():
    """Rank 0's stream, from the reference table: period k pairs [Bb(k−1) ⇄ Fa(k)] then [Ba(k−1) ⇄ Fb(k)]."""
    stream = _text(WPIPE.stream(4, 4, 3)[0], 4, 4).split()
    assert stream[:8] == ["Fa0.0", "Fa0.1", "Fa0.2", "Fa0.3", "Fb0.0", "Fb0.1", "Fb0.2", "Fb0.3"]
    assert stream[8:24] == [
        "Bb0.0", "Fa1.0", "Bb0.1", "Fa1.1", "Bb0.2", "Fa1.2", "Bb0.3", "Fa1.3",
        "Ba0.0", "Fb1.0", "Ba0.1", "Fb1.1", "Ba0.2", "Fb1.2", "Ba0.3", "Fb1.3",
    ]


def test_groups_delays_and_buffers():
    """Group 1 (stages 0..p−1): one update stale, two buffers; group 2 (p..2p−1): fresh, one buffer."""
    assert [WPIPE.delay(s, 4, 4) for s in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [WPIPE.n_buffers(s, 4, 4) for s in range(8)] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert SCHEDULES["wpipe"].stage_indices(4, 1) == [1, 5]


def test_each_step_forwards_only_its_own_minibatch():
    for rank in range(4):
        for step in range(4):
            forwards = {a.microbatch_index // 4 for a in WPIPE.segment(rank, 4, 4, step, 4) if a.computation_type == FORWARD}
            assert forwards == {step}


@pytest.mark.parametrize("pp_size, m", [(2, 1), (2, 2), (2, 4), (3, 2), (4, 3), (4, 4), (4, 8)])
def test_the_registered_schedule_validates(pp_size, m):
    SCHEDULES["wpipe"].check_microbatches(pp_size, m)
    check_versions(WPIPE, pp_size, m, 5)


def test_too_few_microbatches_are_refused():
    with pytest.raises(ValueError, match="schedule 'wpipe' cannot run 2 microbatches with pp_size 4"):
        SCHEDULES["wpipe"].check_microbatches(4, 2)
