"""Which parameters an optimizer treats how: the one place the rules live.

Weight decay applies to the parameters `transformers.Trainer` decays and to no others: not biases,
not norm weights (`decay_parameter_names`, which is Trainer's own rule applied to a stage module;
stage modules keep HF's module tree and names, so a stage decays exactly its share of what Trainer
decays on the whole model).

Muon orthogonalises matrices that map hidden features; everything else is better served by AdamW
(the Muon authors' and the reference study's practice). A parameter goes to Muon only when both
hold:

- it is a matrix (`is_matrix`, fixed): 2-D, or 3-D fused experts (E, A, B) — one matrix per
  expert — whose matrices have both sides > 1, and it is not a bias. Biases of any rank (`bias`,
  GPT-OSS's stacked per-expert `gate_up_proj_bias` (E, 2I)), norms, 1 × H gates (Qwen2-MoE's
  `shared_expert_gate`) are vectors, whatever their shape says;
- its HF name matches none of `adamw_patterns` (regular expressions, configurable as
  `muon_adamw_patterns`): matrices that by role take AdamW — embeddings, lm_head, routers.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_ADAMW_PATTERNS", "decay_parameter_names", "is_matrix", "muon_param_groups", "names_by_group",
           "weight_decay_groups"]

DEFAULT_ADAMW_PATTERNS = (r"embed_tokens", r"lm_head", r"\.gate\.weight$", r"\.router\.")


def is_matrix(name: str, shape) -> bool:
    """Whether parameter `name` of `shape` is a matrix, or a stack of expert matrices, that
    Newton–Schulz may orthogonalise."""
    if name.rpartition(".")[2].endswith("bias"):  # stacked biases (E, n) look like matrices
        return False
    return len(shape) in (2, 3) and min(shape[-2:]) > 1  # a side of 1: a vector, not a matrix


def decay_parameter_names(modules) -> set[str]:
    """Names of the parameters of `modules` (HF-named stage modules or a whole model) that weight
    decay applies to, by `Trainer.get_decay_parameter_names` (it does not use its instance)."""
    from transformers import Trainer

    return {name for module in modules for name in Trainer.get_decay_parameter_names(None, module)}


def weight_decay_groups(groups: list[dict], named_params, weight_decay: float, decay_names) -> list[dict]:
    """`groups` (dicts with "params") split by weight decay: `weight_decay` for the names in
    `decay_names`, 0 for the rest; `decay_names` None decays every parameter."""
    names = {id(p): n for n, p in named_params}
    split = []
    for group in groups:
        for decays in (True, False):
            params = [p for p in group["params"] if (decay_names is None or names[id(p)] in decay_names) == decays]
            if params:
                split.append({**group, "params": params, "weight_decay": weight_decay if decays else 0.0})
    return split


def muon_param_groups(named_params, adamw_patterns=None) -> list[dict]:
    """Muon's param groups (`use_muon` True / False); `adamw_patterns` None: the defaults."""
    compiled = [re.compile(p) for p in (DEFAULT_ADAMW_PATTERNS if adamw_patterns is None else adamw_patterns)]
    muon, adamw = [], []
    for name, p in named_params:
        use_muon = is_matrix(name, p.shape) and not any(c.search(name) for c in compiled)
        (muon if use_muon else adamw).append(p)
    groups = [dict(params=muon, use_muon=True)] if muon else []
    return groups + ([dict(params=adamw, use_muon=False)] if adamw else [])


def names_by_group(named_params, adamw_patterns=None) -> dict[str, list[str]]:
    """{'muon': [...], 'adamw': [...]} parameter names, for reports and tests."""
    named = list(named_params)
    ids = {id(p): n for n, p in named}
    return {("muon" if g["use_muon"] else "adamw"): [ids[id(p)] for p in g["params"]]
            for g in muon_param_groups(named, adamw_patterns)}
