"""The schedule registry: names → ScheduleSpec (stages per rank, placement, action lists, limits)."""

from __future__ import annotations

import dataclasses

import pytest

from hf_asyncpp.schedules import SCHEDULES, ScheduleError, ScheduleSpec, get_schedule_spec, register_schedule
from hf_asyncpp.schedules import registry as registry_module
from hf_asyncpp.schedules.actions import gpipe_actions

BUILTIN = ["gpipe", "1f1b", "interleaved-1f1b", "zbv"]


def test_builtin_names_are_registered_and_synchronous():
    assert set(BUILTIN) <= set(SCHEDULES)
    for name in BUILTIN:
        spec = get_schedule_spec(name)
        assert isinstance(spec, ScheduleSpec)
        assert spec.name == name
        assert spec.synchronous is True
        assert spec.description


def test_asynchronous_schedules_carry_an_order_and_are_not_synchronous():
    spec = get_schedule_spec("pipedream-2bw")
    assert spec.synchronous is False and spec.order is not None and spec.make_actions is None


def test_unknown_name_raises_value_error_listing_the_names():
    with pytest.raises(ValueError) as info:
        get_schedule_spec("pipedream-4bw")
    message = str(info.value)
    assert message.startswith("unknown schedule 'pipedream-4bw'; available: ")
    for name in SCHEDULES:
        assert name in message


def test_names_are_case_sensitive():
    with pytest.raises(ValueError, match="unknown schedule 'GPipe'"):
        get_schedule_spec("GPipe")


@pytest.mark.parametrize(
    "name, stages_per_rank, placement",
    [("gpipe", 1, "loop"), ("1f1b", 1, "loop"), ("interleaved-1f1b", 2, "loop"), ("zbv", 2, "v")],
)
def test_stage_layout_of_builtin_schedules(name, stages_per_rank, placement):
    spec = SCHEDULES[name]
    assert (spec.stages_per_rank, spec.placement) == (stages_per_rank, placement)


@pytest.mark.parametrize("name, n_stages", [("gpipe", 4), ("1f1b", 4), ("interleaved-1f1b", 8), ("zbv", 8)])
def test_n_stages_is_pp_times_stages_per_rank(name, n_stages):
    assert SCHEDULES[name].n_stages(4) == n_stages
    assert SCHEDULES[name].n_stages(1) == n_stages // 4


def test_stage_indices_loop_placement():
    """Loop: rank r holds stages r, r + p, r + 2p, ..."""
    assert [SCHEDULES["1f1b"].stage_indices(4, r) for r in range(4)] == [[0], [1], [2], [3]]
    interleaved = SCHEDULES["interleaved-1f1b"]
    assert interleaved.stage_indices(4, 1) == [1, 5]
    assert [interleaved.stage_indices(4, r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_stage_indices_v_placement():
    """V: rank r holds stage r on the way down and 2p − 1 − r on the way back."""
    zbv = SCHEDULES["zbv"]
    assert zbv.stage_indices(4, 1) == [1, 6]
    assert [zbv.stage_indices(4, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert zbv.stage_indices(1, 0) == [0, 1]
    assert zbv.stage_ranks(2) == {0: 0, 3: 0, 1: 1, 2: 1}


def test_rank_pairs_are_the_ranks_of_consecutive_stages():
    """The pairs that get a group of their own (parallel/mesh.link_groups): a loop of two stages per
    rank also links the last rank to the first; a V turns back on the last rank."""
    assert SCHEDULES["1f1b"].rank_pairs(4) == [(0, 1), (1, 2), (2, 3)]
    assert SCHEDULES["interleaved-1f1b"].rank_pairs(4) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert SCHEDULES["zbv"].rank_pairs(4) == [(0, 1), (1, 2), (2, 3)]
    assert SCHEDULES["wpipe"].rank_pairs(2) == [(0, 1)]
    assert SCHEDULES["zbv"].rank_pairs(1) == []


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_stage_indices_partition_the_stages(name, pp_size):
    spec = SCHEDULES[name]
    held = [s for r in range(pp_size) for s in spec.stage_indices(pp_size, r)]
    assert sorted(held) == list(range(spec.n_stages(pp_size)))


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("pp_size", [2, 4])
def test_stage_indices_match_the_stages_in_each_ranks_actions(name, pp_size):
    """The placement the engine builds stages from is the one the action lists assume."""
    spec = SCHEDULES[name]
    actions = spec.actions(pp_size, 2 * pp_size)
    for r in range(pp_size):
        in_actions = {a.stage_index for a in actions[r] if a is not None}
        assert in_actions == set(spec.stage_indices(pp_size, r)), f"rank {r}"


def test_actions_returns_checked_compute_lists():
    assert SCHEDULES["gpipe"].actions(2, 3) == gpipe_actions(2, 3)


def test_1f1b_with_fewer_microbatches_than_stages_is_refused():
    spec = SCHEDULES["1f1b"]
    with pytest.raises(ValueError, match=r"1F1B needs at least as many microbatches as stages \(4\)"):
        spec.actions(4, 3)
    with pytest.raises(ValueError) as info:
        spec.check_microbatches(4, 3)
    assert str(info.value) == (
        "schedule '1f1b' cannot run 3 microbatches with pp_size 4: "
        "1F1B needs at least as many microbatches as stages (4)"
    )
    spec.check_microbatches(4, 4)  # the boundary is accepted


def test_interleaved_with_microbatches_not_a_multiple_of_rounds_is_refused():
    spec = SCHEDULES["interleaved-1f1b"]
    with pytest.raises(ValueError) as info:
        spec.check_microbatches(2, 5)
    message = str(info.value)
    assert message.startswith("schedule 'interleaved-1f1b' cannot run 5 microbatches with pp_size 2: ")
    assert "multiple of the number of rounds" in message
    assert "\n" not in message  # one line, fit for a config error
    spec.check_microbatches(2, 4)
    spec.check_microbatches(2, 6)


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("n_microbatches", [0, -1])
def test_non_positive_microbatch_counts_are_refused(name, n_microbatches):
    with pytest.raises(ValueError, match=f"n_microbatches must be at least 1, got {n_microbatches}"):
        SCHEDULES[name].check_microbatches(2, n_microbatches)


def test_check_microbatches_turns_schedule_errors_into_one_line_value_errors():
    def broken(pp_size, n_microbatches):  # every rank backwards before it forwards
        return {r: list(reversed(ops)) for r, ops in gpipe_actions(pp_size, n_microbatches).items()}

    spec = ScheduleSpec("broken", "test only", broken)
    with pytest.raises(ScheduleError):
        spec.actions(2, 2)
    with pytest.raises(ValueError) as info:
        spec.check_microbatches(2, 2)
    message = str(info.value)
    assert message.startswith("schedule 'broken' cannot run 2 microbatches with pp_size 2: Rank 0, step 0: ")
    assert "\n" not in message


def test_register_schedule_adds_a_name(monkeypatch):
    monkeypatch.setattr(registry_module, "SCHEDULES", dict(SCHEDULES))
    spec = ScheduleSpec("gpipe-copy", "test only", gpipe_actions)
    assert register_schedule(spec) is spec
    assert registry_module.get_schedule_spec("gpipe-copy") is spec
    assert "gpipe-copy" not in SCHEDULES  # the real registry is untouched by this test


def test_specs_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SCHEDULES["gpipe"].stages_per_rank = 2


def test_spec_defaults():
    spec = ScheduleSpec("x", "test only", gpipe_actions)
    assert (spec.stages_per_rank, spec.placement, spec.synchronous) == (1, "loop", True)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp_size, n_microbatches", [(2, 4), (4, 8), (4, 16)])
def test_the_flush_on_equal_stages_is_the_textbook_bubble(name, pp_size, n_microbatches):
    """A step whose ranks each compute 1 s takes (m + p − 1)/m s: idle (p − 1)/(m + p − 1) of it."""
    flush_s = get_schedule_spec(name).flush_seconds(pp_size, n_microbatches, [1.0] * pp_size)
    assert flush_s / (1.0 + flush_s) == pytest.approx((pp_size - 1) / (n_microbatches + pp_size - 1))


def test_on_unequal_stages_the_busiest_rank_paces_the_step_and_the_flush_adds_the_others_fill_and_drain():
    """1F1B at p = 2, m = 4, rank 1 computing twice rank 0's 1 s: rank 1 never waits once started, so
    the step is rank 0's first forward (1/12 s: a backward takes two forwards), rank 1's 2 s and rank 0's
    last backward (1/6 s)."""
    assert get_schedule_spec("1f1b").flush_seconds(2, 4, [1.0, 2.0]) == pytest.approx(1 / 12 + 1 / 6)


def test_an_asynchronous_schedule_has_no_flush_to_time():
    with pytest.raises(ValueError, match="'pipedream-2bw' never flushes"):
        get_schedule_spec("pipedream-2bw").flush_seconds(2, 4, [1.0, 1.0])
