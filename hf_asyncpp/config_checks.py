"""Everything about a config that can be checked before a process group exists (names, sizes,
paths, the schedule's action lists, the launcher's settings): `validate_config` raises one
`ConfigError` whose message names the key and the fix. Nothing touches output_dir before it passes.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re

from .config import (CheckpointConfig, ConfigError, DataConfig, ExportConfig, FailureConfig, ModelConfig,
                     OptimizerConfig, PipelineConfig, RunConfig, TrainConfig)
from .log import get_logger
from .models.recompute import CHECKPOINTING_MODES
from .optim import OPTIMIZER_NAMES as OPTIMIZERS

__all__ = ["OPTIMIZERS", "apply_launch_settings", "check_model_fits", "check_settings", "check_step_boundaries",
           "build_model_config", "config_overrides", "fit_global_batch", "fit_to_one_process", "resolve_schedule",
           "validate_config"]

logger = get_logger(__name__)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def fit_to_one_process(config: TrainConfig) -> None:
    """Without a launcher there is one process: pp_size becomes 1, and an asynchronous schedule is
    emulated at the depth pp_size asked for (so the run keeps its update rule). Says what it did."""
    from .schedules import SCHEDULES

    if config.pp_size == 1:
        return
    spec = SCHEDULES.get(config.schedule)
    if spec is not None and not spec.synchronous and not config.emulate_pp_size:
        config.emulate_pp_size = config.pp_size
        logger.info(f"one process (no launcher): emulating {config.schedule} at depth {config.pp_size}")
    else:
        logger.info(f"one process (no launcher): pp_size {config.pp_size} → 1")
    config.pp_size = 1


def check_step_boundaries(config: TrainConfig, purpose: str) -> None:
    """Training checkpoints (resumed by replaying the actions whose updates were still due,
    schedules/async_order.py: replay_after) and mid-run evaluation need a schedule that can stop
    between two steps (ScheduleSpec.step_boundary): WPipe's updates straddle them on a pipeline."""
    from .schedules import get_schedule_spec

    spec = get_schedule_spec(config.schedule).starting_synchronously(config.sync_steps)
    boundary = spec.step_boundary(config.pp_size, config.n_microbatches)
    if not boundary.clean:
        raise ConfigError(f"{purpose} are not supported for schedule '{spec.name}': {boundary.reason}")


def _check_lr_schedule(config: OptimizerConfig) -> None:
    """The schedule's name, and its lr_scheduler_kwargs tried on a one-parameter optimizer."""
    import torch
    from transformers.trainer_utils import SchedulerType

    from .optim import lr_scheduler_from_config

    schedulers = [s.value for s in SchedulerType if s.value not in _METRIC_SCHEDULES]
    _require(config.lr_scheduler_type in schedulers,
             f"unknown lr_scheduler_type '{config.lr_scheduler_type}'; available: {', '.join(schedulers)}"
             + (" (a schedule stepped by an evaluation metric is not supported)"
                if config.lr_scheduler_type in _METRIC_SCHEDULES else ""))
    try:
        lr_scheduler_from_config(config, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"lr_scheduler_kwargs {config.lr_scheduler_kwargs} do not fit lr_scheduler_type "
                          f"'{config.lr_scheduler_type}': {err}") from None


# Schedules that step on an evaluation metric, which the engine's per-update step does not have.
_METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")


def apply_launch_settings(config: TrainConfig, launch) -> None:
    """What the launcher was told, honoured or refused: `accelerate launch`'s mixed_precision
    (parallel/launch.py: LaunchInfo.mixed_precision) replaces mixed_precision "auto"; fp16 / fp8, or
    a value the run's config contradicts, is a ConfigError."""
    asked = launch.mixed_precision
    if asked is None:
        return
    _require(asked in ("no", "bf16"), f"accelerate launch asks for mixed_precision {asked}; hf_asyncpp computes "
             "in bf16 (fp32 master weights) or fp32: set mixed_precision to bf16 or no in the accelerate config")
    if config.mixed_precision == "auto":
        config.mixed_precision = asked
    _require(config.mixed_precision == asked, f"accelerate launch asks for mixed_precision {asked} but the run's "
             f"mixed_precision is {config.mixed_precision}: make the accelerate config and the run's config agree")


def _check_resume(config: TrainConfig) -> None:
    """The checkpoint to resume (resume_from_checkpoint, `latest` looked up in output_dir) exists and is whole."""
    from .checkpoint.checkpoints import CheckpointError, find_checkpoint, verify_checkpoint

    if config.resume_from_checkpoint is not None:
        try:
            found = find_checkpoint(config.resume_from_checkpoint, config.output_dir)
            if found is not None:
                verify_checkpoint(found)
        except (CheckpointError, OSError, ValueError) as err:
            raise ConfigError(str(err)) from None


def _at_least_one(config, *keys: str) -> None:
    for key in keys:
        _require(getattr(config, key) >= 1, f"{key} must be at least 1, got {getattr(config, key)}")


# transformers' attention implementations, with the package each needs beyond torch.
ATTENTION_PACKAGES = {"eager": None, "sdpa": None, "flex_attention": None, "flash_attention_2": "flash_attn",
                      "flash_attention_3": "flash_attn_interface"}


def _check_model(config: ModelConfig) -> None:
    _require(config.router_bias_update_rate >= 0,
             f"router_bias_update_rate must be >= 0, got {config.router_bias_update_rate}")
    attention = config.attn_implementation
    if attention is not None:
        _require(attention in ATTENTION_PACKAGES, f"unknown attn_implementation '{attention}'; choose from "
                 f"{', '.join(ATTENTION_PACKAGES)}")
        package = ATTENTION_PACKAGES[attention]
        _require(package is None or importlib.util.find_spec(package) is not None,
                 f"attn_implementation {attention} needs the {package} package, which is not installed here")


def _check_data(config: DataConfig) -> None:
    _at_least_one(config, "seq_len", "shuffle_window")
    _require(0 <= config.eval_fraction < 1, f"eval_fraction must be in [0, 1), got {config.eval_fraction}")
    _require(config.eval_steps >= 0, f"eval_steps must be >= 0, got {config.eval_steps}")
    _require(not (config.streaming and config.eval_fraction > 0),
             "eval_fraction cannot hold out part of a streamed dataset (its length is unknown): set "
             "eval_fraction to 0 and name the held-out files in eval_dataset")
    _require(config.eval_dataset is None or config.eval_fraction == 0,
             "eval_dataset and eval_fraction both name a held-out set: keep one (eval_dataset replaces eval_fraction)")
    _require(not config.eval_steps or config.eval_fraction > 0 or config.eval_dataset is not None,
             "eval_steps asks for evaluation, but there is no evaluation set: set eval_fraction > 0 or eval_dataset")


def _check_pipeline(config: PipelineConfig) -> None:
    _at_least_one(config, "micro_batch_size", "n_microbatches", "pp_size")
    _require(config.activation_checkpointing in CHECKPOINTING_MODES,
             f"unknown activation_checkpointing '{config.activation_checkpointing}'; choose "
             + ", ".join(CHECKPOINTING_MODES))
    _require(config.mixed_precision in ("auto", "bf16", "no"),
             f"unknown mixed_precision '{config.mixed_precision}'; choose auto, bf16 or no")
    _require(config.grad_reduce_dtype in ("fp32", "compute"),
             f"unknown grad_reduce_dtype '{config.grad_reduce_dtype}'; choose fp32 or compute")
    _require(config.fsdp or config.mixed_precision != "bf16",
             "mixed_precision bf16 is applied by FSDP2: set fsdp to true (or mixed_precision to no)")
    _require(config.sync_steps >= 0, f"sync_steps must be >= 0, got {config.sync_steps}")


def _check_optimizer(config: OptimizerConfig) -> None:
    _at_least_one(config, "max_steps")
    _require(config.optimizer in OPTIMIZERS, f"unknown optimizer '{config.optimizer}'; available: {', '.join(OPTIMIZERS)}")
    _require(config.learning_rate > 0, f"learning_rate must be positive, got {config.learning_rate}")
    _require(config.adam_epsilon >= 0, f"adam_epsilon must be >= 0, got {config.adam_epsilon}")
    _require(config.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0 disables clipping), got {config.max_grad_norm}")
    _require(config.grad_clip_scope in ("global", "stage"),
             f"grad_clip_scope must be global or stage, got {config.grad_clip_scope!r}")
    _require(config.muon_lr_scale in ("original", "match_rms_adamw"),
             f"unknown muon_lr_scale '{config.muon_lr_scale}'; choose original or match_rms_adamw")
    for pattern in config.muon_adamw_patterns or ():
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"muon_adamw_patterns: '{pattern}' is not a regular expression ({err})") from None
    _require(config.soap_precondition_frequency >= 1,
             f"soap_precondition_frequency must be at least 1 (updates between eigenbasis refreshes), "
             f"got {config.soap_precondition_frequency}")
    _require(config.soap_max_precond_dim >= 1,
             f"soap_max_precond_dim must be at least 1 (longer sides stay unrotated), got {config.soap_max_precond_dim}")
    _require(config.ef_lambda >= 0, f"ef_lambda must be >= 0, got {config.ef_lambda}")
    # Accepted without ef too (it changes nothing there: every update is the optimizer's alone), so that one
    # study base sets it over arms with and without Error Feedback.
    _require(config.ef_last_update in ("extrapolate", "trajectory"),
             f"unknown ef_last_update '{config.ef_last_update}'; choose extrapolate or trajectory"
             + (" (plain, the optimizer's update alone, ended one older update off the trajectory)"
                if config.ef_last_update == "plain" else ""))
    _require(config.warmup_steps >= 0, f"warmup_steps must be >= 0, got {config.warmup_steps}")
    _require(0 <= config.warmup_ratio < 1, f"warmup_ratio must lie in [0, 1), got {config.warmup_ratio}")
    _require(not (config.warmup_ratio and config.warmup_steps),
             "warmup_steps and warmup_ratio are both set: give one")
    _check_lr_schedule(config)


def _check_run(config: RunConfig) -> None:
    _at_least_one(config, "logging_steps")
    _require(config.peak_tflops >= 0, f"peak_tflops must be >= 0, got {config.peak_tflops}")
    bad = [s for s in config.profile_steps if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    _require(not bad, f"profile_steps are step numbers from 1: {bad} is not")
    try:
        from .reporting import check_report_to

        check_report_to(config.report_to)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_export(config: ExportConfig) -> None:
    try:
        from huggingface_hub.serialization._base import parse_size_to_int

        parse_size_to_int(config.max_shard_size)
    except ValueError:
        raise ConfigError(f"max_shard_size must be a size such as 5GB or 500MB, got '{config.max_shard_size}'") from None
    try:
        from .checkpoint.hf_export import export_dtype

        export_dtype(config.export_dtype)
    except ValueError as err:
        raise ConfigError(f"export_dtype: {err}") from None
    _require(not config.push_to_hub or (config.hub_model_id and config.save_final),
             "push_to_hub needs hub_model_id (namespace/name) and save_final: true")


def _check_checkpoints(config: CheckpointConfig) -> None:
    _require(config.save_steps >= 0, f"save_steps must be >= 0 (0: no checkpoints), got {config.save_steps}")
    _require(config.save_total_limit is None or config.save_total_limit >= 1,
             f"save_total_limit must be at least 1, got {config.save_total_limit}")


def _check_failures(config: FailureConfig) -> None:
    from .resilience import NONFINITE_POLICIES

    _require(config.nonfinite_policy in NONFINITE_POLICIES,
             f"unknown nonfinite_policy '{config.nonfinite_policy}'; choose {' or '.join(NONFINITE_POLICIES)}")
    _require(config.nonfinite_skip_limit >= 0, f"nonfinite_skip_limit must be >= 0, got {config.nonfinite_skip_limit}")
    _require(config.comm_timeout_s > 0, f"comm_timeout_s must be positive, got {config.comm_timeout_s}")


# Each section's own checks, in the order of the sections (the key reference's order).
_SECTION_CHECKS = (_check_model, _check_data, _check_pipeline, _check_optimizer, _check_run, _check_export,
                   _check_checkpoints, _check_failures)


def check_settings(config: TrainConfig, world_size: int):
    """Every check that needs neither the model nor the data: each section's own (ranges, names), then
    those across sections (the schedule against the rest, the checkpoint to resume). Returns the
    schedule's spec."""
    # Imported here: config parsing stays light, validation needs the model and schedule layers.
    from .schedules import get_schedule_spec

    for check in _SECTION_CHECKS:
        check(config)
    _check_resume(config)
    if config.num_train_epochs is not None:
        _require(config.num_train_epochs > 0, f"num_train_epochs must be > 0, got {config.num_train_epochs}")
        _require(not config.streaming, "num_train_epochs needs the data's length, and a streamed dataset has none: "
                                       "give max_steps")
    try:
        spec = get_schedule_spec(config.schedule)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    # FSDP2 sums a synchronous stage's microbatch gradients in the dtype it reduces them in (it keeps no
    # fp32 accumulator when that equals the compute dtype): bf16 reduction would sum them in bf16 too.
    _require(not (spec.synchronous and config.grad_reduce_dtype == "compute"),
             f"grad_reduce_dtype compute applies to asynchronous schedules, whose stages sum a step's microbatch "
             f"gradients in fp32 before reducing them; '{spec.name}' runs under FSDP2, which would sum them in "
             "bf16 as well: use grad_reduce_dtype: fp32")
    _require(not (config.sync_steps and spec.synchronous),
             f"sync_steps makes the first steps of an asynchronous schedule synchronous; '{spec.name}' is "
             "synchronous throughout: remove sync_steps or choose pipedream-2bw, pipedream or wpipe")
    _require(config.sync_steps < config.max_steps,
             f"sync_steps ({config.sync_steps}) must be below max_steps ({config.max_steps}): the run would "
             "never switch to its asynchronous schedule")
    if config.save_steps or config.resume_from_checkpoint:
        check_step_boundaries(config, "training checkpoints")
    if config.eval_steps:
        check_step_boundaries(config, "evaluations during training (eval_steps; the final one works)")
    _require(
        world_size % config.pp_size == 0,
        f"world size {world_size} is not divisible by pp_size {config.pp_size}; "
        f"launch a multiple of {config.pp_size} processes or change pp_size",
    )
    return spec


def check_model_fits(config: TrainConfig, model_config) -> None:
    """The model against the pipeline: enough layers for the stages, untied embeddings, positions
    for seq_len, a stage plan and a microbatch count the schedule accepts."""
    from .models import plan_stages
    from .schedules import get_schedule_spec

    # The order is checked across the switch of a sync start (two synchronous steps stand for any number).
    schedule = get_schedule_spec(config.schedule)
    spec = schedule.starting_synchronously(min(config.sync_steps, 2))
    _require(config.emulate_pp_size >= 0, f"emulate_pp_size must be >= 0, got {config.emulate_pp_size}")
    emulating = spec.order is not None and config.pp_size == 1
    depth = max(config.emulate_pp_size, 1) if emulating else config.pp_size
    _require(
        not (emulating and spec.order.per_microbatch_updates and depth < 2),
        f"schedule '{spec.name}' makes stage s p-1-s updates stale, so on one process it needs the depth to "
        "emulate: set emulate_pp_size >= 2 (or run it on a pipeline, pp_size >= 2)",
    )
    _require(not (emulating and config.mixed_precision == "bf16"),
             f"the one-process emulator of '{spec.name}' computes in fp32 (its stages are not under FSDP2): set "
             "mixed_precision to no, or run the schedule on a pipeline (pp_size >= 2) for bf16 compute")
    n_stages = spec.n_stages(depth)
    n_layers = model_config.num_hidden_layers
    _require(
        n_stages <= n_layers,
        f"pp_size {depth} with schedule '{spec.name}' needs {n_stages} stages, "
        f"but the model has only {n_layers} decoder layers",
    )
    _require(
        not (n_stages > 1 and getattr(model_config, "tie_word_embeddings", False)),
        "tied input/output embeddings cannot be split across pipeline stages; set tie_word_embeddings "
        "to false in the model config (the first and last stage would each own a copy)",
    )
    positions = getattr(model_config, "max_position_embeddings", None)
    _require(positions is None or config.seq_len <= positions,
             f"seq_len {config.seq_len} exceeds the model's max_position_embeddings ({positions}); "
             "shorten seq_len or use a model config with more positions")
    _require(not (spec.synchronous and config.grad_clip_scope == "stage"),
             f"grad_clip_scope stage applies to asynchronous schedules; '{spec.name}' is synchronous and clips by "
             "the global norm (its stages wait for each other at every step anyway): use grad_clip_scope: global")
    sync_steps = min(config.sync_steps, 2)
    problem = _order_problem(schedule, sync_steps, depth, config.n_microbatches, False)
    _require(problem is None, str(problem))
    try:
        plan_stages(model_config, n_stages, config.stage_balance, config.stage_boundaries)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not spec.synchronous and not emulating and config.clips_by_global_norm:
        # the updates wait for every stage's norm (update/held.GlobalClipping)
        problem = _order_problem(schedule, sync_steps, depth, config.n_microbatches, True)
        _require(problem is None, f"{problem}. Clipping by the global norm (max_grad_norm {config.max_grad_norm}, "
                                  "grad_clip_scope global) cannot run this order: set grad_clip_scope: stage to clip "
                                  "each stage by its own norm, or max_grad_norm: 0")
        slowdown = _global_clipping_slowdown(schedule, depth, config.n_microbatches)
        if slowdown > 1.01:  # e.g. PipeDream: a stage needs each update right after its backward
            logger.warning(f"{spec.name} clipped by the global norm: its stages wait for each other's gradient norms; "
                           f"in the schedule's timing model (a backward costs two forwards) a step takes "
                           f"{slowdown:.2f}× as long as with grad_clip_scope: stage, which keeps the "
                           "pipeline busy (docs/optimizers.md)")


# The schedule checks below play the order in one process (tenths of a second to seconds at depth 8);
# they depend on these few values alone (a schedule's spec is immutable), and a study checks hundreds
# of arms that share them.

@functools.lru_cache(maxsize=256)
def _order_problem(schedule, sync_steps: int, depth: int, n_microbatches: int, clip_globally: bool) -> str | None:
    """Why `schedule` (a ScheduleSpec; its first `sync_steps` steps synchronous) cannot run
    n_microbatches at this depth (with its updates clipped by the global norm), or None."""
    try:
        schedule.starting_synchronously(sync_steps).check_microbatches(depth, n_microbatches, clip_globally=clip_globally)
    except ValueError as err:
        return str(err)
    return None


@functools.lru_cache(maxsize=256)
def _global_clipping_slowdown(schedule, depth: int, n_microbatches: int) -> float:
    """`schedule`'s steady step clipped by the global norm over its step clipped by stage, in the timing
    model; timed without a sync start: the steps after the switch are the ones that would wait."""
    clipped, _ = schedule.steady_step(depth, n_microbatches, clip_globally=True)
    unclipped, _ = schedule.steady_step(depth, n_microbatches)
    return clipped / unclipped


def fit_global_batch(config: TrainConfig, world_size: int) -> None:
    """global_batch_size (sequences per optimizer step, all dp ranks) sets n_microbatches to
    global_batch_size / (micro_batch_size × dp); a batch that does not divide is refused."""
    if config.global_batch_size is None or world_size % config.pp_size:  # an indivisible world: check_settings says so
        return
    dp = world_size // config.pp_size
    per_microbatch = config.micro_batch_size * dp
    _require(config.global_batch_size >= per_microbatch and config.global_batch_size % per_microbatch == 0,
             f"global_batch_size {config.global_batch_size} is not a multiple of micro_batch_size "
             f"{config.micro_batch_size} × dp {dp} = {per_microbatch} sequences: choose a multiple, or another "
             "micro_batch_size")
    config.n_microbatches = config.global_batch_size // per_microbatch


def resolve_schedule(config: TrainConfig, steps_per_epoch: float | None = None) -> None:
    """max_steps from num_train_epochs once the data's length (`steps_per_epoch`, finite: a streamed
    dataset is refused before, by check_settings or the Trainer) is known, then a warmup_ratio as steps,
    rounded up as transformers' get_warmup_steps rounds it. Before the data is read a run given epochs
    keeps its ratio for this second call."""
    if config.num_train_epochs is not None:
        if steps_per_epoch is None:
            return
        config.max_steps = max(1, math.ceil(config.num_train_epochs * steps_per_epoch))
        config.num_train_epochs = None  # settled: a resume reads the steps, whatever the data has become
    if config.warmup_ratio:
        config.warmup_steps, config.warmup_ratio = math.ceil(config.warmup_ratio * config.max_steps), 0.0


def config_overrides(text: str | None) -> dict:
    """`config_overrides` as {field: value}: `key=value` pairs separated by commas, as transformers'
    examples take them (`num_hidden_layers=8,rope_theta=1e6`); values read as YAML scalars."""
    import yaml

    overrides = {}
    for pair in filter(None, (part.strip() for part in (text or "").split(","))):
        key, eq, value = pair.partition("=")
        _require(eq and key.strip(), f"config_overrides: '{pair}' is not key=value")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def build_model_config(config: TrainConfig):
    """The HF config of the model a run builds: init_from's or model_config's, with the run's own settings
    of it (attention, aux-loss weight) and `config_overrides`, whose fields must be the model's."""
    from .models import UnsupportedModelError, family_for
    from .models.presets import build_config

    overrides = config_overrides(config.config_overrides)
    _require(not overrides or config.init_from is None, "config_overrides changes the architecture init_from's "
             "weights were trained for: use one or the other (as transformers' run_clm does)")
    source = config.init_from or config.model_config
    try:
        unknown = sorted(set(overrides) - set(build_config(source).to_dict())) if overrides else []
        _require(not unknown, f"config_overrides: {', '.join(unknown)} is not a field of {source}'s config")
        if config.attn_implementation:
            overrides["attn_implementation"] = config.attn_implementation
        if config.router_aux_loss_coef is not None:
            overrides["router_aux_loss_coef"] = config.router_aux_loss_coef
        model_config = build_config(source, **overrides)
        family_for(model_config)
    except (FileNotFoundError, UnsupportedModelError, ValueError, OSError) as err:
        raise ConfigError(str(err)) from None
    return model_config


def validate_config(config: TrainConfig, world_size: int):
    """Check everything before a process group exists. Returns the HF model config to build."""
    from .data import check_dataset_source, check_tokenizer_source, hub_offline, model_tokenizer_source
    from .models.presets import PRESETS

    fit_global_batch(config, world_size)
    resolve_schedule(config)
    check_settings(config, world_size)
    if config.init_from is not None:
        offline = hub_offline()
        _require(os.path.isdir(config.init_from) or (not offline and "/" in config.init_from),
                 f"init_from '{config.init_from}' is not a model directory"
                 + (" (the Hub is offline: HF_HUB_OFFLINE is set)" if offline else ""))
    model_config = build_model_config(config)
    if config.init_from is not None and config.model_config != TrainConfig.model_config:
        logger.warning(f"model_config {config.model_config} is not used: the model is init_from's "
                       f"({config.init_from}), config included")

    check_model_fits(config, model_config)
    try:
        check_dataset_source(config.dataset, seq_len=config.seq_len, vocab_size=model_config.vocab_size)
        if config.eval_dataset is not None:
            check_dataset_source(config.eval_dataset, key="eval_dataset", seq_len=config.seq_len,
                                 vocab_size=model_config.vocab_size)
        # Decided once, here: every later reader (the run, its checkpoints, the export) sees the tokenizer used.
        config.tokenizer = model_tokenizer_source(config.tokenizer, config.init_from, config.model_config, PRESETS)
        check_tokenizer_source(config.tokenizer, model_config.vocab_size)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    return model_config
