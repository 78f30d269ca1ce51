"""Stages chained in one process compute exactly what the unsplit HF model computes.

Every supported family, sdpa and eager attention, sliding windows shorter than the sequence, cut
into 1, 2, 3 and 8 stages: logits, the causal-LM loss and the load-balancing loss equal HF's
forward to 1e-6 (fp32, the same kernels in the same order: in practice bit-identical).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from hf_asyncpp.models import build_stage_modules, load_balancing_loss, plan_stages
from tests.test_engine import FAMILIES, small_model_config

TOL = 1e-6


def _chain(stages, input_ids):
    carried = (input_ids,)
    for stage in stages:
        out = stage(*carried)
        carried = out if isinstance(out, tuple) else (out,)
    return carried


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_chained_stages_equal_the_hf_forward(preset, attn):
    if preset == "tiny-gpt-oss" and attn == "sdpa":
        pytest.skip("transformers runs GPT-OSS with eager attention only")
    config = small_model_config(preset)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    input_ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = model(input_ids=input_ids, labels=input_ids)
    for n_stages in (1, 2, 3, 8):
        plan = plan_stages(config, n_stages)
        stages = build_stage_modules(copy.deepcopy(model), plan, list(range(n_stages)))
        carried = _chain(stages, input_ids)
        torch.testing.assert_close(carried[0], expected.logits, rtol=0, atol=TOL)
        loss = ForCausalLMLoss(carried[0], input_ids, config.vocab_size)
        if getattr(expected, "aux_loss", None) is not None:
            aux = load_balancing_loss(carried[1])
            torch.testing.assert_close(aux, expected.aux_loss, rtol=0, atol=TOL)
            loss = loss + config.router_aux_loss_coef * aux
        else:
            assert len(carried) == 1, "models without a load-balancing loss carry no router statistics"
        torch.testing.assert_close(loss, expected.loss, rtol=0, atol=TOL)


def test_sliding_window_masks_matter_in_this_test():
    """Guard against a vacuous test: with the window shorter than the sequence, treating sliding
    layers as full attention changes the logits."""
    config = small_model_config("tiny-gpt-oss")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    stages = build_stage_modules(copy.deepcopy(model), plan_stages(config, 2), [0, 1])
    input_ids = torch.randint(0, config.vocab_size, (1, 16))
    reference = _chain(stages, input_ids)[0]
    for stage in stages:
        stage.attention_types = {i: "full_attention" for i in stage.attention_types}
    assert (_chain(stages, input_ids)[0] - reference).abs().max() > 1e-3


def test_stage_parameters_partition_the_hf_state_dict_under_hf_names():
    config = small_model_config("tiny-deepseek-v3")
    model = AutoModelForCausalLM.from_config(config)
    names = set(model.state_dict())
    stages = build_stage_modules(copy.deepcopy(model), plan_stages(config, 4), [0, 1, 2, 3])
    seen: list[str] = [k for s in stages for k in s.state_dict()]
    assert len(seen) == len(set(seen)), "a tensor is owned by two stages"
    assert set(seen) == names
    assert "model.embed_tokens.weight" in stages[0].state_dict()
    assert {"lm_head.weight", "model.norm.weight"} <= set(stages[-1].state_dict())
