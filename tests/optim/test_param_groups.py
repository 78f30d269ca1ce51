"""Which parameters Muon orthogonalises, for every supported family: only matrices (per expert for
fused experts); embeddings, lm_head, norms, routers, biases of any rank and 1 × H gates take AdamW."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from hf_asyncpp.models.families import FAMILIES
from hf_asyncpp.models.presets import PRESETS, build_config
from hf_asyncpp.optim.param_groups import is_matrix, names_by_group

ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight")
QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
MLA = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
       "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")
MLA_NORMS = ("self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # (E, A, B): one matrix per expert
ROUTER = ("mlp.gate.weight",)


def dense_mlp(prefix: str = "mlp.") -> tuple[str, ...]:
    return tuple(f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down"))


def each_layer(muon, adamw) -> list:
    return [(muon, adamw)] * 2


# model_type: per decoder layer (2 layers), (Muon names, AdamW names) inside it.
EXPECTED = {
    "mixtral": each_layer(ATTENTION + FUSED_EXPERTS, NORMS + ROUTER),
    "qwen2_moe": each_layer(ATTENTION + FUSED_EXPERTS + dense_mlp("mlp.shared_expert."),
                            NORMS + ROUTER + QKV_BIASES + ("mlp.shared_expert_gate.weight",)),  # (1, H)
    "qwen3_moe": each_layer(ATTENTION + FUSED_EXPERTS, NORMS + ROUTER + QK_NORMS),
    "olmoe": each_layer(ATTENTION + FUSED_EXPERTS, NORMS + ROUTER + QK_NORMS),
    "deepseek_v3": [(MLA + dense_mlp(), NORMS + MLA_NORMS),  # first_k_dense_replace=1
                    (MLA + FUSED_EXPERTS + dense_mlp("mlp.shared_experts."), NORMS + MLA_NORMS + ROUTER)],
    "gpt_oss": each_layer(ATTENTION + FUSED_EXPERTS,
                          NORMS + QKV_BIASES + ("self_attn.o_proj.bias", "self_attn.sinks", "mlp.router.weight",
                                                "mlp.router.bias", "mlp.experts.gate_up_proj_bias",
                                                "mlp.experts.down_proj_bias")),  # stacked biases (E, n)
    "llama": each_layer(ATTENTION + dense_mlp(), NORMS),
    "qwen3": each_layer(ATTENTION + dense_mlp(), NORMS + QK_NORMS),
}
OUTSIDE_LAYERS_ADAMW = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def tiny_model(model_type: str):
    preset = next(p for p, fields in PRESETS.items() if fields["model_type"] == model_type)
    config = build_config(preset, num_hidden_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48,
                          moe_intermediate_size=16, head_dim=8)
    return AutoModelForCausalLM.from_config(config)


def test_every_supported_family_has_expectations():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_every_parameter_lands_in_its_group(model_type):
    groups = names_by_group(tiny_model(model_type).named_parameters())
    muon = [f"model.layers.{i}.{n}" for i, (names, _) in enumerate(EXPECTED[model_type]) for n in names]
    adamw = [f"model.layers.{i}.{n}" for i, (_, names) in enumerate(EXPECTED[model_type]) for n in names]
    assert sorted(groups.get("muon", [])) == sorted(muon)
    assert sorted(groups.get("adamw", [])) == sorted(adamw + list(OUTSIDE_LAYERS_ADAMW))


@pytest.mark.parametrize("name, shape, matrix", [
    ("model.layers.0.mlp.experts.gate_up_proj_bias", (8, 96), False),  # GPT-OSS: a bias per expert
    ("model.layers.0.mlp.experts.down_proj_bias", (8, 32), False),
    ("model.layers.0.mlp.experts.gate_up_proj", (8, 32, 96), True),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 32), False),  # Qwen2-MoE: 1 × H
    ("model.layers.0.mlp.experts.down_proj", (1, 32, 48), True),  # one expert, still a matrix
    ("model.layers.0.mlp.experts.stacked_gates", (8, 1, 32), False),  # a 1 × H row per expert
    ("model.layers.0.self_attn.q_proj.bias", (32,), False),
    ("model.layers.0.mlp.gate.weight", (8, 32), True),  # a matrix: AdamW by role (a name pattern)
])
def test_what_counts_as_a_matrix(name, shape, matrix):
    assert is_matrix(name, shape) is matrix


def test_name_patterns_cannot_send_a_non_matrix_to_muon():
    """`muon_adamw_patterns` replaces the default names; biases and 1 × H gates stay AdamW's."""
    for model_type in ("gpt_oss", "qwen2_moe"):
        muon = names_by_group(tiny_model(model_type).named_parameters(), adamw_patterns=[])["muon"]
        assert "model.embed_tokens.weight" in muon and "model.layers.0.mlp.experts.gate_up_proj" in muon
        assert not [n for n in muon if n.endswith("bias") or "shared_expert_gate" in n], muon


# --- weight decay: Trainer's exclusions, stage by stage --------------------------------------------

def _trainer_decay_names(model) -> set[str]:
    """transformers' own answer on the unsplit model."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_the_stages_decay_exactly_what_trainer_decays_on_the_whole_model(model_type):
    from hf_asyncpp.models import build_stage_modules, plan_stages
    from hf_asyncpp.optim.param_groups import decay_parameter_names

    model = tiny_model(model_type)
    whole = _trainer_decay_names(model)
    plan = plan_stages(model.config, 2, "layers", None)
    per_stage = [decay_parameter_names([stage]) for stage in build_stage_modules(model, plan, [0, 1])]
    assert not per_stage[0] & per_stage[1] and per_stage[0] | per_stage[1] == whole
    names = {n for n, _ in model.named_parameters()}
    exempt = names - whole  # what Trainer leaves undecayed: biases and norm weights, nothing else
    assert exempt == {n for n in names if "bias" in n or "norm" in n}, exempt
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.weight"} <= whole


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "muon", "soap", "lion"])
def test_every_optimizer_applies_weight_decay_to_the_decayed_names_only(optimizer):
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.optim import optimizer_from_config
    from hf_asyncpp.optim.param_groups import decay_parameter_names

    model = tiny_model("qwen3_moe")
    config = TrainConfig(optimizer=optimizer, weight_decay=0.1)
    opt = optimizer_from_config(config, model.named_parameters(), decay_parameter_names([model]))
    names = {id(p): n for n, p in model.named_parameters()}
    decay_of = {names[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert sorted(decay_of) == sorted(names.values())  # every parameter once
    whole = _trainer_decay_names(model)
    assert {n for n, wd in decay_of.items() if wd == 0.1} == whole
    assert {wd for n, wd in decay_of.items() if n not in whole} == {0.0}
