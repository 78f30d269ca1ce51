"""Named tiny model configs: random-init MoE models small enough to train on a laptop CPU.

`tiny-moe` is the default model (Qwen3-MoE layout). One preset per supported family lets every
family be exercised with the same engine; `build_config` also accepts a path to an HF config.json
or a model directory.
"""

from __future__ import annotations

import os
import re

from transformers import AutoConfig

__all__ = ["PRESETS", "build_config"]

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=8192,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=None,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=128)

PRESETS: dict[str, dict] = {
    "tiny-moe": dict(model_type="qwen3_moe", **_COMMON, **_MOE, num_experts=8),
    "tiny-mixtral": dict(model_type="mixtral", **_COMMON, num_experts_per_tok=2, num_local_experts=8,
                         router_jitter_noise=0.0),
    "tiny-qwen2-moe": dict(model_type="qwen2_moe", **_COMMON, **_MOE, num_experts=8,
                           shared_expert_intermediate_size=128),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", **_COMMON, **_MOE, num_experts=8),
    "tiny-olmoe": dict(model_type="olmoe", **_COMMON, num_experts_per_tok=2, num_experts=8),
    "tiny-deepseek-v3": dict(dict(_COMMON, head_dim=16, num_key_value_heads=4), model_type="deepseek_v3", **_MOE, n_routed_experts=8,
                             n_shared_experts=1,
                             n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=64,
                             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                             rope_scaling=None),
    "tiny-gpt-oss": dict(model_type="gpt_oss", **_COMMON, num_experts_per_tok=2, num_local_experts=8,
                         sliding_window=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
    "tiny-llama": dict(model_type="llama", **_COMMON),
    "tiny-qwen3": dict(model_type="qwen3", **_COMMON),
}


def _hub_id_online(name: str) -> bool:
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    return not offline and re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None


def build_config(model_config: str, **overrides):
    """An HF config from a preset name, a config.json path, a model directory, or a Hub model id
    (`namespace/name`, when the Hub is reachable: HF_HUB_OFFLINE unset)."""
    if model_config in PRESETS:
        fields = dict(PRESETS[model_config])
        model_type = fields.pop("model_type")
        fields.update(overrides)
        return AutoConfig.for_model(model_type, **fields)
    if os.path.isfile(model_config) or os.path.isdir(model_config) or _hub_id_online(model_config):
        config = AutoConfig.from_pretrained(model_config)
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    raise FileNotFoundError(
        f"model_config '{model_config}' is neither a preset ({', '.join(PRESETS)}) "
        "nor an existing config.json / model directory, nor a Hub id (namespace/name) with the Hub online"
    )
