"""comm_plan.py: the programs the runtime executes, planned by playing all ranks' orders together.

What `validate.check_program` plays (tests/schedules/test_validate.py) must be what each rank runs:
a rank that plans only its own program gets the same one, step by step, after an early stop and
after a resume; and the planner refuses orders that would need a chunk buffer still in use.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import RECV_F, REDUCE_GRAD, SEND_B, SEND_F, _Action

from hf_asyncpp.schedules import SCHEDULES, ScheduleError
from hf_asyncpp.schedules.async_order import SegmentPrograms, replay_after
from hf_asyncpp.schedules.async_runtime import SENDS_KEPT_FOR_STEPS
from hf_asyncpp.schedules.comm_plan import CommPlanner, P2PBatch, PlanError, plan_program
from hf_asyncpp.schedules.actions import one_f_one_b_actions
from tests.schedules.test_validate import supported_grid

ASYNC = sorted(name for name, spec in SCHEDULES.items() if not spec.synchronous)


def stage_to_rank(spec, pp_size):
    return spec.stage_ranks(pp_size).__getitem__


def programs(spec, pp_size, m, n_steps, keep=None, **kwargs):
    plan = SegmentPrograms(spec.order, pp_size, m, n_steps, stage_to_rank(spec, pp_size), spec.n_stages(pp_size),
                           keep=keep, **kwargs)
    return plan, {r: [plan.program(r, k) for k in range(kwargs.get("start_step", 0), n_steps)]
                  for r in (keep or range(pp_size))}


@pytest.mark.parametrize("name", ASYNC)
@pytest.mark.parametrize("pp_size", [2, 4])
def test_a_rank_planning_only_its_own_program_gets_the_checked_one(name, pp_size):
    spec, m, steps = SCHEDULES[name], pp_size, 5
    _, every = programs(spec, pp_size, m, steps)
    for rank in range(pp_size):
        assert programs(spec, pp_size, m, steps, keep=[rank])[1][rank] == every[rank]


@pytest.mark.parametrize("name", ["pipedream-2bw", "pipedream"])
def test_an_early_stop_plans_the_remaining_steps_as_a_run_of_that_length(name):
    spec, pp_size, m = SCHEDULES[name], 4, 4
    plan = SegmentPrograms(spec.order, pp_size, m, 8, stage_to_rank(spec, pp_size), spec.n_stages(pp_size), keep=[1])
    first = [plan.program(1, k) for k in range(3)]
    plan.n_steps = 4  # stop after one more (draining) step
    rest = [plan.program(1, 3)]
    assert first + rest == programs(spec, pp_size, m, 4, keep=[1])[1][1]
    # the drain forwards nothing of a next minibatch
    assert all(a.microbatch_index < 4 * m for a in rest[0] if isinstance(a, _Action) and a.microbatch_index is not None)


@pytest.mark.parametrize("name", ["pipedream-2bw", "pipedream"])
def test_a_resumed_run_replays_then_continues_with_the_same_messages(name):
    """After a resume every rank first replays the actions of units still due; the messages of the
    replayed and the following steps are planned from the same replay on every rank, so the plan
    still plays under NCCL's rules."""
    from hf_asyncpp.schedules.validate import check_program

    spec, pp_size, m, steps, resume = SCHEDULES[name], 4, 4, 6, 3
    replay = replay_after(spec.order, pp_size, m, resume - 1, steps)
    _, resumed = programs(spec, pp_size, m, steps, start_step=resume, replay=replay)
    flat = {r: [e for program in resumed[r] for e in program] + [None] for r in resumed}
    check_program(flat, stage_to_rank(spec, pp_size), spec.n_stages(pp_size))
    assert resumed[0][0][0] == replay[0][0]  # the replay comes first


def test_updates_run_after_the_batch_that_sends_the_gradient_on():
    """A stage's update (REDUCE_GRAD) does not hold back the gradient its backward produced."""
    spec, pp_size, m = SCHEDULES["pipedream-2bw"], 2, 2
    _, planned = programs(spec, pp_size, m, 3, keep=[1])
    program = [e for step in planned[1] for e in step]
    for i, entry in enumerate(program):
        if isinstance(entry, _Action) and entry.computation_type == REDUCE_GRAD:
            send = next(e for e in reversed(program[:i]) if isinstance(e, P2PBatch))
            assert _Action(1, SEND_B, entry.microbatch_index) in send.ops


def test_a_receive_into_a_buffer_still_in_use_is_refused():
    """With two chunk buffers per stage, rank 1 of 1F1B-without-flush at pp 4 would receive
    microbatch 2's activation into the buffer microbatch 0 still holds."""
    order = SCHEDULES["pipedream-2bw"].order
    actions = lambda r: ((k, a) for k in range(3) for a in order.segment(r, 4, 4, k, 3))
    planner = CommPlanner(range(4), actions, lambda s: s, 4, n_slots=2)
    with pytest.raises(PlanError, match="needs the chunk buffer of microbatch"):
        for k in range(3):
            planner.program(1, k)


def test_an_order_waiting_for_an_input_that_never_comes_is_refused():
    actions = {0: [_Action.from_str(t) for t in "0F0 0B0 0F1 0B1".split()],
               1: [_Action.from_str(t) for t in "1F0 1F1 1B0 1B1".split()]}
    with pytest.raises(PlanError, match="every rank waits for an input that never comes"):
        plan_program(actions, lambda s: s, 2)


def test_every_message_is_planned_once_on_each_side():
    program = plan_program(one_f_one_b_actions(4, 6), lambda s: s, 4)
    ops = [op for ops in program.values() for e in ops if isinstance(e, P2PBatch) for op in e.ops]
    assert len(ops) == len(set(ops)) == 4 * 3 * 6  # 3 boundaries × 6 microbatches × (F, B) × (send, receive)


def _steps_from_send_to_receive(per_step: dict[int, list]) -> list[int]:
    """For every message of these per-rank, per-step programs: the step its receive is posted in
    minus the step its send is posted in (ops name the posting stage: F goes s → s + 1, B s → s − 1)."""
    sent, received = {}, {}
    for steps in per_step.values():
        for k, program in enumerate(steps):
            for op in (op for e in program if isinstance(e, P2PBatch) for op in e.ops):
                kind, s, j = op.computation_type, op.stage_index, op.microbatch_index
                if kind in (SEND_F, SEND_B):
                    sent[(kind == SEND_F, s + 1 if kind == SEND_F else s - 1, j)] = k
                else:
                    received[(kind == RECV_F, s, j)] = k
    assert sent.keys() == received.keys()
    return [received[key] - sent[key] for key in sent]


@pytest.mark.parametrize("name", ASYNC)
def test_every_receive_is_posted_before_the_runtime_waits_for_its_send(name):
    """The runtime waits, at the end of step k, for the sends of steps ≤ k − SENDS_KEPT_FOR_STEPS
    (gloo frees a send only once waited for). That cannot stall a peer if each receive is posted
    less than SENDS_KEPT_FOR_STEPS steps after its send: checked over pp 2…8 and every m up to 2·pp
    the schedule accepts, from the start and after a resume's replay."""
    spec, steps = SCHEDULES[name], 6
    lags = []
    for _, pp_size, m in supported_grid([name]):
        lags += _steps_from_send_to_receive(programs(spec, pp_size, m, steps)[1])
        try:
            replay = replay_after(spec.order, pp_size, m, 2, steps)
        except ScheduleError:  # WPipe cannot resume mid-run
            continue
        lags += _steps_from_send_to_receive(programs(spec, pp_size, m, steps, start_step=3, replay=replay)[1])
    assert min(lags) == 0 and max(lags) < SENDS_KEPT_FOR_STEPS, (min(lags), max(lags))
    # Stronger: both ends post every message in the same step, so nothing posted between two steps
    # (the statistics all-reduce) crosses a message (test_validate.py plays it).
    assert set(lags) == {0}, sorted(set(lags))
