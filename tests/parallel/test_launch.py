"""What the launcher was told, read before any process group starts: accelerate launch's
mixed_precision is honoured or, where the run's config contradicts it, refused with one line;
settings for engines that would take the model over (accelerate's FSDP, DeepSpeed, a dynamo
backend) are refused. train.py's path: exit 2, one `error:` line, nothing written."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_asyncpp.config import load_config
from hf_asyncpp.config_checks import apply_launch_settings
from hf_asyncpp.parallel.launch import LaunchError, read_launch
from hf_asyncpp.run import main

TINY = "training_scripts/configs/tiny_moe.yaml"


@pytest.mark.parametrize("launcher, run, expected", [
    (None, "auto", "auto"), ("bf16", "auto", "bf16"), ("no", "auto", "no"), ("bf16", "bf16", "bf16"), ("no", "no", "no"),
])
def test_accelerates_mixed_precision_fills_in_auto_and_agrees_otherwise(launcher, run, expected, monkeypatch):
    if launcher is not None:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    else:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    config = load_config(None, ["--mixed_precision", run])
    apply_launch_settings(config, read_launch())
    assert config.mixed_precision == expected


@pytest.mark.parametrize("variables, message", [
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "accelerate launch asks for mixed_precision bf16 but the run's "
                                             "mixed_precision is no: make the accelerate config and the run's config agree"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "asks for mixed_precision fp16; hf_asyncpp computes in bf16"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "configured for DeepSpeed, which hf_asyncpp does not use"),
    ({"ACCELERATE_USE_FSDP": "true"}, "configured for FSDP"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "dynamo_backend INDUCTOR; hf_asyncpp compiles each decoder layer itself"),
])
def test_a_launcher_setting_the_run_cannot_honour_is_one_error_before_any_process_group(
        variables, message, tmp_path, monkeypatch, capsys):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", **variables}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert main(["--config", TINY, "--mixed_precision", "no", "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and err.strip().startswith("error:") and message in err, err
    assert not dist.is_initialized() and not out.exists()


def test_the_gpu_environment_is_set_before_cuda_starts_unless_the_user_set_it(monkeypatch):
    """Expandable segments and eager module loading by default (parallel/launch.GPU_ENVIRONMENT); a
    value the user exported is kept."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    read_launch()
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"


def test_the_launch_is_read_from_the_environment(monkeypatch):
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "ACCELERATE_MIXED_PRECISION": "BF16"}.items():
        monkeypatch.setenv(name, value)
    launch = read_launch()
    assert (launch.world_size, launch.rank, launch.local_rank, launch.launched, launch.mixed_precision) == (
        4, 3, 1, True, "bf16")
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    with pytest.raises(LaunchError, match="Megatron-LM"):
        read_launch()


def test_more_processes_on_a_node_than_it_has_gpus_is_one_error_before_any_process_group(tmp_path, monkeypatch,
                                                                                          capsys):
    """Each process of a node takes the GPU of its LOCAL_RANK: a node launching more processes than it
    has GPUs says so on every rank (rank 0 prints it), instead of CUDA's "invalid device ordinal" on
    some ranks from inside the process group's start while the others wait."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    assert main(["--config", TINY, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "this node runs 2 processes but has 1 GPU(s) visible" in err, err
    assert not dist.is_initialized() and not out.exists()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process per GPU
    assert read_launch().local_rank == 0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a launcher that does not say: the process's own LOCAL_RANK
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(LaunchError, match="runs 2 processes but has 1 GPU"):
        read_launch()


@pytest.mark.multirank
def test_under_accelerate_launch_a_contradicted_mixed_precision_stops_both_ranks_with_one_line(tmp_path):
    """accelerate launch's own --mixed_precision (as its config's key would) reaches the ranks; the
    run's config says no: exit status 2 from every rank, one error line (rank 0's), nothing written."""
    import os
    import subprocess

    out = tmp_path / "out"
    cmd = ["accelerate", "launch", "--config_file", "training_scripts/accelerate/cpu_2proc.yaml", "--mixed_precision",
           "bf16", "training_scripts/train.py", "--config", TINY, "--mixed_precision", "no", "--output_dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: accelerate launch asks for mixed_precision bf16 but the run's mixed_precision is no: "
                     "make the accelerate config and the run's config agree"], done.stderr[-2000:]
    assert not out.exists()
