"""hf_asyncpp: synchronous and asynchronous pipeline-parallel pretraining of Hugging Face
Mixture-of-Experts causal LMs on torch.distributed.pipelining.

The public names are imported on first use: `hf-asyncpp --help`, a config check or a study's report
need not import torch, transformers and the Trainer (several CPU-seconds in every process)."""

import importlib

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "export_checkpoint": ".checkpoint", "export_hf_model": ".checkpoint", "gather_full_state_dict": ".checkpoint",
    "ConfigError": ".config", "TrainConfig": ".config", "load_config": ".config",
    "validate_config": ".config_checks",
    "PipelineEngine": ".engine", "build_full_model": ".engine",
    "PERPLEXITY_METRIC_PATH": ".evaluation",
    "StepResult": ".metrics",
    "FAMILIES": ".models", "PRESETS": ".models", "PipelineStageModule": ".models", "StagePlan": ".models",
    "UnsupportedModelError": ".models", "build_config": ".models", "build_stage_modules": ".models",
    "plan_stages": ".models",
    "PipelineLoss": ".models.pipeline_loss",
    "StalenessEmulator": ".optim.delay",
    "SCHEDULES": ".schedules", "ScheduleSpec": ".schedules", "check_schedule": ".schedules",
    "get_schedule_spec": ".schedules", "register_schedule": ".schedules",
    "AsyncOrder": ".schedules.async_order",
    "AsyncPPTrainer": ".trainer", "AsyncPPTrainingArguments": ".trainer",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
