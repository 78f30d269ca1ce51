"""Which parameters an optimizer treats how: the one place the name rules live.

Muon orthogonalises matrices that map hidden features; embeddings, lm_head, norms, biases and
routers are better served by AdamW (the Muon authors' and the reference study's practice). A
parameter goes to AdamW when it is not 2-D/3-D or its HF name matches one of `adamw_patterns`
(regular expressions, configurable as `muon_adamw_patterns`).
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_ADAMW_PATTERNS", "muon_param_groups", "names_by_group"]

DEFAULT_ADAMW_PATTERNS = (r"embed_tokens", r"lm_head", r"norm", r"\.bias$", r"\.gate\.weight$", r"\.router\.")


def muon_param_groups(named_params, adamw_patterns=DEFAULT_ADAMW_PATTERNS) -> list[dict]:
    compiled = [re.compile(p) for p in adamw_patterns]
    muon, adamw = [], []
    for name, p in named_params:
        use_adamw = p.ndim not in (2, 3) or any(c.search(name) for c in compiled)
        (adamw if use_adamw else muon).append(p)
    groups = [dict(params=muon, use_muon=True)] if muon else []
    return groups + ([dict(params=adamw, use_muon=False)] if adamw else [])


def names_by_group(named_params, adamw_patterns=DEFAULT_ADAMW_PATTERNS) -> dict[str, list[str]]:
    """{'muon': [...], 'adamw': [...]} parameter names, for reports and tests."""
    named = list(named_params)
    ids = {id(p): n for n, p in named}
    return {("muon" if g["use_muon"] else "adamw"): [ids[id(p)] for p in g["params"]]
            for g in muon_param_groups(named, adamw_patterns)}


