"""hf_asyncpp: synchronous and asynchronous pipeline-parallel pretraining of Hugging Face
Mixture-of-Experts causal LMs on torch.distributed.pipelining."""

from .checkpoint import export_checkpoint, export_hf_model, gather_full_state_dict
from .config import ConfigError, TrainConfig, load_config
from .config_checks import validate_config
from .engine import PipelineEngine, build_full_model
from .evaluation import PERPLEXITY_METRIC_PATH
from .metrics import StepResult
from .models import (
    FAMILIES,
    PRESETS,
    PipelineStageModule,
    StagePlan,
    UnsupportedModelError,
    build_config,
    build_stage_modules,
    plan_stages,
)
from .models.pipeline_loss import PipelineLoss
from .optim.delay import StalenessEmulator
from .schedules import SCHEDULES, ScheduleSpec, check_schedule, get_schedule_spec, register_schedule
from .schedules.async_order import AsyncOrder
from .trainer import AsyncPPTrainer, AsyncPPTrainingArguments

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "PERPLEXITY_METRIC_PATH",
    "PRESETS",
    "SCHEDULES",
    "AsyncOrder",
    "AsyncPPTrainer",
    "AsyncPPTrainingArguments",
    "ConfigError",
    "PipelineEngine",
    "PipelineLoss",
    "PipelineStageModule",
    "ScheduleSpec",
    "StagePlan",
    "StalenessEmulator",
    "StepResult",
    "TrainConfig",
    "UnsupportedModelError",
    "__version__",
    "build_config",
    "build_full_model",
    "build_stage_modules",
    "check_schedule",
    "export_checkpoint",
    "export_hf_model",
    "gather_full_state_dict",
    "get_schedule_spec",
    "load_config",
    "plan_stages",
    "register_schedule",
    "validate_config",
]
