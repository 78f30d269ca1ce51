"""The public surface is pinned: adding or removing a name is a deliberate change to this list."""

import hf_asyncpp

PUBLIC = {
    "FAMILIES", "PERPLEXITY_METRIC_PATH", "PRESETS", "SCHEDULES", "AsyncOrder", "AsyncPPTrainer",
    "AsyncPPTrainingArguments", "ConfigError", "PipelineEngine", "PipelineLoss", "PipelineStageModule",
    "ScheduleSpec", "StagePlan", "StalenessEmulator", "StepResult", "TrainConfig", "UnsupportedModelError", "__version__",
    "build_config", "build_full_model", "build_stage_modules", "check_schedule", "export_checkpoint", "export_hf_model",
    "gather_full_state_dict", "get_schedule_spec", "load_config", "plan_stages", "register_schedule",
    "validate_config",
}


def test_all_is_pinned_and_importable():
    assert set(hf_asyncpp.__all__) == PUBLIC
    for name in hf_asyncpp.__all__:
        assert hasattr(hf_asyncpp, name), name


def test_every_family_has_a_preset_and_every_schedule_is_registered():
    families = {hf_asyncpp.build_config(p).model_type for p in hf_asyncpp.PRESETS}
    assert families == set(hf_asyncpp.FAMILIES)
    assert set(hf_asyncpp.SCHEDULES) >= {"gpipe", "1f1b", "interleaved-1f1b", "zbv", "pipedream-2bw", "wpipe", "pipedream"}
