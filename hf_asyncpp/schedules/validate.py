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

The play is also a timing model (`cost`: seconds per compute or local action; messages and the norm
all-reduce take none): each rank runs its program in order, an action starts when its rank is free
and its inputs are there (a receive's batch complete, the global norm it waits for posted by every
stage), and a batch completes when its rank and its peers have reached it. The `Timeline` it returns
holds when each rank finished and how long it computed, so the wait a rule adds (global clipping, say)
is the difference between two plays of the same programs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..torch_internals import (
    BACKWARD_INPUT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    _Action,
    _format_pipeline_order,
    _validate_schedule,
)

from .actions import ComputeActions
from .errors import ScheduleError
from .comm_plan import Collective, HostWait, P2PBatch, PlanError, Program, is_compute, matching_receive, peer_of, plan_program

if TYPE_CHECKING:
    from ..update.held import GlobalClipping

__all__ = ["Timeline", "check_program", "check_schedule"]

_BACKWARDS = (FULL_BACKWARD, BACKWARD_INPUT)


@dataclass
class Timeline:
    """A timed play (check_program's `cost`): per rank, when its program ended and how long it computed."""
    finish: dict[int, float]
    busy: dict[int, float]

    @property
    def makespan(self) -> float:
        return max(self.finish.values())


def _fail(message: str, table, rank: int, step: int):
    raise ScheduleError(f"rank {rank}, step {step}: {message}\n\n{_format_pipeline_order(table, error_step_number=step)}")


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


class _Batch:
    def __init__(self, rank: int, batch: P2PBatch, streams: set, posted_at: float):
        self.rank, self.batch, self.streams = rank, batch, streams
        self.done = [False] * len(batch.ops)
        self.channel_index: list[tuple[tuple[int, int], int, bool]] = []  # per op: (sender, receiver), k, is send
        self.complete = False
        # Timing: it can start once posted and at the head of its streams; it completes with its last pair.
        self.start_at, self.completed_at = posted_at, posted_at


def check_program(program: Program, stage_to_rank: Callable[[int], int], n_stages: int, streams: str = "pair",
                  clipping: "GlobalClipping | None" = None,
                  cost: Callable[[int, _Action], float] | None = None) -> Timeline:
    """Play every rank's program under NCCL's rules (see the module docstring); raise ScheduleError.
    `cost(rank, action)`: the seconds a compute or local action takes (default: none)."""
    if streams not in ("pair", "rank"):
        raise ValueError(f"streams must be 'pair' or 'rank', got {streams!r}")
    sends: dict[tuple[int, int], list[tuple[_Action, _Batch]]] = {}  # (sender, receiver) → posted sends
    receives: dict[tuple[int, int], list[tuple[_Action, _Batch]]] = {}
    queues: dict[tuple[int, object], deque[_Batch]] = {}  # (rank, stream) → batches not complete, in posting order
    receive_batch: dict[tuple[int, _Action], _Batch] = {}  # a posted receive, until its compute consumes it
    send_batches: dict[int, list[_Batch]] = {r: [] for r in program}
    open_batches: list[_Batch] = []
    done_forward: set[tuple[int, int]] = set()
    done_backward: set[tuple[int, int]] = set()
    position = {r: 0 for r in program}
    norms_posted: dict[int, set[int]] = {}  # global clipping: update unit → stages that posted its norm
    norm_posted_at: dict[int, float] = {}  # update unit → when its last norm was posted
    units_posted: dict[int, list[int]] = {r: [] for r in program}  # per rank, in posting order
    # Collectives: (group, ranks) → rank → [(step, when posted, {peer: (sends to it, receives from it) before})].
    collectives: dict[tuple[str, frozenset], dict[int, list[tuple[int, float, dict]]]] = {}
    collective_done: dict[tuple[tuple[str, frozenset], int], float] = {}  # (group, k) → when it completed
    posted_collectives: dict[int, list[tuple[tuple[str, frozenset], int]]] = {r: [] for r in program}
    batches_of: dict[int, list[_Batch]] = {r: [] for r in program}
    clock = {r: 0.0 for r in program}  # when each rank's next entry can start
    busy = {r: 0.0 for r in program}
    seconds = cost or (lambda rank, action: 0.0)

    def run(rank: int, ready: float, actions) -> float:
        """Run `actions` on `rank` from `ready` (or when the rank is free); returns when they end."""
        spent = sum(seconds(rank, a) for a in actions)
        clock[rank] = max(clock[rank], ready) + spent
        busy[rank] += spent
        return clock[rank]

    def norm_missing(action: _Action) -> tuple[int, list[int]] | None:
        """(the unit, the stages yet to post its norm) when `action` waits for a global norm."""
        unit = clipping.unit_awaited(action) if clipping else None
        missing = [s for s in range(n_stages) if s not in norms_posted.get(unit, ())] if unit is not None else []
        return (unit, missing) if missing else None

    def post(rank: int, step: int, batch: P2PBatch) -> None:
        peers = [peer_of(op, stage_to_rank) for op in batch.ops]
        posted = _Batch(rank, batch, set(peers) if streams == "pair" else {"*"}, clock[rank])
        for op, peer in zip(batch.ops, peers):
            is_send = op.computation_type in (SEND_F, SEND_B)
            produced = done_forward if op.computation_type == SEND_F else done_backward
            if is_send and (op.stage_index, op.microbatch_index) not in produced:
                _fail(f"{op} is posted before stage {op.stage_index} computed it", program, rank, step)
            channel = (rank, peer) if is_send else (peer, rank)
            mine, theirs = (sends, receives) if is_send else (receives, sends)
            k = len(mine.setdefault(channel, []))
            mine[channel].append((op, posted))
            posted.channel_index.append((channel, k, is_send))
            if k < len(theirs.get(channel, [])):
                other = theirs[channel][k][0]
                send, receive = (op, other) if is_send else (other, op)
                if matching_receive(send) != receive:
                    _fail(f"message {k} from rank {channel[0]} to rank {channel[1]} is {send} but is received by "
                          f"{receive}: NCCL matches by posting order, so the wrong tensor would arrive", program, rank, step)
            if not is_send:
                if (rank, op) in receive_batch:
                    _fail(f"{op} posted twice", program, rank, step)
                receive_batch[(rank, op)] = posted
        if any(op.computation_type in (SEND_F, SEND_B) for op in batch.ops):
            send_batches[rank].append(posted)
        for stream in posted.streams:
            queues.setdefault((rank, stream), deque()).append(posted)
        open_batches.append(posted)
        batches_of[rank].append(posted)

    def post_collective(rank: int, step: int, collective: Collective) -> None:
        if rank not in collective.ranks:
            _fail(f"{collective} is posted by rank {rank}, which is not one of its ranks {sorted(collective.ranks)}",
                  program, rank, step)
        group = (collective.group, collective.ranks)
        posts = collectives.setdefault(group, {})
        k = len(posts.setdefault(rank, []))
        before = {q: (len(sends.get((rank, q), [])), len(receives.get((q, rank), []))) for q in collective.ranks}
        posts[rank].append((step, clock[rank], before))
        posted_collectives[rank].append((group, k))
        if all(len(posts.get(q, ())) > k for q in collective.ranks):  # every rank has posted it: it completes
            check_crossings(collective, posts, k)
            collective_done[(group, k)] = max(posts[q][k][1] for q in collective.ranks)

    def check_crossings(collective: Collective, posts, k: int) -> None:
        """A message between two ranks of `collective` posted before it on one end, after it on the other."""
        for r in sorted(collective.ranks):
            step, _, mine = posts[r][k]
            for q in sorted(collective.ranks - {r}):
                theirs = posts[q][k][2][r]
                for sent, received, channel, ops, kind, other in (
                        (mine[q][0], theirs[1], (r, q), sends, "to", "receive"),
                        (mine[q][1], theirs[0], (q, r), receives, "from", "send")):
                    if sent > received:
                        op = ops[channel][received][0]
                        _fail(f"{collective} is posted with {op} {kind} rank {q} pending, whose {other} rank {q} posts only "
                              f"after its own {collective}: under NCCL the collective's kernel may wait behind the "
                              f"message's, which waits for rank {q}, whose kernel waits in the collective for rank "
                              f"{r}: a potential deadlock", program, r, step)

    def awaited_by(rank: int, wait: HostWait) -> tuple[list, list[_Batch]]:
        """What `wait` on `rank` waits for: its collectives not yet complete, its batches not yet complete."""
        pending = [c for c in posted_collectives[rank] if c not in collective_done and wait.group in (None, c[0][0])]
        batches = [b for b in batches_of[rank] if not b.complete] if wait.group is None else []
        return pending, batches

    def needed_receive(action: _Action) -> _Action | None:
        s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind == FORWARD and s > 0 and stage_to_rank(s - 1) != stage_to_rank(s):
            return _Action(s, RECV_F, mb)
        if kind in _BACKWARDS and s < n_stages - 1 and stage_to_rank(s + 1) != stage_to_rank(s):
            return _Action(s, RECV_B, mb)
        return None

    def try_run(rank: int, step: int, entry) -> bool:
        if entry is None:
            if not all(b.complete for b in send_batches[rank]):
                return False
            run(rank, max((b.completed_at for b in send_batches[rank]), default=0.0), ())
            return True
        if isinstance(entry, P2PBatch):
            post(rank, step, entry)
            return True
        if isinstance(entry, Collective):
            post_collective(rank, step, entry)
            return True
        if isinstance(entry, HostWait):
            if any(awaited_by(rank, entry)):
                return False
            done = [collective_done[c] for c in posted_collectives[rank] if entry.group in (None, c[0][0])]
            done += [b.completed_at for b in batches_of[rank]] if entry.group is None else []
            run(rank, max(done, default=0.0), ())
            return True
        if not is_compute(entry) and entry.sub_actions is None:  # local work: (un)shard, an update
            if clipping and entry.computation_type == REDUCE_GRAD:
                if norm_missing(entry):
                    return False
                unit = clipping.unit_posted(entry)
                awaited = clipping.unit_awaited(entry)
                ended = run(rank, norm_posted_at.get(awaited, 0.0), (entry,))
                norms_posted.setdefault(unit, set()).add(entry.stage_index)
                norm_posted_at[unit] = max(norm_posted_at.get(unit, 0.0), ended)
                units_posted[rank].append(unit)
            else:
                run(rank, 0.0, (entry,))
            return True
        ready = 0.0
        for action in entry.sub_actions or (entry,):
            if norm_missing(action):
                return False
            awaited = clipping.unit_awaited(action) if clipping else None
            ready = max(ready, norm_posted_at.get(awaited, 0.0))
            receive = needed_receive(action)
            if receive is not None:
                batch = receive_batch.get((rank, receive))
                if batch is None:
                    what = "input" if action.computation_type == FORWARD else "output gradient"
                    _fail(f"{action} runs without receiving its {what}", program, rank, step)
                if not batch.complete:
                    return False
                ready = max(ready, batch.completed_at)
        run(rank, ready, entry.sub_actions or (entry,))
        for action in entry.sub_actions or (entry,):
            s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
            receive = needed_receive(action)
            if receive is not None:
                del receive_batch[(rank, receive)]
            if kind == FORWARD:
                if s > 0 and (s - 1, mb) not in done_forward:
                    _fail(f"{action} runs before stage {s - 1} forwarded microbatch {mb}", program, rank, step)
                done_forward.add((s, mb))
            elif kind in _BACKWARDS:
                if s < n_stages - 1 and (s + 1, mb) not in done_backward:
                    _fail(f"{action} runs before stage {s + 1} sent its gradient", program, rank, step)
                done_backward.add((s, mb))
        return True

    def started(batch: _Batch) -> bool:
        return all(queues[(batch.rank, stream)][0] is batch for stream in batch.streams)

    def settle() -> bool:
        """Complete every send/receive pair whose two batches have started; True if anything moved."""
        moved = True
        any_moved = False
        while moved:
            moved = False
            for batch in [b for b in open_batches if not b.complete and started(b)]:
                for i, (channel, k, is_send) in enumerate(batch.channel_index):
                    if batch.done[i]:
                        continue
                    theirs = (receives if is_send else sends).get(channel, [])
                    if k < len(theirs) and started(theirs[k][1]):
                        other = theirs[k][1]
                        batch.done[i] = True
                        other.done[other.channel_index.index((channel, k, not is_send))] = True
                        met_at = max(batch.start_at, other.start_at)
                        batch.completed_at = max(batch.completed_at, met_at)
                        other.completed_at = max(other.completed_at, met_at)
                        moved = True
                if all(batch.done):
                    batch.complete = True
                    for stream in batch.streams:
                        queue = queues[(batch.rank, stream)]
                        queue.popleft()
                        if queue:  # the next batch on this stream can start once this one is done
                            queue[0].start_at = max(queue[0].start_at, batch.completed_at)
                    open_batches.remove(batch)
                    moved = True
            any_moved |= moved
        return any_moved

    progress = True
    while progress:
        progress = False
        for rank, ops in program.items():
            while position[rank] < len(ops) and try_run(rank, position[rank], ops[position[rank]]):
                position[rank] += 1
                progress = True
        progress |= settle()
    stuck = {r: p for r, p in position.items() if p < len(program[r])}
    if stuck:
        rank, step = next(iter(stuck.items()))
        waiting = program[rank][step]
        what = "waiting for its sends to be received forever" if waiting is None else f"{waiting} waits forever"
        if isinstance(waiting, HostWait):
            pending, _ = awaited_by(rank, waiting)
            what += "".join(f" for {group[0]} collective {k}, which rank{'s' * (len(late) > 1)} "
                            f"{', '.join(map(str, late))} {'have' if len(late) > 1 else 'has'} not posted"
                            for group, k in pending
                            for late in [[q for q in sorted(group[1]) if len(collectives[group].get(q, ())) <= k]])
        norm = norm_missing(waiting) if isinstance(waiting, _Action) else None
        if norm:
            what += (f" for the global gradient norm of update unit {norm[0]}, which stage{'s' * (len(norm[1]) > 1)} "
                     f"{', '.join(map(str, norm[1]))} {'have' if len(norm[1]) > 1 else 'has'} not posted")
        blocked = [f"rank {b.rank}: {b.batch} ({'started' if started(b) else 'queued behind an earlier batch'})"
                   for b in open_batches]
        _fail(f"deadlock: {what}; unfinished batches: " + "; ".join(blocked), program, rank, step)
    unpaired = sorted(f"{channel}: {len(sends.get(channel, []))} sends, {len(receives.get(channel, []))} receives"
                      for channel in set(sends) | set(receives)
                      if len(sends.get(channel, [])) != len(receives.get(channel, [])))
    if unpaired:
        raise ScheduleError(f"sends and receives do not pair up: {unpaired}")
    uneven = sorted(f"{group}: " + ", ".join(f"rank {q} posts {len(posts.get(q, ()))}" for q in sorted(ranks))
                    for (group, ranks), posts in collectives.items()
                    if len({len(posts.get(q, ())) for q in ranks}) > 1)
    if uneven:
        raise ScheduleError(f"collectives do not pair up: {uneven}")
    orders = {tuple(units) for units in units_posted.values()}
    if clipping and (len(orders) > 1 or any(len(set(u)) < len(u) for u in units_posted.values())):
        raise ScheduleError("global clipping all-reduces one norm per update on every rank, in the same order: the "
                            f"ranks post the norms of units {dict(units_posted)}; it needs one stage per rank")
    return Timeline(finish=dict(clock), busy=dict(busy))
