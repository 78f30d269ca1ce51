"""The run's configuration: its keys in sections (one dataclass per component, each key with its
meaning), TrainConfig holding them all flat, and YAML + `--key value` overrides. What a config may
hold is checked by config_checks.py."""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass

import yaml

__all__ = ["ALIASES", "SECTIONS", "STRATEGIES", "TRAINER_OPTIMIZERS", "CheckpointConfig", "ConfigError", "DataConfig",
           "ExportConfig", "FailureConfig", "ModelConfig", "OptimizerConfig", "PipelineConfig", "RunConfig", "TrainConfig",
           "config_from_values", "load_config"]


class ConfigError(ValueError):
    """A configuration that cannot run; raised before any process group starts."""


def _key(default, meaning: str):
    """A config key: its default and what it means (shown by `train.py --help` and docs/config.md)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": meaning})
    return dataclasses.field(default=default, metadata={"help": meaning})


# The keys in sections, one dataclass per component: a function that reads one component says so by
# taking that section; TrainConfig is all of them, flat, as YAML files and `--key value` write them.

@dataclass
class ModelConfig:
    """The model to build: its architecture, its starting weights, its routing."""

    model_config: str = _key("tiny-moe", "a preset (`hf_asyncpp.PRESETS`: tiny-moe, tiny-mixtral, tiny-llama, …), an "
                             "HF config.json, a model directory or, with the Hub reachable, a model id; unused "
                             "with init_from, whose config is the model's")
    init_from: str | None = _key(None, "an HF model directory (e.g. an earlier run's final/) or, with the Hub reachable, "
                                 "a model id, whose weights start the run; random init seeded by `seed` otherwise")
    config_overrides: str | None = _key(None, "fields of the model's config changed, as transformers' examples take "
                                        "them: `num_hidden_layers=8,rope_theta=1e6` (not with init_from)")
    attn_implementation: str | None = _key(None, "eager, sdpa, flex_attention, flash_attention_2 or flash_attention_3 "
                                           "(their packages installed); none keeps the model's default")
    router_aux_loss_coef: float | None = _key(None, "weight of the load-balancing loss in the objective; none keeps "
                                              "the model config's")
    router_bias_update_rate: float = _key(0.001, "DeepSeek-V3 routing-bias step γ: after each step every bias moves "
                                          "±γ toward the mean expert load; 0 freezes the biases")


@dataclass
class DataConfig:
    """The text a run reads: its source, tokenizer, blocks, order and held-out share."""

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
    tokenizer: str | None = _key(None, "the model's by default (init_from's, else model_config's directory or Hub id; "
                                 "the built-in presets': `builtin`, the shipped ByteLevel BPE of 8192 tokens); or "
                                 "`builtin`, an HF tokenizer directory, a Hub id")
    seq_len: int = _key(128, "tokens per sample")
    shuffle: bool = _key(True, "permute the blocks (seeded, once per epoch); false reads them in file order")
    shuffle_window: int = _key(10_000, "a shuffled stream permutes its documents this many at a time (a resume "
                               "reads one window again)")
    eval_fraction: float = _key(0.0, "share of the blocks held out for validation (the last ones in file order); "
                                "0: none")
    eval_dataset: str | None = _key(None, "files or a Hub id held out whole for validation, instead of eval_fraction")
    eval_dataset_split: str = _key("validation", "the split of a Hub eval_dataset")
    eval_steps: int = _key(0, "also evaluate every N steps (0: only at the end, when there is a held-out set)")


@dataclass
class PipelineConfig:
    """How the model runs: stages, schedule, microbatches, sharding, precision."""

    pp_size: int = _key(2, "pipeline ranks (dp = world size / pp_size); forced to 1 without a launcher")
    schedule: str = _key("1f1b", "gpipe, 1f1b, interleaved-1f1b, zbv (synchronous); pipedream-2bw, wpipe, pipedream "
                         "(asynchronous; see docs/schedules.md)")
    micro_batch_size: int = _key(8, "samples per microbatch")
    n_microbatches: int = _key(4, "microbatches per optimizer step on each dp rank; the step's loss is their mean")
    global_batch_size: int | None = _key(None, "sequences per optimizer step, all dp ranks together; sets n_microbatches "
                                         "to it / (micro_batch_size × dp), so a launch on more GPUs keeps the batch")
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
                                  "bf16 compute: half the bytes, one more rounding; asynchronous schedules)")
    activation_checkpointing: str = _key("none", "recompute activations in the backward: none, full (every decoder "
                                         "layer) or selective (each layer's MLP / MoE block)")
    compile_layers: bool = _key(False, "torch.compile each decoder layer (the pipeline stays eager)")
    threads_per_rank: int | None = _key(None, "torch CPU threads per rank (none: cores / local ranks)")

    @property
    def rows_per_step(self) -> int:
        """Rows of one minibatch on one dp rank: micro_batch_size × n_microbatches."""
        return self.micro_batch_size * self.n_microbatches


@dataclass
class OptimizerConfig:
    """The update: optimizer, Error Feedback, clipping and the learning-rate schedule over
    max_steps optimizer steps."""

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
    ef_last_update: str = _key("extrapolate", "the run's last update of each stage under Error Feedback: extrapolate "
                               "(as every other: the final weights, which the final evaluation and the export read, "
                               "lie one extrapolated step past the trajectory of the optimizer's updates) or "
                               "trajectory (the last takes the previous extrapolation back: they lie on it); no "
                               "effect without ef")
    max_grad_norm: float = _key(1.0, "clip the gradient being applied to this L2 norm (see grad_clip_scope); 0 disables")
    grad_clip_scope: str = _key("global", "global: by the norm over all stages and dp ranks, every schedule; stage: an "
                                "asynchronous schedule clips each stage by its own norm (its stages never wait for "
                                "each other's norms)")
    lr_scheduler_type: str = _key("cosine", "any transformers scheduler name: linear, cosine, constant, "
                                  "constant_with_warmup, …")
    lr_scheduler_kwargs: dict | None = _key(None, "the schedule's own arguments (e.g. num_cycles, min_lr)")
    warmup_steps: int = _key(0, "learning-rate warm-up steps (a value below 1 is a warmup_ratio)")
    warmup_ratio: float = _key(0.0, "warm-up as a share of max_steps, rounded up (as Trainer takes it); not with "
                               "warmup_steps")
    max_steps: int = _key(100, "optimizer steps")
    num_train_epochs: float | None = _key(None, "passes over the training blocks instead of max_steps: max_steps "
                                          "follows once the data is read (not for a streamed dataset)")

    @property
    def clips_by_global_norm(self) -> bool:
        """Whether each update is clipped by the global gradient norm (of its update unit, all stages)."""
        return self.max_grad_norm > 0 and self.grad_clip_scope == "global"


@dataclass
class RunConfig:
    """Where a run writes and what it records."""

    seed: int = _key(42, "model initialization and shuffle seed")
    output_dir: str = _key("outputs/run", "where metrics, checkpoints and the export go; untouched if the config "
                           "is invalid")
    logging_steps: int = _key(1, "log every N steps (and the last)")
    report_to: list[str] = _key(["tensorboard"], "trackers that also get the logged records: tensorboard, wandb, "
                                "trackio, or none")
    peak_tflops: float = _key(0.0, "a device's peak TFLOP/s for the logged MFU (0: a known GPU's bf16 dense peak; "
                              "none on a CPU)")
    profile_steps: list[int] = _key([], "steps whose torch.profiler trace every rank writes to "
                                    "<output_dir>/profile/ (Chrome trace format)")


@dataclass
class ExportConfig:
    """The final HF model directory, its model card and its upload."""

    save_final: bool = _key(True, "export final/ at the end: an HF model directory with the tokenizer and a model card")
    push_to_hub: bool = _key(False, "upload final/ to hub_model_id at the end (token from HF_TOKEN or "
                             "`hf auth login`)")
    hub_model_id: str | None = _key(None, "the Hub repository, namespace/name")
    hub_revision: str | None = _key(None, "the branch push_to_hub uploads to (created if missing; default: main)")
    hub_private_repo: bool = _key(False, "push_to_hub creates the repository private (an existing one keeps its "
                                  "visibility)")
    max_shard_size: str = _key("5GB", "the export's weights: one model.safetensors below this size, per-stage shards "
                               "and an index above it")
    export_dtype: str = _key("float32", "the export's weights: float32, or bfloat16 (cast from the fp32 masters)")
    license: str = _key("apache-2.0", "the model card's license")
    language: list[str] = _key(["en"], "the model card's language(s)")


@dataclass
class CheckpointConfig:
    """Training checkpoints: how often, how many, which to resume."""

    save_steps: int = _key(0, "write a training checkpoint every N steps to output_dir/checkpoint-<step>/ (0: never)")
    save_total_limit: int | None = _key(None, "keep only the newest N checkpoints")
    resume_from_checkpoint: str | None = _key(None, "a checkpoint directory, or `latest` in output_dir (a fresh start "
                                              "while there is none)")
    checkpoint_hf_weights: bool = _key(True, "write each checkpoint's weights as HF safetensors beside its state (in "
                                       "export_dtype, by rank 0 from the saved files), so from_pretrained loads it; "
                                       "false: a note names the export command")
    checkpoint_async: bool = _key(True, "write checkpoints in the background from a host copy of the state, while "
                                  "training goes on (false: training waits for the files and their checksums)")
    save_before_time_limit: bool = _key(True, "with the job's end time known (SLURM_JOB_END_TIME), save and stop at "
                                        "the last step boundary where a save, timed from the run's last one, fits")


@dataclass
class FailureConfig:
    """What a non-finite step or a silent rank does to the run."""

    nonfinite_policy: str = _key("stop", "a NaN or infinity in the loss or gradient norm (its update is never "
                                 "applied): stop the run one step later, or skip and go on")
    nonfinite_skip_limit: int = _key(10, "under skip: the run stops at the step that makes more than this many steps "
                                     "skipped")
    comm_timeout_s: float = _key(600.0, "seconds a rank waits for another (dead or stalled) before stopping the run")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "pipeline": PipelineConfig, "optimization": OptimizerConfig,
            "run": RunConfig, "export": ExportConfig, "checkpoints": CheckpointConfig, "failures": FailureConfig}


# Bases in reverse: a dataclass lists its bases' fields from the last base to the first.
@dataclass
class TrainConfig(FailureConfig, CheckpointConfig, ExportConfig, RunConfig, OptimizerConfig, PipelineConfig,
                  DataConfig, ModelConfig):
    """Every key of a run, flat: the sections together. `train.py --help` and docs/config.md are
    generated from the fields' help, section by section."""


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


@functools.cache
def _type_hints() -> dict[str, typing.Any]:
    """TrainConfig's annotations, resolved once: resolving them is milliseconds per call, and a study
    builds hundreds of configs of dozens of keys."""
    return typing.get_type_hints(TrainConfig)


def _base_type(annotation) -> tuple[type, bool, type | None]:
    """(scalar type, optional?, list item type) for the simple annotations TrainConfig uses."""
    hint = _type_hints()[annotation]
    args = typing.get_args(hint)
    optional = type(None) in args
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        return list, optional, typing.get_args(hint)[0]
    return hint, optional, None


def _parse_bool(value) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(value)
        return value.lower() in ("true", "1", "yes")
    return bool(value)


def _coerce(key: str, value):
    kind, optional, item = _base_type(key)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if not optional:
            raise ConfigError(f"config key '{key}' cannot be empty")
        return None
    try:
        if kind is bool:
            return _parse_bool(value)
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
    # Each source under this project's names first: an override replaces the file's setting whatever its name.
    values = _our_names(_read_yaml(path) if path is not None else {})
    given = _our_names(_parse_overrides(list(overrides or [])))
    # A setting on the command line replaces the file's, under whichever of its keys each gives it.
    for one, other, _ in _ONE_SETTING:
        if one in given:
            values.pop(other, None)
        if other in given:
            values.pop(one, None)
    return config_from_values({**values, **given})


# Pairs of keys that set one thing two ways.
_ONE_SETTING = [("global_batch_size", "n_microbatches",
                 "global_batch_size sets n_microbatches from micro_batch_size and the dp size"),
                ("num_train_epochs", "max_steps", "num_train_epochs sets max_steps from the data's length"),
                ("warmup_ratio", "warmup_steps", "warmup_ratio sets warmup_steps from max_steps")]


def _parse_overrides(tokens: list[str]) -> dict:
    """`--key value`, `--key=value`; a boolean key alone (`--ef`: true) or negated (`--no-ef`: false)."""
    values = {}
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("--"):
            raise ConfigError(f"expected --key value, got '{token}'")
        key, eq, value = token[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            if key.startswith("no_") and key[3:] in _FIELDS and _base_type(key[3:])[0] is bool:
                key, value = key[3:], "false"
            elif key in _FIELDS and _base_type(key)[0] is bool and (not tokens or tokens[0].startswith("--")):
                value = "true"
            elif not tokens:
                raise ConfigError(f"override --{key} has no value")
            else:
                value = tokens.pop(0)
        values[key] = value
    return values


# transformers' Trainer optimizer names the pipeline takes, and which of its optimizers each is.
TRAINER_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd", "lion_32bit": "lion"}


def _trainer_optimizer(name: str) -> str:
    if name in TRAINER_OPTIMIZERS.values():
        return name
    if name not in TRAINER_OPTIMIZERS:
        raise ConfigError(f"optim {name!r} is not supported: use one of {', '.join(TRAINER_OPTIMIZERS)} or set "
                          "optimizer (adamw, muon, soap, lion, sgd)")
    return TRAINER_OPTIMIZERS[name]


# TrainingArguments' names of settings both have: {its name: (the key here, its value as this key's)}.
# YAML files and --key overrides take either; the Trainer front end maps its own arguments the same way.
ALIASES = {
    "per_device_train_batch_size": ("micro_batch_size", None),
    "gradient_accumulation_steps": ("n_microbatches", None),  # each microbatch one accumulation step
    "optim": ("optimizer", _trainer_optimizer),
    "adam_beta1": ("momentum", None),
    "adam_beta2": ("beta2", None),
    "bf16": ("mixed_precision", lambda value: "bf16" if _parse_bool(value) else "no"),
}

# TrainingArguments' when-to strategies: "steps" is what the *_steps key does; "no" turns evaluations and
# saves during training off (evaluation still ends a run with a held-out set). Epoch-timed events are the
# Trainer front end's.
STRATEGIES = {"eval_strategy": "eval_steps", "save_strategy": "save_steps", "logging_strategy": "logging_steps"}


def _strategies(values: dict) -> dict:
    out = {}
    for key, value in values.items():
        if key not in STRATEGIES:
            out[key] = value
        elif value == "no" and key != "logging_strategy":
            out[STRATEGIES[key]] = 0
        elif value != "steps":
            raise ConfigError(f"{key} {value!r}: train.py times events in steps, so give {STRATEGIES[key]} (with "
                              f"{key} 'steps'{'' if key == 'logging_strategy' else ' or no'}); AsyncPPTrainer takes "
                              "'epoch'")
    return out


def _our_names(values: dict) -> dict:
    """`values` under this project's keys: TrainingArguments' names translated (ALIASES); a setting given
    under two names with different values is a ConfigError."""
    ours, named = {}, {}
    for key, value in _strategies(values).items():
        target, convert = ALIASES.get(key, (key, None))
        value = convert(value) if convert is not None and value is not None else value
        if target in ours and str(ours[target]) != str(value):
            raise ConfigError(f"{named[target]} ({ours[target]}) and {key} ({value}) set one setting to two values: "
                              "give one")
        ours[target], named[target] = value, key
    return ours


def _fractional_warmup_as_ratio(ours: dict) -> dict:
    """A warmup_steps below 1 is a ratio of max_steps, as Trainer takes it (config_checks.resolve_schedule
    makes it steps)."""
    warmup = ours.get("warmup_steps")
    if warmup is not None and not isinstance(warmup, bool):
        try:
            ratio = float(warmup)
        except (TypeError, ValueError):
            ratio = None
        if ratio is not None and 0 < ratio < 1:
            del ours["warmup_steps"]
            if "warmup_ratio" in ours and float(ours["warmup_ratio"]) != ratio:
                raise ConfigError(f"warmup_ratio ({ours['warmup_ratio']}) and warmup_steps ({warmup}) set one setting "
                                  "to two values: give one")
            ours["warmup_ratio"] = ratio
    return ours


# mixed_precision as export_dtype and torch spell the dtypes, besides its own names.
_PRECISION_SPELLINGS = {"bfloat16": "bf16", "float32": "no", "fp32": "no"}


def config_from_values(values: dict) -> TrainConfig:
    """A TrainConfig from key → value (strings or typed values), under this project's names or
    TrainingArguments' (ALIASES); ConfigError for an unknown key or a value of the wrong type. Every
    front end builds its config through here."""
    values = _fractional_warmup_as_ratio(_our_names(values))
    if isinstance(values.get("mixed_precision"), str):
        values["mixed_precision"] = _PRECISION_SPELLINGS.get(values["mixed_precision"], values["mixed_precision"])
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError("unknown config key(s): " + "; ".join(_with_suggestion(key) for key in unknown)
                          + " (`train.py --help` lists every key)")
    for one, other, why in _ONE_SETTING:
        if one in values and other in values:
            raise ConfigError(f"{one} and {other} are both set: give one ({why})")
    return TrainConfig(**{k: _coerce(k, v) for k, v in values.items()})


def _with_suggestion(key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, _FIELDS, n=3, cutoff=0.75)
    return f"{key} (did you mean {' or '.join(close)}?)" if close else key
