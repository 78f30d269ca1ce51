"""Cutting HF causal LMs into pipeline stages."""

from .construct import build_model, build_stages
from .families import FAMILIES, Family, UnsupportedModelError, family_for
from .presets import PRESETS, build_config
from .router_stats import load_balancing_loss
from .split import BALANCE_MODES, StagePlan, build_stage_modules, plan_stages
from .stage import PipelineStageModule

__all__ = [
    "BALANCE_MODES",
    "FAMILIES",
    "PRESETS",
    "Family",
    "PipelineStageModule",
    "StagePlan",
    "UnsupportedModelError",
    "build_config",
    "build_model",
    "build_stage_modules",
    "build_stages",
    "family_for",
    "load_balancing_loss",
    "plan_stages",
]
