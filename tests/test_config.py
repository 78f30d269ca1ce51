"""Configuration: YAML + `--key value` overrides, and one clear error for each kind of bad input,
raised before any process group starts and before anything is written to output_dir."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_asyncpp.config import SECTIONS, ConfigError, TrainConfig, load_config
from hf_asyncpp.config_checks import check_settings, resolve_schedule, validate_config
from hf_asyncpp.run import main
from tests.test_engine import save_model_dir

DEFAULT_YAML = "training_scripts/configs/tiny_moe.yaml"


def test_yaml_values_and_command_line_overrides_are_typed(tmp_path):
    config = load_config(DEFAULT_YAML, ["--max_steps", "7", "--learning_rate=0.5", "--shuffle", "false",
                                        "--stage_boundaries", "1,3", "--init_from", "none"])
    assert config.max_steps == 7 and config.learning_rate == 0.5 and config.shuffle is False
    assert config.stage_boundaries == [1, 3] and config.init_from is None
    assert config.model_config == "tiny-moe"  # from the YAML
    assert config.rows_per_step == config.micro_batch_size * config.n_microbatches


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no optimizer step needed
def test_the_optimizers_epsilon_and_the_schedules_own_arguments_reach_them():
    """adam_epsilon is AdamW's ε; lr_scheduler_kwargs go to transformers' schedule (checked against
    transformers' cosine-with-restarts schedule built directly)."""
    import torch
    from transformers import get_cosine_with_hard_restarts_schedule_with_warmup

    from hf_asyncpp.optim import lr_scheduler_from_config, optimizer_from_config

    config = load_config(None, ["--adam_epsilon", "1e-6", "--lr_scheduler_type", "cosine_with_restarts",
                                "--lr_scheduler_kwargs", '{"num_cycles": 3}', "--max_steps", "12", "--warmup_steps", "2"])
    assert config.lr_scheduler_kwargs == {"num_cycles": 3}
    param = torch.nn.Parameter(torch.zeros(2))
    ours = optimizer_from_config(config, [("w", param)])
    assert ours.param_groups[0]["eps"] == 1e-6
    schedule = lr_scheduler_from_config(config, ours)
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=config.learning_rate)
    reference = get_cosine_with_hard_restarts_schedule_with_warmup(theirs, 2, 12, num_cycles=3)
    for _ in range(12):
        assert schedule.get_last_lr() == reference.get_last_lr()
        schedule.step()
        reference.step()


def test_the_keys_come_in_sections_and_a_run_config_holds_them_all_flat():
    """Every key belongs to one section (a dataclass per component); TrainConfig is all of them in the
    sections' order and is each section; its dict, what YAML files, overrides and a study's arm settings
    hold, stays flat."""
    import dataclasses

    section_keys = [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)]
    assert section_keys == [f.name for f in dataclasses.fields(TrainConfig)]
    assert len(set(section_keys)) == len(section_keys)
    config = load_config(DEFAULT_YAML)
    assert all(isinstance(config, section) for section in SECTIONS.values())
    assert list(dataclasses.asdict(config)) == section_keys
    assert not any(dataclasses.is_dataclass(v) for v in dataclasses.asdict(config).values())


def test_a_function_of_one_section_reads_that_section_alone():
    """The checks of each section, the optimizer, the LR schedule and the model card's data facts run on
    a bare section: a key of another section read there would raise AttributeError. Each check still
    refuses a bad value of its own section."""
    import typing

    import torch

    from hf_asyncpp import config_checks
    from hf_asyncpp.config import DataConfig, OptimizerConfig
    from hf_asyncpp.hub import _data_facts
    from hf_asyncpp.optim import lr_scheduler_from_config, optimizer_from_config

    assert len(config_checks._SECTION_CHECKS) == len(SECTIONS)
    for check, section in zip(config_checks._SECTION_CHECKS, SECTIONS.values()):
        assert typing.get_type_hints(check)["config"] is section, check.__name__
        check(section())
    bad = {"model": {"router_bias_update_rate": -1}, "data": {"eval_fraction": 1.0}, "pipeline": {"pp_size": 0},
           "optimization": {"learning_rate": 0.0}, "run": {"logging_steps": 0}, "export": {"export_dtype": "int8"},
           "checkpoints": {"save_steps": -1}, "failures": {"comm_timeout_s": 0.0}}
    for check, (name, section) in zip(config_checks._SECTION_CHECKS, SECTIONS.items()):
        with pytest.raises(ConfigError, match=next(iter(bad[name]))):
            check(section(**bad[name]))
    optimization = OptimizerConfig(optimizer="muon", max_steps=4)
    optimizer = optimizer_from_config(optimization, [("layer.weight", torch.nn.Parameter(torch.zeros(4, 4)))])
    assert lr_scheduler_from_config(optimization, optimizer).get_last_lr() == [optimization.learning_rate]
    assert _data_facts(DataConfig())["name"] == "shakespeare"


def test_a_value_of_the_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match="max_steps.*int"):
        load_config(None, ["--max_steps", "ten"])


def test_the_default_config_validates_on_two_ranks():
    model_config = validate_config(load_config(DEFAULT_YAML), world_size=2)
    assert model_config.model_type == "qwen3_moe"


def _gpt2_dir(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2).save_pretrained(tmp_path / "gpt2")
    return str(tmp_path / "gpt2")


BAD_INPUTS = {
    "pp larger than layers": (["--pp_size", "8"], 8, "needs 8 stages, but the model has only 4 decoder layers"),
    "world not divisible": (["--pp_size", "2"], 3, "world size 3 is not divisible by pp_size 2"),
    "microbatches the schedule cannot take": (["--schedule", "1f1b", "--n_microbatches", "1"], 2,
                                              "schedule '1f1b' cannot run 1 microbatches"),
    "interleaved microbatches": (["--schedule", "interleaved-1f1b", "--n_microbatches", "5", "--model_config",
                                  "tiny-mixtral"], 2, "schedule 'interleaved-1f1b' cannot run 5 microbatches"),
    "unknown schedule": (["--schedule", "pipedream-9000"], 2, "unknown schedule 'pipedream-9000'; available: gpipe"),
    "unknown optimizer": (["--optimizer", "adamax"], 2, "unknown optimizer 'adamax'; available: sgd, adamw"),
    "unknown key": (["--learnig_rate", "0.1"], 2, "unknown config key.*learnig_rate \\(did you mean learning_rate\\?\\)"),
    "attention without its package": (["--attn_implementation", "flash_attention_2"], 2,
                                      "attn_implementation flash_attention_2 needs the flash_attn package"),
    "unknown attention": (["--attn_implementation", "fast"], 2, "unknown attn_implementation 'fast'; choose from eager"),
    "a config override of no field": (["--config_overrides", "num_hidden_layers=2,hiden_size=64"], 2,
                                      "config_overrides: hiden_size is not a field of tiny-moe's config"),
    "a config override not key=value": (["--config_overrides", "num_hidden_layers"], 2,
                                        "config_overrides: 'num_hidden_layers' is not key=value"),
    "indivisible global batch": (["--global_batch_size", "20", "--micro_batch_size", "4"], 4,
                                 "global_batch_size 20 is not a multiple of micro_batch_size 4 × dp 2 = 8 sequences"),
    "unsupported model": (["--model_config", "{gpt2}"], 2, "model_type 'gpt2' is not supported.*mixtral"),
    "missing dataset": (["--dataset", "/nonexistent/corpus/*.txt"], 2, "dataset '/nonexistent/corpus/\\*.txt' matches no files"),
    "unknown preset": (["--model_config", "tiny-nothing"], 2, "neither a preset"),
    "bad boundaries": (["--stage_boundaries", "3,1"], 2, "stage_boundaries must be 1 increasing"),
    "pipedream on one rank": (["--schedule", "pipedream", "--pp_size", "1"], 1, "set emulate_pp_size >= 2"),
    "missing init_from": (["--init_from", "/nonexistent/model"], 2, "init_from '/nonexistent/model' is not a model directory"),
    "SOAP never refreshing": (["--optimizer", "soap", "--soap_precondition_frequency", "0"], 2,
                              "soap_precondition_frequency must be at least 1 .*got 0"),
    "empty shuffle window": (["--shuffle_window", "0"], 2, "shuffle_window must be at least 1, got 0"),
    "SOAP rotating no side": (["--soap_max_precond_dim", "-1"], 2, "soap_max_precond_dim must be at least 1 .*got -1"),
    "unknown end of Error Feedback": (["--ef", "true", "--ef_last_update", "drop"], 2,
                                      "unknown ef_last_update 'drop'; choose extrapolate or trajectory"),
    "Muon pattern not a regex": (["--optimizer", "muon", "--muon_adamw_patterns", "lm_head,(unclosed"], 2,
                                 "muon_adamw_patterns: '\\(unclosed' is not a regular expression"),
    "bf16 without FSDP": (["--mixed_precision", "bf16", "--fsdp", "false"], 2, "mixed_precision bf16 is applied by FSDP2"),
    "unknown precision": (["--mixed_precision", "fp8"], 2, "unknown mixed_precision 'fp8'; choose auto, bf16 or no"),
    "unknown reduction dtype": (["--grad_reduce_dtype", "fp16"], 2, "unknown grad_reduce_dtype 'fp16'; choose fp32 or compute"),
    "bf16 reduction of a synchronous schedule": (["--schedule", "1f1b", "--grad_reduce_dtype", "compute"], 2,
                                                 "'1f1b' runs under FSDP2, which would sum them in bf16"),
    "bf16 compute in the emulator": (["--schedule", "pipedream-2bw", "--pp_size", "1", "--emulate_pp_size", "2",
                                      "--mixed_precision", "bf16"], 1, "the one-process emulator .* computes in fp32"),
    "unknown checkpointing": (["--activation_checkpointing", "some"], 2,
                              "unknown activation_checkpointing 'some'; choose none, full, selective"),
    "checkpoints of WPipe": (["--schedule", "wpipe", "--grad_clip_scope", "stage", "--save_steps", "10",
                              "--model_config", "tiny-mixtral"], 2,
                             "checkpoints are not supported for schedule 'wpipe': .*applied on some stages"),
    "sequences longer than the model's positions": (["--seq_len", "1000000"], 2,
                                                   "seq_len 1000000 exceeds the model's max_position_embeddings"),
    "evaluation without an evaluation set": (["--eval_fraction", "0", "--eval_steps", "10"], 2,
                                             "no evaluation set: set eval_fraction > 0"),
    "mid-run evaluation of a schedule whose updates straddle steps": (
        ["--schedule", "wpipe", "--grad_clip_scope", "stage", "--eval_fraction", "0.1", "--eval_steps", "2"], 2,
        "evaluations during training .* are not supported for schedule 'wpipe'"),
    "negative save_steps": (["--save_steps", "-1"], 2, "save_steps must be >= 0"),
    "sync start of a synchronous schedule": (["--schedule", "gpipe", "--sync_steps", "2"], 2,
                                             "'gpipe' is synchronous throughout"),
    "negative sync_steps": (["--schedule", "pipedream-2bw", "--sync_steps", "-1"], 2, "sync_steps must be >= 0"),
    "sync_steps reaching max_steps": (["--schedule", "pipedream-2bw", "--sync_steps", "5", "--max_steps", "5"], 2,
                                      "sync_steps \\(5\\) must be below max_steps \\(5\\)"),
    "an export dtype the exports cannot write": (["--export_dtype", "float16"], 2,
                                                 "export_dtype: unknown export dtype 'float16'; choose float32"),
    "resume from a directory that is not a checkpoint": (
        ["--resume_from_checkpoint", "/nonexistent/run/checkpoint-5"], 2, "is not a complete checkpoint"),
    "unknown non-finite policy": (["--nonfinite_policy", "ignore"], 2, "unknown nonfinite_policy 'ignore'"),
    "negative skip limit": (["--nonfinite_skip_limit", "-1"], 2, "nonfinite_skip_limit must be >= 0"),
    "zero communication timeout": (["--comm_timeout_s", "0"], 2, "comm_timeout_s must be positive"),
    "schedule arguments the schedule does not take": (
        ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", "{num_cycle: 2}"], 2,
        "lr_scheduler_kwargs {'num_cycle': 2} do not fit lr_scheduler_type 'cosine'"),
    "a schedule stepped by a metric": (["--lr_scheduler_type", "reduce_lr_on_plateau"], 2,
                                       "stepped by an evaluation metric is not supported"),
    "negative epsilon": (["--adam_epsilon", "-1e-8"], 2, "adam_epsilon must be >= 0"),
    "unknown clipping scope": (["--grad_clip_scope", "layer"], 2, "grad_clip_scope must be global or stage, got 'layer'"),
    "clipping WPipe by the global norm": (
        ["--schedule", "wpipe", "--model_config", "tiny-mixtral"], 2,
        "rank 0, step .*: deadlock: 2F.* waits forever for the global gradient norm of update unit 0, which stage 0 "
        "has not posted.*set grad_clip_scope: stage to clip each stage by its own norm, or max_grad_norm: 0"),
    "per-stage clipping of a synchronous schedule": (["--schedule", "1f1b", "--grad_clip_scope", "stage"], 2,
                                                     "grad_clip_scope stage applies to asynchronous schedules"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_once_before_any_process_group(case, tmp_path, monkeypatch, capsys):
    overrides, world_size, message = BAD_INPUTS[case]
    overrides = [o.replace("{gpt2}", _gpt2_dir(tmp_path)) for o in overrides]
    output_dir = tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    code = main(["--config", DEFAULT_YAML, "--output_dir", str(output_dir), *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("error:") == 1 and err.strip().startswith("error:")
    import re

    assert re.search(message, err), err
    assert not dist.is_initialized()
    assert not output_dir.exists()


def test_only_rank_zero_prints_the_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["--optimizer", "nope", "--output_dir", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ""


def test_tied_embeddings_cannot_be_split(tmp_path):
    from hf_asyncpp.models.presets import build_config

    build_config("tiny-llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    config = TrainConfig(model_config=str(tmp_path / "tied"), pp_size=2)
    with pytest.raises(ConfigError, match="tied input/output embeddings"):
        validate_config(config, world_size=2)


def test_init_from_starts_from_the_saved_weights_and_config(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.engine import build_full_model
    from hf_asyncpp.models.presets import build_config

    saved = AutoModelForCausalLM.from_config(build_config("tiny-olmoe", num_hidden_layers=2))
    save_model_dir(saved, tmp_path / "start")
    config = TrainConfig(init_from=str(tmp_path / "start"), model_config="tiny-moe", pp_size=2)
    model_config = validate_config(config, world_size=2)
    assert model_config.model_type == "olmoe"  # init_from's own config wins over model_config
    loaded = build_full_model(config, model_config)
    for name, tensor in saved.state_dict().items():
        assert (loaded.state_dict()[name] == tensor).all(), name


def test_a_config_extends_another_and_overrides_what_it_names(tmp_path):
    (tmp_path / "base.yaml").write_text("learning_rate: 0.01\nmax_steps: 7\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nmax_steps: 9\n")
    config = load_config(str(tmp_path / "child.yaml"), ["--seed", "3"])
    assert (config.learning_rate, config.max_steps, config.seed) == (0.01, 9, 3)
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(str(tmp_path / "loop.yaml"))


DATA_REFUSALS = {
    "streaming with eval_fraction": (["--streaming", "true", "--eval_fraction", "0.1"],
                                     "eval_fraction cannot hold out part of a streamed dataset"),
    "eval_dataset with eval_fraction": (["--eval_dataset", "{corpus}", "--eval_fraction", "0.1"],
                                        "eval_dataset and eval_fraction both name a held-out set"),
    "Hub dataset offline": (["--dataset", "HuggingFaceFW/fineweb-edu"],
                            "dataset 'HuggingFaceFW/fineweb-edu' is not a local file/directory and the Hub is offline "
                            "\\(HF_HUB_OFFLINE is set\\)"),
    "Hub eval_dataset offline": (["--eval_dataset", "someone/held-out"],
                                 "eval_dataset 'someone/held-out' is not a local file/directory and the Hub is offline"),
    "missing eval_dataset files": (["--eval_dataset", "/nonexistent/held_out.jsonl"],
                                   "eval_dataset: dataset '/nonexistent/held_out.jsonl' matches no files"),
    "evaluation with neither eval set": (["--eval_steps", "5"], "set eval_fraction > 0 or eval_dataset"),
}


@pytest.mark.parametrize("case", sorted(DATA_REFUSALS))
def test_data_settings_that_cannot_run_are_refused(case, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "corpus.txt").write_text("Now is the winter of our discontent")
    overrides, message = DATA_REFUSALS[case]
    overrides = [o.replace("{corpus}", str(tmp_path / "corpus.txt")) for o in overrides]
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(None, ["--pp_size", "1", *overrides]), 1)


def test_a_hub_dataset_id_is_accepted_when_the_hub_is_reachable_and_streaming_evaluates_an_eval_dataset(
        tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    (tmp_path / "held_out.jsonl").write_text('{"text": "Now is the winter of our discontent"}\n')
    config = load_config(None, ["--pp_size", "1", "--dataset", "HuggingFaceFW/fineweb-edu", "--dataset_config_name",
                                "sample-10BT", "--streaming", "true", "--eval_dataset", str(tmp_path / "held_out.jsonl"),
                                "--eval_steps", "5"])
    validate_config(config, 1)  # checks names only: nothing is downloaded before the run
    assert (config.dataset_config_name, config.dataset_split, config.streaming) == ("sample-10BT", "train", True)


@pytest.mark.parametrize("sync_steps", [0, 5])
@pytest.mark.parametrize("schedule, warned", [("pipedream", "3.00×"), ("pipedream-2bw", None)])
def test_clipping_by_the_global_norm_warns_with_the_modelled_slowdown_where_stages_would_wait(schedule, warned,
                                                                                               sync_steps, capsys):
    """PipeDream's stages need each update right after their backward, so they wait for the others'
    norms: three times the step at pp 4, m 8 in the schedule's timing model; 2BW's do not wait. A sync
    start changes only the first steps: the warning is about the ones after the switch."""
    config = TrainConfig(model_config="tiny-moe", pp_size=4, schedule=schedule, n_microbatches=8, max_grad_norm=1.0,
                         sync_steps=sync_steps)
    validate_config(config, world_size=4)
    err = capsys.readouterr().err
    if warned:
        assert f"{schedule} clipped by the global norm" in err and f"a step takes {warned} as long" in err, err
    else:
        assert "clipped by the global norm" not in err


def test_global_batch_size_sets_the_microbatches_from_the_dp_size():
    """The same global batch on twice the ranks: half the microbatches per dp rank, the same sequences a step."""
    for world_size, microbatches in ((2, 8), (4, 4), (8, 2)):
        config = load_config(DEFAULT_YAML, ["--global_batch_size", "64", "--micro_batch_size", "8", "--pp_size", "2"])
        validate_config(config, world_size=world_size)
        assert config.n_microbatches == microbatches
        assert config.micro_batch_size * config.n_microbatches * (world_size // 2) == 64


def test_global_batch_size_and_n_microbatches_are_one_setting(tmp_path):
    (tmp_path / "both.yaml").write_text("global_batch_size: 64\nn_microbatches: 4\n")
    with pytest.raises(ConfigError, match="global_batch_size and n_microbatches are both set: give one"):
        load_config(str(tmp_path / "both.yaml"))
    (tmp_path / "file.yaml").write_text("n_microbatches: 4\n")  # the command line's batch replaces the file's
    assert load_config(str(tmp_path / "file.yaml"), ["--global_batch_size", "64"]).global_batch_size == 64


@pytest.mark.parametrize("overrides, ef, max_steps", [
    (["--ef"], True, 200), (["--ef", "--max_steps", "5"], True, 5), (["--no-ef"], False, 200),
    (["--ef", "false"], False, 200), (["--max_steps", "5", "--ef"], True, 5), (["--ef=true"], True, 200)])
def test_a_boolean_key_alone_is_true_and_negated_is_false(overrides, ef, max_steps):
    config = load_config(DEFAULT_YAML, overrides)
    assert (config.ef, config.max_steps) == (ef, max_steps)


def test_a_yaml_in_trainer_s_names_is_the_same_run_as_one_in_ours(tmp_path):
    """TrainingArguments' names of the settings both have (config.ALIASES): the same TrainConfig, so the
    same tokens per step and the same losses."""
    (tmp_path / "ours.yaml").write_text("micro_batch_size: 4\nn_microbatches: 8\noptimizer: adamw\nmomentum: 0.8\n"
                                        "beta2: 0.95\nmixed_precision: bf16\nmax_steps: 50\nwarmup_steps: 5\n")
    (tmp_path / "trainer.yaml").write_text("per_device_train_batch_size: 4\ngradient_accumulation_steps: 8\n"
                                           "optim: adamw_torch\nadam_beta1: 0.8\nadam_beta2: 0.95\nbf16: true\n"
                                           "max_steps: 50\nwarmup_ratio: 0.1\n")
    (tmp_path / "fraction.yaml").write_text("max_steps: 50\nwarmup_steps: 0.1\n")  # a ratio, as Trainer takes it

    def resolved(path, overrides=()):
        config = load_config(str(path), list(overrides))
        resolve_schedule(config)  # the ratio made steps, as validate_config does
        return config

    assert resolved(tmp_path / "trainer.yaml") == resolved(tmp_path / "ours.yaml")
    assert resolved(tmp_path / "fraction.yaml").warmup_steps == 5
    assert load_config(None, ["--per_device_train_batch_size", "2"]).micro_batch_size == 2
    # the command line replaces the file's setting, whichever name each gives it
    assert load_config(str(tmp_path / "ours.yaml"), ["--per_device_train_batch_size", "2"]).micro_batch_size == 2
    assert resolved(tmp_path / "fraction.yaml", ["--max_steps", "200"]).warmup_steps == 20
    assert resolved(tmp_path / "ours.yaml", ["--warmup_ratio", "0.5"]).warmup_steps == 25


def test_trainer_s_strategies_in_steps_map_onto_the_step_keys_and_epoch_timing_is_refused(tmp_path):
    config = load_config(None, ["--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "10",
                                "--logging_strategy", "steps"])
    assert (config.eval_steps, config.save_steps, config.logging_steps) == (0, 10, 1)
    assert load_config(None, ["--save_strategy", "no"]).save_steps == 0
    for key in ("eval_strategy", "save_strategy", "logging_strategy"):
        with pytest.raises(ConfigError, match=rf"^{key} 'epoch': train.py times events in steps.*AsyncPPTrainer"):
            load_config(None, [f"--{key}", "epoch"])
    with pytest.raises(ConfigError, match="logging_strategy 'no'"):
        load_config(None, ["--logging_strategy", "no"])


def test_epochs_and_steps_are_one_setting_and_epochs_wait_for_the_data(tmp_path):
    (tmp_path / "steps.yaml").write_text("max_steps: 50\n")
    (tmp_path / "both.yaml").write_text("max_steps: 50\nnum_train_epochs: 2\n")
    with pytest.raises(ConfigError, match=r"^num_train_epochs and max_steps are both set: give one"):
        load_config(str(tmp_path / "both.yaml"))
    config = load_config(str(tmp_path / "steps.yaml"), ["--num_train_epochs", "2.5", "--warmup_ratio", "0.1"])
    resolve_schedule(config)  # before the data: nothing known yet, the ratio kept
    assert (config.num_train_epochs, config.warmup_ratio, config.warmup_steps) == (2.5, 0.1, 0)
    resolve_schedule(config, steps_per_epoch=7.5)  # 2.5 × 7.5 = 18.75 → 19 steps, 10% → 2 warm-up steps
    assert (config.max_steps, config.warmup_steps, config.num_train_epochs, config.warmup_ratio) == (19, 2, None, 0)
    with pytest.raises(ConfigError, match="a streamed dataset has none: give max_steps"):
        check_settings(load_config(None, ["--num_train_epochs", "1", "--streaming", "true"]), 1)
    with pytest.raises(ConfigError, match="warmup_ratio and warmup_steps are both set"):
        load_config(str(tmp_path / "steps.yaml"), ["--warmup_steps", "3", "--warmup_ratio", "0.2"])


def test_one_setting_under_two_names_with_two_values_is_refused(tmp_path):
    (tmp_path / "both.yaml").write_text("micro_batch_size: 4\nper_device_train_batch_size: 8\n")
    with pytest.raises(ConfigError, match=r"micro_batch_size \(4\) and per_device_train_batch_size \(8\) set one "
                                          "setting to two values"):
        load_config(str(tmp_path / "both.yaml"))
    (tmp_path / "same.yaml").write_text("micro_batch_size: 4\nper_device_train_batch_size: 4\n")
    assert load_config(str(tmp_path / "same.yaml")).micro_batch_size == 4
    with pytest.raises(ConfigError, match="optim 'adafactor' is not supported"):
        load_config(None, ["--optim", "adafactor"])


def test_config_overrides_change_the_model_s_fields():
    config = load_config(DEFAULT_YAML, ["--config_overrides", "num_hidden_layers=2, num_experts_per_tok=1"])
    model_config = validate_config(config, world_size=2)
    assert (model_config.num_hidden_layers, model_config.num_experts_per_tok) == (2, 1)


@pytest.mark.parametrize("spelling, meant", [("bfloat16", "bf16"), ("float32", "no"), ("fp32", "no"), ("bf16", "bf16")])
def test_mixed_precision_takes_the_dtype_spellings_export_dtype_takes(spelling, meant):
    assert load_config(DEFAULT_YAML, ["--mixed_precision", spelling]).mixed_precision == meant


def test_a_model_config_init_from_overrides_is_said_not_silently_dropped(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.models.presets import build_config

    save_model_dir(AutoModelForCausalLM.from_config(build_config("tiny-olmoe", num_hidden_layers=2)), tmp_path / "start")
    config = TrainConfig(init_from=str(tmp_path / "start"), model_config="tiny-mixtral", pp_size=2)
    validate_config(config, world_size=2)
    assert f"model_config tiny-mixtral is not used: the model is init_from's ({tmp_path / 'start'})" in \
        capsys.readouterr().err
