"""Every rank's program played against the others under NCCL's rules, in one process, and timed
(validate.py's docstring lists the rules; validate.check_program is the entry point).

A `_Play` holds what the ranks have posted and done so far; each rule is one method that the play asks
before an entry runs. The runtime applies the same rules where they come from one place: what an update
waits for is update/held.GlobalClipping, which both ask; which message matches which is comm_plan's
matching_receive.

The play is also a timing model (`cost`: seconds per compute or local action, an update's optimizer
step among them; `link_s`: seconds per message; the norm all-reduce takes none): each rank runs its
program in order, an action starts when its rank is free and its inputs are there (a receive's batch
complete, the global norm it waits for posted by every stage), and messages move by `transport`:
"nccl" (what a GPU run gets, and the default): a batch completes `link_s` after its rank and its peers
have reached it, its pair's stream busy until then, as an NCCL group's kernel is; "gloo" (what the CPU
ranks of benchmarks/schedule_sleep.py run on): a send is buffered, done once posted, its message
arriving `link_s` after it, and a pair's next batch starts without waiting.
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
)
from .comm_plan import Collective, HostWait, P2PBatch, Program, is_compute, matching_receive, peer_of
from .errors import ScheduleError

if TYPE_CHECKING:
    from ..update.held import GlobalClipping

__all__ = ["Timeline", "play"]

_BACKWARDS = (FULL_BACKWARD, BACKWARD_INPUT)


@dataclass
class Timeline:
    """A timed play (check_program's `cost`): per rank, when its program ended and how long it computed."""
    finish: dict[int, float]
    busy: dict[int, float]

    @property
    def makespan(self) -> float:
        return max(self.finish.values())


def fail(message: str, table, rank: int, step: int):
    raise ScheduleError(f"rank {rank}, step {step}: {message}\n\n{_format_pipeline_order(table, error_step_number=step)}")


class _Batch:
    def __init__(self, rank: int, batch: P2PBatch, streams: set, posted_at: float):
        self.rank, self.batch, self.streams = rank, batch, streams
        self.done = [False] * len(batch.ops)
        self.channel_index: list[tuple[tuple[int, int], int, bool]] = []  # per op: (sender, receiver), k, is send
        self.complete = False
        # Timing: it can start once posted and at the head of its streams; it completes with its last pair.
        self.start_at, self.completed_at = posted_at, posted_at


Group = tuple[str, frozenset]


class _Play:
    def __init__(self, program: Program, stage_to_rank: Callable[[int], int], n_stages: int, streams: str,
                 clipping: "GlobalClipping | None", cost: Callable[[int, _Action], float] | None, link_s: float = 0.0,
                 transport: str = "nccl"):
        self.program, self.stage_to_rank, self.n_stages = program, stage_to_rank, n_stages
        self.link_s, self.buffered = link_s, transport == "gloo"
        self.streams, self.clipping = streams, clipping
        self.seconds = cost or (lambda rank, action: 0.0)
        # Messages: per (sender, receiver), the posted sends and receives, in posting order.
        self.sends: dict[tuple[int, int], list[tuple[_Action, _Batch]]] = {}
        self.receives: dict[tuple[int, int], list[tuple[_Action, _Batch]]] = {}
        self.queues: dict[tuple[int, object], deque[_Batch]] = {}  # (rank, stream) → batches not complete, in order
        self.receive_batch: dict[tuple[int, _Action], _Batch] = {}  # a posted receive, until its compute consumes it
        self.send_batches: dict[int, list[_Batch]] = {r: [] for r in program}
        self.open_batches: list[_Batch] = []
        self.batches_of: dict[int, list[_Batch]] = {r: [] for r in program}
        # Compute done, for the data dependencies.
        self.done_forward: set[tuple[int, int]] = set()
        self.done_backward: set[tuple[int, int]] = set()
        # Global clipping: update unit → stages that posted its norm, and when its last was posted; per rank,
        # the units it posted, in order.
        self.norms_posted: dict[int, set[int]] = {}
        self.norm_posted_at: dict[int, float] = {}
        self.units_posted: dict[int, list[int]] = {r: [] for r in program}
        # Collectives: (group, ranks) → rank → [(step, when posted, {peer: (sends to it, receives from it) before})].
        self.collectives: dict[Group, dict[int, list[tuple[int, float, dict]]]] = {}
        self.collective_done: dict[tuple[Group, int], float] = {}  # (group, k) → when it completed
        self.posted_collectives: dict[int, list[tuple[Group, int]]] = {r: [] for r in program}
        # Time: when each rank's next entry can start, and how long it has computed.
        self.clock = {r: 0.0 for r in program}
        self.busy = {r: 0.0 for r in program}

    def fail(self, message: str, rank: int, step: int):
        fail(message, self.program, rank, step)

    # --- time ------------------------------------------------------------------------------------

    def run(self, rank: int, ready: float, actions) -> float:
        """Run `actions` on `rank` from `ready` (or when the rank is free); returns when they end."""
        spent = sum(self.seconds(rank, a) for a in actions)
        self.clock[rank] = max(self.clock[rank], ready) + spent
        self.busy[rank] += spent
        return self.clock[rank]

    # --- the rules an entry waits on -------------------------------------------------------------

    def norm_missing(self, action: _Action) -> tuple[int, list[int]] | None:
        """(the unit, the stages yet to post its norm) when `action` waits for a global norm."""
        unit = self.clipping.unit_awaited(action) if self.clipping else None
        missing = [s for s in range(self.n_stages) if s not in self.norms_posted.get(unit, ())] if unit is not None else []
        return (unit, missing) if missing else None

    def needed_receive(self, action: _Action) -> _Action | None:
        s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
        if kind == FORWARD and s > 0 and self.stage_to_rank(s - 1) != self.stage_to_rank(s):
            return _Action(s, RECV_F, mb)
        if kind in _BACKWARDS and s < self.n_stages - 1 and self.stage_to_rank(s + 1) != self.stage_to_rank(s):
            return _Action(s, RECV_B, mb)
        return None

    def awaited_by(self, rank: int, wait: HostWait) -> tuple[list, list[_Batch]]:
        """What `wait` on `rank` waits for: its collectives not yet complete, its batches not yet complete."""
        pending = [c for c in self.posted_collectives[rank] if c not in self.collective_done
                   and wait.group in (None, c[0][0])]
        batches = [b for b in self.batches_of[rank] if not b.complete] if wait.group is None else []
        return pending, batches

    def started(self, batch: _Batch) -> bool:
        return all(self.queues[(batch.rank, stream)][0] is batch for stream in batch.streams)

    # --- posting ---------------------------------------------------------------------------------

    def post(self, rank: int, step: int, batch: P2PBatch) -> None:
        peers = [peer_of(op, self.stage_to_rank) for op in batch.ops]
        posted = _Batch(rank, batch, set(peers) if self.streams == "pair" else {"*"}, self.clock[rank])
        for op, peer in zip(batch.ops, peers):
            is_send = op.computation_type in (SEND_F, SEND_B)
            produced = self.done_forward if op.computation_type == SEND_F else self.done_backward
            if is_send and (op.stage_index, op.microbatch_index) not in produced:
                self.fail(f"{op} is posted before stage {op.stage_index} computed it", rank, step)
            channel = (rank, peer) if is_send else (peer, rank)
            mine, theirs = (self.sends, self.receives) if is_send else (self.receives, self.sends)
            k = len(mine.setdefault(channel, []))
            mine[channel].append((op, posted))
            posted.channel_index.append((channel, k, is_send))
            if k < len(theirs.get(channel, [])):
                other = theirs[channel][k][0]
                send, receive = (op, other) if is_send else (other, op)
                if matching_receive(send) != receive:
                    self.fail(f"message {k} from rank {channel[0]} to rank {channel[1]} is {send} but is received by "
                              f"{receive}: NCCL matches by posting order, so the wrong tensor would arrive", rank, step)
            if not is_send:
                if (rank, op) in self.receive_batch:
                    self.fail(f"{op} posted twice", rank, step)
                self.receive_batch[(rank, op)] = posted
        if any(op.computation_type in (SEND_F, SEND_B) for op in batch.ops):
            self.send_batches[rank].append(posted)
        for stream in posted.streams:
            self.queues.setdefault((rank, stream), deque()).append(posted)
        self.open_batches.append(posted)
        self.batches_of[rank].append(posted)

    def post_collective(self, rank: int, step: int, collective: Collective) -> None:
        if rank not in collective.ranks:
            self.fail(f"{collective} is posted by rank {rank}, which is not one of its ranks {sorted(collective.ranks)}",
                      rank, step)
        group = (collective.group, collective.ranks)
        posts = self.collectives.setdefault(group, {})
        k = len(posts.setdefault(rank, []))
        before = {q: (len(self.sends.get((rank, q), [])), len(self.receives.get((q, rank), []))) for q in collective.ranks}
        posts[rank].append((step, self.clock[rank], before))
        self.posted_collectives[rank].append((group, k))
        if all(len(posts.get(q, ())) > k for q in collective.ranks):  # every rank has posted it: it completes
            self.check_crossings(collective, posts, k)
            self.collective_done[(group, k)] = max(posts[q][k][1] for q in collective.ranks)

    def check_crossings(self, collective: Collective, posts, k: int) -> None:
        """A message between two ranks of `collective` posted before it on one end, after it on the other."""
        for r in sorted(collective.ranks):
            step, _, mine = posts[r][k]
            for q in sorted(collective.ranks - {r}):
                theirs = posts[q][k][2][r]
                for sent, received, channel, ops, kind, other in (
                        (mine[q][0], theirs[1], (r, q), self.sends, "to", "receive"),
                        (mine[q][1], theirs[0], (q, r), self.receives, "from", "send")):
                    if sent > received:
                        op = ops[channel][received][0]
                        self.fail(f"{collective} is posted with {op} {kind} rank {q} pending, whose {other} rank {q} "
                                  f"posts only after its own {collective}: under NCCL the collective's kernel may wait "
                                  f"behind the message's, which waits for rank {q}, whose kernel waits in the collective "
                                  f"for rank {r}: a potential deadlock", r, step)

    # --- one entry -------------------------------------------------------------------------------

    def try_run(self, rank: int, step: int, entry) -> bool:
        """Run `entry` if what it waits for is there; whether it ran."""
        if entry is None:
            if not all(b.complete for b in self.send_batches[rank]):
                return False
            self.run(rank, max((b.completed_at for b in self.send_batches[rank]), default=0.0), ())
            return True
        if isinstance(entry, P2PBatch):
            self.post(rank, step, entry)
            return True
        if isinstance(entry, Collective):
            self.post_collective(rank, step, entry)
            return True
        if isinstance(entry, HostWait):
            if any(self.awaited_by(rank, entry)):
                return False
            done = [self.collective_done[c] for c in self.posted_collectives[rank] if entry.group in (None, c[0][0])]
            done += [b.completed_at for b in self.batches_of[rank]] if entry.group is None else []
            self.run(rank, max(done, default=0.0), ())
            return True
        if not is_compute(entry) and entry.sub_actions is None:  # local work: (un)shard, an update
            return self.run_local(rank, entry)
        return self.run_compute(rank, step, entry)

    def run_local(self, rank: int, entry: _Action) -> bool:
        clipping = self.clipping
        if not (clipping and entry.computation_type == REDUCE_GRAD):
            self.run(rank, 0.0, (entry,))
            return True
        if self.norm_missing(entry):
            return False
        unit, awaited = clipping.unit_posted(entry), clipping.unit_awaited(entry)
        ended = self.run(rank, self.norm_posted_at.get(awaited, 0.0), (entry,))
        self.norms_posted.setdefault(unit, set()).add(entry.stage_index)
        self.norm_posted_at[unit] = max(self.norm_posted_at.get(unit, 0.0), ended)
        self.units_posted[rank].append(unit)
        return True

    def run_compute(self, rank: int, step: int, entry: _Action) -> bool:
        actions = entry.sub_actions or (entry,)
        ready = 0.0
        for action in actions:
            if self.norm_missing(action):
                return False
            awaited = self.clipping.unit_awaited(action) if self.clipping else None
            ready = max(ready, self.norm_posted_at.get(awaited, 0.0))
            receive = self.needed_receive(action)
            if receive is not None:
                batch = self.receive_batch.get((rank, receive))
                if batch is None:
                    what = "input" if action.computation_type == FORWARD else "output gradient"
                    self.fail(f"{action} runs without receiving its {what}", rank, step)
                if not batch.complete:
                    return False
                ready = max(ready, batch.completed_at)
        self.run(rank, ready, actions)
        for action in actions:
            s, kind, mb = action.stage_index, action.computation_type, action.microbatch_index
            receive = self.needed_receive(action)
            if receive is not None:
                del self.receive_batch[(rank, receive)]
            if kind == FORWARD:
                if s > 0 and (s - 1, mb) not in self.done_forward:
                    self.fail(f"{action} runs before stage {s - 1} forwarded microbatch {mb}", rank, step)
                self.done_forward.add((s, mb))
            elif kind in _BACKWARDS:
                if s < self.n_stages - 1 and (s + 1, mb) not in self.done_backward:
                    self.fail(f"{action} runs before stage {s + 1} sent its gradient", rank, step)
                self.done_backward.add((s, mb))
        return True

    # --- messages in flight ----------------------------------------------------------------------

    def settle(self) -> bool:
        """Complete every send/receive pair whose two batches have started; True if anything moved."""
        moved = True
        any_moved = False
        while moved:
            moved = False
            for batch in [b for b in self.open_batches if not b.complete and self.started(b)]:
                for i, (channel, k, is_send) in enumerate(batch.channel_index):
                    if batch.done[i]:
                        continue
                    theirs = (self.receives if is_send else self.sends).get(channel, [])
                    if k < len(theirs) and self.started(theirs[k][1]):
                        other = theirs[k][1]
                        batch.done[i] = True
                        other.done[other.channel_index.index((channel, k, not is_send))] = True
                        if self.buffered:  # gloo: the message travels from its send, which is done at once
                            sender, receiver = (batch, other) if is_send else (other, batch)
                            receiver.completed_at = max(receiver.completed_at, sender.start_at + self.link_s)
                        else:  # NCCL: the pair meets, then the message takes its time
                            met_at = max(batch.start_at, other.start_at) + self.link_s
                            batch.completed_at = max(batch.completed_at, met_at)
                            other.completed_at = max(other.completed_at, met_at)
                        moved = True
                if all(batch.done):
                    batch.complete = True
                    for stream in batch.streams:
                        queue = self.queues[(batch.rank, stream)]
                        queue.popleft()
                        if queue:  # the next batch on this stream can start once this one is done (NCCL)
                            freed_at = batch.start_at if self.buffered else batch.completed_at
                            queue[0].start_at = max(queue[0].start_at, freed_at)
                    self.open_batches.remove(batch)
                    moved = True
            any_moved |= moved
        return any_moved

    # --- the whole play --------------------------------------------------------------------------

    def play(self) -> Timeline:
        position = {r: 0 for r in self.program}
        progress = True
        while progress:
            progress = False
            for rank, ops in self.program.items():
                while position[rank] < len(ops) and self.try_run(rank, position[rank], ops[position[rank]]):
                    position[rank] += 1
                    progress = True
            progress |= self.settle()
        stuck = {r: p for r, p in position.items() if p < len(self.program[r])}
        if stuck:
            self.report_deadlock(*next(iter(stuck.items())))
        self.check_pairing()
        return Timeline(finish=dict(self.clock), busy=dict(self.busy))

    def report_deadlock(self, rank: int, step: int):
        waiting = self.program[rank][step]
        what = "waiting for its sends to be received forever" if waiting is None else f"{waiting} waits forever"
        if isinstance(waiting, HostWait):
            pending, _ = self.awaited_by(rank, waiting)
            what += "".join(f" for {group[0]} collective {k}, which rank{'s' * (len(late) > 1)} "
                            f"{', '.join(map(str, late))} {'have' if len(late) > 1 else 'has'} not posted"
                            for group, k in pending
                            for late in [[q for q in sorted(group[1]) if len(self.collectives[group].get(q, ())) <= k]])
        norm = self.norm_missing(waiting) if isinstance(waiting, _Action) else None
        if norm:
            what += (f" for the global gradient norm of update unit {norm[0]}, which stage{'s' * (len(norm[1]) > 1)} "
                     f"{', '.join(map(str, norm[1]))} {'have' if len(norm[1]) > 1 else 'has'} not posted")
        blocked = [f"rank {b.rank}: {b.batch} ({'started' if self.started(b) else 'queued behind an earlier batch'})"
                   for b in self.open_batches]
        self.fail(f"deadlock: {what}; unfinished batches: " + "; ".join(blocked), rank, step)

    def check_pairing(self) -> None:
        """After the play: every send met its receive, every collective all its ranks, every norm the same units."""
        unpaired = sorted(f"{channel}: {len(self.sends.get(channel, []))} sends, {len(self.receives.get(channel, []))} "
                          "receives" for channel in set(self.sends) | set(self.receives)
                          if len(self.sends.get(channel, [])) != len(self.receives.get(channel, [])))
        if unpaired:
            raise ScheduleError(f"sends and receives do not pair up: {unpaired}")
        uneven = sorted(f"{group}: " + ", ".join(f"rank {q} posts {len(posts.get(q, ()))}" for q in sorted(ranks))
                        for (group, ranks), posts in self.collectives.items()
                        if len({len(posts.get(q, ())) for q in ranks}) > 1)
        if uneven:
            raise ScheduleError(f"collectives do not pair up: {uneven}")
        orders = {tuple(units) for units in self.units_posted.values()}
        if self.clipping and (len(orders) > 1 or any(len(set(u)) < len(u) for u in self.units_posted.values())):
            raise ScheduleError("global clipping all-reduces one norm per update on every rank, in the same order: the "
                                f"ranks post the norms of units {dict(self.units_posted)}; it needs one stage per rank")


def play(program: Program, stage_to_rank: Callable[[int], int], n_stages: int, streams: str,
         clipping: "GlobalClipping | None", cost: Callable[[int, _Action], float] | None,
         link_s: float = 0.0, transport: str = "nccl") -> Timeline:
    """Play `program` under the rules (ScheduleError on a broken one); its timeline."""
    return _Play(program, stage_to_rank, n_stages, streams, clipping, cost, link_s, transport).play()
