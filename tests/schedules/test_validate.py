"""`check_schedule`: one-process validation of a schedule before any process group exists.

It accepts every registered schedule at the sizes it supports, returns the program torch's runtime
will execute (compute plus the sends and receives torch's own lowering adds), and rejects broken
action lists, each with a specific failure.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import (
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    Schedule1F1B,
    _Action,
)

from hf_asyncpp.schedules import SCHEDULES, ScheduleError, check_schedule
from hf_asyncpp.schedules import validate as validate_module
from hf_asyncpp.schedules.actions import gpipe_actions, one_f_one_b_actions

COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)


def parse(table: dict[int, str]) -> dict[int, list[_Action | None]]:
    """{rank: "0F0 0B0 -"} → {rank: [_Action, ...]}; '-' is a bubble (None)."""
    return {r: [None if t == "-" else _Action.from_str(t) for t in ops.split()] for r, ops in table.items()}


def as_text(program) -> dict[int, str]:
    return {r: " ".join(str(a) for a in ops) for r, ops in program.items()}


def assert_has_table(message: str, error_step: int) -> None:
    """The rank × time table torch formats: a 'Rank r' column per rank, a 'Step t:' row per step."""
    assert "Rank 0" in message and "Rank 1" in message
    assert "Step 0:" in message
    marked = [line for line in message.splitlines() if line.endswith("<-- ERROR HERE")]
    assert len(marked) == 1, message
    assert marked[0].lstrip().startswith(f"Step {error_step}:"), message


# --------------------------------------------------------------------------------------------
# Accepted: every registered schedule at the sizes it supports.
# --------------------------------------------------------------------------------------------

SUPPORTED = {
    "gpipe": [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (2, 5), (4, 1), (4, 4), (4, 8)],
    "1f1b": [(1, 1), (1, 4), (2, 2), (2, 4), (2, 5), (4, 4), (4, 5), (4, 8)],
    "interleaved-1f1b": [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 5), (4, 8), (4, 12)],
    "zbv": [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (2, 5), (4, 2), (4, 4), (4, 8)],
}


@pytest.mark.parametrize(
    "name, pp_size, n_microbatches",
    [(name, pp, m) for name, sizes in SUPPORTED.items() for pp, m in sizes],
)
def test_builtin_schedules_pass_at_supported_sizes(name, pp_size, n_microbatches):
    spec = SCHEDULES[name]
    actions = spec.make_actions(pp_size, n_microbatches)
    program = check_schedule(actions, pp_size, spec.n_stages(pp_size), n_microbatches)

    assert sorted(program) == list(range(pp_size))
    for r in range(pp_size):
        compute = [a for a in program[r] if a.computation_type not in COMMS]
        assert compute == [a for a in actions[r] if a is not None], f"lowering reordered rank {r}'s compute"
    # one stage per rank ⇒ one send/receive pair per microbatch per boundary and direction
    boundaries = spec.n_stages(pp_size) - 1
    every = [a for ops in program.values() for a in ops]
    if spec.stages_per_rank == 1:
        for kind in COMMS:
            assert sum(a.computation_type == kind for a in every) == boundaries * n_microbatches, kind


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_every_registered_schedule_that_accepts_a_size_passes_the_check(name, pp_size):
    """Whatever joins the registry later: accepting a size means its lists validate and simulate."""
    spec = SCHEDULES[name]
    accepted = 0
    for m in (1, 3, 4, 8):
        try:
            spec.check_microbatches(pp_size, m)
        except ValueError:
            continue
        accepted += 1
        if spec.synchronous:
            check_schedule(spec.make_actions(pp_size, m), pp_size, spec.n_stages(pp_size), m)
        else:  # several steps of the continuous order, lowered as its runtime lowers it, and its versions
            assert spec.actions(pp_size, m)
    assert accepted, f"{name} accepts none of the usual microbatch counts at pp_size {pp_size}"


def test_lowered_1f1b_program_golden_pp2_m4():
    """The exact program torch's runtime executes for 1F1B at (pp=2, m=4): each forward on rank 0 is
    followed by its send, each receive lands on rank 1 right before the compute that needs it."""
    program = check_schedule(one_f_one_b_actions(2, 4), 2, 2, 4)
    assert as_text(program) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0F3 0SEND_F3 "
        "0RECV_B2 0B2 0RECV_B3 0B3",
        1: "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1RECV_F2 1B1 1SEND_B1 1F2 1RECV_F3 1B2 1SEND_B2 "
        "1F3 1B3 1SEND_B3",
    }


def test_check_schedule_does_not_consume_the_callers_lists():
    """torch's _add_send_recv pops from the lists it is given; check_schedule must work on copies."""
    actions = gpipe_actions(2, 3)
    before = {r: list(ops) for r, ops in actions.items()}
    check_schedule(actions, 2, 2, 3)
    check_schedule(actions, 2, 2, 3)  # and can be called again on the same data
    assert actions == before


def test_bubbles_are_allowed_and_dropped_from_the_program():
    actions = parse({0: "0F0 - 0B0", 1: "- 1F0 1B0"})
    program = check_schedule(actions, 2, 2, 1)
    assert as_text(program) == {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}


def test_out_of_order_forwards_that_cannot_hang_are_accepted():
    """Rank 1 forwarding microbatch 1 before 0 is fine when rank 0 sends both before waiting:
    the lowering places both receives first. (Only orders that hang are errors; see below.)"""
    actions = parse({0: "0F0 0F1 0B0 0B1", 1: "1F1 1F0 1B0 1B1"})
    check_schedule(actions, 2, 2, 2)


# --------------------------------------------------------------------------------------------
# Rejected: hand-broken lists, each with its own failure.
# --------------------------------------------------------------------------------------------


def test_rejects_backward_before_its_forward_with_the_table():
    actions = parse({0: "0F0 0B0 0F1 0B1", 1: "1B0 1F0 1F1 1B1"})
    with pytest.raises(ScheduleError) as info:
        check_schedule(actions, 2, 2, 2)
    message = str(info.value)
    assert "Rank 1, step 0: Running Full Backward for stage 1, microbatch 0 without first running Forward" in message
    assert_has_table(message, error_step=0)


def test_rejects_weight_gradient_before_input_gradient():
    actions = parse({0: "0F0 0W0 0I0"})
    with pytest.raises(ScheduleError, match="Running Backward Weight for stage 0, microbatch 0 without first running Backward Input"):
        check_schedule(actions, 1, 1, 1)


def test_rejects_a_missing_forward_microbatch():
    actions = parse({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0"})
    with pytest.raises(ScheduleError, match=r"Got 1 .*FORWARD microbatches for stage 1, expected 2"):
        check_schedule(actions, 2, 2, 2)


def test_rejects_a_missing_backward_microbatch():
    actions = parse({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0"})
    with pytest.raises(ScheduleError, match=r"stage 1: expected 2 total backwards.*B=1"):
        check_schedule(actions, 2, 2, 2)


def test_rejects_a_stage_on_two_ranks():
    actions = parse({0: "0F0 1F0 1B0 0B0", 1: "1F1 1B1"})
    with pytest.raises(ScheduleError, match="Stage 1 is assigned to both rank 1 and rank 0"):
        check_schedule(actions, 2, 2, 2)


def test_rejects_a_wrong_number_of_ranks():
    with pytest.raises(ScheduleError, match="incorrect number of ranks - expected 2, actual 1"):
        check_schedule(parse({0: "0F0 0B0"}), 2, 2, 1)


# Orders that hang. torch's lowering pass gives up on them ("Malformed compute schedule") before
# the simulation runs; check_schedule reports that as a ScheduleError with the rank x time table.

HANGS = {
    # rank 1 forwards microbatch 1 first, but rank 0 sends microbatch 1 only after backwarding 0,
    # which needs rank 1's gradient for microbatch 0, which needs its forward of 0 — after 1F1.
    "forward_before_previous_stage_sent_it": {0: "0F0 0B0 0F1 0B1", 1: "1F1 1F0 1B0 1B1"},
    # rank 0 waits for the gradient of microbatch 0 before sending microbatch 1; rank 1 waits for
    # microbatch 1 before sending that gradient: each waits on the other.
    "two_ranks_wait_on_each_other": {0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"},
}


@pytest.mark.parametrize("case", sorted(HANGS))
def test_rejects_orders_that_hang(case):
    actions = parse(HANGS[case])
    with pytest.raises(ScheduleError, match="Malformed compute schedule, can't schedule sends/recvs"):
        check_schedule(actions, 2, 2, 2)


@pytest.mark.parametrize("case", sorted(HANGS))
def test_hanging_orders_raise_schedule_error_with_the_table(case):
    actions = parse(HANGS[case])
    try:
        check_schedule(actions, 2, 2, 2)
    except ScheduleError as err:
        assert "Rank 0" in str(err) and "Step 0:" in str(err)
    else:
        pytest.fail("accepted a hanging order")


def test_rejects_torch_schedule_1f1b_listing():
    """torch 2.13's own Schedule1F1B listing fails validation (current behaviour, asserted on purpose).

    On the last rank it forwards microbatches 1..m instead of 0..m−1: microbatch m does not exist
    and microbatch 0's backward has no forward. This is why actions.py generates 1F1B itself. If torch fixes its
    listing this test fails: then the listing can be used directly and this test rewritten.
    """
    ops = get_schedule_ops(Schedule1F1B, 2, 4, 1)
    actions = {r: [a for a in rank_ops if a is not None and a.computation_type != REDUCE_GRAD] for r, rank_ops in enumerate(ops)}
    with pytest.raises(ScheduleError) as info:
        check_schedule(actions, 2, 2, 4)
    message = str(info.value)
    assert "rank 1, step 6: 1F4 names microbatch 4, outside 0..3" in message
    assert_has_table(message, error_step=6)


def test_rejects_microbatch_indices_out_of_range():
    """Both ranks forward and backward 'microbatch 5' of 2: the counts match, the indices do not."""
    actions = parse({0: "0F0 0F5 0B0 0B5", 1: "1F0 1F5 1B0 1B5"})
    with pytest.raises(ScheduleError, match="names microbatch 5, outside 0..1"):
        check_schedule(actions, 2, 2, 2)


def test_rejects_a_microbatch_forwarded_twice():
    actions = parse({0: "0F0 0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 1B1"})
    with pytest.raises(ScheduleError, match="0F0 runs twice"):
        check_schedule(actions, 2, 2, 2)


def test_rejects_a_stage_index_beyond_n_stages():
    with pytest.raises(ScheduleError, match="names stage 1, outside 0..0"):
        check_schedule(parse({0: "0F0 0B0", 1: "1F0 1B0"}), 2, 1, 1)


# --------------------------------------------------------------------------------------------
# The simulation of the lowered program. torch's lowering is itself careful about dependencies,
# so these failures are provoked by substituting a broken lowering: they specify what the
# simulation catches should the lowering (or a future hand-written one) ever go wrong.
# --------------------------------------------------------------------------------------------

GOOD_COMPUTE = {0: "0F0 0B0", 1: "1F0 1B0"}


def check_with_lowering(monkeypatch, lowered: dict[int, str], compute: dict[int, str] = GOOD_COMPUTE, n_microbatches=1):
    monkeypatch.setattr(validate_module, "lower_with_comms", lambda *args, **kwargs: parse(lowered))
    return check_schedule(parse(compute), 2, 2, n_microbatches)


def test_simulation_accepts_the_correct_program(monkeypatch):
    program = check_with_lowering(
        monkeypatch, {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    )
    assert as_text(program)[1] == "1RECV_F0 1F0 1B0 1SEND_B0"


def test_simulation_reports_deadlock_with_the_table(monkeypatch):
    with pytest.raises(ScheduleError) as info:
        check_with_lowering(monkeypatch, {0: "0RECV_B0 0F0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})
    message = str(info.value)
    assert message.startswith("rank 0, step 0: deadlock: 0RECV_B0 waits forever")
    assert_has_table(message, error_step=0)


def test_simulation_reports_forward_before_the_previous_stage(monkeypatch):
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: 1F0 runs before stage 0 forwarded microbatch 0"):
        check_with_lowering(monkeypatch, {0: "0RECV_B0 0F0 0SEND_F0 0B0", 1: "1F0 1B0 1SEND_B0"})


def test_simulation_reports_forward_without_its_receive(monkeypatch):
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: 1F0 runs without receiving its input") as info:
        check_with_lowering(monkeypatch, {0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1F0 1RECV_F0 1B0 1SEND_B0"})
    assert_has_table(str(info.value), error_step=0)


def test_simulation_reports_backward_without_its_receive(monkeypatch):
    """Rank 0 waits for microbatch 1's gradient, then backwards microbatch 0 whose gradient it never received."""
    compute = {0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 1B1"}
    lowered = {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
        1: "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
    }
    with pytest.raises(ScheduleError, match=r"rank 0, step 5: 0B0 runs without receiving its output gradient"):
        check_with_lowering(monkeypatch, lowered, compute, n_microbatches=2)


def test_simulation_reports_backward_before_the_next_stage(monkeypatch):
    with pytest.raises(ScheduleError, match=r"rank 0, step 2: 0B0 runs before stage 1 sent its gradient"):
        check_with_lowering(monkeypatch, {0: "0F0 0SEND_F0 0B0 0RECV_B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})


def test_simulation_reports_unpaired_sends(monkeypatch):
    with pytest.raises(ScheduleError, match=r"sends and receives do not pair up: \[\"\('F', 0, 7\)\"\]"):
        check_with_lowering(
            monkeypatch, {0: "0F0 0SEND_F0 0SEND_F7 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
        )
