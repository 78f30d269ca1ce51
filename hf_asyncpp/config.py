"""The run's configuration: one dataclass, YAML + `--key value` overrides, and all validation.

`load_config` parses; `validate_config` checks everything that can be checked before a process
group exists (names, sizes, paths, the schedule's action lists) and raises one `ConfigError`
whose message names the key and the fix. Nothing touches output_dir before validation passes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass

import yaml

__all__ = ["ConfigError", "OPTIMIZERS", "TrainConfig", "apply_launch_settings", "check_model_fits", "check_settings", "check_step_boundaries", "config_from_values", "fit_to_one_process", "load_config", "validate_config"]

from .log import get_logger
from .models.recompute import CHECKPOINTING_MODES
from .optim import OPTIMIZER_NAMES as OPTIMIZERS

logger = get_logger(__name__)


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any process group starts."""


def _key(default, meaning: str):
    """A config key: its default and what it means (shown by `train.py --help` and docs/config.md)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": meaning})
    return dataclasses.field(default=default, metadata={"help": meaning})


# The section each group of keys belongs to, by its first key (keys after it, in order, join it).
SECTION_STARTS = {"model_config": "model", "dataset": "data", "pp_size": "pipeline", "optimizer": "optimization",
                  "output_dir": "output", "save_steps": "checkpoints", "nonfinite_policy": "failures"}


@dataclass
class TrainConfig:
    """Every key of a run; `train.py --help` and docs/config.md are generated from the fields' help."""

    model_config: str = _key("tiny-moe", "a preset (`hf_asyncpp.PRESETS`: tiny-moe, tiny-mixtral, tiny-llama, …), an "
                             "HF config.json, or a model directory")
    init_from: str | None = _key(None, "an HF model directory (e.g. an earlier run's final/) or, with the Hub reachable, "
                                 "a model id, whose weights start the run; random init seeded by `seed` otherwise")
    attn_implementation: str | None = _key(None, "sdpa or eager; none keeps the model's default")
    router_aux_loss_coef: float | None = _key(None, "weight of the load-balancing loss in the objective; none keeps "
                                              "the model config's")
    router_bias_update_rate: float = _key(0.001, "DeepSeek-V3 routing-bias step γ: after each step every bias moves "
                                          "±γ toward the mean expert load; 0 freezes the biases")
    dataset: str = _key("shakespeare", "`shakespeare` (offline corpus), .txt/.jsonl/.parquet files (a glob or "
                        "directory), a `prepare-data` directory, or a Hub dataset id")
    dataset_config_name: str | None = _key(None, "the Hub dataset's configuration (subset)")
    dataset_split: str = _key("train", "the Hub dataset's split (local files are one split)")
    dataset_revision: str | None = _key(None, "revision (branch, tag or commit) of the Hub dataset and eval_dataset: "
                                        "pin it for a reproducible run")
    streaming: bool = _key(False, "read `dataset` as a stream, each dp rank its own documents, packed on the fly "
                           "(corpora too large to load); holds nothing out: use eval_dataset")
    text_column: str = _key("text", "the column holding text in json/parquet sources")
    preprocessing_num_workers: int | None = _key(None, "processes tokenizing a map-style dataset (cached on disk; "
                                                 "none: one)")
    tokenizer: str = _key("builtin", "`builtin` (the shipped ByteLevel BPE, 8192 tokens) or an HF tokenizer directory")
    seq_len: int = _key(128, "tokens per sample")
    shuffle: bool = _key(True, "permute the blocks (seeded, once per epoch); false reads them in file order")
    shuffle_window: int = _key(10_000, "a shuffled stream permutes its documents this many at a time (a resume "
                               "reads one window again)")
    eval_fraction: float = _key(0.0, "share of the blocks held out for validation (the last ones in file order); "
                                "0: none")
    eval_dataset: str | None = _key(None, "files or a Hub id held out whole for validation, instead of eval_fraction")
    eval_dataset_split: str = _key("validation", "the split of a Hub eval_dataset")
    eval_steps: int = _key(0, "also evaluate every N steps (0: only at the end, when there is a held-out set)")
    pp_size: int = _key(2, "pipeline ranks (dp = world size / pp_size); forced to 1 without a launcher")
    schedule: str = _key("1f1b", "gpipe, 1f1b, interleaved-1f1b, zbv (synchronous); pipedream-2bw, wpipe, pipedream "
                         "(asynchronous; see docs/schedules.md)")
    micro_batch_size: int = _key(8, "samples per microbatch")
    n_microbatches: int = _key(4, "microbatches per optimizer step on each dp rank; the step's loss is their mean")
    stage_balance: str = _key("compute", "how layers are split: compute (parameters a token touches), params "
                              "(stored parameters) or layers (equal counts)")
    stage_boundaries: list[int] | None = _key(None, "explicit split: the first layer of each stage after the first, "
                                              "e.g. [3, 6, 9]")
    emulate_pp_size: int = _key(0, "an asynchronous schedule on one process: the pipeline depth it emulates (0: 1; "
                                "set from pp_size without a launcher)")
    sync_steps: int = _key(0, "an asynchronous schedule: its first N steps run synchronously (every gradient "
                           "fresh), then the schedule starts from their weights as from the start of training")
    fsdp: bool = _key(True, "with dp > 1, shard parameters, gradients, optimizer state, weight versions and EF buffers "
                      "over the dp replicas (FSDP2); false: whole replicas and an all-reduce")
    mixed_precision: str = _key("auto", "compute dtype of the stages: auto (bf16 on GPUs, fp32 on CPU), bf16 or no; "
                                "master weights and optimizer state stay fp32")
    grad_reduce_dtype: str = _key("fp32", "dtype gradients are averaged over dp in: fp32, or compute (bf16 under "
                                  "bf16 compute: half the bytes, one more rounding)")
    activation_checkpointing: str = _key("none", "recompute activations in the backward: none, full (every decoder "
                                         "layer) or selective (each layer's MLP / MoE block)")
    compile_layers: bool = _key(False, "torch.compile each decoder layer (the pipeline stays eager)")
    threads_per_rank: int | None = _key(None, "torch CPU threads per rank (none: cores / local ranks)")
    optimizer: str = _key("adamw", "adamw, muon, soap, lion or sgd (see docs/optimizers.md)")
    learning_rate: float = _key(1e-3, "peak learning rate")
    momentum: float = _key(0.9, "SGD momentum; β1 of AdamW, SOAP and Lion; Muon's momentum")
    beta2: float = _key(0.95, "β2 of AdamW and SOAP (also SOAP's factor EMA rate); Lion's momentum EMA rate")
    weight_decay: float = _key(0.0, "decoupled for AdamW, SOAP and Lion, L2 for SGD; never on biases and norm "
                               "weights (as transformers.Trainer)")
    adam_epsilon: float = _key(1e-8, "ε of AdamW, SOAP and Muon's AdamW part")
    muon_lr_scale: str = _key("original", "Muon's LR scale by matrix shape: original (sqrt(max(1, A/B))) or "
                              "match_rms_adamw (0.2·sqrt(max(A, B)))")
    muon_nesterov: bool = _key(True, "Nesterov momentum in Muon")
    muon_adamw_patterns: list[str] | None = _key(None, "regular expressions of the parameter names Muon leaves to "
                                                 "AdamW (none: embed_tokens, lm_head, gates, routers)")
    soap_precondition_frequency: int = _key(10, "SOAP refreshes its eigenbases every N updates")
    soap_max_precond_dim: int = _key(4096, "SOAP leaves a matrix side longer than this unrotated")
    ef: bool = _key(False, "Error Feedback: apply u + ef_lambda·(u − u_prev) instead of the optimizer's update u")
    ef_lambda: float = _key(1.0, "the Error Feedback weight λ (0 is exactly the plain optimizer)")
    max_grad_norm: float = _key(1.0, "clip by the L2 norm (global for synchronous schedules, per stage for "
                                "asynchronous ones); 0 disables")
    lr_scheduler_type: str = _key("cosine", "any transformers scheduler name: linear, cosine, constant, "
                                  "constant_with_warmup, …")
    lr_scheduler_kwargs: dict | None = _key(None, "the schedule's own arguments (e.g. num_cycles, min_lr)")
    warmup_steps: int = _key(0, "learning-rate warm-up steps")
    max_steps: int = _key(100, "optimizer steps")
    seed: int = _key(42, "model initialization and shuffle seed")
    output_dir: str = _key("outputs/run", "where metrics, checkpoints and the export go; untouched if the config "
                           "is invalid")
    logging_steps: int = _key(1, "log every N steps (and the last)")
    report_to: list[str] = _key(["tensorboard"], "trackers that also get the logged records: tensorboard, wandb, "
                                "trackio, or none")
    save_final: bool = _key(True, "export final/ at the end: an HF model directory with the tokenizer and a model card")
    push_to_hub: bool = _key(False, "upload final/ to hub_model_id at the end (token from HF_TOKEN or "
                             "`hf auth login`)")
    hub_model_id: str | None = _key(None, "the Hub repository, namespace/name")
    max_shard_size: str = _key("5GB", "the export's weights: one model.safetensors below this size, per-stage shards "
                               "and an index above it")
    export_dtype: str = _key("float32", "the export's weights: float32, or bfloat16 (cast from the fp32 masters)")
    license: str = _key("apache-2.0", "the model card's license")
    language: list[str] = _key(["en"], "the model card's language(s)")
    save_steps: int = _key(0, "write a training checkpoint every N steps to output_dir/checkpoint-<step>/ (0: never)")
    save_total_limit: int | None = _key(None, "keep only the newest N checkpoints")
    resume_from_checkpoint: str | None = _key(None, "a checkpoint directory, or `latest` in output_dir (a fresh start "
                                              "while there is none)")
    nonfinite_policy: str = _key("stop", "a NaN or infinity in the loss or gradient norm (its update is never "
                                 "applied): stop the run one step later, or skip and go on")
    nonfinite_skip_limit: int = _key(10, "under skip: the run stops at the step that makes more than this many steps "
                                     "skipped")
    comm_timeout_s: float = _key(600.0, "seconds a rank waits for another (dead or stalled) before stopping the run")

    @property
    def rows_per_step(self) -> int:
        """Rows of one minibatch on one dp rank: micro_batch_size × n_microbatches."""
        return self.micro_batch_size * self.n_microbatches


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _base_type(annotation) -> tuple[type, bool, type | None]:
    """(scalar type, optional?, list item type) for the simple annotations TrainConfig uses."""
    hint = typing.get_type_hints(TrainConfig)[annotation]
    args = typing.get_args(hint)
    optional = type(None) in args
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        return list, optional, typing.get_args(hint)[0]
    return hint, optional, None


def _coerce(key: str, value):
    kind, optional, item = _base_type(key)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if not optional:
            raise ConfigError(f"config key '{key}' cannot be empty")
        return None
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if kind is dict:
            value = yaml.safe_load(value) if isinstance(value, str) else value
            if not isinstance(value, dict):
                raise ValueError(value)
            return dict(value)
        if kind is list:
            if isinstance(value, str):
                value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
            if item is str and not all(isinstance(v, str) for v in value):
                raise ValueError(value)
            return [item(v) for v in value]
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key '{key}' expects {kind.__name__}, got {value!r}") from None


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> dict:
    """A config file's keys; `extends: other.yaml` (relative to the file) supplies the keys it omits."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist")
    if os.path.realpath(path) in seen:
        raise ConfigError(f"config file '{path}' extends itself (through {' → '.join(seen)})")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values")
    base = values.pop("extends", None)
    if base is None:
        return values
    parent = _read_yaml(os.path.join(os.path.dirname(path), str(base)), (*seen, os.path.realpath(path)))
    return {**parent, **values}


def load_config(path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML file (optional) and apply `--key value` / `--key=value` overrides."""
    values = _read_yaml(path) if path is not None else {}
    tokens = list(overrides or [])
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("--"):
            raise ConfigError(f"expected --key value, got '{token}'")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if not tokens:
                raise ConfigError(f"override --{key} has no value")
            value = tokens.pop(0)
        values[key.replace("-", "_")] = value
    return config_from_values(values)


def config_from_values(values: dict) -> TrainConfig:
    """A TrainConfig from key → value (strings or typed values); ConfigError for an unknown key or a
    value of the wrong type. Every front end builds its config through here."""
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; known keys: {', '.join(_FIELDS)}")
    return TrainConfig(**{k: _coerce(k, v) for k, v in values.items()})


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


def check_step_boundaries(spec, config: TrainConfig, purpose: str) -> None:
    """Training checkpoints (resumed by replaying the actions whose updates were still due,
    schedules/async_order.py: replay_after) and mid-run evaluation need every update unit applied on
    all stages or on none at a step boundary; WPipe's straddle it. The single-process emulator's
    held-back gradients are not saved."""
    from .schedules import ScheduleError
    from .schedules.async_order import replay_after

    if spec.synchronous:
        return
    if purpose == "training checkpoints":
        _require(config.pp_size > 1, f"training checkpoints of the emulated schedule '{spec.name}' (pp_size 1) "
                 "are not supported; run it on a pipeline (pp_size >= 2) or use save_final for an HF export")
    elif config.pp_size == 1:
        return
    try:  # the boundary after the first asynchronous step (a sync start's steps hold nothing in flight)
        replay_after(spec.order, config.pp_size, config.n_microbatches, config.sync_steps, config.sync_steps + 2)
    except ScheduleError as err:
        raise ConfigError(f"{purpose} are not supported for schedule '{spec.name}': {err}") from None


def _check_lr_schedule(config: TrainConfig) -> None:
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
    from .checkpoint.checkpoints import CheckpointError, find_checkpoint, verify_checkpoint

    if config.resume_from_checkpoint is not None:
        try:
            found = find_checkpoint(config.resume_from_checkpoint, config.output_dir)
            if found is not None:
                verify_checkpoint(found)
        except (CheckpointError, OSError, ValueError) as err:
            raise ConfigError(str(err)) from None


def check_settings(config: TrainConfig, world_size: int):
    """Every check that needs neither the model nor the data (ranges, names, the schedule, the
    checkpoint to resume). Returns the schedule's spec."""
    # Imported here: config parsing stays light, validation needs the model and schedule layers.
    from .schedules import get_schedule_spec

    for key in ("seq_len", "micro_batch_size", "n_microbatches", "pp_size", "max_steps", "logging_steps",
                "shuffle_window"):
        _require(getattr(config, key) >= 1, f"{key} must be at least 1, got {getattr(config, key)}")
    _require(config.learning_rate > 0, f"learning_rate must be positive, got {config.learning_rate}")
    _require(config.max_grad_norm >= 0, f"max_grad_norm must be >= 0 (0 disables clipping), got {config.max_grad_norm}")
    _require(config.router_bias_update_rate >= 0,
             f"router_bias_update_rate must be >= 0, got {config.router_bias_update_rate}")
    _require(config.muon_lr_scale in ("original", "match_rms_adamw"),
             f"unknown muon_lr_scale '{config.muon_lr_scale}'; choose original or match_rms_adamw")
    for pattern in config.muon_adamw_patterns or ():
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"muon_adamw_patterns: '{pattern}' is not a regular expression ({err})") from None
    try:
        from .reporting import check_report_to

        check_report_to(config.report_to)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _require(config.activation_checkpointing in CHECKPOINTING_MODES,
             f"unknown activation_checkpointing '{config.activation_checkpointing}'; choose "
             + ", ".join(CHECKPOINTING_MODES))
    _require(config.mixed_precision in ("auto", "bf16", "no"),
             f"unknown mixed_precision '{config.mixed_precision}'; choose auto, bf16 or no")
    _require(config.grad_reduce_dtype in ("fp32", "compute"),
             f"unknown grad_reduce_dtype '{config.grad_reduce_dtype}'; choose fp32 or compute")
    _require(config.fsdp or config.mixed_precision != "bf16",
             "mixed_precision bf16 is applied by FSDP2: set fsdp to true (or mixed_precision to no)")
    _require(config.soap_precondition_frequency >= 1,
             f"soap_precondition_frequency must be at least 1 (updates between eigenbasis refreshes), "
             f"got {config.soap_precondition_frequency}")
    _require(config.soap_max_precond_dim >= 1,
             f"soap_max_precond_dim must be at least 1 (longer sides stay unrotated), got {config.soap_max_precond_dim}")
    _require(config.ef_lambda >= 0, f"ef_lambda must be >= 0, got {config.ef_lambda}")
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
    _require(0 <= config.eval_fraction < 1, f"eval_fraction must be in [0, 1), got {config.eval_fraction}")
    _require(config.eval_steps >= 0, f"eval_steps must be >= 0, got {config.eval_steps}")
    _require(not (config.streaming and config.eval_fraction > 0),
             "eval_fraction cannot hold out part of a streamed dataset (its length is unknown): set "
             "eval_fraction to 0 and name the held-out files in eval_dataset")
    _require(config.eval_dataset is None or config.eval_fraction == 0,
             "eval_dataset and eval_fraction both name a held-out set: keep one (eval_dataset replaces eval_fraction)")
    _require(not config.eval_steps or config.eval_fraction > 0 or config.eval_dataset is not None,
             "eval_steps asks for evaluation, but there is no evaluation set: set eval_fraction > 0 or eval_dataset")
    _require(config.save_steps >= 0, f"save_steps must be >= 0 (0: no checkpoints), got {config.save_steps}")
    _require(config.save_total_limit is None or config.save_total_limit >= 1,
             f"save_total_limit must be at least 1, got {config.save_total_limit}")
    from .resilience import NONFINITE_POLICIES

    _require(config.nonfinite_policy in NONFINITE_POLICIES,
             f"unknown nonfinite_policy '{config.nonfinite_policy}'; choose {' or '.join(NONFINITE_POLICIES)}")
    _require(config.nonfinite_skip_limit >= 0, f"nonfinite_skip_limit must be >= 0, got {config.nonfinite_skip_limit}")
    _require(config.comm_timeout_s > 0, f"comm_timeout_s must be positive, got {config.comm_timeout_s}")
    _check_resume(config)
    _require(config.warmup_steps >= 0, f"warmup_steps must be >= 0, got {config.warmup_steps}")
    _require(config.optimizer in OPTIMIZERS, f"unknown optimizer '{config.optimizer}'; available: {', '.join(OPTIMIZERS)}")
    _require(config.adam_epsilon >= 0, f"adam_epsilon must be >= 0, got {config.adam_epsilon}")
    _check_lr_schedule(config)
    try:
        spec = get_schedule_spec(config.schedule)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _require(config.sync_steps >= 0, f"sync_steps must be >= 0, got {config.sync_steps}")
    _require(not (config.sync_steps and spec.synchronous),
             f"sync_steps makes the first steps of an asynchronous schedule synchronous; '{spec.name}' is "
             "synchronous throughout: remove sync_steps or choose pipedream-2bw, pipedream or wpipe")
    _require(config.sync_steps < config.max_steps,
             f"sync_steps ({config.sync_steps}) must be below max_steps ({config.max_steps}): the run would "
             "never switch to its asynchronous schedule")
    if config.save_steps or config.resume_from_checkpoint:
        check_step_boundaries(spec, config, "training checkpoints")
    if config.eval_steps:
        check_step_boundaries(spec, config, "evaluations during training (eval_steps; the final one works)")
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
    spec = get_schedule_spec(config.schedule).starting_synchronously(min(config.sync_steps, 2))
    _require(config.emulate_pp_size >= 0, f"emulate_pp_size must be >= 0, got {config.emulate_pp_size}")
    emulating = spec.order is not None and config.pp_size == 1
    depth = max(config.emulate_pp_size, 1) if emulating else config.pp_size
    _require(
        not (emulating and spec.order.per_microbatch_updates and depth < 2),
        f"schedule '{spec.name}' makes stage s p-1-s updates stale, so on one process it needs the depth to "
        "emulate: set emulate_pp_size >= 2 (or run it on a pipeline, pp_size >= 2)",
    )
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
    try:
        spec.check_microbatches(depth, config.n_microbatches)
        plan_stages(model_config, n_stages, config.stage_balance, config.stage_boundaries)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def validate_config(config: TrainConfig, world_size: int):
    """Check everything before a process group exists. Returns the HF model config to build."""
    from .data import check_dataset_source, check_tokenizer_source, hub_offline
    from .models import UnsupportedModelError, family_for
    from .models.presets import build_config

    check_settings(config, world_size)
    overrides = {}
    if config.attn_implementation:
        overrides["attn_implementation"] = config.attn_implementation
    if config.router_aux_loss_coef is not None:
        overrides["router_aux_loss_coef"] = config.router_aux_loss_coef
    source = config.init_from or config.model_config
    if config.init_from is not None:
        offline = hub_offline()
        _require(os.path.isdir(config.init_from) or (not offline and "/" in config.init_from),
                 f"init_from '{config.init_from}' is not a model directory"
                 + (" (the Hub is offline: HF_HUB_OFFLINE is set)" if offline else ""))
    try:
        model_config = build_config(source, **overrides)
        family_for(model_config)
    except (FileNotFoundError, UnsupportedModelError, ValueError, OSError) as err:
        raise ConfigError(str(err)) from None

    check_model_fits(config, model_config)
    try:
        check_dataset_source(config.dataset, seq_len=config.seq_len, vocab_size=model_config.vocab_size)
        if config.eval_dataset is not None:
            check_dataset_source(config.eval_dataset, key="eval_dataset", seq_len=config.seq_len,
                                 vocab_size=model_config.vocab_size)
        check_tokenizer_source(config.tokenizer, model_config.vocab_size)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    return model_config
