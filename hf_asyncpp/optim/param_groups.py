"""Which parameters an optimizer treats how: the one place the rules live.

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

__all__ = ["DEFAULT_ADAMW_PATTERNS", "is_matrix", "muon_param_groups", "names_by_group"]

DEFAULT_ADAMW_PATTERNS = (r"embed_tokens", r"lm_head", r"\.gate\.weight$", r"\.router\.")


def is_matrix(name: str, shape) -> bool:
    """Whether parameter `name` of `shape` is a matrix, or a stack of expert matrices, that
    Newton–Schulz may orthogonalise."""
    if name.rpartition(".")[2].endswith("bias"):  # stacked biases (E, n) look like matrices
        return False
    return len(shape) in (2, 3) and min(shape[-2:]) > 1  # a side of 1: a vector, not a matrix


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
