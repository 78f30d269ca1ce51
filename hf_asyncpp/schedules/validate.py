"""One-process checks of a schedule's action lists, run before any process group exists.

`check_schedule` lowers the compute lists with torch's own pass (`_add_send_recv`, the one the
runtime uses) and then plays all ranks against each other:
  - torch's `_validate_schedule`: each microbatch forwarded and backwarded once per stage, F before B,
    I before W, every stage on one rank;
  - every send has its receive and every receive its send (same stage, microbatch, direction);
  - data dependencies: stage s forwards microbatch i only after stage s−1 did, and backwards it
    only after stage s+1 did (through a receive, or earlier on the same rank);
  - no deadlock: receives block until the matching send has run; the play must finish
    (torch's lowering already refuses most orders that would hang; both are reported the same way);
  - stage and microbatch indices in range, and no compute op run twice.
Any failure raises `ScheduleError` with the rank × time table, the offending step marked.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    _Action,
    _add_send_recv,
    _format_pipeline_order,
    _validate_schedule,
)

from .actions import ComputeActions

__all__ = ["ScheduleError", "check_schedule", "lower_in_order", "lower_with_comms"]

_BACKWARDS = (FULL_BACKWARD, BACKWARD_INPUT)


class ScheduleError(AssertionError):
    pass


def lower_with_comms(actions: ComputeActions, stage_to_rank: Callable[[int], int], n_stages: int):
    compute_only = {r: [a for a in ops if a is not None] for r, ops in actions.items()}
    return _add_send_recv(compute_only, stage_to_rank=stage_to_rank, num_stages=n_stages)


def lower_in_order(ops: list[_Action], stage_to_rank: Callable[[int], int], n_stages: int,
                   sends: bool = True) -> list[_Action]:
    """One rank's compute actions with a receive just before the compute that needs it and (with
    `sends`) a send just after the compute that produces it: the order the asynchronous runtime
    executes (it issues the sends itself, right after the compute, and never blocks on them)."""
    lowered = []
    for a in ops:
        s, kind, mb = a.stage_index, a.computation_type, a.microbatch_index
        rank = stage_to_rank(s)
        if kind == FORWARD:
            if s > 0 and stage_to_rank(s - 1) != rank:
                lowered.append(_Action(s, RECV_F, mb))
            lowered.append(a)
            if sends and s < n_stages - 1 and stage_to_rank(s + 1) != rank:
                lowered.append(_Action(s, SEND_F, mb))
        else:
            if s < n_stages - 1 and stage_to_rank(s + 1) != rank:
                lowered.append(_Action(s, RECV_B, mb))
            lowered.append(a)
            if sends and s > 0 and stage_to_rank(s - 1) != rank:
                lowered.append(_Action(s, SEND_B, mb))
    return lowered



def _fail(message: str, lowered, rank: int, step: int):
    table = _format_pipeline_order(lowered, error_step_number=step)
    raise ScheduleError(f"rank {rank}, step {step}: {message}\n\n{table}")


def _check_indices_and_repeats(actions: ComputeActions, n_stages: int, n_microbatches: int) -> None:
    """What torch's count-based check lets through: indices out of range, an op run twice."""
    seen: set[tuple] = set()
    for rank, ops in actions.items():
        for step, action in enumerate(ops):
            if action is None:
                continue
            for op in action.sub_actions or (action,):
                key = (op.stage_index, op.computation_type, op.microbatch_index)
                if not 0 <= op.stage_index < n_stages:
                    _fail(f"{op} names stage {op.stage_index}, outside 0..{n_stages - 1}", actions, rank, step)
                if op.microbatch_index is not None and not 0 <= op.microbatch_index < n_microbatches:
                    _fail(f"{op} names microbatch {op.microbatch_index}, outside 0..{n_microbatches - 1}",
                          actions, rank, step)
                if key in seen:
                    _fail(f"{op} runs twice", actions, rank, step)
                seen.add(key)


def check_schedule(actions: ComputeActions, pp_size: int, n_stages: int, n_microbatches: int,
                   lower: Callable | None = None) -> dict:
    """Validate and simulate; returns the lowered per-rank lists (compute + comms).

    `lower(ops, stage_to_rank, n_stages)` lowers one rank's list; default: torch's pass over all ranks.
    A lowered list may hold None: there the rank waits until every send it issued was received (the
    end of a runtime call, where torch waits for its sends)."""
    _check_indices_and_repeats(actions, n_stages, n_microbatches)
    try:
        stage_to_rank = _validate_schedule(actions, pp_size, n_stages, n_microbatches)
    except AssertionError as err:
        raise ScheduleError(str(err)) from None
    try:
        if lower is None:
            lowered = lower_with_comms(actions, stage_to_rank.__getitem__, n_stages)
        else:
            lowered = {r: lower(ops, stage_to_rank.__getitem__, n_stages) for r, ops in actions.items()}
    except AssertionError as err:  # torch's lowering gives up on orders that would hang
        raise ScheduleError(f"{err}: an order that would hang\n\n{_format_pipeline_order(actions)}") from None

    sent: set[tuple] = set()  # (kind, stage, mb) messages in flight
    received: set[tuple] = set()
    done_forward: set[tuple[int, int]] = set()  # (stage, mb) forwarded, on any rank
    done_backward: set[tuple[int, int]] = set()
    position = {r: 0 for r in lowered}
    sent_by: dict[int, set[tuple]] = {r: set() for r in lowered}

    def ready(rank: int, action: _Action | None) -> bool:
        if action is None:
            return sent_by[rank] <= received
        s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind == RECV_F:
            return ("F", s - 1, mb) in sent
        if kind == RECV_B:
            return ("B", s + 1, mb) in sent
        return True

    def run(rank: int, step: int, action: _Action | None) -> None:
        if action is None:
            return
        s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind in (SEND_F, SEND_B):
            message = ("F" if kind == SEND_F else "B", s, mb)
            sent.add(message)
            sent_by[rank].add(message)
        elif kind == RECV_F:
            received.add(("F", s - 1, mb))
        elif kind == RECV_B:
            received.add(("B", s + 1, mb))
        elif kind == FORWARD:
            if s > 0 and (s - 1, mb) not in done_forward:
                _fail(f"{action} runs before stage {s - 1} forwarded microbatch {mb}", lowered, rank, step)
            if s > 0 and stage_to_rank[s - 1] != rank and ("F", s - 1, mb) not in received:
                _fail(f"{action} runs without receiving its input", lowered, rank, step)
            done_forward.add((s, mb))
        elif kind in _BACKWARDS:
            if s < n_stages - 1 and (s + 1, mb) not in done_backward:
                _fail(f"{action} runs before stage {s + 1} sent its gradient", lowered, rank, step)
            if s < n_stages - 1 and stage_to_rank[s + 1] != rank and ("B", s + 1, mb) not in received:
                _fail(f"{action} runs without receiving its output gradient", lowered, rank, step)
            done_backward.add((s, mb))

    progress = True
    while progress:
        progress = False
        for rank, ops in lowered.items():
            while position[rank] < len(ops) and ready(rank, ops[position[rank]]):
                run(rank, position[rank], ops[position[rank]])
                position[rank] += 1
                progress = True
    stuck = {r: p for r, p in position.items() if p < len(lowered[r])}
    if stuck:
        rank, step = next(iter(stuck.items()))
        waiting = lowered[rank][step]
        what = "the end of a step, for its sends to be received," if waiting is None else waiting
        _fail(f"deadlock: {what} waits forever", lowered, rank, step)
    if sent != received:
        orphan = sorted(map(str, sent ^ received))
        raise ScheduleError(f"sends and receives do not pair up: {orphan}")
    return lowered
