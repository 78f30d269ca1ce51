"""`check_schedule`: one-process validation of a schedule before any process group exists.

It accepts every registered schedule at the sizes it supports, returns the programs the runtime
executes (compute plus the P2P batches comm_plan.py plans), plays them under NCCL's rules —
matching by posting order per pair of ranks, ordered streams, sends that complete only with their
receive — and rejects broken action lists and programs, each with a specific failure.
"""

from __future__ import annotations

import re

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    Schedule1F1B,
    _Action,
)

from hf_asyncpp.schedules import (
    SCHEDULES,
    ScheduleError,
    check_schedule,
    get_schedule_spec,
)
from hf_asyncpp.schedules.actions import gpipe_actions, one_f_one_b_actions
from hf_asyncpp.schedules.comm_plan import Collective, HostWait, P2PBatch, plan_program
from hf_asyncpp.schedules.registry import MODEL_COSTS
from hf_asyncpp.schedules.validate import check_program

COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)


def parse(table: dict[int, str]) -> dict[int, list[_Action | None]]:
    """{rank: "0F0 0B0 -"} → {rank: [_Action, ...]}; '-' is a bubble (None)."""
    return {r: [None if t == "-" else _Action.from_str(t) for t in ops.split()] for r, ops in table.items()}


def parse_program(table: dict[int, str]):
    """{rank: "0F0 0SEND_F0+0RECV_B0 0B0 ."}: '+' joins the operations of one batch, a lone send or
    receive is a batch of one, '.' waits for the rank's sends, AR@g is an all-reduce on group g of all
    the table's ranks, wait@g a host wait for the rank's collectives on g (wait@all: for everything)."""
    def entry(token):
        if token == ".":
            return None
        if token.startswith("AR@"):  # an all-reduce on the named group of every rank in the table
            return Collective(token[3:], frozenset(table))
        if token.startswith("wait@"):  # the host waits for the named group's collectives, or for all
            return HostWait(None if token == "wait@all" else token[5:])
        ops = [_Action.from_str(t) for t in token.split("+")]
        return P2PBatch(tuple(ops)) if ops[0].computation_type in COMMS else ops[0]

    return {r: [entry(t) for t in ops.split()] for r, ops in table.items()}


def as_text(program) -> dict[int, str]:
    return {r: " ".join("." if a is None else str(a) for a in ops) for r, ops in program.items()}


def assert_has_table(message: str, error_step: int) -> None:
    """The rank × time table torch formats: a 'Rank r' column per rank, a 'Step t:' row per step."""
    assert "Rank 0" in message and "Rank 1" in message
    assert "Step 0" in message  # zero-padded to the widest step number
    marked = [line for line in message.splitlines() if line.endswith("<-- ERROR HERE")]
    assert len(marked) == 1, message
    assert int(marked[0].split(":")[0].split()[1]) == error_step, message


def comm_ops(program):
    return [op for ops in program.values() for e in ops if isinstance(e, P2PBatch) for op in e.ops]


# --------------------------------------------------------------------------------------------
# Accepted: every registered schedule at every size it supports, under both stream models.
# --------------------------------------------------------------------------------------------


def supported_grid(names=None):
    """Every registered schedule (or those named), pp 2…8, m from the smallest it accepts to 2·pp (its
    own placement: loop for one and two stages per rank, V for zbv)."""
    for name, spec in sorted((n, SCHEDULES[n]) for n in (names or SCHEDULES)):
        for pp_size in range(2, 9):
            for m in range(1, 2 * pp_size + 1):
                try:
                    spec.check_microbatches(pp_size, m)
                except ValueError:
                    continue
                yield name, pp_size, m


GRID = list(supported_grid())


def test_the_grid_covers_every_schedule_and_placement():
    assert {name for name, _, _ in GRID} == set(SCHEDULES)
    assert {SCHEDULES[name].placement for name, _, _ in GRID} == {"loop", "v"}
    assert {SCHEDULES[name].stages_per_rank for name, _, _ in GRID} == {1, 2}


@pytest.mark.parametrize("streams", ["pair", "rank"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_runs_under_nccl_rules_at_every_supported_size(name, streams):
    """One stream per pair of ranks (NCCL's P2P), or one for all of a rank's peers (stricter)."""
    spec = SCHEDULES[name]
    for _, pp_size, m in [g for g in GRID if g[0] == name]:
        n_stages = spec.n_stages(pp_size)
        if spec.synchronous:
            check_schedule(spec.make_actions(pp_size, m), pp_size, n_stages, m, streams=streams)
        else:
            steps = 3
            actions = spec.order.stream(pp_size, m, steps)
            check_schedule(actions, pp_size, n_stages, m * steps, streams=streams,
                           plan=lambda stage_to_rank: spec.programs(pp_size, m, steps, stage_to_rank))


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
def test_planning_keeps_each_ranks_compute_order_and_pairs_every_message(name, pp_size, n_microbatches):
    spec = SCHEDULES[name]
    actions = spec.make_actions(pp_size, n_microbatches)
    program = check_schedule(actions, pp_size, spec.n_stages(pp_size), n_microbatches)

    assert sorted(program) == list(range(pp_size))
    for r in range(pp_size):
        compute = [a for a in program[r] if isinstance(a, _Action)]
        assert compute == [a for a in actions[r] if a is not None], f"planning reordered rank {r}'s compute"
        assert program[r][-1] is None  # a flushed step ends waiting for its sends
    # one stage per rank ⇒ one send/receive pair per microbatch per boundary and direction
    boundaries = spec.n_stages(pp_size) - 1
    if spec.stages_per_rank == 1:
        for kind in COMMS:
            assert sum(op.computation_type == kind for op in comm_ops(program)) == boundaries * n_microbatches, kind


def test_1f1b_program_golden_pp2_m4():
    """What the runtime executes for 1F1B at (pp=2, m=4): rank 0 posts each activation's send together
    with the next gradient's receive, as torch's own 1F1B does; rank 1 posts each receive as soon as
    the activation is produced, and both post the pair's messages in the same order."""
    program = check_schedule(one_f_one_b_actions(2, 4), 2, 2, 4)
    assert as_text(program) == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1+0RECV_B0 0B0 0F2 0SEND_F2+0RECV_B1 0B1 0F3 0SEND_F3+0RECV_B2 0B2 "
        "0RECV_B3 0B3 .",
        1: "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1RECV_F2 1B1 1SEND_B1 1F2 1RECV_F3 1B2 1SEND_B2 1F3 1B3 1SEND_B3 .",
    }


def test_check_schedule_does_not_consume_the_callers_lists():
    actions = gpipe_actions(2, 3)
    before = {r: list(ops) for r, ops in actions.items()}
    check_schedule(actions, 2, 2, 3)
    check_schedule(actions, 2, 2, 3)  # and can be called again on the same data
    assert actions == before


def test_bubbles_are_allowed_and_dropped_from_the_program():
    actions = parse({0: "0F0 - 0B0", 1: "- 1F0 1B0"})
    program = check_schedule(actions, 2, 2, 1)
    assert as_text(program) == {0: "0F0 0SEND_F0+0RECV_B0 0B0 .", 1: "1RECV_F0 1F0 1B0 1SEND_B0 ."}


def test_out_of_order_forwards_receive_in_the_senders_order():
    """Rank 1 forwards microbatch 1 before 0: it still posts its receives in the order rank 0 sends
    (0, then 1) — NCCL would otherwise hand it microbatch 0's activation as microbatch 1's."""
    actions = parse({0: "0F0 0F1 0B0 0B1", 1: "1F1 1F0 1B0 1B1"})
    program = check_schedule(actions, 2, 2, 2)
    assert as_text(program)[1].startswith("1RECV_F0+1RECV_F1 1F1 1F0")


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


# Orders that hang: no run exists, so the planner finds every rank waiting for an input that never
# comes; check_schedule reports it as a ScheduleError with the compute lists as a rank x time table.

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
    with pytest.raises(ScheduleError, match="the order cannot run: every rank waits for an input that never comes"):
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
# The play under NCCL's rules, on hand-written programs: what it catches should the planner (or a
# future hand-written program) ever go wrong.
# --------------------------------------------------------------------------------------------


def play(table: dict[int, str], n_stages: int = 2, streams: str = "pair"):
    check_program(parse_program(table), lambda s: s, n_stages, streams)


def send_then_receive_1f1b(pp_size: int, m: int) -> dict[int, str]:
    """1F1B with every operation alone: a receive right before the compute that needs it, a send right
    after the compute that produced it — the order gloo forgives and NCCL does not."""
    program = {}
    for r, ops in one_f_one_b_actions(pp_size, m).items():
        tokens = []
        for a in ops:
            forward = a.computation_type.name == "FORWARD"
            if forward and r > 0:
                tokens.append(f"{r}RECV_F{a.microbatch_index}")
            if not forward and r < pp_size - 1:
                tokens.append(f"{r}RECV_B{a.microbatch_index}")
            tokens.append(str(a))
            if forward and r < pp_size - 1:
                tokens.append(f"{r}SEND_F{a.microbatch_index}")
            if not forward and r > 0:
                tokens.append(f"{r}SEND_B{a.microbatch_index}")
        program[r] = " ".join(tokens + ["."])
    return program


def test_accepts_the_correct_program():
    play({0: "0F0 0SEND_F0 0RECV_B0 0B0 .", 1: "1RECV_F0 1F0 1B0 1SEND_B0 ."})


def test_rejects_ungrouped_send_then_receive_1f1b_at_pp2_with_the_table():
    """The circular wait of the issue: rank 0 sends activation 2 then waits for gradient 1, rank 1
    sends gradient 1 then waits for activation 2; each send needs a receive queued behind the other."""
    with pytest.raises(ScheduleError) as info:
        play(send_then_receive_1f1b(2, 4))
    message = str(info.value)
    assert "deadlock" in message and "queued behind an earlier batch" in message, message
    assert_has_table(message, error_step=int(message.split(",")[1].split()[1].rstrip(":")))


def test_the_same_1f1b_with_each_send_grouped_with_the_next_receive_runs():
    grouped = {
        0: "0F0 0SEND_F0 0F1 0SEND_F1+0RECV_B0 0B0 0F2 0SEND_F2+0RECV_B1 0B1 0F3 0SEND_F3+0RECV_B2 0B2 0RECV_B3 0B3 .",
        1: "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0+1RECV_F2 1F1 1B1 1SEND_B1+1RECV_F3 1F2 1B2 1SEND_B2 1F3 1B3 1SEND_B3 .",
    }
    play(grouped)


def test_rejects_a_receive_posted_early_that_blocks_a_later_send_to_the_same_peer():
    """Rank 0 posts its gradient receive before sending the activation: on the pair's stream the
    receive waits for a gradient that needs the activation queued behind it."""
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0, step 3: deadlock: 0B0 waits forever; unfinished batches: rank 0: 0RECV_B0 (started); "
            "rank 0: 0SEND_F0 (queued behind an earlier batch)")):
        play({0: "0RECV_B0 0F0 0SEND_F0 0B0 .", 1: "1RECV_F0 1F0 1B0 1SEND_B0 ."})


def test_rejects_receives_posted_out_of_the_senders_order():
    """Tags would keep the two activations apart; NCCL matches the first send to the first receive."""
    with pytest.raises(ScheduleError) as info:
        play({0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0+0RECV_B1 0B0 0B1 .",
              1: "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1B1 1SEND_B0+1SEND_B1 ."})
    message = str(info.value)
    assert "message 0 from rank 0 to rank 1 is 0SEND_F0 but is received by 1RECV_F1" in message
    assert "the wrong tensor would arrive" in message


def test_rejects_ranks_that_wait_for_their_sends_before_posting_the_peers_receive():
    """'.' waits for the rank's sends (a flushed step's end): each rank waits for a send whose receive
    the other posts only after its own wait."""
    with pytest.raises(ScheduleError, match="deadlock: waiting for its sends to be received forever"):
        play({0: "0F0 0SEND_F0 0F1 0SEND_F1 . 0RECV_B0 0RECV_B1 0B0 0B1",
              1: "1RECV_F0 1F0 1B0 1SEND_B0 . 1RECV_F1 1F1 1B1 1SEND_B1"})


def test_rejects_a_forward_before_the_previous_stage_on_the_same_rank():
    with pytest.raises(ScheduleError, match=r"rank 0, step 0: 1F0 runs before stage 0 forwarded microbatch 0"):
        check_program(parse_program({0: "1F0 0F0 0B0 1B0"}), lambda s: 0, 2)


def test_rejects_forward_without_its_receive():
    with pytest.raises(ScheduleError, match=r"rank 1, step 0: 1F0 runs without receiving its input") as info:
        play({0: "0F0 0SEND_F0 0RECV_B0 0B0 .", 1: "1F0 1RECV_F0 1B0 1SEND_B0 ."})
    assert_has_table(str(info.value), error_step=0)


def test_rejects_backward_without_its_receive():
    with pytest.raises(ScheduleError, match=r"rank 0, step 3: 0B0 runs without receiving its output gradient"):
        play({0: "0F0 0F1 0SEND_F0+0SEND_F1+0RECV_B1 0B0 0B1 .",
              1: "1RECV_F0+1RECV_F1 1F0 1F1 1B0 1B1 1SEND_B0+1SEND_B1 ."})


def test_rejects_a_send_posted_before_its_compute():
    with pytest.raises(ScheduleError, match=r"rank 1, step 2: 1SEND_B0 is posted before stage 1 computed it"):
        play({0: "0F0 0SEND_F0 0RECV_B0 0B0 .", 1: "1RECV_F0 1F0 1SEND_B0 1B0 ."})


def test_rejects_unpaired_sends():
    with pytest.raises(ScheduleError, match=r"sends and receives do not pair up: \['\(0, 1\): 2 sends, 1 receives'\]"):
        play({0: "0F0 0SEND_F0 0RECV_B0 0B0 0SEND_F0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"})


# --- collectives on other communicators, and the host's waits -----------------------------------


def test_rejects_a_collective_posted_with_a_send_pending_that_the_peer_receives_only_after_its_own():
    """Rank 0 all-reduces its statistics on the default group with its activation still unreceived;
    rank 1 posts that receive only after its own all-reduce. Under NCCL rank 0's collective kernel may
    wait behind its send's, which waits for rank 1, whose collective waits for rank 0."""
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0, step 2: all_reduce@world is posted with 0SEND_F0 to rank 1 pending, whose receive rank 1 "
            "posts only after its own all_reduce@world: under NCCL the collective's kernel may wait behind the "
            "message's, which waits for rank 1, whose kernel waits in the collective for rank 0: a potential "
            "deadlock")) as info:
        play({0: "0F0 0SEND_F0 AR@world 0RECV_B0 0B0 .", 1: "AR@world 1RECV_F0 1F0 1B0 1SEND_B0 ."})
    assert_has_table(str(info.value), error_step=2)


def test_rejects_a_collective_posted_with_a_receive_pending_that_the_peer_sends_only_after_its_own():
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 1, step 1: all_reduce@dp is posted with 1RECV_F0 from rank 0 pending, whose send rank 0 posts "
            "only after its own all_reduce@dp")):
        play({0: "AR@dp 0F0 0SEND_F0 0RECV_B0 0B0 .", 1: "1RECV_F0 AR@dp 1F0 1B0 1SEND_B0 ."})


def test_a_collective_both_ranks_post_on_the_same_side_of_their_messages_runs():
    """The same messages and all-reduce, both ends of each message before the collective (or after)."""
    play({0: "0F0 0SEND_F0 AR@world 0RECV_B0 0B0 .", 1: "1RECV_F0 AR@world 1F0 1B0 1SEND_B0 ."})
    play({0: "AR@world 0F0 0SEND_F0 0RECV_B0 0B0 wait@world .", 1: "AR@world wait@world 1RECV_F0 1F0 1B0 1SEND_B0 ."})


def test_a_host_wait_blocks_until_what_it_waits_for_has_completed():
    """Rank 0 reads its all-reduce's result (a host wait) before sending the activation that rank 1
    needs before it reaches its own all-reduce: neither ever moves on."""
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0, step 1: deadlock: wait@world waits forever for world collective 0, which rank 1 has not "
            "posted")):
        play({0: "AR@world wait@world 0F0 0SEND_F0 0RECV_B0 0B0 .", 1: "1RECV_F0 1F0 AR@world 1B0 1SEND_B0 ."})
    # Rank 1 waits for everything it posted, its receive too, before its all-reduce (a device synchronize).
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0, step 2: deadlock: wait@world waits forever for world collective 0, which rank 1 has not posted; "
            "unfinished batches: rank 1: 1RECV_F0 (started)")):
        play({0: "0F0 AR@world wait@world 0SEND_F0 0RECV_B0 0B0 .", 1: "1RECV_F0 wait@all AR@world 1F0 1B0 1SEND_B0 ."})


def test_rejects_collectives_that_do_not_pair_up():
    with pytest.raises(ScheduleError, match=re.escape("collectives do not pair up: ['world: rank 0 posts 2, rank 1 "
                                                      "posts 1']")):
        play({0: "AR@world 0F0 0SEND_F0 0RECV_B0 0B0 . AR@world", 1: "AR@world 1RECV_F0 1F0 1B0 1SEND_B0 ."})


@pytest.mark.parametrize("name", sorted(n for n, spec in SCHEDULES.items() if spec.synchronous))
def test_a_synchronous_schedules_steps_with_their_collectives_run(name):
    """Each rank of a synchronous schedule, step after step as train_step runs it: the flushed step (its
    sends waited for), clipping's all-reduce over the pipeline read on the host, the statistics
    all-reduce on the default group, and the previous step's statistics read at the next step's end."""
    spec = SCHEDULES[name]
    for _, pp_size, m in [g for g in GRID if g[0] == name]:
        to_rank = spec.stage_ranks(pp_size).__getitem__
        ranks = frozenset(range(pp_size))
        step = plan_program(spec.make_actions(pp_size, m), to_rank, spec.n_stages(pp_size))
        program = {r: [] for r in step}
        for k in range(3):
            for r, ops in step.items():
                program[r] += [*ops, None, Collective("pp", ranks), HostWait("pp"), Collective("world", ranks)]
                program[r] += [HostWait("world")] if k else []
        check_program(program, to_rank, spec.n_stages(pp_size))


ASYNC_GRID = [(name, pp_size, m) for name, pp_size, m in GRID if not SCHEDULES[name].synchronous and pp_size in (2, 4, 8)]


@pytest.mark.parametrize("name", sorted({name for name, _, _ in ASYNC_GRID}))
@pytest.mark.parametrize("sync_steps", [0, 2])
def test_an_asynchronous_schedules_statistics_all_reduce_crosses_none_of_its_messages(name, sync_steps):
    """The statistics all-reduce at the end of each segment, the previous step's read at the next:
    every message between two ranks is posted on the same side of it at both ends (pp 2, 4, 8, every
    m the schedule accepts, with and without a sync start). Before the planner posted a receive in
    its send's segment (comm_plan.CommPlanner._emit), WPipe crossed at every size (rank 1 posted the
    all-reduce with 3SEND_B0 to rank 0 pending, which rank 0 received only in its next segment) and
    PipeDream-2BW at pp 8 with 3 <= m <= 6."""
    from hf_asyncpp.schedules.async_order import SegmentPrograms

    spec, steps = get_schedule_spec(name).starting_synchronously(sync_steps), 4
    for _, pp_size, m in [g for g in ASYNC_GRID if g[0] == name]:
        ranks, to_rank = frozenset(range(pp_size)), spec.stage_ranks(pp_size).__getitem__
        segments = SegmentPrograms(spec.order, pp_size, m, steps, to_rank, spec.n_stages(pp_size), 0, None)
        program = {r: [] for r in range(pp_size)}
        for k in range(steps):
            for r in range(pp_size):
                program[r] += [*segments.program(r, k), Collective("world", ranks)] + ([HostWait("world")] if k else [])
        check_program(program, to_rank, spec.n_stages(pp_size))


def _programs_with_statistics(spec, pp_size, m, steps, clip_globally, carried=True):
    """Each rank's programs as train_step runs them: its segment, the host's read of the previous
    step's statistics with one update's norm where `statistics_read` puts it (or, in a step without a
    norm read, at its end), then the step's statistics all-reduce on the default group; `carried`
    False: every step reads them at its end instead (as before issue 38)."""
    from hf_asyncpp.schedules.async_order import SegmentPrograms
    from hf_asyncpp.update.held import GlobalClipping, norm_reads, statistics_read

    ranks, to_rank = frozenset(range(pp_size)), spec.stage_ranks(pp_size).__getitem__
    segments = SegmentPrograms(spec.order, pp_size, m, steps, to_rank, spec.n_stages(pp_size), 0, None)
    clipping = GlobalClipping(spec.order, pp_size, m)
    program, carried_at = {r: [] for r in range(pp_size)}, {r: [] for r in range(pp_size)}
    for r in range(pp_size):
        held = {}
        for k in range(steps):
            segment = segments.program(r, k)
            at = statistics_read(norm_reads(segment, clipping if clip_globally else None, held), clip_globally)
            at = at if carried and k else None
            carried_at[r].append(at)
            program[r] += [e for entry in segment for e in ([HostWait("world")] if entry == at else []) + [entry]]
            program[r] += ([HostWait("world")] if k and at is None else []) + [Collective("world", ranks)]
            if k == steps - 1:
                held.clear()  # the drain settles its held updates
        program[r].append(None)
    return program, to_rank, clipping if clip_globally else None, carried_at


@pytest.mark.parametrize("name", sorted({name for name, _, _ in ASYNC_GRID}))
@pytest.mark.parametrize("sync_steps", [0, 2])
@pytest.mark.parametrize("clip_globally", [True, False])
def test_the_previous_steps_statistics_read_with_an_updates_norm_cannot_deadlock(name, sync_steps, clip_globally):
    """The host read of a steady step (update/held.statistics_read): an update's norm and, in the same
    transfer, the previous step's statistics, which waits for every rank's all-reduce of them. Played
    where it happens, with the all-reduce between segments and the updates held for the global norm (or
    applied at once), at pp 2, 4, 8 and every m the schedule accepts: no deadlock, no crossing, and in
    every steady step (not the first, the switch from a sync start, nor the drain) each rank reads them
    with a norm, not on their own."""
    spec, steps = get_schedule_spec(name).starting_synchronously(sync_steps), 5
    for _, pp_size, m in [g for g in ASYNC_GRID if g[0] == name]:
        if clip_globally:
            try:
                spec.check_microbatches(pp_size, m, clip_globally=True)
            except ValueError:  # refused by the config check (WPipe would wait for its own rank's norm)
                continue
        program, to_rank, clipping, carried_at = _programs_with_statistics(spec, pp_size, m, steps, clip_globally)
        check_program(program, to_rank, spec.n_stages(pp_size), clipping=clipping)
        steady = [k for k in range(1, steps - 1) if k != sync_steps]  # the switch fills the pipeline anew
        assert all(carried_at[r][k] is not None for r in carried_at for k in steady), (pp_size, m, carried_at)


@pytest.mark.parametrize("name, pp_size, m, clip_globally", [
    ("pipedream-2bw", 4, 8, True), ("pipedream-2bw", 4, 8, False), ("pipedream-2bw", 8, 16, True),
    ("pipedream", 4, 8, True), ("pipedream", 4, 8, False), ("wpipe", 4, 8, False)])
def test_reading_the_statistics_with_a_norm_makes_no_rank_wait_in_the_timing_model(name, pp_size, m, clip_globally):
    """The read waits for every rank to have ended the previous step; where it is placed, they have. (The
    first norm read of a PipeDream step applied at once would cost 3 of 24 time units at pp 4, m 8;
    the last costs nothing.)"""
    spec = get_schedule_spec(name)
    finish = {}
    for carried in (True, False):
        program, to_rank, clipping, _ = _programs_with_statistics(spec, pp_size, m, 5, clip_globally, carried)
        finish[carried] = check_program(program, to_rank, spec.n_stages(pp_size), clipping=clipping, cost=_cost).finish
    assert finish[True] == finish[False]


# --- clipping by the global norm (update/held.GlobalClipping) -----------------------------------


def test_under_global_clipping_a_forward_awaits_the_update_its_version_needs_and_an_update_its_predecessor():
    """2BW's minibatch k runs on x(k − 1), the weights after unit k − 2's update; PipeDream's
    microbatch j on stage s of 4 on x(j − (3 − s)); an update waits for the stage's previous one."""
    from torch.distributed.pipelining.schedules import FORWARD, REDUCE_GRAD, _Action

    from hf_asyncpp.schedules.pipedream import PIPEDREAM, PIPEDREAM_2BW
    from hf_asyncpp.update.held import GlobalClipping

    two_bw = GlobalClipping(PIPEDREAM_2BW, 2, 4)
    assert [two_bw.unit_awaited(_Action(1, FORWARD, j)) for j in range(0, 16, 4)] == [None, None, 0, 1]
    assert [two_bw.unit_awaited(_Action(0, REDUCE_GRAD, j)) for j in (3, 7, 11)] == [None, 0, 1]
    assert two_bw.unit_posted(_Action(0, REDUCE_GRAD, 11)) == 2
    pipedream = GlobalClipping(PIPEDREAM, 4, 4)
    assert [pipedream.unit_awaited(_Action(s, FORWARD, 5)) for s in range(4)] == [1, 2, 3, 4]
    assert pipedream.unit_awaited(_Action(3, FORWARD, 0)) is None


@pytest.mark.parametrize("schedule, pp_size, n_microbatches, sync_steps",
                         [("pipedream-2bw", 2, 4, 0), ("pipedream-2bw", 4, 4, 0), ("pipedream-2bw", 8, 8, 0),
                          ("pipedream-2bw", 4, 2, 0), ("pipedream-2bw", 2, 4, 2), ("pipedream", 4, 4, 0),
                          ("pipedream", 2, 2, 2)])
def test_one_stage_per_rank_orders_clip_globally_without_deadlock(schedule, pp_size, n_microbatches, sync_steps):
    """Played under NCCL's rules with every held update waiting for all stages' norms."""
    spec = get_schedule_spec(schedule).starting_synchronously(sync_steps)
    spec.actions(pp_size, n_microbatches, clip_globally=True)


def test_wpipe_cannot_clip_globally_its_second_group_would_wait_for_its_own_rank():
    """WPipe's second group (delay 0) needs unit k's update before its first forward of k + 1, which
    on rank 0 comes before rank 0's own first-group backward of k: the norm it waits for is its own."""
    with pytest.raises(ScheduleError, match="rank 0, step 19: deadlock: 2F2 waits forever for the global gradient "
                                            "norm of update unit 0, which stage 0 has not posted"):
        get_schedule_spec("wpipe").actions(2, 2, clip_globally=True)
    get_schedule_spec("wpipe").actions(2, 2)  # per-stage clipping: nothing waits


def test_global_norms_are_refused_where_a_rank_would_post_two_per_update():
    """One all-reduce per update and rank: two stages on a rank would pair one stage's norm on one
    rank with the other stage's on the next (here WPipe's synchronous steps, which do not deadlock)."""
    with pytest.raises(ScheduleError, match="it needs one stage per rank"):
        get_schedule_spec("wpipe").starting_synchronously(2).actions(2, 4, clip_globally=True)


# --- the timing model (check_program's `cost`) --------------------------------------------------

F_COST, B_COST = MODEL_COSTS[FORWARD], MODEL_COSTS[FULL_BACKWARD]  # 1 and 2: a backward costs two forwards


def _cost(rank, action):
    return {FORWARD: F_COST, FULL_BACKWARD: B_COST}.get(action.computation_type, 0.0)


def _steady_step(spec, pp_size, m, clip_globally=False):
    """A step's time once the pipeline is full."""
    return spec.steady_step(pp_size, m, _cost, clip_globally)[0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp_size, m", [(2, 4), (4, 8), (8, 8), (8, 16)])
def test_a_flushed_schedules_programs_take_the_textbook_time(name, pp_size, m):
    """(m + p − 1)(F + B) and nothing more: a compute never waits for a message from the neighbour it
    does not need (a rank posts one batch per peer, so a backward's gradient does not wait for the
    next forward's activation from the other side)."""
    timeline = get_schedule_spec(name).timeline(pp_size, m, 1, _cost)
    assert timeline.makespan == (m + pp_size - 1) * (F_COST + B_COST)
    assert set(timeline.busy.values()) == {m * (F_COST + B_COST)}


@pytest.mark.parametrize("name", ["pipedream-2bw", "pipedream"])
@pytest.mark.parametrize("pp_size, m", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_an_asynchronous_schedule_runs_without_a_bubble_once_the_pipeline_is_full(name, pp_size, m):
    assert _steady_step(get_schedule_spec(name), pp_size, m) == m * (F_COST + B_COST)


@pytest.mark.parametrize("pp_size, m", [(4, 8)])  # p 8, m 16: 1.25× (benchmarks/schedule_model.py)
def test_pipedream_2bw_needs_a_stream_per_pair_of_ranks_to_run_without_a_bubble(pp_size, m):
    """On one stream for all of a rank's peers (one NCCL group for the whole pipeline), a middle
    rank's batch with one neighbour waits behind a batch with the other: the step grows past its
    limit. The runtime posts each pair's batches on their own group (parallel/mesh.link_groups)."""
    spec = get_schedule_spec("pipedream-2bw")
    assert spec.steady_step(pp_size, m, _cost, streams="pair")[0] == m * (F_COST + B_COST)
    assert spec.steady_step(pp_size, m, _cost, streams="rank")[0] > 1.1 * m * (F_COST + B_COST)


@pytest.mark.parametrize("pp_size, m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_clipping_pipedream_2bw_by_the_global_norm_makes_no_stage_wait(pp_size, m):
    """The one-step delay leaves every held update time for all stages' norms to arrive."""
    spec = get_schedule_spec("pipedream-2bw")
    assert spec.timeline(pp_size, m, 4, _cost, clip_globally=True).finish == spec.timeline(pp_size, m, 4, _cost).finish


def test_clipping_pipedream_by_the_global_norm_waits_for_the_first_stage_at_every_microbatch():
    """PipeDream's later stages need each update right after their own backward (config validation
    warns about this): the steady step grows by more than half."""
    spec = get_schedule_spec("pipedream")
    assert _steady_step(spec, 4, 8, clip_globally=True) > 1.5 * _steady_step(spec, 4, 8)


UPDATE_COST = 0.5  # an optimizer step, in forwards


def _cost_with_updates(rank, action):
    return UPDATE_COST if action.computation_type == REDUCE_GRAD else _cost(rank, action)


@pytest.mark.parametrize("clip_globally", [False, True])
def test_a_synchronous_step_ends_with_each_stages_update_after_its_flush(clip_globally):
    """1F1B's first rank ends the flush last: every step adds its optimizer step once, whether the ranks
    also wait for each other in the global norm's all-reduce or not."""
    pp_size, m = 4, 8
    step, limit = get_schedule_spec("1f1b").steady_step(pp_size, m, _cost_with_updates, clip_globally)
    assert step == (m + pp_size - 1) * (F_COST + B_COST) + UPDATE_COST
    assert limit == m * (F_COST + B_COST) + UPDATE_COST


def test_an_asynchronous_update_overlaps_the_pipeline():
    """PipeDream-2BW's updates run between its microbatches: the step is the busiest rank's compute
    and updates, with no flush to wait for."""
    pp_size, m = 4, 8
    step, limit = get_schedule_spec("pipedream-2bw").steady_step(pp_size, m, _cost_with_updates)
    assert step == limit == m * (F_COST + B_COST) + UPDATE_COST


def test_each_message_takes_the_link_time_on_its_way():
    """p 2, one microbatch: the activation and its gradient each cross the link once."""
    link = 0.25
    timeline = get_schedule_spec("gpipe").timeline(2, 1, 1, _cost, link_s=link)
    assert timeline.makespan == 2 * (F_COST + B_COST) + 2 * link


def test_messages_move_as_nccl_moves_them_or_as_gloo_buffers_them():
    """ZBV sends both ways between the same ranks. On NCCL a pair's batch completes once both ranks have
    reached it and its message has taken its time, and the pair's next batch waits for it; gloo buffers
    a send, its message arriving its time after it (the sleeping benchmark's ranks). Slow links cost
    NCCL's pairs more; instant ones cost neither."""
    spec = get_schedule_spec("zbv")

    def cost(rank, action):  # a forward, an input gradient and a weight gradient: 1 each
        return MODEL_COSTS.get(action.computation_type, 0.0)

    def step(link_s: float, transport: str) -> float:
        return spec.steady_step(4, 4, cost, link_s=link_s, transport=transport)[0]

    assert step(0.0, "nccl") == step(0.0, "gloo") == 30  # 24 computing, 6 of ZBV's ramp at m = p
    assert step(1.0, "nccl") > step(1.0, "gloo") > step(0.0, "gloo")
    with pytest.raises(ValueError, match="transport"):
        spec.steady_step(4, 4, cost, transport="mpi")
