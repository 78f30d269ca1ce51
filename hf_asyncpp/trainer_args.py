"""`AsyncPPTrainingArguments`: transformers' TrainingArguments plus the pipeline's fields.

The arguments become a `TrainConfig` (config.py) at construction, so a bad value (unknown pipeline
key, wrong type, negative learning rate, unknown schedule or optimizer, …) raises one `ConfigError`
before TrainingArguments sets up devices and before any process group starts. Every field of
TrainingArguments is in `HONOURED` (works as in transformers.Trainer; how, in brief) or `REFUSED`
(any value but the default is that ConfigError); docs/training_arguments.md lists both. In brief:

- per_device_train_batch_size is the microbatch size; n_microbatches microbatches make one step on
  each dp rank (gradient_accumulation_steps is its other name; Trainer itself then sees 1);
- `optim` names map onto the pipeline's optimizers (`optimizer` names them too; the two must agree);
  `momentum` (default: adam_beta1) is the optimizer's first-moment / momentum coefficient;
- bf16 turns on bf16 compute with fp32 master weights; accelerate launch's mixed_precision is
  honoured or a contradiction refused (config_checks.apply_launch_settings);
- torch_compile compiles each decoder layer (`compile_layers`), not the whole model;
- report_to defaults to tensorboard.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .config import TRAINER_OPTIMIZERS, ConfigError, TrainConfig, config_from_values
from .config_checks import apply_launch_settings, check_settings, fit_global_batch, fit_to_one_process

__all__ = ["AsyncPPTrainingArguments", "HONOURED", "REFUSED", "SINCE_TRANSFORMERS_5_24"]

# Every field of transformers' TrainingArguments is in exactly one of these (tests/test_trainer_args.py
# enumerates them, so a field a new transformers version adds fails until it is placed here).
# HONOURED: works as in transformers.Trainer, or has no effect there either; how, in brief.
HONOURED = {
    "output_dir": "checkpoints, metrics.jsonl and the final/ export",
    "per_device_train_batch_size": "the microbatch size; a step is n_microbatches of them on each dp rank",
    "num_train_epochs": "max_steps from epochs when max_steps is unset",
    "gradient_accumulation_steps": "microbatches per pipeline step on each dp rank: n_microbatches (give one of the "
                                   "two, or both with one value)",
    "max_steps": "steps (minibatches)",
    "learning_rate": "peak learning rate",
    "lr_scheduler_type": "transformers' schedules (not reduce_lr_on_plateau or greedy, which need a metric per step)",
    "lr_scheduler_kwargs": "the schedule's own arguments",
    "warmup_steps": "steps, or below 1 a ratio of max_steps",
    "optim": "adamw_torch, adamw_torch_fused → adamw; sgd → SGD (momentum 0 unless `momentum` is set); "
             "lion_32bit → lion; other names are refused",
    "weight_decay": "decoupled; not on biases and norm weights (Trainer.get_decay_parameter_names)",
    "adam_beta1": "β1 / momentum of every optimizer unless `momentum` is set",
    "adam_beta2": "β2 (Lion: its momentum's EMA rate)",
    "adam_epsilon": "ε of AdamW, SOAP and Muon's AdamW part",
    "average_tokens_across_devices": "no effect: every microbatch holds the same number of tokens (packed "
                                     "blocks), so the token mean is the mean of the microbatch means",
    "max_grad_norm": "by the global norm over all stages (or each asynchronous stage's own: grad_clip_scope)",
    "bf16": "bf16 compute, fp32 master weights, optimizer state and gradient sums",
    "tf32": "set by TrainingArguments (GPUs)",
    "activation_checkpointing": "every decoder layer recomputed in the backward",
    "gradient_checkpointing": "the same as activation_checkpointing",
    "torch_compile": "each decoder layer compiled (compile_layers)",
    "use_cache": "set on model.config by Trainer, so in the export's config.json",
    "logging_strategy": "steps, epoch or no",
    "logging_steps": "steps, or below 1 a ratio of max_steps",
    "logging_first_step": "by DefaultFlowCallback",
    "log_on_each_node": "transformers' logging",
    "logging_nan_inf_filter": "the logged loss averages the finite losses since the last log",
    "include_num_input_tokens_seen": "logs num_input_tokens_seen (every token of a packed block is a real one)",
    "log_level": "transformers' verbosity, set by Trainer",
    "log_level_replica": "transformers' verbosity on other processes, set by Trainer",
    "disable_tqdm": "Trainer's progress bar callback",
    "report_to": "transformers' integration callbacks",
    "run_name": "passed to the trackers",
    "project": "passed to the trackers",
    "trackio_space_id": "passed to trackio",
    "trackio_bucket_id": "passed to trackio",
    "trackio_static_space_id": "passed to trackio",
    "eval_strategy": "steps, epoch or no; an evaluation always ends a run with an eval_dataset",
    "eval_steps": "steps, or below 1 a ratio of max_steps",
    "eval_delay": "by DefaultFlowCallback",
    "eval_on_start": "an evaluation before the first step (not a best-metric candidate, as in Trainer)",
    "prediction_loss_only": "no effect: evaluation computes the loss only",
    "eval_do_concat_batches": "no effect: no predictions are gathered (compute_metrics is refused)",
    "eval_use_gather_object": "no effect: no predictions are gathered",
    "eval_accumulation_steps": "no effect: no predictions are gathered",
    "include_for_metrics": "no effect: no predictions are gathered",
    "batch_eval_metrics": "no effect: no predictions are gathered",
    "save_strategy": "steps, epoch, best or no",
    "save_steps": "steps, or below 1 a ratio of max_steps",
    "save_total_limit": "the newest N checkpoints are kept (refused with metric_for_best_model: the best "
                        "one would not be kept)",
    "enable_jit_checkpoint": "a SIGTERM saves a checkpoint at the next step boundary; runs do that even "
                             "when it is False",
    "push_to_hub": "save_model() pushes the export; hub_strategy every_save also at each checkpoint",
    "hub_token": "the push's token",
    "hub_private_repo": "the repository's visibility when created",
    "hub_model_id": "the repository",
    "hub_strategy": "end or every_save (checkpoint and all_checkpoints are refused)",
    "hub_always_push": "no effect: every push is blocking, so none is skipped",
    "hub_revision": "the branch pushed to (created if missing)",
    "metric_for_best_model": "state.best_metric, best_global_step and best_model_checkpoint as Trainer sets them",
    "greater_is_better": "the direction of metric_for_best_model",
    "seed": "weights, data order and dropout",
    "full_determinism": "enabled by Trainer",
    "remove_unused_columns": "no effect: only input_ids (or the text column) is read",
    "train_sampling_strategy": "random (blocks shuffled per epoch) or sequential; group_by_length is refused",
    "do_train": "not used by Trainer either (a script's switch)",
    "do_eval": "not used by Trainer either (a script's switch)",
    "do_predict": "not used by Trainer either (a script's switch)",
    "resume_from_checkpoint": "not used by Trainer either: pass it to train()",
    "local_rank": "set by the launcher",
}
# Fields named above that transformers added in 5.24 (activation checkpointing's names beside gradient
# checkpointing's): absent from TrainingArguments under the older releases supported (5.17 on).
SINCE_TRANSFORMERS_5_24 = ("activation_checkpointing", "activation_checkpointing_kwargs")

# REFUSED: a value other than the default raises one ConfigError naming the field and why.
_NO_DATALOADER = "rows come from the pipeline's sampler (hf_asyncpp/data), not a DataLoader"
_NO_DDP = "there is no DDP: the pipeline's own process groups and FSDP2 over dp"
REFUSED = {
    "optim_args": "the optimizers take their settings from the arguments and pipeline_config",
    "optim_target_modules": "only GaLore / APOLLO use it, and they are not available",
    "label_smoothing_factor": "the pipeline's LM loss has no label smoothing",
    "fp16": "use bf16 (fp32 master weights, bf16 compute)",
    "bf16_full_eval": "evaluation runs in the training compute dtype",
    "fp16_full_eval": "evaluation runs in the training compute dtype",
    "activation_checkpointing_kwargs": "the pipeline recomputes with its own checkpointing (models/recompute.py)",
    "gradient_checkpointing_kwargs": "the pipeline recomputes with its own checkpointing (models/recompute.py)",
    "torch_compile_backend": "compile_layers uses torch.compile's default backend",
    "torch_compile_mode": "compile_layers uses torch.compile's default mode",
    "use_liger_kernel": "the stages run the HF layers as they are",
    "liger_kernel_config": "the stages run the HF layers as they are",
    "neftune_noise_alpha": "no embedding noise in pretraining",
    "torch_empty_cache_steps": "not implemented",
    "auto_find_batch_size": "the microbatch size is part of the schedule: set per_device_train_batch_size",
    "per_device_eval_batch_size": "evaluation runs minibatches of the training shape",
    "save_only_model": "a checkpoint always holds the whole training state",
    "save_on_each_node": "every rank writes its shards of one checkpoint",
    "load_best_model_at_end": "not implemented: state.best_model_checkpoint names the best checkpoint to resume or export",
    "ignore_data_skip": "a resumed run always continues at the next unseen block",
    "restore_callback_states_from_checkpoint": "callback states are not saved in checkpoints",
    "data_seed": "the data order follows seed",
    "use_cpu": "the device follows the launch (CUDA when present)",
    "accelerator_config": "accelerate does not drive the pipeline",
    "parallelism_config": "the pipeline's own mesh: pp_size and dp = world size / pp_size",
    "dataloader_drop_last": _NO_DATALOADER,
    "dataloader_num_workers": _NO_DATALOADER,
    "dataloader_pin_memory": _NO_DATALOADER,
    "dataloader_persistent_workers": _NO_DATALOADER,
    "dataloader_prefetch_factor": _NO_DATALOADER,
    "dataloader_multiprocessing_context": _NO_DATALOADER,
    "dataloader_in_order": _NO_DATALOADER,
    "label_names": "the labels are the input_ids, shifted",
    "length_column_name": "only group_by_length reads it, which is refused",
    "ddp_find_unused_parameters": _NO_DDP,
    "ddp_bucket_cap_mb": _NO_DDP,
    "ddp_broadcast_buffers": _NO_DDP,
    "ddp_static_graph": _NO_DDP,
    "ddp_backend": "gloo on CPU, nccl on CUDA, chosen by the pipeline",
    "ddp_timeout": "set comm_timeout_s in pipeline_config",
    "fsdp": "FSDP2 over dp is the pipeline's own (the fsdp key of pipeline_config)",
    "fsdp_config": "FSDP2 over dp is the pipeline's own (the fsdp key of pipeline_config)",
    "deepspeed": "the pipeline is its own engine",
    "debug": "not implemented",
    "skip_memory_metrics": "memory metrics are not collected",
}
# Values of honoured fields that are refused, and why.
_REFUSED_VALUES = {
    "hub_strategy": (("checkpoint", "all_checkpoints"), "training checkpoints are sharded DCP state, not pushed"),
    "train_sampling_strategy": (("group_by_length",), "packed blocks all have one length"),
}
# `optim` names that mean one of the pipeline's optimizers.
_OPTIM_NAMES = TRAINER_OPTIMIZERS  # the names YAML files take too (config.ALIASES)
_EMPTY = (None, "", [], {})
_OPTIM_DEFAULT = next(f.default for f in dataclasses.fields(TrainingArguments) if f.name == "optim")
# Pipeline fields of these arguments that are TrainConfig keys under the same name.
_PIPELINE_KEYS = ("schedule", "pp_size", "n_microbatches", "ef", "ef_lambda")


def _value(value):
    return getattr(value, "value", value)  # enums as their strings


def _refuse_unsupported(args) -> None:
    """One ConfigError for the first refused field (or value) that is set."""
    for f in dataclasses.fields(TrainingArguments):
        if f.name in REFUSED:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = _value(getattr(args, f.name))
            if value != default and not (value in _EMPTY and default in _EMPTY):
                raise ConfigError(f"{f.name}={value!r} is not supported: {REFUSED[f.name]}")
    for name, (values, why) in _REFUSED_VALUES.items():
        if _value(getattr(args, name)) in values:
            raise ConfigError(f"{name}={_value(getattr(args, name))!r} is not supported: {why}")
    if args.save_total_limit and args.metric_for_best_model:
        raise ConfigError("save_total_limit with metric_for_best_model is not supported: checkpoint rotation "
                          "would not keep the best checkpoint")


def _optimizer_name(args) -> str:
    """The pipeline's optimizer from `optim` (Trainer's name) and `optimizer` (ours)."""
    optim = _value(args.optim)
    if optim not in _OPTIM_NAMES:
        raise ConfigError(f"optim={optim!r} is not supported: use one of {', '.join(_OPTIM_NAMES)} or set optimizer "
                          "(adamw, muon, soap, lion, sgd)")
    if optim == _OPTIM_DEFAULT:
        return args.optimizer
    if args.optimizer not in ("adamw", _OPTIM_NAMES[optim]):  # "adamw": optimizer's default
        raise ConfigError(f"optim={optim!r} and optimizer={args.optimizer!r} name two optimizers: set one")
    return _OPTIM_NAMES[optim]


_TRAIN_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _pipeline_key(name: str):
    """The TrainConfig key `name` as a Trainer argument: its default and its help, from the one field."""
    key = _TRAIN_CONFIG_FIELDS[name]
    return field(default=key.default, metadata=key.metadata)


@dataclass
class AsyncPPTrainingArguments(TrainingArguments):
    schedule: str = _pipeline_key("schedule")
    pp_size: int = _pipeline_key("pp_size")
    n_microbatches: int = _pipeline_key("n_microbatches")
    optimizer: str = _pipeline_key("optimizer")
    momentum: float | None = field(default=None, metadata={"help": "momentum / beta1 (default: adam_beta1)"})
    ef: bool = _pipeline_key("ef")
    ef_lambda: float = _pipeline_key("ef_lambda")
    seq_len: int | None = field(default=None, metadata={"help": "tokens per row (default: the dataset's rows)"})
    mixed_precision: str = _pipeline_key("mixed_precision")
    pipeline_config: dict | None = field(default=None, metadata={
        "help": "any other TrainConfig key (e.g. muon_lr_scale, soap_precondition_frequency, stage_balance)"})
    report_to: None | str | list[str] = field(default="tensorboard", metadata={"help": "trackers; 'none' for none"})

    def __post_init__(self):
        from .parallel.launch import LaunchError, read_launch

        _refuse_unsupported(self)
        self._accumulation_as_microbatches()
        try:
            self.launch = read_launch()
        except LaunchError as err:
            raise ConfigError(str(err)) from None
        # TrainingArguments replaces mixed_precision by accelerate's reading of it; the pipeline keeps ours.
        self.pipeline_precision = self.mixed_precision
        if not self.launch.launched:  # a plain `python script.py` or a notebook: one process, as train.py
            one_process = self.to_train_config()
            fit_to_one_process(one_process)
            self.pp_size = 1
            if one_process.emulate_pp_size:
                self.pipeline_config = {**(self.pipeline_config or {}), "emulate_pp_size": one_process.emulate_pp_size}
        self.pipeline = self.to_train_config()
        check_settings(self.pipeline, self.launch.world_size)
        super().__post_init__()

    def _accumulation_as_microbatches(self) -> None:
        """gradient_accumulation_steps is n_microbatches under Trainer's name. The pipeline accumulates
        them within its step, so Trainer itself (its accelerator, its logged batch) sees 1."""
        accumulation = self.gradient_accumulation_steps
        if accumulation == 1:
            return
        if self.n_microbatches not in (accumulation, _TRAIN_CONFIG_FIELDS["n_microbatches"].default):
            raise ConfigError(f"n_microbatches ({self.n_microbatches}) and gradient_accumulation_steps "
                              f"({accumulation}) set one setting to two values: give one")
        self.n_microbatches, self.gradient_accumulation_steps = accumulation, 1

    @property
    def place_model_on_device(self) -> bool:
        """Never: the pipeline places this rank's stages on its device and releases the rest of the
        model (engine.py), so the Trainer must not move the whole model first."""
        return False

    def to_train_config(self, max_steps: int | None = None, seq_len: int | None = None) -> TrainConfig:
        """The run's TrainConfig. Before the datasets are known, max_steps ≤ 0 (epochs) and an unset
        seq_len stand as 1 and TrainConfig's default; the Trainer fills them in."""
        optimizer = _optimizer_name(self)
        # Trainer's torch SGD has no momentum; every other optimizer's β1 is adam_beta1.
        momentum = self.momentum if self.momentum is not None else 0.0 if _value(self.optim) == "sgd" else self.adam_beta1
        kwargs = self.lr_scheduler_kwargs
        values = {
            **{key: getattr(self, key) for key in _PIPELINE_KEYS},
            "optimizer": optimizer, "momentum": momentum, "beta2": self.adam_beta2, "adam_epsilon": self.adam_epsilon,
            "learning_rate": self.learning_rate, "weight_decay": self.weight_decay, "max_grad_norm": self.max_grad_norm,
            "lr_scheduler_type": _value(self.lr_scheduler_type), "lr_scheduler_kwargs": kwargs or None,
            "seed": self.seed, "shuffle": _value(self.train_sampling_strategy) != "sequential",
            "mixed_precision": "bf16" if self.bf16 else getattr(self, "pipeline_precision", self.mixed_precision),
            "micro_batch_size": self.per_device_train_batch_size, "output_dir": self.output_dir,
            "save_total_limit": self.save_total_limit, "hub_model_id": self.hub_model_id,
            "max_steps": max_steps or (self.max_steps if self.max_steps > 0 else 1),
            "report_to": [], "save_final": False, "push_to_hub": False,  # the Trainer's callbacks and methods do these
            # Trainer's on_save callbacks (a push at every save, best-checkpoint tracking) read the state at
            # the save, on complete files: written while training waits (pipeline_config may say otherwise).
            "checkpoint_async": False,
        }
        if getattr(self, "activation_checkpointing", False) or self.gradient_checkpointing:  # HF's switch, its old name
            values["activation_checkpointing"] = "full"  # every decoder layer; "selective" via pipeline_config
        if self.torch_compile:  # compiled per decoder layer (models/compile.py), not as a whole model
            values["compile_layers"] = True
        if seq_len or self.seq_len:
            values["seq_len"] = seq_len or self.seq_len
        extra = dict(self.pipeline_config or {})
        arguments = {"logging_steps", "eval_steps", "save_steps", "warmup_steps", "warmup_ratio", "num_train_epochs"}
        clashes = sorted(set(extra) & (set(values) | arguments))
        if clashes:
            raise ConfigError(f"pipeline_config sets {', '.join(clashes)}, which are training arguments: set them there")
        if "global_batch_size" in extra:  # it sets n_microbatches (config_checks.fit_global_batch)
            values.pop("n_microbatches")
        config = config_from_values({k: v for k, v in {**values, **extra}.items() if v is not None})
        config.save_total_limit = self.save_total_limit
        apply_launch_settings(config, self.launch)
        fit_global_batch(config, self.launch.world_size)
        return config
