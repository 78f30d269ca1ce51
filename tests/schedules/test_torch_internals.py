"""Pins the private torch.distributed.pipelining APIs hf_asyncpp.schedules is built on.

These are underscore names with no stability promise. Each test names what the project uses, so a
torch upgrade that changes one fails here, with a precise message, rather than deep inside a
multi-process run. Update the project and these pins together.
"""

from __future__ import annotations

import inspect
import re
from unittest import mock

import pytest
import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_reduce_grad,
    _add_unshard_reshard,
    _ComputationType,
    _format_pipeline_order,
    _PipelineScheduleRuntime,
    _validate_schedule,
)

from hf_asyncpp.schedules.actions import one_f_one_b_actions, torch_multi_stage_actions


def parse(table: dict[int, str]) -> dict[int, list[_Action]]:
    return {r: [_Action.from_str(t) for t in ops.split()] for r, ops in table.items()}


def as_text(program) -> dict[int, str]:
    return {r: " ".join(str(a) for a in ops) for r, ops in program.items()}


def mock_stage(pp_size: int, n_stages: int, rank: int = 0):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages = rank, pp_size, n_stages
    stage.stage_index = rank
    stage.submod = None
    return stage


def test_torch_version_is_2_13():
    """The pins below were taken on torch 2.13; on another version re-check them all."""
    assert torch.__version__.startswith("2.13"), torch.__version__


# --------------------------------------------------------------------------------------------
# _Action and _ComputationType
# --------------------------------------------------------------------------------------------


def test_action_is_a_named_tuple_with_these_fields():
    assert _Action._fields == ("stage_index", "computation_type", "microbatch_index", "sub_actions")
    action = _Action(0, _ComputationType.FORWARD, 3)
    assert (action.stage_index, action.computation_type, action.microbatch_index, action.sub_actions) == (
        0,
        _ComputationType.FORWARD,
        3,
        None,
    )
    assert action == _Action(0, _ComputationType.FORWARD, 3)  # value equality: usable in sets and ==
    assert hash(action) == hash(_Action(0, _ComputationType.FORWARD, 3))


@pytest.mark.parametrize(
    "text, stage, kind, mb",
    [
        ("0F3", 0, "FORWARD", 3),
        ("1B0", 1, "FULL_BACKWARD", 0),
        ("2I1", 2, "BACKWARD_INPUT", 1),
        ("2W1", 2, "BACKWARD_WEIGHT", 1),
        ("0SEND_F1", 0, "SEND_F", 1),
        ("1RECV_F1", 1, "RECV_F", 1),
        ("1SEND_B0", 1, "SEND_B", 0),
        ("0RECV_B0", 0, "RECV_B", 0),
        ("0REDUCE_GRAD", 0, "REDUCE_GRAD", None),
    ],
)
def test_action_text_form_round_trips(text, stage, kind, mb):
    action = _Action.from_str(text)
    assert action == _Action(stage, _ComputationType[kind], mb)
    assert str(action) == text
    assert repr(action) == text


@pytest.mark.parametrize(
    "member, value",
    [
        ("FORWARD", "F"),
        ("FULL_BACKWARD", "B"),
        ("BACKWARD_INPUT", "I"),
        ("BACKWARD_WEIGHT", "W"),
        ("SEND_F", "SEND_F"),
        ("RECV_F", "RECV_F"),
        ("SEND_B", "SEND_B"),
        ("RECV_B", "RECV_B"),
        ("REDUCE_GRAD", "REDUCE_GRAD"),
    ],
)
def test_computation_type_values_used(member, value):
    assert _ComputationType[member].value == value


@pytest.mark.parametrize(
    "alias, member",
    [
        ("F", "FORWARD"),
        ("B", "FULL_BACKWARD"),
        ("I", "BACKWARD_INPUT"),
        ("W", "BACKWARD_WEIGHT"),
        ("FORWARD", "FORWARD"),
        ("FULL_BACKWARD", "FULL_BACKWARD"),
        ("BACKWARD_INPUT", "BACKWARD_INPUT"),
        ("BACKWARD_WEIGHT", "BACKWARD_WEIGHT"),
        ("SEND_F", "SEND_F"),
        ("RECV_F", "RECV_F"),
        ("SEND_B", "SEND_B"),
        ("RECV_B", "RECV_B"),
        ("REDUCE_GRAD", "REDUCE_GRAD"),
    ],
)
def test_module_level_aliases_imported_by_the_project(alias, member):
    assert getattr(torch_schedules, alias) is _ComputationType[member]


# --------------------------------------------------------------------------------------------
# _validate_schedule and _format_pipeline_order
# --------------------------------------------------------------------------------------------


def test_validate_schedule_signature():
    assert list(inspect.signature(_validate_schedule).parameters) == [
        "actions",
        "pp_group_size",
        "num_stages",
        "num_microbatches",
    ]


def test_validate_schedule_returns_the_stage_to_rank_map():
    assert _validate_schedule(one_f_one_b_actions(2, 4), 2, 2, 4) == {0: 0, 1: 1}
    interleaved = torch_multi_stage_actions(torch_schedules.ScheduleInterleaved1F1B, 2, 4)
    assert _validate_schedule(interleaved, 2, 4, 4) == {0: 0, 1: 1, 2: 0, 3: 1}
    zbv = torch_multi_stage_actions(torch_schedules.ScheduleZBVZeroBubble, 2, 4)
    assert _validate_schedule(zbv, 2, 4, 4) == {0: 0, 1: 1, 2: 1, 3: 0}


def test_validate_schedule_raises_assertion_error_with_the_table():
    with pytest.raises(AssertionError) as info:
        _validate_schedule(parse({0: "0B0 0F0"}), 1, 1, 1)
    message = str(info.value)
    assert message.startswith("Rank 0, step 0: Running Full Backward for stage 0, microbatch 0 without first running Forward")
    assert "Full pipeline schedule:" in message and "<-- ERROR HERE" in message


def test_format_pipeline_order_is_a_rank_by_step_table():
    table = _format_pipeline_order({0: [_Action.from_str("0F0"), None], 1: [_Action.from_str("1F0")]}, error_step_number=1)
    lines = table.splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1"]
    assert lines[1].split() == ["Step", "0:", "0F0", "1F0"]
    assert lines[2].startswith("Step 1:") and lines[2].endswith("<-- ERROR HERE")


# --------------------------------------------------------------------------------------------
# Runtime and stage: what hf_asyncpp.schedules.runtime and the engine call
# --------------------------------------------------------------------------------------------


def test_runtime_sets_the_stage_to_rank_map_from_compute_lists_without_a_process_group():
    """ActionListSchedule takes torch's stage → rank map from its lists; the program is ours."""
    runtime = _PipelineScheduleRuntime(
        stages=[mock_stage(2, 2)], n_microbatches=4, loss_fn=lambda out, target: out, scale_grads=True
    )
    runtime._validate_and_set_stage_mapping(one_f_one_b_actions(2, 4))
    assert runtime.stage_index_to_group_rank == {0: 0, 1: 1}
    assert runtime._num_stages == 2 and runtime.rank == 0
    assert hasattr(runtime, "_has_backward")


def test_add_reduce_grad_reduces_a_stage_after_its_last_backward():
    """Synchronous FSDP stages reduce their gradient once per step (schedules/runtime.py)."""
    program = _add_reduce_grad(parse({0: "0F0 0F1 0B0 0B1"})[0], 2)
    assert " ".join(str(a) for a in program) == "0F0 0F1 0B0 0B1 0REDUCE_GRAD"


def test_runtime_dispatches_any_action_type_registered_in_its_function_map():
    """ProgramRuntime posts its P2P batches by putting SEND_F/SEND_B/RECV_F/RECV_B into this map
    (register_custom_function refuses them, the dispatch does not), and the asynchronous runtime
    registers REDUCE_GRAD as a stage's update."""
    runtime = _PipelineScheduleRuntime(stages=[mock_stage(2, 2)], n_microbatches=1, loss_fn=None)
    assert runtime._comp_type_to_function_map == {}
    runtime.register_custom_function(_ComputationType.REDUCE_GRAD, lambda action, ctx: None)
    source = inspect.getsource(_PipelineScheduleRuntime._step_microbatches)
    dispatch = source.index("if action.computation_type in self._comp_type_to_function_map:")
    assert dispatch < source.index("_perform_action(action)"), "the map must be consulted before torch's own handling"
    assert "self._comp_type_to_function_map[action.computation_type](" in source


def test_runtime_waits_for_the_receive_works_it_finds_under_stage_and_chunk():
    """ProgramRuntime hands the works of each posted batch to torch under (stage, chunk); torch pops
    and waits for them right before the forward or backward that needs the message."""
    runtime = _PipelineScheduleRuntime(stages=[mock_stage(2, 2)], n_microbatches=1, loss_fn=None)
    assert runtime.fwd_recv_ops == {} and runtime.bwd_recv_ops == {}
    source = inspect.getsource(_PipelineScheduleRuntime._step_microbatches)
    assert "_wait_batch_p2p(self.fwd_recv_ops.pop((stage_idx, mb_index)))" in source
    assert "_wait_batch_p2p(self.bwd_recv_ops.pop((stage_idx, mb_index)))" in source
    assert "w.wait()" in inspect.getsource(torch_schedules._wait_batch_p2p)


def test_runtime_has_the_step_hooks_the_project_overrides():
    for name in ("_step_microbatches", "step", "eval"):
        assert callable(getattr(_PipelineScheduleRuntime, name, None)), name


@pytest.mark.parametrize(
    "method, params",
    [
        ("forward_one_chunk", [("fwd_chunk_id",), ("args",), ("kwargs", None), ("save_forward_output", True)]),
        ("backward_one_chunk", [("bwd_chunk_id",), ("loss", None), ("full_backward", True), ("last_backward", False)]),
        ("backward_weight_one_chunk", [("bwd_chunk_id",), ("last_backward", False)]),
    ],
)
def test_hooked_stage_overrides_the_stage_compute_methods_with_torchs_parameters(method, params):
    """HookedStage (schedules/stage_hooks.py) runs its hooks around these three, passing every
    parameter on to torch's: an upgrade that adds or renames one must change the overrides too."""
    from hf_asyncpp.schedules.stage_hooks import HookedStage

    def listed(fn):
        return [(p.name,) if p.default is inspect.Parameter.empty else (p.name, p.default)
                for p in list(inspect.signature(fn).parameters.values())[1:]]

    assert listed(getattr(PipelineStage, method)) == params
    assert listed(getattr(HookedStage, method)) == params
    assert getattr(HookedStage, method) is not getattr(PipelineStage, method)


def test_the_runtime_computes_on_a_stage_only_through_its_three_compute_methods():
    """Every compute action torch's runtime dispatches reaches a stage through the methods
    HookedStage overrides, looked up on the stage and called with these keywords; it never runs the
    stage's module itself. So the hooks see every forward, full backward, backward-input and
    backward-weight of a program."""
    source = inspect.getsource(_PipelineScheduleRuntime._step_microbatches)
    assert source.count("stage.forward_one_chunk(") == 1 and "save_forward_output=return_outputs" in source
    assert source.count("stage.backward_one_chunk(") == 2
    assert "full_backward=True" in source and "full_backward=False" in source
    assert source.count("stage.backward_weight_one_chunk(") == 1
    assert "submod(" not in source and "forward_maybe_with_nosync" not in source and "backward_maybe" not in source


def test_multi_stage_schedules_build_their_order_from_mock_stages():
    """torch_multi_stage_actions relies on this: the order is computed at construction, for all ranks."""
    for cls in (torch_schedules.ScheduleInterleaved1F1B, torch_schedules.ScheduleZBVZeroBubble):
        schedule = cls([mock_stage(2, 4), mock_stage(2, 4)], 4)
        assert sorted(schedule.pipeline_order) == [0, 1]


# --- what the asynchronous runtime relies on --------------------------------------------------


@pytest.mark.parametrize(
    "method, first_params",
    [
        ("get_fwd_send_ops", ["self", "fwd_chunk_id"]),
        ("get_bwd_send_ops", ["self", "bwd_chunk_id"]),
        ("get_fwd_recv_ops", ["self", "fwd_chunk_id"]),
        ("get_bwd_recv_ops", ["self", "bwd_chunk_id"]),
    ],
)
def test_pipeline_stage_p2p_op_builders(method, first_params):
    """ProgramRuntime builds each batch's operations from these (schedules/runtime.py)."""
    fn = getattr(PipelineStage, method, None)
    assert callable(fn), method
    assert list(inspect.signature(fn).parameters)[: len(first_params)] == first_params


def test_stage_p2p_ops_carry_tag_zero():
    """NCCL ignores tags; the runtime relies on none, and the stage's operations carry the default 0,
    so gloo matches them by posting order per pair of ranks, as NCCL does."""
    import torch.distributed as dist

    assert inspect.signature(dist.P2POp.__init__).parameters["tag"].default == 0
    for method in ("get_fwd_send_ops", "get_bwd_send_ops", "_get_recv_ops"):
        source = inspect.getsource(getattr(PipelineStage, method))
        assert "dist.P2POp(" in source and not re.search(r"\btag\b", source), method


def test_stage_p2p_ops_name_their_peer_by_global_rank():
    """The runtime moves each of a stage's operations onto its peer's two-rank group by rebuilding it
    from `op`, `tensor` and `peer` (schedules/runtime.py): P2POp must keep the peer's global rank there."""
    import torch.distributed as dist

    assert list(inspect.signature(dist.P2POp.__init__).parameters)[:5] == ["self", "op", "tensor", "peer", "group"]
    assert "return_global=True" in inspect.getsource(dist.P2POp.__init__)
    for method in ("get_fwd_send_ops", "get_bwd_send_ops", "_get_recv_ops"):
        assert "peer_global_rank" in inspect.getsource(getattr(PipelineStage, method)), method


def test_runtime_state_the_programs_are_run_with():
    """ProgramRuntime sets torch's program (`pipeline_order_with_comms`, rank → actions) before each
    run; the asynchronous runtime computes its losses with the schedule's `_loss_fn` and walks
    `_stages`; a forward-only program drops a forward's cached outputs from the stage's `fwd_cache`
    (chunk id → (outputs, inputs)) once used."""
    loss_fn = lambda out, target: out  # noqa: E731
    stage = mock_stage(2, 2)
    runtime = _PipelineScheduleRuntime(stages=[stage], n_microbatches=1, loss_fn=loss_fn)
    assert runtime._loss_fn is loss_fn and runtime._stages == [stage] and runtime._has_backward
    assert "self.pipeline_order_with_comms[self.rank]" in inspect.getsource(_PipelineScheduleRuntime._step_microbatches)
    assert "self.fwd_cache[fwd_chunk_id] = (" in inspect.getsource(PipelineStage.forward_one_chunk)
    assert "self.fwd_cache.pop(bwd_chunk_id)" in inspect.getsource(PipelineStage.backward_one_chunk)


def test_runtime_hooks_used_by_the_async_runtime():
    params = list(inspect.signature(_PipelineScheduleRuntime._step_microbatches).parameters)
    assert params[:6] == ["self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs"]
    for hook in ("_maybe_compute_loss", "_maybe_get_loss", "_compute_loss", "_initialize_stages"):
        assert callable(getattr(_PipelineScheduleRuntime, hook, None)), hook
    # step() sets the stages' has_backward before running; the async runtime does the same itself.
    assert "stage.has_backward = self._has_backward" in inspect.getsource(torch_schedules.PipelineScheduleMulti.step)


def test_add_unshard_reshard_gathers_a_stage_before_its_first_compute_and_releases_it_after():
    """The forward-only (evaluation) program of FSDP stages relies on it (schedules/runtime.py)."""
    program = _add_unshard_reshard(parse({0: "0F0 0F1"})[0])
    assert " ".join(str(a) for a in program) == "0UNSHARD 0F0 0F1 0RESHARD"


def test_runtime_records_whether_its_stages_were_initialised():
    """The asynchronous runtime gives torch's one-time shape inference a microbatch in slot 0 when a
    resumed run's first segment has none there (schedules/async_runtime.py)."""
    source = inspect.getsource(torch_schedules.PipelineScheduleMulti._initialize_stages)
    assert "_stages_forward_initialized" in source
    source = inspect.getsource(_PipelineScheduleRuntime._step_microbatches)
    assert "target_mbs[0]" in source and "arg_mbs[0]" in source


# --- static stage metadata and fake tensors ----------------------------------------------------


def test_runtime_asks_a_warmup_hook_for_the_stages_inference_mode():
    """ProgramRuntime overrides `_warmup_p2p` to mark every stage's metadata static (its stages are
    given their inputs and outputs, models/stage_io.py) instead of torch's vote."""
    from torch.distributed.pipelining._utils import InferenceMode

    source = inspect.getsource(torch_schedules._PipelineSchedule._initialize_pp_stages)
    assert "self._warmup_p2p(stages, self._has_backward, p2p_done)" in source
    assert list(inspect.signature(torch_schedules._PipelineSchedule._warmup_p2p).parameters) == [
        "self", "stages", "has_backward", "p2p_done"]
    assert InferenceMode.STATIC.name == "STATIC"
    stage_source = inspect.getsource(PipelineStage._prepare_forward_infra)
    assert "self._inference_mode == InferenceMode.DYNAMIC" in stage_source
    assert "self._stage_meta.inputs = self._user_meta.inputs" in stage_source
    assert "is_complete_for_forward" in dir(torch.distributed.pipelining._utils._StageMeta)


def test_fake_tensor_internals_used_by_stage_io_and_the_plan():
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # noqa: F401
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    assert isinstance(fake_impls.op_implementations_dict, dict)
    assert callable(fake_impls.register_op_impl) and callable(fake_impls.in_kernel_invocation_manager)
    assert "fake" in torch.distributed.Backend.backend_list


# --- private APIs outside torch.distributed.pipelining ------------------------------------------
# (`distributed_c10d._abort_process_group` and `_set_pg_timeout` are pinned by their behaviour on gloo
# groups in tests/parallel/test_mesh.py.)


def test_muon_learning_rate_scaling_is_torchs():
    """optim/muon.py scales each matrix's lr as torch's Muon does, with its private helper."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr  # noqa: F401

    assert list(inspect.signature(_adjust_lr).parameters) == ["lr", "adjust_lr_fn", "param_shape"]
    assert _adjust_lr(0.1, "original", torch.Size([16, 4])) == pytest.approx(0.2)  # lr · √max(1, rows / cols)


def test_flat_dense_tensor_buffers_round_trip():
    """updates.py all-reduces a stage's gradients as one flat buffer."""
    grads = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    flat = torch._utils._flatten_dense_tensors(grads)
    assert flat.shape == (10,)
    assert all(torch.equal(a, b) for a, b in zip(torch._utils._unflatten_dense_tensors(flat, grads), grads))


def test_dispatch_mode_pytree_and_dtensor_internals_of_the_memory_tracker():
    """planning/memory_tracker.py: a dispatch mode flattening each op's outputs, and a DTensor's
    storage is its local shard's."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
    from torch.utils._pytree import tree_flatten

    assert tree_flatten((torch.ones(1), [torch.zeros(2)]))[0][1].shape == (2,)
    assert "_local_tensor" in DTensor.__slots__


def test_foreach_subtraction_used_by_error_feedback():
    a, b = [torch.ones(2)], [torch.full((2,), 3.0)]
    assert torch.equal(torch._foreach_sub(a, b)[0], torch.full((2,), -2.0))
    torch._foreach_sub_(a, b, alpha=0.5)
    assert torch.equal(a[0], torch.full((2,), -0.5))


def test_process_group_abort_and_timeout_used_by_the_mesh():
    """parallel/mesh.py aborts a group whose peer is lost and sets a group's timeout through c10d's private
    helpers (their behaviour: tests/parallel/test_mesh.py)."""
    from torch.distributed import distributed_c10d

    assert list(inspect.signature(distributed_c10d._abort_process_group).parameters)[:1] == ["group"]
    assert list(inspect.signature(distributed_c10d._set_pg_timeout).parameters)[:2] == ["timeout", "group"]


def test_dynamo_disable_module_internals_and_the_grouped_mm_op():
    """torch._dynamo.disable keeps per-layer compilation off the stage wrapper and routing hooks; models/
    construct.py fills a module's own `_parameters` / `_buffers`; fake_kernels.py registers a fake kernel
    for `aten._grouped_mm`."""
    import torch._dynamo

    assert callable(torch._dynamo.disable)
    module = torch.nn.Linear(2, 2)
    assert set(module._parameters) == {"weight", "bias"} and isinstance(module._buffers, dict)
    assert hasattr(torch.ops.aten, "_grouped_mm")
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        assert isinstance(torch.empty(2), FakeTensor)
