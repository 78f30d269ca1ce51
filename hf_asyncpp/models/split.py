"""Where to cut: contiguous layer ranges per stage, balanced by cost, and building the stages.

Costs are estimated on a meta-device copy of the model (no memory, no init):
  - "compute": parameters a token touches — routed experts count top_k / E of their size, the
    embedding lookup counts nothing, lm_head its full size (it is a matmul per token);
  - "params": stored parameters, embedding and lm_head included (balances memory);
  - "layers": one unit per decoder layer.
Explicit `boundaries` (the first layer of every stage after the first) override the balancer.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from .stage import PipelineStageModule

__all__ = ["BALANCE_MODES", "StagePlan", "build_stage_modules", "foreign_modules", "layer_costs", "plan_stages",
           "release_foreign_modules"]

BALANCE_MODES = ("compute", "params", "layers")
_ROUTED_EXPERT = re.compile(r"\.experts\.")


class StagePlan(tuple):
    """Layer ranges, one per stage, in stage order."""

    def describe(self) -> str:
        return ", ".join(f"stage {s}: layers {r.start}-{r.stop - 1}" for s, r in enumerate(self))


def layer_costs(config, balance: str) -> tuple[tuple[float, ...], float, float]:
    """(per-layer cost, extra cost of the first stage, extra cost of the last stage)."""
    if balance == "layers":
        return (1.0,) * config.num_hidden_layers, 0.0, 0.0
    key = (config.to_json_string(use_diff=False), balance)
    if key not in _PARAMETER_COSTS:  # a study checks hundreds of arms of one model
        _PARAMETER_COSTS[key] = _parameter_costs(config, balance)
    return _PARAMETER_COSTS[key]


_PARAMETER_COSTS: dict[tuple[str, str], tuple[tuple[float, ...], float, float]] = {}  # by the config's content


def _parameter_costs(config, balance: str) -> tuple[tuple[float, ...], float, float]:
    """layer_costs from the model's parameter counts, on a meta-device model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    top_k = getattr(model, "num_experts_per_tok", None)
    num_experts = getattr(model, "num_experts", None)

    def cost(module: nn.Module) -> float:
        total = 0.0
        for name, param in module.named_parameters():
            share = 1.0
            if balance == "compute" and top_k and num_experts and _ROUTED_EXPERT.search("." + name):
                share = top_k / num_experts
            total += param.numel() * share
        return total

    per_layer = tuple(cost(layer) for layer in model.model.layers)
    first = 0.0 if balance == "compute" else cost(model.model.embed_tokens)
    last = cost(model.model.norm) + cost(model.lm_head)
    return per_layer, first, last


def _balanced_cuts(costs: list[float], n_stages: int, first: float, last: float) -> list[int]:
    """Contiguous split minimising the most expensive stage (exact, O(n_stages · n_layers²))."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def span(i: int, j: int, stage: int) -> float:
        return prefix[j] - prefix[i] + (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the lowest max-cost for layers [0, j) over stages 0..s.
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = span(0, j, 0)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], span(i, j, s))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    starts, j = [], n
    for s in range(n_stages - 1, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return starts[::-1]


def plan_stages(config, n_stages: int, balance: str = "compute", boundaries: list[int] | None = None) -> StagePlan:
    n_layers = config.num_hidden_layers
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages need at least {n_stages} decoder layers; the model has {n_layers}")
    if boundaries:
        starts = list(boundaries)
        if len(starts) != n_stages - 1 or starts != sorted(set(starts)) or not (0 < starts[0] and starts[-1] < n_layers):
            raise ValueError(
                f"stage_boundaries must be {n_stages - 1} increasing layer indices in 1..{n_layers - 1} "
                f"(the first layer of each stage after the first); got {boundaries}"
            )
    elif balance not in BALANCE_MODES:
        raise ValueError(f"unknown balance '{balance}'; choose one of {', '.join(BALANCE_MODES)}")
    else:
        per_layer, first, last = layer_costs(config, balance)
        starts = _balanced_cuts(per_layer, n_stages, first, last) if n_stages > 1 else []
    edges = [0, *starts, n_layers]
    return StagePlan(range(a, b) for a, b in zip(edges[:-1], edges[1:]))


def build_stage_modules(causal_lm: nn.Module, plan: StagePlan, stage_indices: list[int]) -> list[PipelineStageModule]:
    """The stages this rank runs, cut out of a full model (they share its modules)."""
    last = len(plan) - 1
    return [PipelineStageModule(causal_lm, plan[s], is_first=s == 0, is_last=s == last) for s in stage_indices]


def foreign_modules(causal_lm: nn.Module, plan: StagePlan, stage_indices: list[int]) -> list[str]:
    """Names of the parts of `causal_lm` that none of stages `stage_indices` holds: other stages'
    decoder layers, and the embeddings or the final norm and LM head when not held here."""
    held = {i for s in stage_indices for i in plan[s]}
    names = [f"model.layers.{i}" for i in range(len(causal_lm.model.layers)) if i not in held]
    if 0 not in stage_indices:
        names.append("model.embed_tokens")
    if len(plan) - 1 not in stage_indices:
        names += ["model.norm", "lm_head"]
    return names


def release_foreign_modules(causal_lm: nn.Module, plan: StagePlan, stage_indices: list[int]) -> None:
    """Move what the local stages do not hold to the meta device, so that a model its caller keeps
    (the Trainer's) costs this rank only its own stages' memory."""
    for name in foreign_modules(causal_lm, plan, stage_indices):
        causal_lm.get_submodule(name).to("meta")
