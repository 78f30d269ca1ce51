"""Every private torch name hf_asyncpp uses, in one place, with what each supported release offers.

hf_asyncpp supports torch 2.11 to 2.15 (`SUPPORTED`). The pipeline's runtime is its own
(schedules/runtime.py): it runs action lists on `PipelineStage`'s public chunk methods
(`forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk`, `perform_reduce_grad`, the
`get_*_ops` P2P builders), so torch's private schedule runtime, which changed in every release of the
range, is not used. What remains private is listed here; tests/schedules/test_torch_internals.py pins
each name's behaviour on the installed release, and CI runs it at both ends of the range.

| name | used by | releases |
|---|---|---|
| `schedules._Action`, `_ComputationType` and its aliases | action lists as data | 2.11–2.15 (2.15 adds WAIT_SEND_*, WAIT_REDUCE_GRAD: unused) |
| `schedules._add_unshard_reshard` | FSDP gather / release around a stage's computes | 2.11–2.15 (2.15 adds keyword options: unused) |
| `schedules._validate_schedule`, `_format_pipeline_order` | schedule checks and their rank × step table | 2.11–2.15 |
| stage metadata set-up (`prepare_stages`) | each stage's receive buffers from its static inputs and outputs | two generations: `inputs_meta` (2.11), `_user_meta` + inference mode (2.12–2.14), the same decided by a distributed vote (2.15; not needed: every stage is static) |
| a forward's saved state (`forget_forward`) | a forward-only program frees what a backward would need | `fwd_cache` (≤ 2.14), `_forward_chunk_states` (2.15) |
| receive buffers (`receive_buffers`) | memory accounting | `args_recv_info` / `grad_recv_info` (2.15 allocates them lazily: None until posted) |
| `_subclasses.fake_tensor`, `_subclasses.fake_impls` | stage shapes and memory plans on fake tensors | 2.11–2.15 |
| `testing._internal.distributed.fake_pg.FakeStore` | one process playing any rank (`hf-asyncpp plan`) | 2.11–2.15 (2.15: a C++ class, same import) |
| `distributed_c10d._abort_process_group`, `_set_pg_timeout` | a lost peer's group aborted; group timeouts | 2.11–2.15 |
| `optim._muon` constants and `_adjust_lr` | Muon on whole (gathered) matrices | 2.11–2.15 |
| `_foreach_sub_`, `_foreach_add_`, `_utils._(un)flatten_dense_tensors` | Error Feedback's step; one all-reduce for a stage's gradients | 2.11–2.15 |
| `utils._python_dispatch.TorchDispatchMode`, `utils._pytree.tree_flatten`, DTensor `_local_tensor` (`local_shard`) | the memory tracker | 2.11–2.15 |
| `nn.Module._parameters` / `_buffers` (`own_slots`) | initial values drawn on the CPU for any device | 2.11–2.15 |
| flat all-gather and reduce-scatter (`all_gather_flat`, `reduce_scatter_flat`; public, renamed) | dp-sharded stage state | `all_gather_into_tensor` / `reduce_scatter_tensor` (2.11–2.15; deprecated from 2.13, warning once per process), `all_gather_single` / `reduce_scatter_single` (2.13+): the newer where present |
| FSDP2's unsharded tensors (`fsdp_unsharded`) | the memory plan names gathered compute copies and gradients before their reduction | a module's param groups: `_fsdp_param_group` (2.11), `_fsdp_param_groups` (2.12+); each param's `all_gather_outputs`, `_unsharded_param.grad`, and its reduce-dtype sums `unsharded_accumulated_grad` (a field up to 2.14; 2.15 accumulates in the unsharded grad) |
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import _foreach_add_, _foreach_sub_
from torch._subclasses import fake_impls
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.distributed_c10d import _abort_process_group, _set_pg_timeout
from torch.distributed.pipelining.schedules import (
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
    _ComputationType,
    _format_pipeline_order,
    _validate_schedule,
)
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "BACKWARD_INPUT", "BACKWARD_WEIGHT", "DEFAULT_A", "DEFAULT_B", "DEFAULT_C", "EPS", "FORWARD", "FULL_BACKWARD",
    "RECV_B", "RECV_F", "REDUCE_GRAD", "RESHARD", "RELEASE", "SEND_B", "SEND_F", "STAGE_METADATA", "SUPPORTED",
    "UNSHARD", "FakeTensor", "FakeTensorMode", "TorchDispatchMode", "_Action", "_ComputationType", "_abort_process_group",
    "_flatten_dense_tensors", "_foreach_add_", "_foreach_sub_", "_unflatten_dense_tensors", "_add_unshard_reshard", "_adjust_lr", "_format_pipeline_order", "_set_pg_timeout",
    "_validate_schedule", "all_gather_flat", "fake_impls", "fake_store", "forget_forward", "fsdp_unsharded", "local_shard", "own_slots", "prepare_stages", "receive_buffers",
    "reduce_scatter_flat", "release_of", "tree_flatten", "unset_fake_temporarily",
]

# One tensor gathered from (scattered to) every rank of a group: 2.13 renamed the collectives and deprecates
# the old names, which 2.11 alone has.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The releases supported, oldest and newest (setup.cfg states the same bounds; CI tests both ends).
SUPPORTED = ((2, 11), (2, 15))


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.11.0+cu130" → (2, 11)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


RELEASE = release_of(torch.__version__)

if not SUPPORTED[0] <= RELEASE <= SUPPORTED[1]:
    raise ImportError(f"hf_asyncpp supports torch {SUPPORTED[0][0]}.{SUPPORTED[0][1]} to "
                      f"{SUPPORTED[1][0]}.{SUPPORTED[1][1]}; this is torch {torch.__version__}")

# How a PipelineStage learns its buffers' shapes (see prepare_stages), told apart by what the stage has:
#   "inputs_meta": 2.11: static metadata is `inputs_meta` from the constructor's input_args;
#   "inference_mode": 2.12–2.15: `_user_meta`, used when the stage's `_inference_mode` is STATIC
#   (torch's schedules decide the mode by a vote over all ranks, which static stages do not need).
_STAGE_INIT_SOURCE = torch.distributed.pipelining.PipelineStage.__init__.__code__.co_names
STAGE_METADATA = "inference_mode" if "_user_meta" in _STAGE_INIT_SOURCE else "inputs_meta"


def prepare_stages(stages, n_microbatches: int, has_backward: bool, loss_fn, first_args: tuple = (),
                   target=None) -> None:
    """Set up each local stage for `n_microbatches` chunks (receive buffers, send destinations, the
    backward's gradient buffers) from the inputs and outputs it was constructed with, without the
    metadata messages torch's own schedules exchange. Called before a program runs whenever the stages
    are new or switch between training and forward-only."""
    for stage in stages:
        stage.has_backward = has_backward
    if STAGE_METADATA == "inputs_meta":
        for stage in stages:
            if stage.inputs_meta is None:
                raise RuntimeError(f"stage {stage.stage_index} was built without its inputs and outputs")
            stage._prepare_forward_infra(n_microbatches, first_args if stage.is_first else (), {})
        if has_backward:
            for stage in stages:
                stage._prepare_backward_infra(n_microbatches)
        return
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        if not stage._user_meta.is_complete_for_forward():
            raise RuntimeError(f"stage {stage.stage_index} was built without its inputs and outputs")
        stage._inference_mode = InferenceMode.STATIC
    # Static metadata runs no forward or backward to learn shapes, so torch's backup / cleanup pair
    # around its inference (2.13+: it also drops FSDP gradients) has nothing to undo here.
    for stage in stages:
        stage._prepare_forward_infra(n_microbatches, first_args if stage.is_first else None, {},
                                     has_backward=has_backward)
    if has_backward:
        grad_meta = None
        for stage in reversed(stages):
            grad_meta = stage._prepare_backward_infra(n_microbatches, loss_fn=loss_fn, target=target,
                                                      received_grad_meta=grad_meta)


def forget_forward(stage, chunk_id: int) -> None:
    """Drop what `stage` keeps of chunk `chunk_id`'s forward for its backward (forward-only programs)."""
    saved = stage.fwd_cache if hasattr(stage, "fwd_cache") else stage._forward_chunk_states
    saved.pop(chunk_id, None)


def receive_buffers(stage) -> list[torch.Tensor]:
    """The P2P receive buffers `stage` holds now (activations and gradients, every chunk)."""
    infos = [*stage.args_recv_info.values(), *getattr(stage, "grad_recv_info", {}).values()]
    return [b for group in infos for info in group if isinstance(b := getattr(info, "buffer", None), torch.Tensor)]


def fsdp_unsharded(modules) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FSDP2's unsharded tensors under `modules` that hold memory now: the gathered compute copies of
    the parameters, and their gradients before the reduction (with the sums kept across microbatches)."""
    copies, grads = [], []
    for module in modules:
        for sub in module.modules():
            state = sub._get_fsdp_state() if hasattr(sub, "_get_fsdp_state") else None
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # 2.11: one group per module
                groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
            for param in (p for group in groups for p in group.fsdp_params):
                copies += param.all_gather_outputs
                unsharded = getattr(param, "_unsharded_param", None)
                grads += [getattr(unsharded, "grad", None), param.__dict__.get("unsharded_accumulated_grad")]
    return [t for t in copies if _allocated(t)], [t for t in grads if _allocated(t)]


def _allocated(tensor) -> bool:
    """A tensor whose storage holds memory (FSDP frees a gathered copy by resizing its storage to 0)."""
    return isinstance(tensor, torch.Tensor) and local_shard(tensor).untyped_storage().nbytes() > 0


def own_slots(module: torch.nn.Module) -> tuple[dict, dict]:
    """A module's own parameter and buffer slots (name → tensor): assigning there swaps a tensor in
    without the checks and hooks of `setattr` (models/construct.py draws initial values on the CPU so)."""
    return module._parameters, module._buffers


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a DTensor holds on this rank (itself for a plain tensor), read without dispatching an
    op: the memory tracker runs inside a dispatch mode, where `to_local()` would be one more op."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def fake_store():
    """A store for the "fake" process-group backend: any world size in one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()
