"""What a resumed asynchronous run replays: every action, up to the checkpointed step, of the update
units no stage has applied yet (their forwards rebuild in-flight activations and pending messages,
their backwards pending gradient sums); a unit applied on some stages only cannot be replayed."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import FORWARD

from hf_asyncpp.schedules import ScheduleError, get_schedule_spec
from hf_asyncpp.schedules.async_order import replay_after


def _text(replay):
    return {rank: " ".join(str(a) for a in ops) for rank, ops in replay.items()}


@pytest.mark.parametrize("schedule", ["pipedream-2bw", "pipedream"])
def test_after_a_step_the_next_minibatchs_warm_up_forwards_are_replayed(schedule):
    order = get_schedule_spec(schedule).order
    assert _text(replay_after(order, 2, 4, 0, 5)) == {0: "0F4", 1: ""}
    # Rank r is w_r = p − 1 − r forwards ahead; the last stage has nothing in flight.
    assert _text(replay_after(order, 4, 4, 2, 5)) == {0: "0F12 0F13 0F14", 1: "1F12 1F13", 2: "2F12", 3: ""}


def test_replayed_forwards_are_exactly_those_without_their_backward_before_the_boundary():
    order = get_schedule_spec("pipedream-2bw").order
    for pp_size, m in [(2, 2), (3, 4), (4, 8)]:
        for step in range(3):
            done = {r: [a for k in range(step + 1) for a in order.segment(r, pp_size, m, k, 6)] for r in range(pp_size)}
            replay = replay_after(order, pp_size, m, step, 6)
            for rank, ops in done.items():
                backwarded = {(a.stage_index, a.microbatch_index) for a in ops if a.computation_type != FORWARD}
                in_flight = [a for a in ops
                             if a.computation_type == FORWARD and (a.stage_index, a.microbatch_index) not in backwarded]
                assert replay[rank] == in_flight


def test_wpipe_updates_a_minibatch_across_a_step_boundary_and_cannot_be_replayed():
    with pytest.raises(ScheduleError, match="applied on some stages but not on others"):
        replay_after(get_schedule_spec("wpipe").order, 2, 4, 1, 5)
