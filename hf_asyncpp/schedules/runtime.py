"""Executing a rank's program (comm_plan.py) with torch's action-list runtime.

torch's `_PipelineScheduleRuntime` runs the compute actions (forward, backward, loss, FSDP unshard /
reshard / gradient reduction); the sends and receives are ours: each `P2PBatch` of the program is
posted as one `batch_isend_irecv` (one NCCL group) when torch reaches its first operation, and the
receives' works are handed to torch, which waits for them before the compute that needs them. Every
message goes untagged (tag 0): on gloo it is then matched by posting order per pair of ranks, as NCCL
matches it, so what runs on CPU is what would run on GPUs. Given `links` (parallel/mesh.link_groups),
a batch goes on its peer's two-rank group, so each pair of ranks has its own NCCL stream.

`ActionListSchedule` runs a synchronous schedule: one flushed step per call, waiting for its sends
at the end. The asynchronous runtime (async_runtime.py) builds on `ProgramRuntime` too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    _Action,
    _add_reduce_grad,
    _add_unshard_reshard,
    _PipelineScheduleRuntime,
)

from .comm_plan import P2PBatch, is_compute, plan_program
from .registry import ScheduleSpec

__all__ = ["ActionListSchedule", "ProgramRuntime", "build_eval_schedule", "build_schedule"]

_COMMS = (SEND_F, SEND_B, RECV_F, RECV_B)


class ProgramRuntime(_PipelineScheduleRuntime):
    """torch's runtime fed with programs whose P2P batches this class posts."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, scale_grads: bool,
                 links: dict | None = None):
        super().__init__(stages=stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        self._links = links or {}  # peer's global rank → the group its messages go on (default: the stages')
        # torch dispatches any action type found here to the function (register_custom_function
        # refuses communication types, its dispatch does not: pinned in test_torch_internals.py).
        for kind in _COMMS:
            self._comp_type_to_function_map[kind] = self._post_batch_at_first_op
        self._stage_by_index = {stage.stage_index: stage for stage in stages}
        self._batches: deque[tuple[_Action, ...]] = deque()  # this call's batches, in program order
        self._ops_left_in_batch = 0
        self._programs_run = 0
        # (the program run that posted it, the batch) for posted batches holding sends, not yet known complete
        self._send_works: list[tuple[int, _PostedBatch]] = []

    def _warmup_p2p(self, stages, has_backward: bool, p2p_done: bool) -> None:
        """Every stage was given its inputs and outputs (models/stage_io.py), so torch's metadata is
        static on every rank: its vote on that (a message through the whole pipeline and back, then a
        host read of the result) is not needed. Overrides torch's private hook (pinned:
        tests/schedules/test_torch_internals.py)."""
        for stage in stages:
            if not stage._user_meta.is_complete_for_forward():
                raise RuntimeError(f"stage {stage.stage_index} was built without its inputs and outputs")
            stage._inference_mode = InferenceMode.STATIC

    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None):
        super()._maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs)
        if stage.is_last and not self._has_backward:
            # torch keeps each forward's outputs for its backward until the next step; a forward-only
            # program has none, and the last stage's outputs are logits: m of them would stay alive.
            stage.fwd_cache.pop(mb_index, None)

    def _lowered(self, program, slot: Callable[[int], int] = lambda j: j) -> tuple[list[_Action], list[tuple]]:
        """(torch's action list for `program`, its batches): a batch's operations stand in the list
        where it is posted; microbatch ids become torch's chunk ids (`slot`)."""
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

    def _run_program(self, flat: list[_Action], batches: list[tuple], *args, **kwargs):
        self.pipeline_order_with_comms = {self.rank: flat}
        self._batches, self._ops_left_in_batch = deque(batches), 0
        self._programs_run += 1
        return super()._step_microbatches(*args, **kwargs)

    def _post_batch_at_first_op(self, action: _Action, ctx) -> None:
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
                    self._stage_by_index[op.stage_index].fwd_cache.pop(op.microbatch_index, None)
        # NCCL returns one work for a whole group: a compute waits for its receive's whole batch.
        for op in ops:
            if op.computation_type == RECV_F:
                self.fwd_recv_ops[(op.stage_index, op.microbatch_index)] = [posted]
            elif op.computation_type == RECV_B:
                self.bwd_recv_ops[(op.stage_index, op.microbatch_index)] = [posted]
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


def _fsdp_lowered(actions, n_microbatches: int):
    """torch's FSDP passes: gather a stage before its first compute, release it after its last, reduce
    its gradient after its last backward."""
    return {r: _add_reduce_grad(_add_unshard_reshard([a for a in ops if a is not None]), n_microbatches)
            for r, ops in actions.items()}


class ActionListSchedule(ProgramRuntime):
    """A synchronous schedule: our checked compute lists, planned (comm_plan.py) and run by torch.

    `eval()` (forward only, e.g. validation loss or logits) runs the same lists with every backward
    removed: each rank keeps its forwards in the training order, so its program stays deadlock-free,
    and the stages are the same objects, so torch's train ↔ eval switch applies."""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, actions,
                 spec: ScheduleSpec | None, links: dict | None = None):
        super().__init__(stages, n_microbatches, loss_fn, scale_grads=True, links=links)
        self.spec = spec
        self.pipeline_order = actions
        self._validate_and_set_stage_mapping(actions)
        stage_to_rank = self.stage_index_to_group_rank.__getitem__
        self._train = self._lowered(plan_program(_fsdp_lowered(actions, n_microbatches), stage_to_rank,
                                                 self._num_stages)[self.rank])
        self._eval = self._lowered(plan_program({r: _add_unshard_reshard(ops) for r, ops in forward_only(actions).items()},
                                                stage_to_rank, self._num_stages)[self.rank])

    def _step_microbatches(self, *args, **kwargs):
        try:
            return self._run_program(*(self._train if self._has_backward else self._eval), *args, **kwargs)
        finally:
            self.wait_for_sends()


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
    """build_eval_schedule's order: GPipe over stages placed in a loop. torch checks a full training
    order, so its backwards (GPipe's, reversed) are listed too; they are never run."""
    local = {r: list(range(r, n_stages, pp_size)) for r in range(pp_size)}
    return {r: [_Action(s, FORWARD, j) for s in local[r] for j in range(n_microbatches)]
            + [_Action(s, FULL_BACKWARD, j) for s in reversed(local[r]) for j in range(n_microbatches)]
            for r in range(pp_size)}


def forward_only(actions):
    """Each rank's forwards in its training order: what `eval()` runs of a schedule's lists."""
    return {r: [a for a in ops if a is not None and a.computation_type == FORWARD] for r, ops in actions.items()}
