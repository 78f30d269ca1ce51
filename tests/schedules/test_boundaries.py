"""Whether a run can stop (checkpoint, SIGTERM), be evaluated or resume between two steps, per
schedule (ScheduleSpec.step_boundary): the one answer config validation, the engine's mid-run
evaluation and the loop's SIGTERM handling all read."""

from __future__ import annotations

import pytest

from hf_asyncpp.schedules import get_schedule_spec


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("pp_size, m", [(2, 4), (4, 8)])
def test_a_synchronous_schedule_flushes_every_step_and_can_always_stop(schedule, pp_size, m):
    boundary = get_schedule_spec(schedule).step_boundary(pp_size, m)
    assert boundary.clean and boundary.straddling_units == () and boundary.reason == ""


# (schedule, pp_size, n_microbatches, sync_steps) → whether a run can stop between its steps.
ANSWERS = {
    ("pipedream-2bw", 2, 4, 0): True,
    ("pipedream-2bw", 3, 2, 0): True,
    ("pipedream-2bw", 4, 8, 0): True,
    ("pipedream-2bw", 4, 1, 2): True,
    ("pipedream", 2, 4, 0): True,
    ("pipedream", 4, 4, 0): True,
    ("pipedream", 3, 8, 0): True,
    ("pipedream", 2, 2, 3): True,
    ("wpipe", 2, 4, 0): False,
    ("wpipe", 3, 2, 0): False,
    ("wpipe", 4, 8, 0): False,
    ("wpipe", 2, 4, 1): False,
    ("wpipe", 4, 3, 3): False,
}


@pytest.mark.parametrize("schedule, pp_size, m, sync_steps", list(ANSWERS))
def test_an_asynchronous_schedule_stops_between_steps_unless_its_updates_straddle_them(schedule, pp_size, m, sync_steps):
    spec = get_schedule_spec(schedule).starting_synchronously(sync_steps)
    boundary = spec.step_boundary(pp_size, m)
    assert boundary.clean is ANSWERS[(schedule, pp_size, m, sync_steps)]
    if not boundary.clean:
        # WPipe's first group applies minibatch k one step after its second group: at the boundary
        # after the first asynchronous step, that step's minibatch is half applied.
        assert boundary.straddling_units == (sync_steps,)
        assert boundary.reason == (f"wpipe: after step {sync_steps}, update unit(s) [{sync_steps}] are applied on "
                                   "some stages but not on others; a run cannot resume at this step boundary by replay")


@pytest.mark.parametrize("schedule, pp_size, m, sync_steps", list(ANSWERS))
def test_the_first_asynchronous_boundary_answers_for_every_later_one(schedule, pp_size, m, sync_steps):
    order = get_schedule_spec(schedule).starting_synchronously(sync_steps).order
    first = order.boundary_after(pp_size, m, sync_steps).clean
    assert [order.boundary_after(pp_size, m, step).clean for step in range(sync_steps, sync_steps + 6)] == [first] * 6
    # A sync start's own steps flush: nothing straddles them, whatever the order.
    assert all(order.boundary_after(pp_size, m, step).clean for step in range(sync_steps))


@pytest.mark.parametrize("schedule", ["pipedream-2bw", "pipedream", "wpipe"])
def test_the_single_process_emulator_can_always_stop(schedule):
    # pp_size 1 runs the order in one process with nothing in flight between steps (emulation.py)
    assert get_schedule_spec(schedule).step_boundary(1, 4).clean


def test_the_emulator_answer_is_the_emulators_not_the_orders():
    # WPipe's two groups on one rank would straddle the boundary if the order were played there.
    assert not get_schedule_spec("wpipe").order.boundary_after(1, 4, 0).clean
