"""Per-family facts the stage splitter needs, keyed by `config.model_type`.

HF decoder-only models share one skeleton (embed_tokens → layers → norm → lm_head, rotary
embeddings on `model.rotary_emb`) but differ in how each layer picks its attention mask and in
whether the causal LM adds a router load-balancing loss. Everything family-specific lives here;
adding a family is one entry in `FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "UnsupportedModelError", "family_for", "layer_attention_type"]


class UnsupportedModelError(ValueError):
    """The model class is not one the stage splitter knows how to cut."""


@dataclass(frozen=True)
class Family:
    model_type: str
    # How a layer's attention mask is chosen, mirroring the family's own `Model.forward`:
    #   "layer_types"    config.layer_types[i] names "full_attention" or "sliding_attention";
    #   "global_sliding" every layer slides when config.sliding_window is set;
    #   "causal"         every layer is plainly causal.
    mask_rule: str
    # True when the causal LM adds router_aux_loss_coef × load-balancing loss (Switch style).
    # DeepSeek-V3 balances with a routing bias instead and has no such loss.
    has_load_balancing_loss: bool
    # Routers carry `e_score_correction_bias` (aux-loss-free balancing, DeepSeek-V3).
    has_routing_bias: bool = False


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("mixtral", "global_sliding", True),
        Family("qwen2_moe", "layer_types", True),
        Family("qwen3_moe", "global_sliding", True),
        Family("olmoe", "causal", True),
        Family("deepseek_v3", "causal", False, has_routing_bias=True),
        Family("gpt_oss", "layer_types", True),
        Family("llama", "causal", False),
        Family("qwen3", "layer_types", False),
    )
}


def family_for(config) -> Family:
    """The family of an HF config, or one clear error naming the supported ones."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedModelError(
            f"model_type '{getattr(config, 'model_type', type(config).__name__)}' is not supported "
            f"for pipeline splitting; supported model types: {supported}"
        )
    return family


def layer_attention_type(config, family: Family, layer_index: int) -> str:
    """'full_attention' or 'sliding_attention' for one decoder layer, as the HF model decides it."""
    if family.mask_rule == "layer_types":
        return config.layer_types[layer_index]
    if family.mask_rule == "global_sliding" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"
