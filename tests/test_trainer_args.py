"""AsyncPPTrainingArguments: every field of transformers' TrainingArguments is honoured or refused.

- Each field of the pinned transformers' TrainingArguments is in exactly one of HONOURED and
  REFUSED, so a field a new version adds fails here until it is placed.
- A refused field set to anything but its default is one ConfigError naming the field, raised
  before TrainingArguments sets up devices and before any process group starts, with nothing written.
- The honoured optimizer settings reach the pipeline's config: optim names, adam_epsilon,
  lr_scheduler_kwargs, train_sampling_strategy; accelerate launch's mixed_precision is honoured or a
  contradiction refused.
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainingArguments

from hf_asyncpp import ConfigError
from hf_asyncpp.trainer_args import HONOURED, REFUSED, SINCE_TRANSFORMERS_5_24

FIELDS = {f.name: f for f in dataclasses.fields(TrainingArguments)}


def _args(tmp_path, **overrides):
    from hf_asyncpp import AsyncPPTrainingArguments

    return AsyncPPTrainingArguments(output_dir=str(tmp_path / "out"),
                                    **{**dict(pp_size=1, max_steps=2, report_to="none"), **overrides})


def test_every_training_argument_is_honoured_or_refused_and_nothing_else_is_listed():
    assert not set(HONOURED) & set(REFUSED)
    assert sorted(set(FIELDS) - set(HONOURED) - set(REFUSED)) == []  # a new field: place it in one list
    newer = () if "activation_checkpointing" in FIELDS else SINCE_TRANSFORMERS_5_24  # transformers 5.17–5.23
    assert sorted((set(HONOURED) | set(REFUSED)) - set(FIELDS)) == sorted(newer)  # a field transformers dropped


def _non_default(name: str):
    """A value other than the field's default (the refusal comes before any check of its type)."""
    f = FIELDS[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    return "something"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_argument_set_is_one_error_naming_it_before_any_device_or_process_group(name, tmp_path, monkeypatch):
    import torch.distributed as dist

    if name not in FIELDS:
        pytest.skip(f"this transformers has no {name} (added in 5.24)")

    def no_devices(self):
        raise AssertionError("TrainingArguments set up devices before the refusal")

    monkeypatch.setattr(TrainingArguments, "__post_init__", no_devices)
    with pytest.raises(ConfigError, match=f"^{name}=.* is not supported: "):
        _args(tmp_path, **{name: _non_default(name)})
    assert not dist.is_initialized() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(hub_strategy="checkpoint"), "hub_strategy='checkpoint' is not supported"),
    (dict(train_sampling_strategy="group_by_length"), "train_sampling_strategy='group_by_length' is not supported"),
    (dict(save_total_limit=2, metric_for_best_model="loss"), "would not keep the best checkpoint"),
    (dict(optim="adafactor"), "optim='adafactor' is not supported: use one of adamw_torch, adamw_torch_fused, sgd"),
    (dict(optim="sgd", optimizer="muon"), "name two optimizers"),
    (dict(lr_scheduler_kwargs={"num_cycle": 2}, lr_scheduler_type="cosine_with_restarts"), "unexpected keyword argument"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"), "stepped by an evaluation metric is not supported"),
    (dict(adam_epsilon=-1.0), "adam_epsilon must be >= 0"),
])
def test_refused_values_of_honoured_arguments(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _args(tmp_path, **overrides)
    assert not (tmp_path / "out").exists()


def test_optimizer_arguments_reach_the_pipeline_config(tmp_path):
    """Trainer's optim names map onto the pipeline's optimizers (its SGD has no momentum, as Trainer
    builds torch.optim.SGD); ε, the schedule's own arguments and the sampling order pass through."""
    default = _args(tmp_path).pipeline
    assert (default.optimizer, default.momentum, default.adam_epsilon, default.shuffle) == ("adamw", 0.9, 1e-8, True)
    assert _args(tmp_path, optimizer="muon").pipeline.optimizer == "muon"  # optim left at its default
    sgd = _args(tmp_path, optim="sgd").pipeline
    assert (sgd.optimizer, sgd.momentum) == ("sgd", 0.0)
    assert _args(tmp_path, optim="sgd", momentum=0.5).pipeline.momentum == 0.5
    lion = _args(tmp_path, optim="lion_32bit", adam_beta1=0.95, adam_beta2=0.98).pipeline
    assert (lion.optimizer, lion.momentum, lion.beta2) == ("lion", 0.95, 0.98)
    assert _args(tmp_path, optim="adamw_torch", adam_epsilon=1e-6).pipeline.adam_epsilon == 1e-6
    restarts = _args(tmp_path, lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs='{"num_cycles": 3}')
    assert restarts.pipeline.lr_scheduler_kwargs == {"num_cycles": 3}
    assert not _args(tmp_path, train_sampling_strategy="sequential").pipeline.shuffle


@pytest.mark.parametrize("launcher, asked, expected", [
    ("bf16", {}, "bf16"), ("no", {}, "no"), ("bf16", dict(bf16=True), "bf16"), ("no", dict(mixed_precision="no"), "no"),
])
def test_accelerate_launchs_mixed_precision_is_honoured(launcher, asked, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)  # bf16=True on CPU
    assert _args(tmp_path, **asked).pipeline.mixed_precision == expected


@pytest.mark.parametrize("launcher, asked, message", [
    ("no", dict(bf16=True), "accelerate launch asks for mixed_precision no but the run's mixed_precision is bf16"),
    ("bf16", dict(mixed_precision="no"), "asks for mixed_precision bf16 but the run's mixed_precision is no"),
    ("fp16", {}, "asks for mixed_precision fp16; hf_asyncpp computes in bf16"),
])
def test_accelerate_launchs_mixed_precision_contradicted_is_refused(launcher, asked, message, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    with pytest.raises(ConfigError, match=message):
        _args(tmp_path, **asked)
    assert not (tmp_path / "out").exists()


# --- docs/training_arguments.md lists both, generated from them -----------------------------------

DOC = "docs/training_arguments.md"
BEGIN, END = "<!-- generated from trainer_args.HONOURED / REFUSED: python -m tests.test_trainer_args -->", "<!-- end -->"


def generated_tables() -> str:
    rows = lambda table: "\n".join(f"| `{name}` | {text} |" for name, text in sorted(table.items()))  # noqa: E731
    return (f"{BEGIN}\n\n### Honoured\n\n| field | how |\n|---|---|\n{rows(HONOURED)}\n\n"
            f"### Refused (any value but the default)\n\n| field | why |\n|---|---|\n{rows(REFUSED)}\n\n{END}")


def test_the_reference_lists_every_field_as_the_code_does():
    from pathlib import Path

    text = Path(DOC).read_text()
    assert text[text.index(BEGIN):text.index(END) + len(END)] == generated_tables(), \
        "docs/training_arguments.md is out of date: run python -m tests.test_trainer_args"


if __name__ == "__main__":  # rewrite the generated part of the reference
    from pathlib import Path

    path = Path(DOC)
    text = path.read_text()
    path.write_text(text[:text.index(BEGIN)] + generated_tables() + text[text.index(END) + len(END):])


def test_the_pipelines_mixed_precision_survives_trainingarguments_own_reading(tmp_path, monkeypatch):
    """TrainingArguments replaces `mixed_precision` by accelerate's reading of it ("no" here); the
    Trainer builds its config again later (with the datasets' seq_len), and must still see ours."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    args = _args(tmp_path, mixed_precision="bf16")
    assert args.mixed_precision == "no"  # what accelerate's Accelerator is given
    assert args.to_train_config(seq_len=16).mixed_precision == "bf16"


def test_a_global_batch_size_in_pipeline_config_sets_the_microbatches(tmp_path, monkeypatch):
    """The YAML front end's global_batch_size, through pipeline_config: n_microbatches follows from it,
    per_device_train_batch_size and the launch's dp size (here 4 ranks at pp 2: dp 2)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    config = _args(tmp_path, pp_size=2, per_device_train_batch_size=2,
                   pipeline_config={"global_batch_size": 24}).to_train_config()
    assert (config.micro_batch_size, config.n_microbatches, config.global_batch_size) == (2, 6, 24)


def test_gradient_accumulation_steps_is_the_microbatches_of_a_pipeline_step(tmp_path):
    """Trainer's name for n_microbatches: the pipeline accumulates them inside its step, so Trainer's own
    loop machinery (its accelerator, its logged batch) is left at 1; the same value under both names is one
    setting."""
    args = _args(tmp_path, gradient_accumulation_steps=4)
    assert (args.to_train_config().n_microbatches, args.gradient_accumulation_steps) == (4, 1)
    assert _args(tmp_path, gradient_accumulation_steps=3, n_microbatches=3).to_train_config().n_microbatches == 3
