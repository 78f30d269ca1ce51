"""Asynchronous pipelines equal the single-process staleness emulator.

PipeDream-2BW, PipeDream and WPipe on 2 and 4 gloo ranks (pp = 2 and pp = 4, and pp = 2 × dp = 2): at
pp 2 two MoE families × SGD with momentum and AdamW, at pp 4 one family with AdamW; 6 optimizer steps: the final weights equal those of the
emulator — the HF model on one process with `StalenessEmulator`: delay 1 per minibatch for 2BW;
an update per microbatch with stage r's parameters p − 1 − r updates stale for PipeDream — within
1e-5, and the last stage's per-step losses match. fp32; the pipeline and the emulator run the same kernels on the same microbatches, so
differences are rounding from differently ordered sums (~1e-7); 1e-5 leaves room for 6 steps of
AdamW, whose normalisation can amplify a rounding difference in a tiny second moment.
"""

from __future__ import annotations

import pytest

from tests.ranks import run_ranks
from tests import p2p_tags
from tests.engine_runs import M, MBS, SEQ, STEPS, token_rows, train_and_evaluate
from tests.test_engine import small_model_config

TOL = 1e-5
OPTIMIZERS = {"sgd": dict(learning_rate=0.5, momentum=0.9), "adamw": dict(learning_rate=3e-3, momentum=0.9),
              "muon": dict(learning_rate=2e-2, momentum=0.95)}


def stage_delays(model, model_config, pp_size, schedule):
    """{parameter: delay} for the emulator: each parameter gets its pipeline stage's delay."""
    from hf_asyncpp.models import plan_stages
    from hf_asyncpp.schedules import get_schedule_spec

    spec = get_schedule_spec(schedule)
    n_stages = spec.n_stages(pp_size)
    plan, order = plan_stages(model_config, n_stages), spec.order
    delays = {}
    for name, param in model.named_parameters():
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            stage = next(s for s, layers in enumerate(plan) if layer in layers)
        else:
            stage = 0 if name.startswith("model.embed_tokens") else n_stages - 1
        delays[param] = order.delay(stage, pp_size, M)
    return delays


def emulate(model, config, rows_per_step, dp_size, aux_coef, delays, per_microbatch):
    """One process: HF model, torch optimizer, the emulator; returns per-step LM losses.

    Per-minibatch updates accumulate the m microbatches (loss / m); per-microbatch updates take one
    step per microbatch. dp replicas each accumulate their own gradient, which are then summed and
    divided by dp as the all-reduce does (the same arithmetic, so even Muon's bf16 Newton–Schulz,
    which amplifies rounding differences, sees identical inputs)."""
    from hf_asyncpp.optim import optimizer_from_config
    from hf_asyncpp.optim.delay import StalenessEmulator

    from hf_asyncpp.optim.error_feedback import ErrorFeedback

    opt = optimizer_from_config(config, model.named_parameters())
    emulator = StalenessEmulator(ErrorFeedback(opt, config.ef_lambda) if config.ef else opt, delays)
    params = list(model.parameters())
    losses = []
    for rows in rows_per_step:
        replicas = [replica.chunk(M) for replica in rows.chunk(dp_size)]
        units = [[(r[i],) for r in replicas] for i in range(M)] if per_microbatch else [list(replicas)]
        lm = 0.0
        for unit in units:  # one update: each dp replica accumulates its microbatches, then they average
            replica_grads = []
            with emulator.stale_weights():
                for microbatches in unit:
                    emulator.zero_grad()
                    for mb in microbatches:
                        out = model(input_ids=mb, labels=mb)
                        (out.loss / len(microbatches)).backward()
                        lm += (out.loss - aux_coef * out.aux_loss).item() / (M * dp_size)
                    replica_grads.append([p.grad.clone() for p in params])
            for p, *grads in zip(params, *replica_grads):
                total = grads[0]
                for g in grads[1:]:
                    total = total + g
                p.grad = total / dp_size  # as the dp all-reduce: sum, then divide
            emulator.step()
        losses.append(lm)
    return losses


def _worker(rank, world_size, pp_size, presets, optimizers, schedule="pipedream-2bw", emulate_depth=0, ef=False,
            checkpointing="none"):
    import copy

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine, build_full_model
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    report = []
    try:
        for preset in presets:
            model_config = small_model_config(preset)
            for optimizer in optimizers:
                config = TrainConfig(model_config=preset, pp_size=pp_size, schedule=schedule,
                                     optimizer=optimizer, max_grad_norm=0.0, lr_scheduler_type="constant",
                                     seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=4, max_steps=STEPS,
                                     emulate_pp_size=emulate_depth, ef=ef, activation_checkpointing=checkpointing,
                                     **OPTIMIZERS[optimizer])
                full = build_full_model(config, model_config)
                reference = copy.deepcopy(full)
                rows = token_rows(model_config.vocab_size, layout.dp_size)
                mine = [r.chunk(layout.dp_size)[layout.dp_rank] for r in rows]
                engine = PipelineEngine(config, model_config, layout, model=full)
                with p2p_tags.recording() as messages:
                    results = [engine.train_step(mine[k], mine[k + 1] if k + 1 < STEPS else None) for k in range(STEPS)]
                    losses = [r.loss for r in results]
                    engine.finish()
                delays = stage_delays(reference, model_config, emulate_depth or pp_size, schedule)
                expected = emulate(reference, config, rows, layout.dp_size, model_config.router_aux_loss_coef, delays,
                                   per_microbatch=engine.spec.order.per_microbatch_updates)
                state = engine.stage_state_dict()
                ref_state = dict(reference.named_parameters())
                compared = [n for n in state if n in ref_state]
                init = dict(build_full_model(config, model_config).named_parameters())
                report.append(dict(
                    preset=preset, optimizer=optimizer, compared=compared,
                    moved=max((state[n] - init[n].detach()).abs().max().item() for n in compared),
                    param_diff=max((state[n] - ref_state[n].detach()).abs().max().item() for n in compared),
                    loss_diff=max(abs(a - b) for a, b in zip(losses, expected)),
                    losses=losses, expected=expected, ages=[r.weight_version_age_per_stage for r in results],
                    messages=messages, pipelined=pp_size > 1,
                ))
    finally:
        shutdown_parallel()
    return report


def _check(reports, schedule="pipedream-2bw"):
    for i, row in enumerate(reports[0]):
        for report in reports:
            if report[i]["pipelined"]:
                p2p_tags.assert_untagged(report[i]["messages"])  # matched by posting order, as under NCCL
                p2p_tags.assert_each_pair_on_its_own_group(report[i]["messages"])
            assert report[i]["param_diff"] < TOL, report[i]
            assert report[i]["loss_diff"] < TOL, report[i]
            assert report[i]["moved"] > 1e-3, report[i]  # the updates really happened
        n_stages = len(row["ages"][0])
        final_ages = {
            "pipedream-2bw": [1] * n_stages,
            "pipedream": [n_stages - 1 - s for s in range(n_stages)],
            "wpipe": [1] * (n_stages // 2) + [0] * (n_stages // 2),
        }[schedule]
        assert row["ages"][-1] == final_ages, row["ages"]


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size", [2, 4])
def test_pipedream_2bw_equals_the_delay_one_emulator(pp_size):
    """Two families × SGD and AdamW at pp 2; at pp 4 one family with AdamW (the order is what changes)."""
    presets, optimizers = (["tiny-qwen3-moe", "tiny-mixtral"], ["sgd", "adamw"]) if pp_size == 2 else (["tiny-mixtral"], ["adamw"])
    _check(run_ranks(pp_size, _worker, pp_size, presets, optimizers))


@pytest.mark.multirank
def test_pipedream_2bw_with_data_parallel_replicas_and_activation_checkpointing_equals_the_emulator():
    """The stages recompute every layer in the backward, on the weight version of the forward."""
    _check(run_ranks(4, _worker, 2, ["tiny-olmoe"], ["adamw"], "pipedream-2bw", 0, False, "full"))


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size", [2, 4])
def test_pipedream_equals_the_per_stage_delay_emulator(pp_size):
    presets, optimizers = (["tiny-qwen3-moe", "tiny-gpt-oss"], ["sgd", "adamw"]) if pp_size == 2 else (["tiny-gpt-oss"], ["adamw"])
    _check(run_ranks(pp_size, _worker, pp_size, presets, optimizers, "pipedream"),
           "pipedream")


@pytest.mark.multirank
def test_pipedream_with_data_parallel_replicas_and_selective_checkpointing_equals_the_emulator():
    """The stages recompute each MoE block in the backward."""
    _check(run_ranks(4, _worker, 2, ["tiny-mixtral"], ["adamw"], "pipedream", 0, False, "selective"), "pipedream")


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size", [2, 4])
def test_wpipe_equals_the_emulator_with_one_stale_half(pp_size):
    """WPipe: the first half of the stages (group 1) one update stale, the second half fresh."""
    presets, optimizers = (["tiny-qwen3-moe", "tiny-olmoe"], ["sgd", "adamw"]) if pp_size == 2 else (["tiny-olmoe"], ["adamw"])
    _check(run_ranks(pp_size, _worker, pp_size, presets, optimizers, "wpipe"), "wpipe")


@pytest.mark.multirank
def test_wpipe_with_data_parallel_replicas_equals_the_emulator():
    _check(run_ranks(4, _worker, 2, ["tiny-mixtral"], ["adamw"], "wpipe"), "wpipe")


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, depth", [("pipedream-2bw", 1), ("pipedream-2bw", 4), ("wpipe", 2), ("pipedream", 4)])
def test_one_process_emulates_the_schedule_at_a_depth(schedule, depth):
    """pp_size 1: the engine runs the stages the schedule would have at `depth` in one process, each
    with its own delay (WPipe's first half stale, PipeDream's stage s p−1−s updates stale), as
    train.py does without a launcher."""
    _check(run_ranks(1, _worker, 1, ["tiny-qwen3-moe"], ["adamw"], schedule, depth), schedule)


def _scope(schedule: str) -> str:
    """The default clipping (max_grad_norm 1.0) by the global norm, except WPipe's: it cannot (config_checks)."""
    return "stage" if schedule == "wpipe" else "global"


def _final_state(rank, world_size, pp_size, schedule, emulate_depth, scope):
    from hf_asyncpp.checkpoint import gather_full_state_dict
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config("tiny-mixtral")
        config = TrainConfig(model_config="tiny-mixtral", pp_size=pp_size, schedule=schedule, optimizer="adamw",
                             learning_rate=3e-3, max_grad_norm=0.05, grad_clip_scope=scope, lr_scheduler_type="linear",
                             warmup_steps=2, seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=4,
                             max_steps=STEPS, emulate_pp_size=emulate_depth)
        engine = PipelineEngine(config, model_config, layout)
        rows = token_rows(model_config.vocab_size, 1)
        losses = [engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None) for k in range(STEPS)]
        losses = [r.loss for r in losses]
        engine.finish()
        state = gather_full_state_dict(engine.stage_state_dict(), layout)
        return None if state is None else ({k: v.tolist() for k, v in state.items()}, losses)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, scope", [("pipedream-2bw", "global"), ("pipedream-2bw", "stage"),
                                             ("pipedream", "global"), ("wpipe", "stage")])
def test_the_emulated_run_equals_the_pipeline_run_with_clipping_and_lr_warmup(schedule, scope):
    """The same config on 2 ranks and emulated on one process at depth 2: same weights, same losses,
    with clipping (max_grad_norm small enough to clip every step) by the global norm, or each stage
    by its own, and a warm-up. (WPipe cannot clip globally: config_checks refuses it.) The scope's
    meaning itself is held to a reference in tests/executors/test_asynchronous_references.py."""
    import torch

    pipeline_state, pipeline_losses = next(r for r in run_ranks(2, _final_state, 2, schedule, 0, scope) if r)
    emulated_state, emulated_losses = run_ranks(1, _final_state, 1, schedule, 2, scope)[0]
    assert pipeline_losses == pytest.approx(emulated_losses, abs=TOL)
    assert pipeline_state.keys() == emulated_state.keys()
    for name in pipeline_state:
        diff = (torch.tensor(pipeline_state[name]) - torch.tensor(emulated_state[name])).abs().max().item()
        assert diff < TOL, (name, diff)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipedream_2bw_with_error_feedback_equals_the_emulator(world_size):
    """Error Feedback (λ = 1) around AdamW and SGD on the 2BW pipeline (pp 2, and pp 2 × dp 2)."""
    optimizers = ["adamw", "sgd"] if world_size == 2 else ["adamw"]  # pp 2 × dp 2: AdamW (Muon has its own test)
    _check(run_ranks(world_size, _worker, 2, ["tiny-qwen3-moe"], optimizers, "pipedream-2bw", 0, True))


@pytest.mark.multirank
def test_pipedream_2bw_with_muon_and_error_feedback_on_pp2_dp2_equals_the_emulator():
    """Muon (bf16 Newton–Schulz, the same kernels on both sides) + Error Feedback, pp 2 × dp 2."""
    _check(run_ranks(4, _worker, 2, ["tiny-qwen3-moe"], ["muon"], "pipedream-2bw", 0, True))


def _evaluating(rank, world_size, pp_size, schedule, emulate_depth, evaluate_after, data_dp=1):
    """Train STEPS steps, evaluating held-out rows after each step in `evaluate_after`; returns
    (train losses, eval losses, final weights) on the rank holding the gathered state. The rows are
    those of `data_dp` replicas; a rank with fewer dp replicas takes larger microbatches of them. The
    aux loss is off: it is not linear in the microbatch size, so different splits would train apart."""

    from hf_asyncpp.checkpoint import gather_full_state_dict
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        model_config.router_aux_loss_coef = 0.0
        dp = layout.dp_size
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=pp_size, schedule=schedule, optimizer="adamw",
                             learning_rate=3e-3, seq_len=SEQ, micro_batch_size=MBS * data_dp // dp, n_microbatches=M,
                             seed=4, max_steps=STEPS, emulate_pp_size=emulate_depth, grad_clip_scope=_scope(schedule))
        engine = PipelineEngine(config, model_config, layout)
        with p2p_tags.recording() as messages:
            losses, evals = train_and_evaluate(engine, layout, model_config.vocab_size, data_dp, evaluate_after)
        state = gather_full_state_dict(engine.stage_state_dict(), layout)
        return None if state is None else (losses, evals, {k: v.tolist() for k, v in state.items()}, messages)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, world_size, after", [
    ("pipedream-2bw", 2, (2, 4)), ("pipedream-2bw", 4, (2, 4)), ("pipedream", 2, (2, 4)),
    ("wpipe", 2, (STEPS,)),  # its updates straddle step boundaries: only the final weights are consistent
])
def test_an_asynchronous_pipeline_evaluates_mid_run_without_disturbing_training(schedule, world_size, after):
    """Evaluation after steps 2 and 4 of an asynchronous pipeline (pp 2; at 4 ranks pp 2 × dp 2 with
    sharded masters) measures the newest weights: the emulator's evaluation at the same steps, within
    TOL; the microbatches in flight are untouched, so the per-step losses and the final weights equal
    those of the same run without evaluation bit for bit."""
    evaluated = next(r for r in run_ranks(world_size, _evaluating, 2, schedule, 0, after, world_size // 2) if r)
    emulated = run_ranks(1, _evaluating, 1, schedule, 2, after, world_size // 2)[0]
    assert len(evaluated[1]) == len(after)
    p2p_tags.assert_untagged(evaluated[3])  # training and evaluation messages alike
    assert evaluated[1] == pytest.approx(emulated[1], abs=TOL)
    if schedule == "pipedream-2bw":
        plain = next(r for r in run_ranks(world_size, _evaluating, 2, schedule, 0, (), world_size // 2) if r)
        assert evaluated[0] == plain[0]
        assert evaluated[2] == plain[2]
    else:
        assert evaluated[0] == pytest.approx(emulated[0], abs=TOL)


def _pending_sends_per_step(rank, world_size, schedule, steps):
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), world_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=world_size, schedule=schedule, seq_len=SEQ,
                             micro_batch_size=MBS, n_microbatches=M, max_steps=steps, grad_clip_scope=_scope(schedule))
        engine = PipelineEngine(config, model_config, layout)
        rows = torch.randint(0, model_config.vocab_size, (MBS * M, SEQ), generator=torch.Generator().manual_seed(3))
        pending = []
        for k in range(steps):
            engine.train_step(rows, rows if k + 1 < steps else None)
            pending.append(engine.executor.schedule.pending_send_batches)
        engine.finish()
        return pending, engine.executor.schedule.pending_send_batches
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["pipedream-2bw", "wpipe"])
def test_an_asynchronous_pipeline_keeps_the_sends_of_its_last_two_steps_only(schedule):
    """gloo frees a sent tensor only once its send is waited for: the runtime waits for each step's
    sends two steps later, so what a rank keeps stays bounded however long it trains (before, the last
    stage of a 2BW run kept ~4 more send batches every step, 4 MB a step on the tiny model)."""
    for pending, after_finish in run_ranks(2, _pending_sends_per_step, schedule, 12):
        assert max(pending) <= 2 * 2 * M, pending  # two steps, at most one send batch per microbatch and direction
        assert pending[-2] <= pending[3], pending  # not growing
        assert after_finish == 0


def _teardown_when_stopped(rank, world_size):
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.parallel.test_mesh import group_teardowns

    layout = init_parallel(read_launch(), world_size)
    model_config = small_model_config("tiny-qwen3-moe")
    config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=world_size, schedule="pipedream-2bw", seq_len=SEQ,
                         micro_batch_size=MBS, n_microbatches=M, max_steps=8)
    engine = PipelineEngine(config, model_config, layout)
    rows = torch.randint(0, model_config.vocab_size, (MBS * M, SEQ), generator=torch.Generator().manual_seed(3))
    for _ in range(4):
        engine.train_step(rows, rows)
    engine.finish(wait_for_sends=False)  # as the loop does after a SIGTERM between steps
    with group_teardowns(engine.executor.schedule._links.values()) as ended:
        shutdown_parallel()
    return ended


@pytest.mark.multirank
def test_an_asynchronous_pipeline_stopped_between_steps_tears_down_without_its_unreceived_sends():
    """Stopped between steps (SIGTERM), a 2BW pipeline has forwarded into a step that never runs, and
    its sends of it are never received; its messages travel on pair groups only, and those are aborted
    at teardown (destroying them would wait for those sends under NCCL), the other groups destroyed."""
    for ended in run_ranks(2, _teardown_when_stopped):
        assert ended == {("link", "aborted"), ("another group", "destroyed")}


def _receive_buffer_bytes(rank, world_size, schedule, n_microbatches):
    """(bytes of this rank's stage's receive buffers, of one chunk's) after two steps."""
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), world_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=world_size, schedule=schedule, seq_len=SEQ,
                             micro_batch_size=MBS, n_microbatches=n_microbatches, max_steps=2,
                             grad_clip_scope=_scope(schedule))
        engine = PipelineEngine(config, model_config, layout)
        rows = torch.randint(0, model_config.vocab_size, (MBS * n_microbatches, SEQ),
                             generator=torch.Generator().manual_seed(3))
        engine.train_step(rows, rows)
        engine.train_step(rows, None)
        engine.finish()
        (stage,) = engine.executor.stages
        chunks = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
        buffers = {id(i.buffer): i.buffer for infos in chunks for i in infos if i.buffer is not None}
        one = sum(i.buffer.nbytes for i in (stage.args_recv_info[0] + stage.grad_recv_info[0]) if i.buffer is not None)
        return sum(b.nbytes for b in buffers.values()), one, len(stage.args_recv_info)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_an_asynchronous_stage_holds_receive_buffers_for_the_microbatches_it_can_hold_only():
    """PipeDream-2BW at pp 2, m 8: a stage holds at most 2 microbatches between their activation's
    receive and their backward, so torch is given 2 chunk ids, not max(2m, m + p + 1) = 16: each
    stage's receive buffers shrink eightfold (rank 0 its gradient buffers, rank 1 its activations)."""
    from hf_asyncpp.schedules import get_schedule_spec

    m = 8
    n_slots = get_schedule_spec("pipedream-2bw").order.n_slots(2, m)
    assert n_slots == 2
    for held, one, chunks in run_ranks(2, _receive_buffer_bytes, "pipedream-2bw", m):
        assert chunks == n_slots
        assert one > 0 and held == n_slots * one
        before = max(2 * m, m + 2 + 1) * one
        assert held * 8 == before
