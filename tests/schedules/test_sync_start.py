"""Sync start (`sync_steps: N`): the first N steps of an asynchronous order run synchronously — each
step forwards and backwards only its own minibatch, every gradient at the current weights — and the
order then starts at step N as it starts a run, its versions counted on from the N steps' updates."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import FORWARD

from hf_asyncpp.schedules import get_schedule_spec
from hf_asyncpp.schedules.async_order import check_versions, replay_after

M = 4


def _order(schedule, sync_steps):
    return get_schedule_spec(schedule).starting_synchronously(sync_steps).order


@pytest.mark.parametrize("schedule", ["pipedream-2bw", "pipedream", "wpipe"])
@pytest.mark.parametrize("pp_size", [2, 4])
def test_the_order_across_the_switch_pairs_its_messages_and_keeps_its_versions(schedule, pp_size):
    spec = get_schedule_spec(schedule).starting_synchronously(2)
    spec.actions(pp_size, M)  # planned segment by segment and played under NCCL's rules, no deadlock
    check_versions(spec.order, pp_size, M, 6)


def test_pipedream_2bw_runs_minibatch_k_on_the_newest_version_then_one_behind_from_the_switch():
    order = _order("pipedream-2bw", 2)
    versions = [order.version(0, 2, k * M, M) for k in range(6)]
    assert versions == [0, 1, 2, 2, 3, 4]  # steps 0, 1 synchronous; step 2 as 2BW's first step; then delay 1
    assert [order.synchronous_step(k) for k in range(4)] == [True, True, False, False]


def test_pipedream_updates_after_each_microbatch_on_the_weights_of_the_one_before():
    order = _order("pipedream", 1)
    assert [order.version(0, 4, j, M) for j in range(M)] == [0, 1, 2, 3]  # stage 0, delay 3 later
    assert [order.version(0, 4, j, M) for j in range(M, 3 * M)] == [4, 4, 4, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("schedule", ["pipedream-2bw", "pipedream", "wpipe"])
def test_a_synchronous_step_forwards_and_backwards_only_its_own_minibatch(schedule):
    order = _order(schedule, 3)
    for step in range(3):
        for rank in range(2):
            ops = order.segment(rank, 2, M, step, 6)
            assert {a.microbatch_index // M for a in ops} == {step}
            assert sum(a.computation_type == FORWARD for a in ops) * 2 == len(ops)


def test_a_resume_inside_the_synchronous_steps_replays_nothing_and_after_the_switch_what_the_order_does():
    order, plain = _order("pipedream-2bw", 2), get_schedule_spec("pipedream-2bw").order
    assert replay_after(order, 4, M, 1, 6) == {r: [] for r in range(4)}
    shifted = {r: [(a.stage_index, a.computation_type, a.microbatch_index + 2 * M) for a in ops]
               for r, ops in replay_after(plain, 4, M, 0, 4).items()}
    assert {r: [(a.stage_index, a.computation_type, a.microbatch_index) for a in ops]
            for r, ops in replay_after(order, 4, M, 2, 6).items()} == shifted


def test_a_synchronous_schedule_has_no_sync_start():
    assert get_schedule_spec("1f1b").starting_synchronously(0).order is None
    with pytest.raises(ValueError, match="synchronous"):
        get_schedule_spec("1f1b").starting_synchronously(2)
