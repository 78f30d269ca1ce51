"""DeepSeek-V3's routing biases follow the delay rule of the weights under asynchronous schedules.

The rule (models/routing_bias.py): minibatch k's bias update is computed from the token loads of
minibatch k's own forwards (all its microbatches, all dp replicas) and applied together with minibatch
k's weight update, and a microbatch routes with the bias of the weight version it is bound to. For
PipeDream-2BW (delay 1, w_k = x_{max(k−1, 0)}): minibatch k runs on (x_{k−1}, b_{k−1}), then
x_{k+1} = x_k − U(g_k) and b_{k+1} = b_k + γ·sign(mean(load_k) − load_k).

Checked here:
  - one process: a stage's microbatches are forwarded in the order of their ids in every
    asynchronous order, also after a resume's replay (what lets the pipeline take a minibatch's loads
    as the oldest ones counted); a weight version holds its own routing biases and routes with them;
  - gloo ranks: the pp 2 pipeline, the one-process emulator at depth 2 and a direct recursion written
    here (HF model, AdamW, stale weights and biases swapped in by hand) give the same per-step losses
    and final weights and biases within TOL = 1e-5 (fp32, the same kernels; differences are rounding
    of differently ordered sums, ~1e-7; biases are sums of ±γ and match exactly unless a routing
    decision flipped). The same recursion with an unversioned bias (the rule before this fix) ends
    far from it, so the comparison can tell the rules apart. PipeDream and WPipe, and pp 2 × dp 2
    (loads summed over replicas), equal the emulator. A 2BW run saved after step 3 with microbatches
    in flight and resumed continues bit for bit (the bias versions are saved with the weight versions).
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import FORWARD

from hf_asyncpp.schedules import ScheduleError, get_schedule_spec
from hf_asyncpp.schedules.async_order import replay_after
from tests.engine_runs import M, MBS, SEQ, STEPS, token_rows, train_and_evaluate
from tests.ranks import run_ranks
from tests.test_engine import small_model_config

TOL = 1e-5
PRESET = "tiny-deepseek-v3"
AT = 3
RATE = 0.01  # large against the spread of sigmoid(router logits) at init (~1e-2): biases steer routing
ASYNC = ["pipedream-2bw", "pipedream", "wpipe"]
# AdamW's step lr·m/(√v + ε) magnifies the rounding of gradient entries near ε (an expert that few
# tokens reach): summed in another order (dp replicas averaged vs one larger microbatch) such an
# entry moved 1.2e-5 where SGD's weights agree to 4e-9. The dp comparison therefore runs SGD, whose
# step is linear in the gradient, with a rate large enough to move every weight far beyond TOL.
LEARNING_RATE = {"adamw": 3e-3, "sgd": 0.5}


# --- one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ASYNC)
@pytest.mark.parametrize("pp_size, m", [(2, 4), (4, 4), (4, 3)])
def test_a_stage_forwards_its_microbatches_in_order_also_after_a_replay(schedule, pp_size, m):
    """The pipeline takes minibatch k's loads as the oldest m counted forwards of the stage when k's
    update is due: forwards must come in microbatch order, and a resumed run (counting afresh) must
    start with the first microbatch of the first minibatch whose update is still due."""
    order, n_steps = get_schedule_spec(schedule).order, 5
    for boundary in [None, *range(n_steps - 1)]:
        if boundary is None:
            streams = order.stream(pp_size, m, n_steps)
        else:
            try:
                replay = replay_after(order, pp_size, m, boundary, n_steps)
            except ScheduleError:  # WPipe: not resumable at this boundary
                continue
            streams = {r: replay[r] + [a for k in range(boundary + 1, n_steps)
                                       for a in order.segment(r, pp_size, m, k, n_steps)] for r in range(pp_size)}
        for rank, ops in streams.items():
            for stage in {a.stage_index for a in ops}:
                forwards = [a.microbatch_index for a in ops if a.stage_index == stage and a.computation_type == FORWARD]
                if boundary is None:
                    assert forwards == list(range(n_steps * m)), (rank, stage)
                else:
                    done = sum(1 for k in range(boundary + 1) for a in order.segment(rank, pp_size, m, k, n_steps)
                               if a.stage_index == stage and a.computation_type != FORWARD
                               and a.microbatch_index % m == m - 1)  # minibatches this stage has updated
                    assert forwards == list(range(done * m, n_steps * m)), (boundary, rank, stage)


def test_each_weight_version_routes_with_its_own_bias():
    """VersionedStage keeps the routing biases in its version buffers: publishing a changed master
    bias changes routing on the new version only; the master stays what evaluation sees."""
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import build_full_model
    from hf_asyncpp.models import build_stage_modules, plan_stages
    from hf_asyncpp.update.versions import VersionedStage

    model_config = small_model_config(PRESET)
    config = TrainConfig(model_config=PRESET, seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=4)
    module = build_stage_modules(build_full_model(config, model_config), plan_stages(model_config, 1), [0])[0]
    versioned = VersionedStage(module, 2)
    routers = module.routing_load.routers
    names = [n for n, _ in module.named_buffers() if n.endswith("e_score_correction_bias")]
    assert names and all(n in versioned.buffers_[0] for n in names)
    chosen = []
    routers[0].register_forward_hook(lambda mod, args, out: chosen.append(out[2].clone()))
    rows = torch.randint(0, model_config.vocab_size, (MBS, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        versioned(rows)  # version 0, biases 0
        routers[0].e_score_correction_bias[:4] += 1.0  # the master bias: experts 0..3 win everything
        versioned.bind_master(1)
        versioned.publish_master(1)
        versioned.active = 1
        versioned(rows)
        versioned.active = 0
        versioned(rows)
    assert not torch.equal(chosen[0].sort(-1).values, chosen[1].sort(-1).values)
    assert int(chosen[1].max()) < 4  # version 1 routes with the published bias
    assert torch.equal(chosen[0], chosen[2])  # version 0 still with its own
    assert float(versioned.buffers_[0][names[0]].abs().max()) == 0.0


# --- gloo ranks -------------------------------------------------------------------------------


def _config(pp_size, schedule, micro_batch_size, emulate_depth=0, output_dir="output", optimizer="adamw"):
    from hf_asyncpp.config import TrainConfig

    return TrainConfig(model_config=PRESET, pp_size=pp_size, schedule=schedule, optimizer=optimizer,
                       learning_rate=LEARNING_RATE[optimizer],
                       momentum=0.9, max_grad_norm=0.0, lr_scheduler_type="constant", seq_len=SEQ,
                       micro_batch_size=micro_batch_size, n_microbatches=M, seed=4, max_steps=STEPS,
                       emulate_pp_size=emulate_depth, router_bias_update_rate=RATE, output_dir=output_dir)


def _recursion(config, model_config, rows_per_step, versioned_bias=True):
    """PipeDream-2BW written out on the HF model: minibatch k forwards and backwards on the weights
    and routing biases of version max(k − 1, 0) (swapped in by load_state_dict), AdamW steps the
    current weights, the biases move by ±RATE from minibatch k's loads. `versioned_bias=False`: the
    current biases route instead (the rule before the fix). Returns (losses, final state)."""
    import torch

    from hf_asyncpp.engine import build_full_model
    from hf_asyncpp.optim import optimizer_from_config

    model = build_full_model(config, model_config)
    optimizer = optimizer_from_config(config, list(model.named_parameters()))
    routers = {n: m for n, m in model.named_modules() if hasattr(m, "e_score_correction_bias")}
    loads = {}
    for name, router in routers.items():
        router.register_forward_hook(lambda mod, args, out, name=name: loads.__setitem__(
            name, loads.get(name, 0) + torch.bincount(out[2].reshape(-1), minlength=mod.num_experts)))
    previous = {n: t.detach().clone() for n, t in model.state_dict().items()}
    losses = []
    for rows in rows_per_step:
        current = {n: t.detach().clone() for n, t in model.state_dict().items()}
        stale = previous if versioned_bias else {
            n: current[n] if n.endswith("e_score_correction_bias") else t for n, t in previous.items()}
        model.load_state_dict(stale)
        model.zero_grad()
        loads.clear()
        loss = 0.0
        for mb in rows.chunk(M):
            out = model(input_ids=mb, labels=mb)
            (out.loss / M).backward()
            loss += out.loss.item() / M
        model.load_state_dict(current)  # in place: the gradients stay
        optimizer.step()
        with torch.no_grad():
            for name, router in routers.items():
                load = loads[name].double()
                router.e_score_correction_bias += RATE * torch.sign(load.mean() - load).float()
        previous = current
        losses.append(loss)
    return losses, {n: t.detach() for n, t in model.state_dict().items()}


def _train(rank, world_size, pp_size, schedule, emulate_depth, data_dp, with_recursion=False, evaluate_after=(),
           optimizer="adamw"):
    """STEPS steps of the engine (a pipeline, or emulated at `emulate_depth`) on the rows of `data_dp`
    replicas (a rank with fewer replicas takes larger microbatches of them), evaluating held-out rows
    after the steps in `evaluate_after` (forwards that must not count as routing loads); returns the
    losses, evaluation losses and final state (as lists) on the rank holding the gathered state, and
    the direct recursion's results."""

    from hf_asyncpp.checkpoint import gather_full_state_dict
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config(PRESET)
        dp, d = layout.dp_size, layout.dp_rank
        config = _config(pp_size, schedule, MBS * data_dp // dp, emulate_depth, optimizer=optimizer)
        engine = PipelineEngine(config, model_config, layout)
        losses, evals = train_and_evaluate(engine, layout, model_config.vocab_size, data_dp, evaluate_after)
        state = gather_full_state_dict(engine.stage_state_dict(), layout)
        if state is None:
            return None
        result = dict(losses=losses, evals=evals, state={k: v.tolist() for k, v in state.items()})
        if with_recursion:
            rows = [r.chunk(dp)[d] for r in token_rows(model_config.vocab_size, data_dp)]
            for key, versioned_bias in (("recursion", True), ("unversioned", False)):
                rec_losses, rec_state = _recursion(config, model_config, rows, versioned_bias)
                result[key] = dict(losses=rec_losses, state={k: v.tolist() for k, v in rec_state.items()})
        return result
    finally:
        shutdown_parallel()


def _max_diff(a: dict, b: dict) -> tuple[float, float]:
    """(largest weight difference, largest routing-bias difference) between two states."""
    import torch

    assert a.keys() == b.keys()
    diffs = {n: (torch.tensor(a[n]) - torch.tensor(b[n])).abs().max().item() for n in a}
    biases = [d for n, d in diffs.items() if n.endswith("e_score_correction_bias")]
    assert biases
    return max(d for n, d in diffs.items() if not n.endswith("e_score_correction_bias")), max(biases)


def _assert_equal_runs(run, reference, what):
    assert run["losses"] == pytest.approx(reference["losses"], abs=TOL), what
    weights, biases = _max_diff(run["state"], reference["state"])
    assert weights < TOL and biases < TOL, (what, weights, biases)


@pytest.mark.multirank
def test_pipedream_2bw_routing_biases_follow_the_weight_versions():
    """pp 2 pipeline ≡ emulator at depth 2 ≡ the 2BW recursion written out, with evaluations after
    steps 2 and 4 in between (they route too, but are no minibatch's load); an unversioned bias would
    give another run."""
    import torch

    pipeline = next(r for r in run_ranks(2, _train, 2, "pipedream-2bw", 0, 1, False, (2, 4)) if r)
    emulated = run_ranks(1, _train, 1, "pipedream-2bw", 2, 1, True, (2, 4))[0]
    _assert_equal_runs(pipeline, emulated, "pipeline vs emulator")
    assert len(pipeline["evals"]) == 2 and pipeline["evals"] == pytest.approx(emulated["evals"], abs=TOL)
    _assert_equal_runs(pipeline, emulated["recursion"], "pipeline vs recursion")
    biases = [torch.tensor(v) for n, v in pipeline["state"].items() if n.endswith("e_score_correction_bias")]
    assert max(float(b.abs().max()) for b in biases) >= RATE  # the biases really moved
    # The same recursion routing with the current (not the version's) biases ends elsewhere.
    unversioned = emulated["unversioned"]
    weights, bias_diff = _max_diff(pipeline["state"], unversioned["state"])
    assert max(abs(a - b) for a, b in zip(pipeline["losses"], unversioned["losses"])) > 100 * TOL
    assert weights > 100 * TOL and bias_diff >= RATE, (weights, bias_diff)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, world_size, optimizer",
                         [("pipedream", 2, "adamw"), ("wpipe", 2, "adamw"), ("pipedream-2bw", 4, "sgd")])
def test_routing_biases_of_other_asynchronous_runs_equal_the_emulator(schedule, world_size, optimizer):
    """PipeDream (bias updated with the update of a minibatch's last microbatch, routing with the
    stage's per-microbatch versions), WPipe (one stale half, one fresh) and 2BW on pp 2 × dp 2 (loads
    summed over the replicas; the emulator takes the replicas' rows as larger microbatches; SGD, see
    LEARNING_RATE)."""
    data_dp = world_size // 2
    pipeline = next(r for r in run_ranks(world_size, _train, 2, schedule, 0, data_dp, False, (), optimizer) if r)
    emulated = run_ranks(1, _train, 1, schedule, 2, data_dp, False, (), optimizer)[0]
    _assert_equal_runs(pipeline, emulated, schedule)
