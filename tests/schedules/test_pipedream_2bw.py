"""PipeDream-2BW's order and weight versions, checked in one process."""

from __future__ import annotations

import pytest

from hf_asyncpp.schedules import SCHEDULES, ScheduleError
from hf_asyncpp.schedules.async_order import check_versions
from hf_asyncpp.schedules.pipedream_2bw import PIPEDREAM_2BW, PipeDream2BW


def _text(ops, m):
    return " ".join(f"{a.computation_type.value}{a.microbatch_index // m}.{a.microbatch_index % m}" for a in ops)


def test_rank0_order_matches_the_reference_table_p4_m4():
    """The per-rank sequence of the 2BW reference (no flush; S_k after the last backward of k)."""
    segments = [_text(PIPEDREAM_2BW.segment(0, 4, 4, k, 3), 4) for k in range(3)]
    assert segments == [
        "F0.0 F0.1 F0.2 F0.3 B0.0 F1.0 B0.1 F1.1 B0.2 F1.2 B0.3",
        "F1.3 B1.0 F2.0 B1.1 F2.1 B1.2 F2.2 B1.3",
        "F2.3 B2.0 B2.1 B2.2 B2.3",
    ]


def test_last_rank_alternates_without_warmup():
    assert _text(PIPEDREAM_2BW.segment(3, 4, 4, 1, 3), 4) == "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3"


@pytest.mark.parametrize("pp_size, m", [(2, 1), (2, 4), (3, 2), (4, 1), (4, 2), (4, 4), (4, 8), (6, 3)])
def test_the_registered_schedule_validates_including_m_below_p(pp_size, m):
    spec = SCHEDULES["pipedream-2bw"]
    assert not spec.synchronous
    spec.check_microbatches(pp_size, m)  # sends/receives pair, F before B, no deadlock, versions


def test_every_stage_runs_minibatch_k_on_version_k_minus_1():
    m = 4
    for stage in range(4):
        versions = [PIPEDREAM_2BW.version(stage, 4, j, m) for j in range(0, 5 * m, m)]
        assert versions == [0, 0, 1, 2, 3]  # w_0 = w_1 = init, then one step behind, at any depth


def test_at_most_two_versions_are_live_and_none_is_overwritten_in_use():
    for pp_size in (2, 4, 8):
        check_versions(PIPEDREAM_2BW, pp_size, pp_size, 5)


def test_a_single_buffer_would_overwrite_weights_a_pending_backward_needs():
    class OneBuffer(PipeDream2BW):
        n_buffers = 1

        def buffer_written_after(self, stage, pp_size, step):
            return 0

    with pytest.raises(ScheduleError, match="overwrites buffer 0 while microbatches"):
        check_versions(OneBuffer(), 4, 4, 3)


def test_a_wrong_version_rule_is_caught():
    class Fresh(PipeDream2BW):
        def version(self, stage, pp_size, j, n_microbatches):
            return j // n_microbatches  # no delay, but delay() still says 1

    with pytest.raises(ScheduleError, match="runs on version"):
        check_versions(Fresh(), 2, 2, 3)
