"""A middle pipeline stage (no embeddings, no LM head) with `moe_2b`'s layer shapes, for the benchmarks
that measure one stage (activation_memory.py, gpu_stage.py)."""

from __future__ import annotations

from pathlib import Path

MOE_2B = Path(__file__).resolve().parents[1] / "training_scripts" / "models" / "moe_2b"


def middle_stage(n_layers: int, device="cpu", experts_implementation: str | None = None):
    """(config, stage): `n_layers` decoder layers of moe_2b, built by models/construct.py on `device`."""
    from transformers import AutoConfig

    from hf_asyncpp.models import build_stages, plan_stages

    config = AutoConfig.from_pretrained(MOE_2B)
    config.num_hidden_layers = n_layers + 2  # a first and a last layer around the measured stage
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    plan = plan_stages(config, 3, boundaries=[1, n_layers + 1])
    (stage,) = build_stages(config, plan, [1], device, seed=0)
    return config, stage
