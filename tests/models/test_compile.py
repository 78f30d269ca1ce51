"""Compiled decoder layers (`compile_layers`) compute what the eager ones compute.

Specification:
  - a stage whose decoder layers are compiled gives the losses and gradients of the eager stage, for
    MoE and dense families, with and without activation checkpointing;
  - every layer of a stage runs through the same graphs (compiled once, whatever the depth);
  - under weight stashing each weight version runs through the compiled layers on its own tensors:
    alternating two versions gives each version's eager gradient (a graph that kept the first
    version's weights as constants would give the first version's gradient for both);
  - pipelines, synchronous (1F1B) and asynchronous (PipeDream-2BW), train to the eager run's losses
    and weights.

Tolerance: inductor fuses elementwise chains and reorders fp32 reductions, so values differ from
eager ones by a few ulps (relative ~1e-6). One SGD step (lr 0.5) carries such gradient differences
into the weights at ~lr × 1e-6; the bounds below (2e-5 on losses and gradients relative to their
largest entry, 1e-5 absolute on weights after 5 steps, 2e-6 on pipeline losses of ~4.9, i.e. 4 fp32
ulps) leave margins of 4–10× over what is seen (≤ 2.3e-6 on gradients, ≤ 2.3e-6 on weights, 3.6e-7
on losses) and fail on any real difference, such as a gradient taken on the wrong weight version
(~1e-2).

Backends: inductor's own numerics are checked on one MoE family (Qwen3-MoE, with and without
checkpointing) and one dense family. The DeepSeek-V3 stage and the two-rank pipelines compile with
`aot_eager`: the same dynamo capture and AOT-autograd graphs (what decides that weights are graph
inputs and that every version reuses one graph), run with eager kernels. CPU inductor's C++ code
generation costs ~35 CPU-s per MoE family in every fresh process, and it is not the backend our GPUs
run; benchmarks/gpu_stage.py compiles with inductor on a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from hf_asyncpp.models import build_stages, plan_stages
from hf_asyncpp.models.compile import compile_layers
from hf_asyncpp.models.recompute import apply_activation_checkpointing
from hf_asyncpp.update.versions import VersionedStage

from tests.models.test_recompute import _loss
from tests.ranks import run_ranks
from tests.test_engine import small_model_config

# Inductor builds its kernels in compile worker processes.
pytestmark = pytest.mark.launch

TOL = 2e-5
INDUCTOR_CHECKED = {"tiny-qwen3-moe", "tiny-llama"}


@contextlib.contextmanager
def _backend(backend: str):
    """`torch.compile` (as compile_layers calls it) with this backend, inside the block."""
    real = torch.compile
    torch.compile = functools.partial(real, backend=backend)
    try:
        yield
    finally:
        torch.compile = real


def _stage(preset: str, compiled: bool, checkpointing: str = "none"):
    config = small_model_config(preset)
    (stage,) = build_stages(config, plan_stages(config, 1), [0], "cpu", seed=2)
    if compiled:
        compile_layers(stage, checkpointing)
    apply_activation_checkpointing(stage, checkpointing)
    return stage


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _loss_and_grads(stage, rows):
    loss = _loss(stage, rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("preset,checkpointing", [("tiny-qwen3-moe", "none"), ("tiny-qwen3-moe", "full"),
                                                  ("tiny-qwen3-moe", "selective"), ("tiny-deepseek-v3", "none"),
                                                  ("tiny-llama", "none")])
def test_compiled_layers_give_the_eager_losses_and_gradients(preset, checkpointing):
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    eager_loss, eager = _loss_and_grads(_stage(preset, False, checkpointing), rows)
    with _backend("inductor" if preset in INDUCTOR_CHECKED else "aot_eager"):
        compiled = _stage(preset, True, checkpointing)
    for _ in range(2):  # the second call reuses the graphs
        loss, grads = _loss_and_grads(compiled, rows)
        assert _relative(loss, eager_loss) <= TOL
        assert grads.keys() == eager.keys()
        assert max(_relative(grads[n], eager[n]) for n in eager) <= TOL


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_layers_of_a_stage_share_their_graphs(checkpointing):
    """Compilation is paid once per kind of layer, not once per layer: a stage four times as deep
    compiles no more graphs (a per-layer recompilation would also hit dynamo's recompile limit of 8
    and leave deeper layers silently eager)."""
    from torch._dynamo.utils import counters

    graphs = {}
    for n_layers in (2, 8):
        torch._dynamo.reset()
        counters.clear()
        config = small_model_config("tiny-qwen3-moe")
        config.num_hidden_layers = n_layers
        (stage,) = build_stages(config, plan_stages(config, 1), [0], "cpu", seed=2)
        compile_layers(stage, checkpointing)
        apply_activation_checkpointing(stage, checkpointing)
        _loss_and_grads(stage, torch.randint(0, 128, (2, 16)))
        graphs[n_layers] = counters["stats"]["unique_graphs"]
    assert graphs[2] >= 1 and graphs[8] == graphs[2], graphs


def test_each_weight_version_runs_through_the_compiled_layers_on_its_own_weights():
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for compiled in (False, True):
        versioned = VersionedStage(_stage("tiny-qwen3-moe", compiled), n_buffers=2)
        with torch.no_grad():  # version 1: different weights
            for tensor in versioned.buffers_[1].values():
                tensor.mul_(1.5) if tensor.is_floating_point() else None
        results[compiled] = []
        for buffer in (0, 1, 0, 1):
            versioned.active = buffer
            loss = _loss(versioned, rows)
            loss.backward()
            weights = versioned.compute_copy(buffer)
            results[compiled].append((loss.detach(), {n: t.grad.clone() for n, t in weights.items() if t.grad is not None}))
            for t in weights.values():
                t.grad = None
    for (eager_loss, eager), (loss, grads) in zip(results[False], results[True]):
        assert _relative(loss, eager_loss) <= TOL
        assert eager and max(_relative(grads[n], eager[n]) for n in eager) <= TOL
    assert _relative(results[False][0][0], results[False][1][0]) > 100 * TOL  # the versions do differ


def _pipeline(rank, world_size, schedule):
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.parallel.test_fsdp import _train

    layout = init_parallel(read_launch(), 2)
    try:
        with _backend("aot_eager"):
            runs = {compiled: _train(layout, "tiny-qwen3-moe", schedule, "sgd", fsdp=False, compile_layers=compiled)[:2]
                    for compiled in (False, True)}
    finally:
        shutdown_parallel()
    (eager, eager_losses), (compiled, losses) = runs[False], runs[True]
    return dict(weights=max((compiled[n] - eager[n]).abs().max().item() for n in eager),
                losses=max(abs(a - b) for a, b in zip(losses, eager_losses)))


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream-2bw"])
def test_pipelines_with_compiled_layers_train_to_the_eager_losses_and_weights(schedule):
    for report in run_ranks(2, _pipeline, schedule):
        assert report["weights"] <= 1e-5 and report["losses"] <= 2e-6, report
