"""The plan's predicted step (planning/step_time.py): each stage's cost from its FLOPs on an assumed
device, played by the schedules' timing model.

References are independent of the code under test: a decoder layer's parameters counted by hand from
its config, and the textbook steps of the pipelines on equal stages (1F1B: (m + p − 1) × (F + B);
an asynchronous pipeline that never flushes: m × (F + B)). How the model compares with the real runtime
is benchmarks/schedule_sleep.py's business (benchmarks/README.md).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_asyncpp.config import TrainConfig
from hf_asyncpp.models import plan_stages
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.planning.step_time import (
    OPTIMIZER_BYTES,
    Device,
    StageCost,
    fastest_fitting,
    predict_step,
    predict_steps,
    stage_costs,
    step_table,
)
from hf_asyncpp.schedules import get_schedule_spec

DEVICE = Device(peak_tflops=100.0, mfu=0.5, memory_tbs=2.0, link_gbs=10.0)


def _config(**changes) -> TrainConfig:
    base = TrainConfig(model_config="tiny-llama", pp_size=2, schedule="1f1b", seq_len=64, micro_batch_size=2,
                       n_microbatches=4, mixed_precision="bf16")
    return replace(base, **changes)


def test_each_stage_costs_its_layers_flops_on_the_device_a_third_per_pass():
    model = build_config("tiny-llama")  # llama: q and o h×h, k and v h×(kv heads × head dim), a gated MLP
    h, i, kv, head_dim = model.hidden_size, model.intermediate_size, model.num_key_value_heads, model.head_dim
    heads, vocab, seq = model.num_attention_heads, model.vocab_size, 64
    layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * i + 2 * h  # + its two RMSNorms
    attention = 12 * heads * head_dim * seq  # per token and layer: scores and values, forward and backward
    tokens = 2 * seq
    first, last = stage_costs(_config(), model, 2, DEVICE)
    layers = [len(r) for r in plan_stages(model, 2, "compute")]  # the LM head weighs: 3 layers + 1
    flops = [tokens * (6 * layer * n + attention * n) for n in layers]
    flops[1] += tokens * 6 * (vocab * h + h)  # the LM head's matmul and the final norm
    for stage, expected in zip((first, last), flops):
        assert stage.forward_s == pytest.approx(expected / 3 / 50e12)
        assert stage.input_gradient_s == stage.weight_gradient_s == pytest.approx(stage.forward_s)
    stored_last = layers[1] * layer + h + vocab * h
    assert last.optimizer_s == pytest.approx(OPTIMIZER_BYTES * stored_last / 2e12)


def test_full_recomputation_adds_a_forward_to_the_backward():
    plain = stage_costs(_config(), build_config("tiny-llama"), 2, DEVICE)
    recomputed = stage_costs(_config(activation_checkpointing="full"), build_config("tiny-llama"), 2, DEVICE)
    for a, b in zip(plain, recomputed):
        assert b.input_gradient_s == pytest.approx(a.input_gradient_s + a.forward_s)
        assert (b.forward_s, b.weight_gradient_s) == (a.forward_s, a.weight_gradient_s)


@pytest.mark.parametrize("p, m", [(4, 4), (4, 8), (8, 16)])
def test_the_predicted_step_of_equal_stages_is_the_textbook_one(p, m):
    equal = [StageCost(1.0, 1.0, 1.0, 0.0)] * p  # F = 1, B = 2
    step, limit = predict_step(get_schedule_spec("1f1b"), p, m, equal)
    assert (step, limit) == (pytest.approx((m + p - 1) * 3), pytest.approx(m * 3))
    step, limit = predict_step(get_schedule_spec("pipedream-2bw"), p, m, equal)
    assert step == pytest.approx(m * 3) == limit


def test_a_slow_link_adds_its_time_to_the_flushing_pipeline_per_hop():
    equal = [StageCost(1.0, 1.0, 1.0, 0.0)] * 4
    step, _ = predict_step(get_schedule_spec("1f1b"), 4, 4, equal)
    slow, _ = predict_step(get_schedule_spec("1f1b"), 4, 4, equal, link_s=0.5)
    # the first microbatch's forward and its gradient cross 3 links each before the pipeline is full
    assert slow >= step + 2 * 3 * 0.5


def test_every_schedule_is_predicted_at_the_layout_with_tokens_per_second_or_refused_with_why():
    config = _config(pp_size=2, n_microbatches=4, max_grad_norm=1.0, grad_clip_scope="global")
    records = predict_steps(config, build_config("tiny-llama"), world_size=4, device=DEVICE)
    assert [r["schedule"] for r in records] == ["1f1b", "interleaved-1f1b", "zbv", "pipedream-2bw", "wpipe", "pipedream"]
    for r in records:
        if "refused" in r:
            continue
        assert r["step_s"] >= r["limit_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(4 * 2 * 64 * 2 / r["step_s"])  # m × batch × seq × dp 2
    clipping = {r["schedule"]: r.get("clipping") for r in records}
    assert clipping["1f1b"] == clipping["pipedream-2bw"] == "global"
    assert clipping["wpipe"] == "stage"  # its order cannot wait for the global norm: it clips per stage


def test_the_fastest_schedule_named_is_the_fastest_whose_memory_was_played_and_fits():
    records = [{"schedule": "1f1b", "clipping": "global", "step_s": 3.0, "limit_s": 2.0, "tokens_per_s": 1.0},
               {"schedule": "zbv", "clipping": "global", "step_s": 2.0, "limit_s": 2.0, "tokens_per_s": 1.5},
               {"schedule": "pipedream-2bw", "clipping": "global", "step_s": 2.1, "limit_s": 2.0, "tokens_per_s": 1.4},
               {"schedule": "pipedream", "refused": "needs more microbatches"}]
    fits = {"1f1b": True, "zbv": False, "pipedream-2bw": True}
    assert fastest_fitting(records, fits)["schedule"] == "pipedream-2bw"
    assert fastest_fitting(records, {"zbv": False}) is None
    table = step_table(records, fits)
    assert "| pipedream-2bw | global | 2100 | 2000 | 1.050 | 1 | fits **fastest that fits** |" in table
    assert "does not fit" in table and "refused: needs more microbatches" in table
