"""One-process checks of a schedule, run before any process group exists.

`check_schedule` validates the compute lists, plans their communication (comm_plan.py, the plan the
runtime executes) and plays every rank's program against the others under NCCL's rules
(`check_program`):
  - torch's `_validate_schedule`: each microbatch forwarded and backwarded once per stage, F before B,
    I before W, every stage on one rank; stage and microbatch indices in range, no compute run twice;
  - matching by posting order, not by tag: for each ordered pair of ranks, the k-th send is matched
    to the k-th receive, and both must carry the same message (kind, stage, microbatch) — under NCCL
    a mismatch is no error but a wrong tensor;
  - streams: NCCL runs the batches posted on one communicator in posting order on one stream.
    `streams="pair"`: one stream per pair of ranks, as the runtime posts each pair's batches on a
    group of its own (parallel/mesh.link_groups); `"rank"`: one stream for all of a rank's peers, as
    one group for the whole pipeline would give. A batch starts when it is at the head of each of
    its streams, and its operations progress together;
  - rendezvous: a send completes only together with its receive, once both have started; a compute
    waits for the batch holding its receive, a `None` entry for every send its rank posted;
  - data dependencies: a send only after the compute that produces it; stage s forwards microbatch i
    only after stage s−1 did, backwards it only after stage s+1 did;
  - global clipping (`clipping`, update/held.GlobalClipping): a forward on a new version, or a
    stage's next update, waits until every stage has posted the gradient norm of the update unit
    it needs; the norms are all-reduced on a group of their own, one per update, so every rank must
    post them for the same units in the same order (one stage per rank);
  - collectives on other communicators (`Collective`: the statistics all-reduce on the default group,
    a dp gather) do not block the host and complete once each of their ranks has posted them; the
    k-th ones on a group meet. A collective must not cross a message: if, between two of its ranks,
    a message is posted before the collective on one end and after it on the other, the first end
    has it pending while its collective waits for the second, whose end of the message waits behind
    its own collective. NCCL's kernels wait on the device for their peers, and a kernel of one
    communicator may not start while another's waits (NCCL guarantees no concurrency between
    communicators): a potential deadlock, reported at the collective of the rank with the message
    pending. (NCCL setting a communicator up there would wait for certain; mesh.start_communicators
    sets every one up before the first step.)
  - host-blocking points (`HostWait`: a wait on a collective, a host read of its result, a device
    synchronize) block the rank's program until what they wait for has completed;
  - the play must finish: otherwise a deadlock, with what each stuck rank waits for.
Any failure raises `ScheduleError` with the rank × time table, the offending step marked.

The play (play.py: a `_Play` whose methods are the rules) is also a timing model: the `Timeline` it
returns holds when each rank finished and how long it computed, so the wait a rule adds (global clipping,
say) is the difference between two plays of the same programs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..torch_internals import (
    _Action,
    _format_pipeline_order,
    _validate_schedule,
)

from .actions import ComputeActions
from .comm_plan import PlanError, Program, plan_program
from .errors import ScheduleError
from .play import Timeline, fail, play

if TYPE_CHECKING:
    from ..update.held import GlobalClipping

__all__ = ["check_program", "check_schedule"]

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
                    fail(f"{op} names stage {op.stage_index}, outside 0..{n_stages - 1}", actions, rank, step)
                if op.microbatch_index is not None and not 0 <= op.microbatch_index < n_microbatches:
                    fail(f"{op} names microbatch {op.microbatch_index}, outside 0..{n_microbatches - 1}",
                          actions, rank, step)
                if key in seen:
                    fail(f"{op} runs twice", actions, rank, step)
                seen.add(key)


def check_schedule(actions: ComputeActions, pp_size: int, n_stages: int, n_microbatches: int,
                   plan: Callable[[Callable[[int], int]], Program] | None = None, streams: str = "pair",
                   clipping: "GlobalClipping | None" = None) -> Program:
    """Validate, plan and play; returns the per-rank programs.

    `plan(stage_to_rank)` gives the programs to play; default: one flushed step of `actions`
    (comm_plan.plan_program), each rank waiting for its sends at the end, as the runtime does.
    `clipping`: the programs' updates wait for global gradient norms (see check_program)."""
    _check_indices_and_repeats(actions, n_stages, n_microbatches)
    try:
        stage_to_rank = _validate_schedule(actions, pp_size, n_stages, n_microbatches)
    except AssertionError as err:
        raise ScheduleError(str(err)) from None
    try:
        if plan is None:
            program = {r: ops + [None] for r, ops in plan_program(actions, stage_to_rank.__getitem__, n_stages).items()}
        else:
            program = plan(stage_to_rank.__getitem__)
    except PlanError as err:
        raise ScheduleError(f"{err}\n\n{_format_pipeline_order(actions)}") from None
    check_program(program, stage_to_rank.__getitem__, n_stages, streams, clipping)
    return program


def check_program(program: Program, stage_to_rank: Callable[[int], int], n_stages: int, streams: str = "pair",
                  clipping: "GlobalClipping | None" = None,
                  cost: Callable[[int, _Action], float] | None = None, link_s: float = 0.0,
                  transport: str = "nccl") -> Timeline:
    """Play every rank's program under NCCL's rules (see the module docstring; play.py plays them); raise
    ScheduleError. `cost(rank, action)`: the seconds a compute or local action takes (default: none);
    `link_s`: the seconds a message takes to arrive (default: none); `transport`: "nccl" (the rules) or
    "gloo" (buffered sends: a timing of the CPU ranks, play.py's docstring)."""
    if transport not in ("nccl", "gloo"):
        raise ValueError(f"transport must be 'nccl' or 'gloo', got {transport!r}")
    if streams not in ("pair", "rank"):
        raise ValueError(f"streams must be 'pair' or 'rank', got {streams!r}")
    return play(program, stage_to_rank, n_stages, streams, clipping, cost, link_s, transport)
