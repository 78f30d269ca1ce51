"""Where the pipeline is cut: contiguous ranges, balanced by cost, or given explicitly."""

from __future__ import annotations

import pytest

from hf_asyncpp.models import FAMILIES, UnsupportedModelError, family_for, plan_stages
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.models.split import _balanced_cuts, layer_costs


def test_ranges_are_contiguous_and_cover_every_layer():
    config = build_config("tiny-moe", num_hidden_layers=10)
    for n_stages in range(1, 11):
        plan = plan_stages(config, n_stages)
        assert [r.start for r in plan][0] == 0 and plan[-1].stop == 10
        assert all(a.stop == b.start for a, b in zip(plan, plan[1:]))
        assert all(len(r) >= 1 for r in plan)


def test_balancer_minimises_the_most_expensive_stage():
    # Brute force over all cuts of 6 layers into 3 stages.
    import itertools

    costs, first, last = [5.0, 1.0, 1.0, 4.0, 2.0, 2.0], 0.5, 3.0
    best = min(
        max(sum(costs[:a]) + first, sum(costs[a:b]), sum(costs[b:]) + last)
        for a, b in itertools.combinations(range(1, 6), 2)
    )
    a, b = _balanced_cuts(costs, 3, first, last)
    assert max(sum(costs[:a]) + first, sum(costs[a:b]), sum(costs[b:]) + last) == best


def test_compute_balance_counts_active_experts_and_puts_lm_head_on_the_last_stage():
    config = build_config("tiny-moe", num_hidden_layers=8)
    per_layer, first, last = layer_costs(config, "compute")
    params_layer, params_first, _ = layer_costs(config, "params")
    assert first == 0.0 and params_first > 0  # an embedding lookup costs no matmul
    assert per_layer[0] < params_layer[0]  # only top_k of E experts run per token
    assert last >= config.vocab_size * config.hidden_size
    plan = plan_stages(config, 2)
    assert len(plan[0]) > len(plan[1])  # the last stage also carries lm_head


def test_dense_first_layers_cost_differently_from_moe_layers():
    config = build_config("tiny-deepseek-v3", num_hidden_layers=4)
    per_layer, _, _ = layer_costs(config, "params")
    assert per_layer[0] != per_layer[1]  # first_k_dense_replace = 1


def test_explicit_boundaries_override_the_balancer():
    config = build_config("tiny-moe", num_hidden_layers=6)
    plan = plan_stages(config, 3, boundaries=[1, 2])
    assert [(r.start, r.stop) for r in plan] == [(0, 1), (1, 2), (2, 6)]
    assert plan.describe() == "stage 0: layers 0-0, stage 1: layers 1-1, stage 2: layers 2-5"


@pytest.mark.parametrize("bad", [[0, 3], [3, 2], [2, 2], [2], [2, 6]])
def test_bad_boundaries_are_rejected(bad):
    with pytest.raises(ValueError, match="stage_boundaries"):
        plan_stages(build_config("tiny-moe", num_hidden_layers=6), 3, boundaries=bad)


def test_more_stages_than_layers_is_rejected():
    with pytest.raises(ValueError, match="5 pipeline stages need at least 5 decoder layers"):
        plan_stages(build_config("tiny-moe"), 5)


def test_unsupported_model_names_the_supported_families():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError) as err:
        family_for(GPT2Config())
    for model_type in FAMILIES:
        assert model_type in str(err.value)
