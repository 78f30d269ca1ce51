"""The chunk slots of an asynchronous order: as few as its plays allow (async_order.held_spans).

torch's PipelineStage allocates an activation and a gradient receive buffer per chunk id; microbatch
j uses slot j mod n_slots. n_slots is the largest span of microbatch ids a stage holds at once in
the runtime's plays (from the start to a drain, resumed by replay, across a sync start's switch):
with it every play passes the planner's slot check, and with one fewer some play does not.
"""

from __future__ import annotations

import pytest

from hf_asyncpp.schedules import SCHEDULES, ScheduleError
from hf_asyncpp.schedules.async_order import SegmentPrograms, _placement, held_spans, replay_after
from hf_asyncpp.schedules.comm_plan import PlanError

ASYNC = sorted(name for name, spec in SCHEDULES.items() if not spec.synchronous)
GRID = [(pp_size, m) for pp_size in (2, 4, 8) for m in (4, 8, 32, 64)]


def _supported(spec, pp_size, m):
    try:
        spec.order.segment(0, pp_size, m, 0, 1)
        return True
    except ValueError:  # PipeDream and WPipe need m ≥ pp − 1
        return False


def _play(order, pp_size, m, n_slots, n_steps, starts):
    """Every play of `starts` (0: from the start; k: resumed by replay before step k) with n_slots."""
    for start in starts:
        replay = None
        if start:
            try:
                replay = replay_after(order, pp_size, m, start - 1, n_steps)
            except ScheduleError:
                continue
        plan = SegmentPrograms(order, pp_size, m, n_steps, start_step=start, replay=replay, keep=[], n_slots=n_slots,
                               **_placement(order, pp_size, m))
        for k in range(start, n_steps):
            plan.program(0, k)
        yield plan


def _plays_pass(order, pp_size, m, n_slots) -> bool:
    played, n_steps, resumes = order.span_plays(pp_size, m)
    try:
        for _ in _play(played, pp_size, m, n_slots, n_steps, [0, *resumes]):
            pass
        return True
    except PlanError:
        return False


@pytest.mark.parametrize("sync_steps", [0, 2])
@pytest.mark.parametrize("name", ASYNC)
def test_the_slot_count_passes_the_planner_and_one_fewer_does_not(name, sync_steps):
    spec = SCHEDULES[name].starting_synchronously(sync_steps)
    for pp_size, m in GRID:
        if not _supported(spec, pp_size, m):
            continue
        n_slots = spec.order.n_slots(pp_size, m)
        assert n_slots <= max(2 * m, m + pp_size + 1)  # never more than the fixed count it replaces
        assert _plays_pass(spec.order, pp_size, m, n_slots), (pp_size, m, n_slots)
        assert not _plays_pass(spec.order, pp_size, m, n_slots - 1), (pp_size, m, n_slots)


@pytest.mark.parametrize("sync_steps", [0, 1, 3])
@pytest.mark.parametrize("name", ASYNC)
def test_longer_runs_and_later_resumes_hold_no_wider_span(name, sync_steps):
    """The plays held_spans makes cover the steady state: a run three times as long, resumed at every
    step, holds the same spans (and, with sync_steps 3, the switch after three synchronous steps)."""
    spec = SCHEDULES[name].starting_synchronously(sync_steps)
    for pp_size, m in [(2, 2), (2, 4), (4, 3), (4, 4), (4, 8), (8, 8)]:
        if not _supported(spec, pp_size, m):
            continue
        n_steps = sync_steps + 12
        spans: dict[str, int] = {}
        for plan in _play(spec.order, pp_size, m, None, n_steps, range(n_steps - 1)):
            for (_, kind), span in plan.spans.items():
                spans[kind] = max(spans.get(kind, 0), span)
        assert spans == held_spans(spec.order, pp_size, m), (pp_size, m)


def test_the_slot_counts_at_the_shipped_scale():
    """moe_10b's pipeline (pp 8, m 64): PipeDream-2BW and PipeDream hold 8 microbatches per stage, not
    128 (docs/scale.md); WPipe forwards a whole minibatch through each group before its backwards."""
    order = SCHEDULES["pipedream-2bw"].order
    assert [order.n_slots(8, m) for m in (4, 8, 32, 64)] == [5, 8, 8, 8]
    assert SCHEDULES["pipedream"].order.n_slots(8, 64) == 8
    assert SCHEDULES["wpipe"].order.n_slots(8, 64) == 72
    # a sync start's synchronous steps forward the whole minibatch before its backwards
    assert SCHEDULES["pipedream-2bw"].starting_synchronously(2).order.n_slots(8, 64) == 64


def test_the_slot_count_is_computed_in_a_fraction_of_a_second():
    import time

    order = SCHEDULES["wpipe"].starting_synchronously(5).order
    start = time.perf_counter()
    order.n_slots(8, 64)  # moe_10b: pp 8, m 64
    assert time.perf_counter() - start < 2.0
