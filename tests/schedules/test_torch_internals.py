"""Pins the private torch names hf_asyncpp uses (hf_asyncpp/torch_internals.py) on the installed torch.

These are underscore names with no stability promise. Each test names what the project uses, so a
torch upgrade that changes one fails here, with a precise message, rather than deep inside a
multi-process run. CI runs this file at both ends of the supported range (torch 2.11 and 2.15) and the
full suite at 2.13; where releases differ, the test says which behaviour each release has.
"""

from __future__ import annotations

import inspect
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from hf_asyncpp import torch_internals
from hf_asyncpp.schedules.actions import one_f_one_b_actions, torch_multi_stage_actions
from hf_asyncpp.torch_internals import (
    RELEASE,
    SUPPORTED,
    _Action,
    _add_unshard_reshard,
    _ComputationType,
    _format_pipeline_order,
    _validate_schedule,
)


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


def test_the_installed_torch_is_in_the_supported_range():
    assert SUPPORTED == ((2, 11), (2, 15))
    assert SUPPORTED[0] <= RELEASE <= SUPPORTED[1], torch.__version__


@pytest.mark.parametrize("version, release", [("2.11.0+cu130", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.15.0", (2, 15)),
                                              ("2.16.0.dev20261201", (2, 16))])
def test_a_release_is_read_from_any_build_of_torch(version, release):
    assert torch_internals.release_of(version) == release


def test_setup_cfg_states_the_same_range():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "setup.cfg").read_text()
    assert "torch>=2.11,<2.16" in text


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
# Stage: what hf_asyncpp.schedules.runtime (our own runtime) calls
# --------------------------------------------------------------------------------------------


def test_the_stage_metadata_generation_of_each_release():
    """prepare_stages sets stages up from `inputs_meta` on 2.11 and from `_user_meta` in STATIC
    inference mode from 2.12 on."""
    assert torch_internals.STAGE_METADATA == ("inputs_meta" if RELEASE <= (2, 11) else "inference_mode")
    if torch_internals.STAGE_METADATA == "inference_mode":
        from torch.distributed.pipelining._utils import InferenceMode

        assert InferenceMode.STATIC.name == "STATIC"
        params = list(inspect.signature(PipelineStage._prepare_backward_infra).parameters)
        assert params[:5] == ["self", "num_microbatches", "loss_fn", "target", "received_grad_meta"]
        assert "has_backward" in inspect.signature(PipelineStage._prepare_forward_infra).parameters
    else:
        assert list(inspect.signature(PipelineStage._prepare_backward_infra).parameters) == ["self", "num_microbatches"]


@pytest.fixture
def one_rank_fake_group():
    """A "fake" process group of `world_size` ranks played by this process (no messages move)."""
    created = []

    def start(world_size: int, rank: int):
        dist.init_process_group("fake", store=torch_internals.fake_store(), rank=rank, world_size=world_size)
        created.append(True)

    yield start
    if created:
        dist.destroy_process_group()


def _linear_stage(stage_index: int, n_stages: int, microbatch: int = 3):
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    example = torch.empty(microbatch, 4, device="meta")
    # A later stage's input requires grad (models/stage_io.py marks it so): its gradient flows back.
    inputs = example.clone().requires_grad_(stage_index > 0)
    return module, PipelineStage(module, stage_index, n_stages, torch.device("cpu"), inputs, example)


def test_a_prepared_stage_computes_what_autograd_computes(one_rank_fake_group):
    """A one-stage pipeline run through the chunk methods the runtime calls: the gradient of two
    microbatches' summed losses, scaled by 1/2 at REDUCE_GRAD, equals plain autograd's of their mean."""
    one_rank_fake_group(1, 0)
    module, stage = _linear_stage(0, 1)
    loss_fn = lambda out, target: ((out - target) ** 2).sum()  # noqa: E731
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    torch_internals.prepare_stages([stage], 2, True, loss_fn, (x[:3],), y[:3])
    for chunk in range(2):
        output = stage.forward_one_chunk(chunk, (x[3 * chunk:3 * chunk + 3],), {}, save_forward_output=True)
        loss = loss_fn(output, y[3 * chunk:3 * chunk + 3])
        stage.backward_one_chunk(chunk, loss=loss, full_backward=True, last_backward=chunk == 1)
    stage.perform_reduce_grad(2)
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    ((loss_fn(module(x[:3]), y[:3]) + loss_fn(module(x[3:]), y[3:])) / 2).backward()
    for got, want in zip(grads, (p.grad for p in module.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32, same ops, summation order only
    assert len(stage.output_chunks) == 2


def test_a_forward_only_stage_can_forget_a_forward(one_rank_fake_group):
    """forget_forward drops what a stage keeps of a forward for its backward (`fwd_cache` up to 2.14,
    `_forward_chunk_states` on 2.15); a forward-only program calls it once a forward is used."""
    one_rank_fake_group(1, 0)
    _, stage = _linear_stage(0, 1)
    torch_internals.prepare_stages([stage], 1, False, None, (torch.randn(3, 4),))
    with torch.no_grad():
        stage.forward_one_chunk(0, (torch.randn(3, 4),), {}, save_forward_output=False)
    saved = stage.fwd_cache if hasattr(stage, "fwd_cache") else stage._forward_chunk_states
    assert 0 in saved
    torch_internals.forget_forward(stage, 0)
    assert 0 not in saved


def test_a_later_stage_receives_into_buffers_of_its_static_input_shape(one_rank_fake_group):
    """A stage after the first receives its input into a buffer per chunk: allocated at set-up up to
    2.14, when its receive is posted on 2.15; receive_buffers lists those that exist."""
    one_rank_fake_group(2, 1)
    _, stage = _linear_stage(1, 2)
    torch_internals.prepare_stages([stage], 2, True, lambda out, target: out.sum(), ())
    ops = stage.get_fwd_recv_ops(0)
    assert [(op.tensor.shape, op.peer) for op in ops] == [(torch.Size([3, 4]), 0)]
    buffers = torch_internals.receive_buffers(stage)
    assert any(b is ops[0].tensor for b in buffers)
    assert len(buffers) == (1 if RELEASE >= (2, 15) else 2)


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


def test_add_unshard_reshard_gathers_a_stage_before_its_first_compute_and_releases_it_after():
    """The forward-only (evaluation) program of FSDP stages relies on it (schedules/runtime.py)."""
    program = _add_unshard_reshard(parse({0: "0F0 0F1"})[0])
    assert " ".join(str(a) for a in program) == "0UNSHARD 0F0 0F1 0RESHARD"


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
    """update/gradients.py all-reduces a stage's gradients as one flat buffer."""
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


def test_foreach_arithmetic_used_by_error_feedback():
    from hf_asyncpp.torch_internals import _foreach_add_, _foreach_sub_

    a, b = [torch.ones(2)], [torch.full((2,), 3.0)]
    _foreach_sub_(a, b)
    assert torch.equal(a[0], torch.full((2,), -2.0))
    _foreach_add_(a, b, alpha=0.5)
    assert torch.equal(a[0], torch.full((2,), -0.5))


def test_the_flat_collectives_are_the_releases_undeprecated_names():
    """FSDP's gathered state moves through one flat all-gather / reduce-scatter: the `_single` names where
    the release has them (2.13 deprecates the old ones), the `_tensor` ones before, called alike (what
    they move: tests/parallel/test_fsdp.py)."""
    newest = hasattr(dist, "all_gather_single")
    assert torch_internals.all_gather_flat is (dist.all_gather_single if newest else dist.all_gather_into_tensor)
    assert torch_internals.reduce_scatter_flat is (dist.reduce_scatter_single if newest else dist.reduce_scatter_tensor)
    assert list(inspect.signature(torch_internals.all_gather_flat).parameters)[:3] == ["output_tensor", "input_tensor",
                                                                                         "group"]
    assert list(inspect.signature(torch_internals.reduce_scatter_flat).parameters)[:2] == ["output", "input"]


def test_process_group_abort_and_timeout_used_by_the_mesh():
    """parallel/mesh.py aborts a group whose peer is lost and sets a group's timeout through c10d's private
    helpers (their behaviour: tests/parallel/test_mesh.py)."""
    from torch.distributed import distributed_c10d

    assert list(inspect.signature(distributed_c10d._abort_process_group).parameters)[:1] == ["group"]
    assert list(inspect.signature(distributed_c10d._set_pg_timeout).parameters)[:2] == ["timeout", "group"]


def test_module_slots_fake_tensors_and_the_grouped_mm_op():
    """models/construct.py fills a module's own `_parameters` / `_buffers` (own_slots); fake_kernels.py
    registers a fake kernel for `aten._grouped_mm`; the memory tracker reads a DTensor's shard."""
    from torch.distributed.tensor import DTensor

    from hf_asyncpp.torch_internals import (
        FakeTensor,
        FakeTensorMode,
        local_shard,
        own_slots,
    )

    module = torch.nn.Linear(2, 2)
    parameters, buffers = own_slots(module)
    assert set(parameters) == {"weight", "bias"} and isinstance(buffers, dict)
    assert parameters is module._parameters
    assert hasattr(torch.ops.aten, "_grouped_mm")
    assert "_local_tensor" in DTensor.__slots__
    plain = torch.ones(1)
    assert local_shard(plain) is plain
    with FakeTensorMode():
        assert isinstance(torch.empty(2), FakeTensor)


def test_fsdp_s_unsharded_copies_and_gradient_sums_are_found_while_they_hold_memory(one_rank_fake_group):
    """fsdp_unsharded finds FSDP2's gathered compute copies while a module is unsharded (none once it is
    resharded), and its unsharded gradients kept across microbatches before their reduction: the
    reduce-dtype sums up to 2.14, the unsharded grad on 2.15 (param groups: one per module on 2.11, a
    list from 2.12)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    one_rank_fake_group(1, 0)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    fully_shard(module, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert torch_internals.fsdp_unsharded([module]) == ([], [])
    module.set_requires_gradient_sync(False)  # microbatches accumulate; the reduction waits for the last
    output = module(torch.randn(3, 4))
    copies, grads = torch_internals.fsdp_unsharded([module])
    assert sum(c.numel() for c in copies) == sum(p.numel() for p in module.parameters()) and not grads
    assert all(c.dtype == torch.bfloat16 for c in copies)
    output.float().sum().backward()  # then resharded (FSDP's default after a backward)
    copies, grads = torch_internals.fsdp_unsharded([module])
    assert not copies and sorted(g.numel() for g in grads) == sorted(p.numel() for p in module.parameters())
