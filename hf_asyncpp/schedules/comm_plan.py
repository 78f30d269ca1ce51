"""The communication plan: where each rank posts its pipeline messages, so that the program is
correct under NCCL's rules (docs/ARCHITECTURE.md, "Communication").

A rank's *program* is its compute actions with `P2PBatch`es between them. NCCL imposes:

- **Matching by order, not by tag.** Between two ranks, in one direction, the k-th send meets the
  k-th receive; the tag is ignored. Both ends must post the messages of a pair in the same order.
- **Rendezvous on ordered streams.** The P2P operations a rank posts for a peer run in posting order,
  and a send completes only together with its receive. A receive posted early blocks whatever the
  rank posts after it for that peer until its message comes.

The plan is made by playing all ranks' compute orders together, as if each took one time unit: in
every round each rank runs its next compute if its input exists (the activation from stage s − 1,
the gradient from stage s + 1). When a compute runs, its sends are appended to its rank's program
and, at the same moment, the matching receives to the receivers' programs. Every pair of ranks
therefore posts its messages, in both directions, in one common order — the order they are produced
in a run that exists — so each pair's two streams advance in lockstep, and a receive is posted as
early as the receiver can know of it (its buffer is ready before the data is). The operations
between two computes form one batch per peer (`batch_isend_irecv`; NCCL groups them, as torch's
1F1B pairs its `fwd_send_bwd_recv`). Per peer, because a compute waits for its receive's whole
batch (NCCL returns one work per group): a backward whose gradient comes from the next rank must
not also wait for an activation from the previous one that only the next forward needs. One batch
for both neighbours cost 1F1B 43 time units instead of (m + p − 1)(F + B) = 33 at p = 4, m = 8
with F = 1, B = 2 in the timing model of `validate.check_program`, and PipeDream-2BW 38 instead of
24 per step. `validate.check_program` plays the result under NCCL's rules; it is what the runtime
executes.

Local actions in an order (UNSHARD, RESHARD, REDUCE_GRAD: work between computes that needs no
message) keep their place; they run after the sends of the compute before them.

Asynchronous orders are continuous: their ranks' actions come lazily, tagged with the step
(segment) they belong to, and a rank's program for step k is handed out once nothing more can be
appended to it. Segment k is played to its end on every rank before any rank places an action
of segment k + 1, so the play does not depend on which ranks ask for programs, and a step not yet
played may still be redefined (an early stop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..torch_internals import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    _Action,
)

__all__ = ["Collective", "CommPlanner", "HostWait", "P2PBatch", "PlanError", "Program", "is_compute",
           "matching_receive", "peer_of", "plan_program"]

_COMPUTE = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
_BACKWARDS = (FULL_BACKWARD, BACKWARD_INPUT)


@dataclass(frozen=True)
class P2PBatch:
    """Sends and receives a rank posts together (one NCCL group); each op names the posting stage."""

    ops: tuple[_Action, ...]

    def __str__(self) -> str:
        return "+".join(map(str, self.ops))


@dataclass(frozen=True)
class Collective:
    """A collective a rank posts on another communicator than the pipeline's messages (the statistics
    all-reduce on the default group, a dp gather): `ranks` take part, the k-th of each on one `group`
    meet. Posting it does not block the host; it completes once every rank of it has posted it."""

    group: str
    ranks: frozenset[int]
    what: str = "all_reduce"

    def __str__(self) -> str:
        return f"{self.what}@{self.group}"


@dataclass(frozen=True)
class HostWait:
    """The host waits (a `work.wait()`, a `.item()` or `.tolist()` of a result): for this rank's
    collectives on `group` to complete, or, with group None, for everything it has posted (its
    message batches and collectives), as a device synchronize does."""

    group: str | None = None

    def __str__(self) -> str:
        return f"wait@{self.group or 'all'}"


# None: wait until this rank's sends completed.
Program = dict[int, list["_Action | P2PBatch | Collective | HostWait | None"]]


class PlanError(ValueError):
    """An order no program can run: a compute whose input never comes, or a chunk buffer in use."""


def is_compute(action) -> bool:
    return isinstance(action, _Action) and action.computation_type in _COMPUTE


def peer_of(comm: _Action, stage_to_rank: Callable[[int], int]) -> int:
    """The rank at the other end of a send or receive."""
    s, kind = comm.stage_index, comm.computation_type
    return stage_to_rank(s + 1 if kind in (SEND_F, RECV_B) else s - 1)


def matching_receive(send: _Action) -> _Action:
    """The receive a send is for: an activation goes to stage s + 1, a gradient to stage s − 1."""
    if send.computation_type == SEND_F:
        return _Action(send.stage_index + 1, RECV_F, send.microbatch_index)
    return _Action(send.stage_index - 1, RECV_B, send.microbatch_index)


def _leaves(action: _Action):
    return action.sub_actions or (action,)


class CommPlanner:
    """Plays the ranks' compute orders together and builds their programs (see the module docstring).

    `actions_of(rank)` iterates over (segment, action) of that rank's order, segments non-decreasing.
    Programs are kept for the ranks in `keep` (default all); the others are only played.

    The play also follows what each stage holds per microbatch, in its rank's program order (which
    is the order its rank runs it in): its chunk state (torch's per-chunk entries: the posted
    receive, the forward's cache) from its activation's receive, or its forward on a stage that
    receives none, to its backward; its activation receive buffer from the receive to the backward
    (autograd keeps the stage's input; to the forward in a `forward_only` play); its gradient
    receive buffer from the receive to the backward (a split backward's weight half, W, ends them).
    `spans[(stage, kind)]` is the largest span max − min + 1 of the microbatch ids held at once
    ("chunk", "activation", "gradient"). Ids j and j' held together never share index j mod n when
    n ≥ that span, whatever their residues: `n_slots` (chunk) and `pools` (per kind) check the play
    against such counts, refusing a hold whose index a different microbatch still holds."""

    def __init__(self, ranks: Iterable[int], actions_of: Callable[[int], Iterator[tuple[int, _Action]]],
                 stage_to_rank: Callable[[int], int], n_stages: int, n_slots: int | None = None,
                 keep: Iterable[int] | None = None, pools: dict[str, int] | None = None, forward_only: bool = False):
        self.ranks = sorted(ranks)
        self.stage_to_rank, self.n_stages, self.n_slots = stage_to_rank, n_stages, n_slots
        self.counts = {"chunk": n_slots, **(pools or {})}
        self.forward_only = forward_only
        self.spans: dict[tuple[int, str], int] = {}  # (stage, kind) → largest span of ids held at once
        self._actions = {r: actions_of(r) for r in self.ranks}
        self._next: dict[int, tuple[int, _Action] | None] = {r: self._pull(r) for r in self.ranks}
        self._keep = set(self.ranks if keep is None else keep)
        self._segment = {r: -1 for r in self.ranks}  # segment of the rank's last placed action
        self._program: dict[int, deque[tuple[int, object]]] = {r: deque() for r in self.ranks}
        self._produced: set[tuple[int, str, int]] = set()  # (stage, "F"/"B", mb) not yet consumed
        self._held: dict[tuple[int, str], set[int]] = {}  # (stage, kind) → microbatches held
        self._holder: dict[tuple[int, str, int], int] = {}  # (stage, kind, index) → the microbatch holding it

    def _pull(self, rank: int):
        return next(self._actions[rank], None)

    def _ready(self, action: _Action) -> bool:
        for leaf in _leaves(action):
            s, kind, j = leaf.stage_index, leaf.computation_type, leaf.microbatch_index
            if kind == FORWARD and s > 0 and (s - 1, "F", j) not in self._produced:
                return False
            if kind in _BACKWARDS and s < self.n_stages - 1 and (s + 1, "B", j) not in self._produced:
                return False
        return True

    def _emit(self, rank: int, entry, by_segment: int | None = None) -> None:
        """Append to the rank's program, in the segment of the action it runs next; a receive
        (`by_segment`: the sender's segment) no later than its send's segment: a receive appended
        while the receiving rank has finished step k, for a message of step k, ends step k's
        program, so that both ends post every message on the same side of the step boundary."""
        if rank in self._keep:
            head = self._next[rank]
            segment = self._segment[rank] if head is None else head[0]
            if by_segment is not None:
                segment = min(segment, by_segment)
            self._program[rank].append((segment, entry))

    def _hold(self, rank: int, stage: int, kind: str, j: int, what: str) -> None:
        held = self._held.setdefault((stage, kind), set())
        if j in held:
            return
        held.add(j)
        span = max(held) - min(held) + 1
        if span > self.spans.get((stage, kind), 0):
            self.spans[(stage, kind)] = span
        n = self.counts.get(kind)
        if n is None:
            return
        holder = self._holder.setdefault((stage, kind, j % n), j)
        if holder != j:
            buffer = "chunk buffer" if kind == "chunk" else f"{kind} receive buffer"
            raise PlanError(f"rank {rank}: {what} of microbatch {j} needs the {buffer} of microbatch {holder}, which "
                            f"stage {stage} has not yet backwarded (index {j % n} of {n})")

    def _release(self, stage: int, kind: str, j: int) -> None:
        self._held.get((stage, kind), set()).discard(j)
        n = self.counts.get(kind)
        if n is not None and self._holder.get((stage, kind, j % n)) == j:
            del self._holder[(stage, kind, j % n)]

    def _place(self, rank: int, segment: int, action: _Action) -> None:
        self._segment[rank] = segment
        self._emit(rank, action)
        for leaf in _leaves(action):
            s, kind, j = leaf.stage_index, leaf.computation_type, leaf.microbatch_index
            if kind == FORWARD:
                self._produced.discard((s - 1, "F", j))
                self._produced.add((s, "F", j))
                self._hold(rank, s, "chunk", j, "the forward")
                if self.forward_only:
                    self._release(s, "chunk", j)
                    self._release(s, "activation", j)
                if s < self.n_stages - 1 and self.stage_to_rank(s + 1) != rank:
                    self._message(rank, _Action(s, SEND_F, j))
            elif kind in _BACKWARDS:
                self._produced.discard((s + 1, "B", j))
                self._produced.add((s, "B", j))
                if kind == FULL_BACKWARD:  # BACKWARD_INPUT: its weight half still needs them
                    for held in ("chunk", "activation", "gradient"):
                        self._release(s, held, j)
                if s > 0 and self.stage_to_rank(s - 1) != rank:
                    self._message(rank, _Action(s, SEND_B, j))
            elif kind == BACKWARD_WEIGHT:
                for held in ("chunk", "activation", "gradient"):
                    self._release(s, held, j)

    def _message(self, rank: int, send: _Action) -> None:
        receive = matching_receive(send)
        receiver = self.stage_to_rank(receive.stage_index)
        s, j = receive.stage_index, receive.microbatch_index
        self._hold(receiver, s, "chunk", j, "the receive")
        self._hold(receiver, s, "activation" if receive.computation_type == RECV_F else "gradient", j, "the receive")
        self._emit(rank, send)
        self._emit(receiver, receive, by_segment=self._segment[rank])

    def _round(self, horizon: int) -> bool:
        """Each rank places its next action if it can and it belongs to a segment up to `horizon`;
        True if any did."""
        moved = False
        for rank in self.ranks:
            head = self._next[rank]
            if head is not None and head[0] <= horizon and (
                    not is_compute(head[1]) and head[1].sub_actions is None or self._ready(head[1])):
                self._place(rank, *head)
                self._next[rank] = self._pull(rank)
                moved = True
        return moved

    def last_placed_segment(self, rank: int) -> int:
        return self._segment[rank]

    def restart(self, rank: int, actions: Iterator[tuple[int, _Action]]) -> None:
        """Continue rank `rank`'s order from `actions` (which must start at its next, unplaced action)."""
        self._actions[rank] = actions
        self._next[rank] = self._pull(rank)

    def program(self, rank: int, segment: int) -> list[_Action | P2PBatch]:
        """Rank `rank`'s program for `segment` (call for its segments in order): its actions with the
        sends and receives between them, consecutive ones merged into one batch per peer (in the
        order of each peer's first message)."""
        # Every rank plays `segment` to its end, none beyond: the play is then the same whichever ranks
        # ask, and later segments may still be redefined (an early stop).
        while any(head is not None and head[0] <= segment for head in self._next.values()):
            if not self._round(horizon=segment):
                stuck = {r: str(h[1]) for r, h in self._next.items() if h is not None}
                raise PlanError(f"the order cannot run: every rank waits for an input that never comes: {stuck}")
        entries = self._program[rank]
        program: list[_Action | P2PBatch] = []
        run: dict[int, list[_Action]] = {}  # the messages since the last action, by peer
        while entries and entries[0][0] <= segment:
            _, entry = entries.popleft()
            if isinstance(entry, _Action) and entry.computation_type in (SEND_F, SEND_B, RECV_F, RECV_B):
                run.setdefault(peer_of(entry, self.stage_to_rank), []).append(entry)
            else:
                program += [P2PBatch(tuple(ops)) for ops in run.values()]
                run = {}
                program.append(entry)
        return program + [P2PBatch(tuple(ops)) for ops in run.values()]


def plan_program(actions: dict[int, list[_Action | None]], stage_to_rank: Callable[[int], int], n_stages: int) -> Program:
    """Every rank's program for finite action lists (one flushed step); bubbles (None) dropped."""
    planner = CommPlanner(actions, lambda r: iter([(0, a) for a in actions[r] if a is not None]), stage_to_rank, n_stages)
    return {r: planner.program(r, 0) for r in sorted(actions)}
