"""PipeDream-2BW's and PipeDream's orders and weight versions, checked in one process."""

from __future__ import annotations

import pytest

from hf_asyncpp.schedules import SCHEDULES, ScheduleError
from hf_asyncpp.schedules.async_order import check_versions
from hf_asyncpp.schedules.pipedream import PIPEDREAM, PIPEDREAM_2BW, PipeDream2BW


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


CASES = [(2, 1), (2, 4), (3, 2), (4, 1), (4, 2), (4, 3), (4, 4), (4, 8), (6, 3), (6, 5)]


@pytest.mark.parametrize("name, pp_size, m", [("pipedream-2bw", p, m) for p, m in CASES]
                         + [("pipedream", p, m) for p, m in CASES if m >= p - 1])
def test_the_registered_schedule_validates_including_m_below_p(name, pp_size, m):
    """2BW at any m; PipeDream from m = p − 1 on (below it refuses, see further down)."""
    spec = SCHEDULES[name]
    assert not spec.synchronous
    spec.check_microbatches(pp_size, m)  # sends/receives pair, F before B, no deadlock, versions


def test_every_stage_runs_minibatch_k_on_version_k_minus_1():
    m = 4
    for stage in range(4):
        versions = [PIPEDREAM_2BW.version(stage, 4, j, m) for j in range(0, 5 * m, m)]
        assert versions == [0, 0, 1, 2, 3]  # w_0 = w_1 = init, then one step behind, at any depth


def test_at_most_two_versions_are_live_and_none_is_overwritten_in_use():
    for pp_size in (2, 4, 8):
        assert {PIPEDREAM_2BW.n_buffers(s, pp_size, pp_size) for s in range(pp_size)} == {2}
        check_versions(PIPEDREAM_2BW, pp_size, pp_size, 5)


def test_pipedream_staleness_grows_toward_the_first_stage():
    """Stage r takes each gradient at weights p − 1 − r updates old and stashes p − r versions."""
    pp_size, m = 4, 4
    assert [PIPEDREAM.delay(s, pp_size, m) for s in range(pp_size)] == [3, 2, 1, 0]
    assert [PIPEDREAM.n_buffers(s, pp_size, m) for s in range(pp_size)] == [4, 3, 2, 1]
    # Microbatch j on stage 0 runs on version j − 3 (the first four on the initial weights).
    assert [PIPEDREAM.version(0, pp_size, j, m) for j in range(8)] == [0, 0, 0, 0, 1, 2, 3, 4]
    check_versions(PIPEDREAM, pp_size, m, 4)


def test_pipedream_staleness_does_not_depend_on_the_microbatch_count():
    """Stage r is p − 1 − r updates stale at every accepted m, the smallest (p − 1) included."""
    for pp_size in (3, 4, 6):
        for m in (pp_size - 1, pp_size, 2 * pp_size):
            assert [PIPEDREAM.delay(s, pp_size, m) for s in range(pp_size)] == list(range(pp_size - 1, -1, -1))
            check_versions(PIPEDREAM, pp_size, m, 4)  # ... and the order really takes gradients that old


@pytest.mark.parametrize("pp_size, m", [(3, 1), (4, 1), (4, 2), (6, 3), (8, 2)])
def test_pipedream_refuses_fewer_than_p_minus_1_microbatches_instead_of_capping_the_staleness(pp_size, m):
    """PipeDream's stage r holds p − 1 − r microbatches in flight whatever m is; capping its warm-up at
    m (the old order) silently made stage 0 only m updates stale. Exact staleness would need a step to
    forward past the next minibatch, which the runtime is not given, so validation refuses it with
    the registry's message, before any process group exists."""
    message = (f"schedule 'pipedream' cannot run {m} microbatches with pp_size {pp_size}: PipeDream keeps "
               f"p-1-r microbatches in flight on stage r .* use n_microbatches >= pp_size - 1 = {pp_size - 1}, "
               "or pipedream-2bw")
    with pytest.raises(ValueError, match=message):
        SCHEDULES["pipedream"].check_microbatches(pp_size, m)
    with pytest.raises(ValueError, match="PipeDream keeps p-1-r"):  # no caller gets a capped delay either
        PIPEDREAM.delay(0, pp_size, m)
    SCHEDULES["pipedream-2bw"].check_microbatches(pp_size, m)  # one-step delay: any m is fine


def test_too_few_buffers_would_overwrite_weights_a_pending_backward_needs():
    class OneBuffer(PipeDream2BW):
        def n_buffers(self, stage, pp_size, n_microbatches):
            return 1

    with pytest.raises(ScheduleError, match="overwrites buffer 0 while microbatches"):
        check_versions(OneBuffer(), 4, 4, 3)


def test_a_version_rule_that_disagrees_with_the_delay_is_caught():
    class Fresh(PipeDream2BW):
        def version(self, stage, pp_size, j, n_microbatches):
            return j // n_microbatches  # no delay, but delay() still says 1

    with pytest.raises(ScheduleError, match="needs version 1, but after 0 updates"):
        check_versions(Fresh(), 2, 2, 3)
