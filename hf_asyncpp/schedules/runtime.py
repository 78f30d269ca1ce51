"""Executing a rank's program (comm_plan.py): the pipeline's own action-list runtime.

A program is a rank's compute actions (forward, backward, its input and weight halves, FSDP's
unshard / reshard / gradient reduction) with its P2P batches between them. `ProgramRuntime` walks it
and calls `PipelineStage`'s chunk methods (`forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`, `perform_reduce_grad`) and its P2P builders (`get_*_ops`), the public
face of a stage, the same in every supported torch; torch's private schedule runtime, which changed
in every release, is not used (torch_internals.py lists what remains private).

Each `P2PBatch` of the program is posted as one `batch_isend_irecv` (one NCCL group) when the walk
reaches its first operation; a compute that needs one of its receives waits for the whole batch (NCCL
returns one work for a group). Every message goes untagged (tag 0): on gloo it is then matched by
posting order per pair of ranks, as NCCL matches it, so what runs on CPU is what would run on GPUs.
Given `links` (parallel/mesh.link_groups), a batch goes on its peer's two-rank group, so each pair of
ranks has its own NCCL stream.

`ActionListSchedule` runs a synchronous schedule: one flushed step per call, waiting for its sends
at the end. The asynchronous runtime (async_runtime.py) builds on `ProgramRuntime` too.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from ..torch_internals import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    _Action,
    _add_unshard_reshard,
    _format_pipeline_order,
    forget_forward,
    prepare_stages,
)
from .comm_plan import P2PBatch, is_compute, plan_program
from .registry import ScheduleSpec

__all__ = ["ActionListSchedule", "ProgramRuntime", "build_eval_schedule", "build_schedule", "stage_ranks_of",
           "with_gradient_reductions"]

_COMMS = (SEND_F, SEND_B, RECV_F, RECV_B)


def stage_ranks_of(actions) -> dict[int, int]:
    """{stage: the rank that computes it} from per-rank compute lists."""
    return {a.stage_index: rank for rank, ops in actions.items() for a in ops if a is not None}


class ProgramRuntime:
    """Runs one rank's programs on its stages: compute through the stages' chunk methods, P2P batches
    posted by this class. `loss_fn(output, target)` gives the last stage's loss per microbatch (None:
    forward only). `scale_grads`: gradients are divided by the number of microbatches at REDUCE_GRAD."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable | None,
                 scale_grads: bool, links: dict | None = None):
        self._stages = stages
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._has_backward = loss_fn is not None
        self.rank, self.pp_group_size = stages[0].group_rank, stages[0].group_size
        self._num_stages = stages[0].num_stages
        self._links = links or {}  # peer's global rank → the group its messages go on (default: the stages')
        self._stage_by_index = {stage.stage_index: stage for stage in stages}
        self._prepared_for: bool | None = None  # the has_backward the stages' buffers were set up for
        self._losses: dict[int, torch.Tensor] = {}  # chunk id → the last stage's loss, until its backward
        self.fwd_recv_ops: dict[tuple[int, int], _PostedBatch] = {}  # (stage, chunk) → its receive's batch
        self.bwd_recv_ops: dict[tuple[int, int], _PostedBatch] = {}
        self._unshard_ops: dict[int, list] = {}  # stage → FSDP gathers in flight
        self._unsharded: set[int] = set()
        self._backwards: Counter[int] = Counter()  # stage → backwards (full or weight) in this program
        self._batches: deque[tuple[_Action, ...]] = deque()  # this call's batches, in program order
        self._ops_left_in_batch = 0
        self._programs_run = 0
        # (the program run that posted it, the batch) for posted batches holding sends, not yet known complete
        self._send_works: list[tuple[int, _PostedBatch]] = []

    def set_stage_ranks(self, stage_to_rank: dict[int, int]) -> None:
        """Where every stage of the pipeline is computed (the stages name their peers by it)."""
        self.stage_index_to_group_rank = stage_to_rank
        for stage in self._stages:
            stage.stage_index_to_group_rank = stage_to_rank

    # --- what a subclass may change: the loss and a stage's gradient reduction ----------------------

    def _compute_loss(self, output, target):
        return self._loss_fn(output, target)

    def _after_forward(self, stage, output, target_mbs, chunk: int) -> None:
        """The last stage's loss, right after its forward."""
        if stage.is_last and self._loss_fn is not None:
            self._losses[chunk] = self._compute_loss(output, target_mbs[chunk])
        if stage.is_last and not self._has_backward:
            # A stage keeps each forward's outputs for its backward until the next step; a
            # forward-only program has none, and the last stage's outputs are logits.
            forget_forward(stage, chunk)

    def _loss_for_backward(self, stage, chunk: int):
        return self._losses.pop(chunk) if stage.is_last and self._loss_fn is not None else None

    def _reduce_grad(self, action: _Action) -> None:
        if self._has_backward:
            stage = self._stage_by_index[action.stage_index]
            stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)

    # --- running a program --------------------------------------------------------------------

    def _lowered(self, program, slot: Callable[[int], int] = lambda j: j) -> tuple[list[_Action], list[tuple]]:
        """(the actions of `program` in order, its batches): a batch's operations stand in the list
        where it is posted; microbatch ids become the stages' chunk ids (`slot`)."""
        flat, batches = [], []
        for entry in program:
            if entry is None:  # waiting for the sends: at the end of a step, or in finish()
                continue
            ops = entry.ops if isinstance(entry, P2PBatch) else (entry,)
            ops = tuple(_Action(a.stage_index, a.computation_type, slot(a.microbatch_index))
                        if is_compute(a) or a.computation_type in _COMMS else a for a in ops)
            if isinstance(entry, P2PBatch):
                batches.append(ops)
            flat += ops
        return flat, batches

    def _run_program(self, flat: list[_Action], batches: list[tuple], arg_mbs: list, target_mbs: list | None,
                     return_outputs: bool) -> None:
        if self._prepared_for is not self._has_backward:
            prepare_stages(self._stages, self._n_microbatches, self._has_backward, self._loss_fn,
                           arg_mbs[0], target_mbs[0] if target_mbs else None)
            self._prepared_for = self._has_backward
        self._batches, self._ops_left_in_batch = deque(batches), 0
        self._programs_run += 1
        self._backwards.clear()
        for step, action in enumerate(flat):
            try:
                with record_function(str(action)):  # one named range per action in a profiler trace
                    self._perform(action, arg_mbs, target_mbs, return_outputs)
            except Exception as error:
                error.add_note(f"rank {self.rank} running its program, at step {step} ({action}):\n"
                               + _format_pipeline_order({self.rank: flat}, error_step_number=step))
                raise
        if self._unshard_ops:
            raise RuntimeError(f"stages {sorted(self._unshard_ops)} were gathered for no compute")

    def _perform(self, action: _Action, arg_mbs: list, target_mbs: list | None, return_outputs: bool) -> None:
        kind, s, j = action.computation_type, action.stage_index, action.microbatch_index
        stage = self._stage_by_index[s]
        if kind in _COMMS:
            self._post_batch_at_first_op(action)
        elif kind == UNSHARD:
            if isinstance(stage.submod, FSDPModule):
                self._unshard_ops[s] = [m.unshard(async_op=True) for m in stage.submod.modules()
                                        if isinstance(m, FSDPModule)]
        elif kind == RESHARD:
            if isinstance(stage.submod, FSDPModule):
                for module in stage.submod.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
                self._unsharded.discard(s)
        elif kind == REDUCE_GRAD:
            self._reduce_grad(action)
        elif kind == FORWARD:
            self._gathered(stage)
            local_input = s - 1 in self._stage_by_index  # a V placement's turn: the output is passed, not sent
            if not stage.is_first and not local_input:
                self._received(self.fwd_recv_ops, action)
            output = stage.forward_one_chunk(j, arg_mbs[j], {}, save_forward_output=return_outputs)
            self._after_forward(stage, output, target_mbs, j)
            if s + 1 in self._stage_by_index:
                self._stage_by_index[s + 1].set_local_fwd_input(output, j)
        elif kind in (FULL_BACKWARD, BACKWARD_INPUT):
            self._gathered(stage)
            if not stage.is_last and s + 1 not in self._stage_by_index:
                self._received(self.bwd_recv_ops, action)
            full = kind == FULL_BACKWARD
            if full:
                self._backwards[s] += 1
            stage.backward_one_chunk(j, loss=self._loss_for_backward(stage, j), full_backward=full,
                                     last_backward=full and self._backwards[s] == self._n_microbatches)
            if s - 1 in self._stage_by_index:
                self._stage_by_index[s - 1].set_local_bwd_input(stage.get_local_bwd_output(j), j)
        elif kind == BACKWARD_WEIGHT:
            self._gathered(stage)
            self._backwards[s] += 1
            stage.backward_weight_one_chunk(j, last_backward=self._backwards[s] == self._n_microbatches)
        else:
            raise ValueError(f"{action}: no such action in a program")

    def _received(self, works: dict, action: _Action) -> None:
        key = (action.stage_index, action.microbatch_index)
        if key not in works:
            raise RuntimeError(f"{action} computes before its input was received")
        works.pop(key).wait()

    def _gathered(self, stage) -> None:
        """An FSDP stage's parameters are gathered before it computes (its UNSHARD's works waited for)."""
        if not isinstance(stage.submod, FSDPModule):
            return
        s = stage.stage_index
        for handle in self._unshard_ops.pop(s, ()):
            handle.wait()
            self._unsharded.add(s)
        if s not in self._unsharded:
            raise RuntimeError(f"stage {s} computes on sharded parameters (no UNSHARD before it)")

    def _post_batch_at_first_op(self, action: _Action) -> None:
        if self._ops_left_in_batch:
            self._ops_left_in_batch -= 1
            return
        ops = self._batches.popleft()
        if action != ops[0]:
            raise RuntimeError(f"program out of step: reached {action}, the next batch starts with {ops[0]}")
        self._ops_left_in_batch = len(ops) - 1
        p2p = []
        for op in ops:
            stage = self._stage_by_index[op.stage_index]
            make = {SEND_F: stage.get_fwd_send_ops, SEND_B: stage.get_bwd_send_ops,
                    RECV_F: stage.get_fwd_recv_ops, RECV_B: stage.get_bwd_recv_ops}[op.computation_type]
            p2p += make(op.microbatch_index)
        if self._links:
            p2p = [dist.P2POp(p.op, p.tensor, p.peer, self._links[p.peer]) for p in p2p]
        posted = _PostedBatch(dist.batch_isend_irecv(p2p) if p2p else [])
        if not self._has_backward:  # forward only: a sent output is needed by nothing else here
            for op in ops:
                if op.computation_type == SEND_F:
                    forget_forward(self._stage_by_index[op.stage_index], op.microbatch_index)
        for op in ops:
            if op.computation_type == RECV_F:
                self.fwd_recv_ops[(op.stage_index, op.microbatch_index)] = posted
            elif op.computation_type == RECV_B:
                self.bwd_recv_ops[(op.stage_index, op.microbatch_index)] = posted
        if any(op.computation_type in (SEND_F, SEND_B) for op in ops):
            self._send_works.append((self._programs_run, posted))

    @property
    def pending_send_batches(self) -> int:
        """Posted batches holding sends that are kept until known complete (each keeps its tensors)."""
        return len(self._send_works)

    def wait_for_sends(self) -> None:
        while self._send_works:
            self._send_works.pop()[1].wait()

    def retire_sends(self, programs_back: int) -> None:
        """Forget the sends known complete, and wait for those posted `programs_back` or more program
        runs ago. gloo reports a send complete only once it is waited for, so without the wait an
        asynchronous CPU run would keep every activation and gradient it ever sent. Waiting cannot
        stall a peer as long as every receive is posted less than `programs_back` runs after its send
        (tests/schedules/test_comm_plan.py pins that for the asynchronous orders)."""
        due = self._programs_run - programs_back
        for run, posted in self._send_works:
            if run <= due:
                posted.wait()
        self._send_works = [(run, posted) for run, posted in self._send_works if not posted.is_completed()]


class _PostedBatch:
    """The works of one posted batch, waited for once however many receives share them (waiting
    twice for a gloo receive waits for a second message)."""

    def __init__(self, works: list):
        self._works, self._waited = works, False

    def wait(self) -> bool:
        if not self._waited:
            for work in self._works:
                work.wait()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or all(work.is_completed() for work in self._works)


def with_gradient_reductions(actions: list[_Action], n_microbatches: int) -> list[_Action]:
    """A stage's REDUCE_GRAD right after its last backward (full, or weight half) of the step."""
    lowered, backwards = [], Counter()
    for action in actions:
        lowered.append(action)
        if action.computation_type in (FULL_BACKWARD, BACKWARD_WEIGHT):
            backwards[action.stage_index] += 1
            if backwards[action.stage_index] == n_microbatches:
                lowered.append(_Action(action.stage_index, REDUCE_GRAD, None))
    return lowered


def _fsdp_lowered(actions, n_microbatches: int):
    """FSDP's actions: gather a stage before its first compute and release it after its last (torch's
    pass), reduce its gradient after its last backward."""
    return {r: with_gradient_reductions(_add_unshard_reshard([a for a in ops if a is not None]), n_microbatches)
            for r, ops in actions.items()}


class ActionListSchedule(ProgramRuntime):
    """A synchronous schedule: our checked compute lists, planned (comm_plan.py), one flushed step per
    call (`step`), as torch's schedules are called.

    `eval()` (forward only, e.g. validation loss or logits) runs the same lists with every backward
    removed: each rank keeps its forwards in the training order, so its program stays deadlock-free,
    and the stages are the same objects, set up again for the mode they run in."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, actions,
                 spec: ScheduleSpec | None, links: dict | None = None):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=True, links=links)
        self.spec = spec
        self.set_stage_ranks(stage_ranks_of(actions))
        stage_to_rank = self.stage_index_to_group_rank.__getitem__
        self._train = self._lowered(plan_program(_fsdp_lowered(actions, n_microbatches), stage_to_rank,
                                                 self._num_stages)[self.rank])
        self._eval = self._lowered(plan_program({r: _add_unshard_reshard(ops) for r, ops in forward_only(actions).items()},
                                                stage_to_rank, self._num_stages)[self.rank])

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None, return_outputs: bool = True):
        """One training step over the minibatch `args` (first stage) and `target` (last stage), split
        into microbatches along dimension 0; the last stage's merged outputs if `return_outputs`."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() computes gradients: call it with gradients enabled, or call eval()")
        return self._flushed(self._train, args, target, return_outputs)

    def eval(self, *args: torch.Tensor, target: torch.Tensor | None = None, return_outputs: bool = True):
        """`step` without backwards: the forward-only program."""
        has_backward, self._has_backward = self._has_backward, False
        try:
            return self._flushed(self._eval, args, target, return_outputs)
        finally:
            self._has_backward = has_backward

    def _flushed(self, program, args, target, return_outputs: bool):
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._losses.clear()
        m = self._n_microbatches
        arg_mbs = list(zip(*(torch.tensor_split(a, m) for a in args))) if args else [()] * m
        target_mbs = list(torch.tensor_split(target, m)) if target is not None else None
        try:
            self._run_program(*program, arg_mbs, target_mbs, return_outputs)
        finally:
            self.wait_for_sends()
        last = [stage for stage in self._stages if stage.is_last]
        if not (return_outputs and last):
            return None
        chunks = last[0].output_chunks
        if isinstance(chunks[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*chunks))
        return torch.cat(chunks)


def build_schedule(spec: ScheduleSpec, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable,
                   links: dict | None = None):
    pp_size = stages[0].group_size
    return ActionListSchedule(stages, n_microbatches, loss_fn, spec.actions(pp_size, n_microbatches), spec, links)


def build_eval_schedule(stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable) -> ActionListSchedule:
    """A forward-only program (GPipe order: each rank forwards its stages in index order, all
    microbatches of one before the next) for stages placed in a loop, stage s on rank s mod pp.

    Asynchronous pipelines evaluate through it: their training runtime never finishes a step with an
    empty pipeline, so evaluation runs beside it, on its own PipelineStage objects built on their
    own process group: no message of it can meet one of training's in flight."""
    return ActionListSchedule(stages, n_microbatches, loss_fn,
                              eval_actions(stages[0].group_size, stages[0].num_stages, n_microbatches), None)


def eval_actions(pp_size: int, n_stages: int, n_microbatches: int):
    """build_eval_schedule's order: GPipe's forwards over stages placed in a loop."""
    local = {r: list(range(r, n_stages, pp_size)) for r in range(pp_size)}
    return {r: [_Action(s, FORWARD, j) for s in local[r] for j in range(n_microbatches)] for r in range(pp_size)}


def forward_only(actions):
    """Each rank's forwards in its training order: what `eval()` runs of a schedule's lists."""
    return {r: [a for a in ops if a is not None and a.computation_type == FORWARD] for r, ops in actions.items()}
