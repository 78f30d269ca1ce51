"""One pipeline stage of an HF causal LM: a contiguous range of decoder layers, run as HF runs them.

The stage keeps the HF module tree and its parameter names (`model.embed_tokens.weight`,
`model.layers.7.mlp.experts.gate_up_proj`, `lm_head.weight`): layers sit in a ModuleDict keyed by
their original index, so a stage's `state_dict()` is a slice of the full model's and the export
needs no renaming. Each stage rebuilds what HF's `Model.forward` builds once (rotary embeddings,
the causal / sliding-window masks for the configured attention implementation) for its own layers.

Data flow between stages: hidden states (B, T, H) and, for models with a load-balancing loss, the
router statistics vector of `router_stats` (2E + 1 floats). The last stage returns logits.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .families import family_for, layer_attention_type
from .recompute import is_recomputing
from .router_stats import add_router_logits, empty_router_stats
from .routing_bias import RoutingLoadCounter

__all__ = ["PipelineStageModule", "router_class_of"]

_MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}
# The builders' required cache argument: `past_key_values` in transformers 5.17, `cache` from 5.24 on.
_MASK_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def router_class_of(causal_lm: nn.Module) -> type | None:
    """The router module class whose output[0] HF records as `router_logits`, if any; where the model
    class does not declare one (DeepSeek-V3 before transformers 5.24), the class of the routers that
    hold a routing bias (`e_score_correction_bias`), whose outputs are the same."""
    recorder = (getattr(type(causal_lm), "_can_record_outputs", None) or {}).get("router_logits")
    declared = getattr(recorder, "target_class", None)
    if declared is not None:
        return declared
    return next((type(m) for m in causal_lm.modules() if isinstance(getattr(m, "e_score_correction_bias", None),
                                                                     torch.Tensor)), None)


class PipelineStageModule(nn.Module):
    """Layers `layer_ids` of `causal_lm`, plus embeddings if first and norm + lm_head if last."""

    def __init__(self, causal_lm: nn.Module, layer_ids: range, is_first: bool, is_last: bool):
        super().__init__()
        config = causal_lm.config
        self.config = config
        self.family = family_for(config)
        self.layer_ids = tuple(layer_ids)
        self.is_first, self.is_last = is_first, is_last
        # Parameters the model class keeps in fp32 whatever the compute dtype (DeepSeek-V3's router).
        self.fp32_patterns = tuple(getattr(causal_lm, "_keep_in_fp32_modules_strict", None) or ())
        base = causal_lm.model

        self.model = nn.Module()
        if is_first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in layer_ids})
        if is_last:
            self.model.norm = base.norm
            self.lm_head = causal_lm.lm_head
        # Buffers only (inv_freq, not persistent): every stage recomputes cos/sin for its layers.
        self.model.rotary_emb = base.rotary_emb

        self.attention_types = {i: layer_attention_type(config, self.family, i) for i in layer_ids}
        # Router statistics travel between stages only when the loss needs them.
        self.carries_router_stats = self.family.has_load_balancing_loss and bool(
            getattr(config, "output_router_logits", False)
        )
        self.num_experts = getattr(causal_lm, "num_experts", None)
        self.top_k = getattr(causal_lm, "num_experts_per_tok", None)
        self._router_logits: list[torch.Tensor] = []
        router_class = router_class_of(causal_lm)
        if self.carries_router_stats and router_class is not None:
            for module in self.model.layers.modules():
                if isinstance(module, router_class):
                    module.register_forward_hook(self._record_router_logits)
        # DeepSeek-V3 style routers: counts of tokens per expert for the bias update.
        self.routing_load = (
            RoutingLoadCounter(self.model.layers, router_class)
            if self.family.has_routing_bias and router_class is not None
            else None
        )

    @torch.compiler.disable  # eager under compile_layers: a list growing layer by layer would recompile each layer
    def _record_router_logits(self, module, args, output):
        if not is_recomputing():  # an activation-checkpointing recomputation is no second forward
            self._router_logits.append(output[0])

    def _masks(self, hidden: torch.Tensor) -> dict[str, torch.Tensor | None]:
        # No position_ids: given them (and no attention mask, no cache), masking_utils looks for packed
        # sequences in them, a host read per forward (`find_packed_sequence_indices`). A stage's are
        # always the default arange, one sequence per row, where that search finds none: the mask is
        # the one HF builds from them.
        return {
            kind: _MASK_BUILDERS[kind](
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                position_ids=None,
                **{_MASK_CACHE_ARGUMENT: None},
            )
            for kind in set(self.attention_types.values())
        }

    def forward(self, x: torch.Tensor, router_stats: torch.Tensor | None = None):
        hidden = self.model.embed_tokens(x) if self.is_first else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        masks = self._masks(hidden)

        self._router_logits.clear()
        for index, layer in self.model.layers.items():
            hidden = layer(
                hidden,
                attention_mask=masks[self.attention_types[int(index)]],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
            )
        if self.is_last:
            hidden = self.lm_head(self.model.norm(hidden))
        if not self.carries_router_stats:
            return hidden
        if router_stats is None:
            router_stats = empty_router_stats(self.num_experts, device=hidden.device)
        router_stats = add_router_logits(router_stats, self._router_logits, self.top_k)
        self._router_logits.clear()
        return hidden, router_stats
