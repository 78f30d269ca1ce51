"""`AsyncPPTrainingArguments`: transformers' TrainingArguments plus the pipeline's fields.

The arguments become a `TrainConfig` (config.py) at construction, so a bad value (unknown pipeline
key, wrong type, negative learning rate, unknown schedule or optimizer, …) raises one `ConfigError`
before TrainingArguments sets up devices and before any process group starts. What the Trainer
fields mean for the pipeline:

- per_device_train_batch_size is the microbatch size; n_microbatches microbatches make one step on
  each dp rank (the role gradient_accumulation_steps plays in Trainer, which must stay 1);
- learning_rate, weight_decay, adam_beta2, max_grad_norm, lr_scheduler_type, warmup_steps, max_steps
  (or num_train_epochs), seed, logging/eval/save steps, save_total_limit and hub_model_id keep their
  meaning; `momentum` (default: adam_beta1) is the optimizer's first-moment / momentum coefficient;
- bf16 turns on bf16 compute with fp32 master weights; fp16 is refused;
- torch_compile compiles each decoder layer (`compile_layers`), not the whole model;
- report_to defaults to tensorboard.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .config import ConfigError, TrainConfig, check_settings, config_from_values, fit_to_one_process

__all__ = ["AsyncPPTrainingArguments"]

# Pipeline fields of these arguments that are TrainConfig keys under the same name.
_PIPELINE_KEYS = ("schedule", "pp_size", "n_microbatches", "optimizer", "ef", "ef_lambda", "mixed_precision")
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

        try:
            launch = read_launch()
        except LaunchError as err:
            raise ConfigError(str(err)) from None
        if not launch.launched:  # a plain `python script.py` or a notebook: one process, as train.py
            one_process = self.to_train_config()
            fit_to_one_process(one_process)
            self.pp_size = 1
            if one_process.emulate_pp_size:
                self.pipeline_config = {**(self.pipeline_config or {}), "emulate_pp_size": one_process.emulate_pp_size}
        self.pipeline = self.to_train_config()
        check_settings(self.pipeline, launch.world_size)
        super().__post_init__()

    @property
    def place_model_on_device(self) -> bool:
        """Never: the pipeline places this rank's stages on its device and releases the rest of the
        model (engine.py), so the Trainer must not move the whole model first."""
        return False

    def to_train_config(self, max_steps: int | None = None, seq_len: int | None = None) -> TrainConfig:
        """The run's TrainConfig. Before the datasets are known, max_steps ≤ 0 (epochs) and an unset
        seq_len stand as 1 and TrainConfig's default; the Trainer fills them in."""
        if self.gradient_accumulation_steps != 1:
            raise ConfigError("gradient_accumulation_steps must be 1: a pipeline step already accumulates "
                              "n_microbatches microbatches (set n_microbatches instead)")
        if self.fp16:
            raise ConfigError("fp16 is not supported: use bf16 (fp32 master weights, bf16 compute)")
        scheduler = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
        values = {
            **{key: getattr(self, key) for key in _PIPELINE_KEYS},
            "momentum": self.adam_beta1 if self.momentum is None else self.momentum,
            "beta2": self.adam_beta2, "learning_rate": self.learning_rate, "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm, "lr_scheduler_type": scheduler, "seed": self.seed,
            "micro_batch_size": self.per_device_train_batch_size, "output_dir": self.output_dir,
            "save_total_limit": self.save_total_limit, "hub_model_id": self.hub_model_id,
            "max_steps": max_steps or (self.max_steps if self.max_steps > 0 else 1),
            "report_to": [], "save_final": False, "push_to_hub": False,  # the Trainer's callbacks and methods do these
        }
        if self.bf16:
            values["mixed_precision"] = "bf16"
        if self.activation_checkpointing or self.gradient_checkpointing:  # HF's switch (and its old name)
            values["activation_checkpointing"] = "full"  # every decoder layer; "selective" via pipeline_config
        if self.torch_compile:  # compiled per decoder layer (models/compile.py), not as a whole model
            values["compile_layers"] = True
        if seq_len or self.seq_len:
            values["seq_len"] = seq_len or self.seq_len
        extra = dict(self.pipeline_config or {})
        clashes = sorted(set(extra) & (set(values) | {"logging_steps", "eval_steps", "save_steps", "warmup_steps"}))
        if clashes:
            raise ConfigError(f"pipeline_config sets {', '.join(clashes)}, which are training arguments: set them there")
        config = config_from_values({k: v for k, v in {**values, **extra}.items() if v is not None})
        config.save_total_limit = self.save_total_limit
        return config
