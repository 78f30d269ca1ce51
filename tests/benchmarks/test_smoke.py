"""Every benchmark script runs at tiny sizes and writes its JSON, so none can break unnoticed. Timings are
the scripts' business and are never asserted here (benchmarks/README.md holds the measured ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# script → its arguments at tiny sizes (each also gets --out)
TINY = {
    "activation_memory.py": ["--layers", "1", "--seq_len", "32", "--micro_batch_size", "1", "--pp", "2", "--repeats", "1"],
    "data_path.py": ["--seq-len", "16", "--rows-per-step", "4", "--step-ms", "1", "--steps", "3"],
    "gpu_bf16_accumulation.py": ["--microbatches", "2", "--hidden", "16", "--intermediate", "32", "--tokens", "8",
                                 "--repeats", "1"],
    "memory_per_rank.py": ["--seq-len", "16", "--micro-batch-size", "1", "--microbatches", "2", "--dp", "1",
                           "--arms", "pipedream-2bw:adamw"],
    "optimizer_cost.py": ["--updates", "2", "--rounds", "1", "--microbatches", "2"],
    "pipeline_schedules.py": ["--schedules", "gpipe,pipedream-2bw", "--microbatches", "2", "--steps", "2", "--warmup", "1",
                              "--seq-len", "16", "--micro-batch-size", "2"],
    "plan_accuracy.py": ["--model", "training_scripts/models/moe_cpu_1m", "--layers", "4", "--seq-len", "32",
                         "--micro-batch-size", "1", "--microbatches", "2"],
    "scale_rehearsal.py": ["--model", "training_scripts/models/moe_cpu_1m", "--layers", "4", "--seq-len", "16",
                           "--micro-batch-size", "1", "--microbatches", "2", "--steps", "1"],
    "revision_step_times.py": ["--base", "HEAD", "--schedules", "1f1b", "--microbatches", "2", "--steps", "2",
                               "--warmup", "1", "--seq-len", "16", "--micro-batch-size", "2", "--emulated-steps", "7",
                               "--rounds", "1"],
    "schedule_model.py": ["--depths", "2"],
    "schedule_sleep.py": ["--pp", "2", "--microbatches", "1", "--schedules", "1f1b,pipedream-2bw", "--steps", "1",
                          "--last-stage-factor", "1", "--forward-ms", "1", "--backward-ms", "1"],
}
# Scripts for a GPU, run by benchmarks/gpu_checks.sh, whose CPU dry run .ci/torch_range makes.
GPU_SCRIPTS = {"gpu_stage.py", "gpu_versioned_stage.py"}


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {path.name for path in (REPO / "benchmarks").glob("*.py")
               if 'if __name__ == "__main__":' in path.read_text()}  # not the helpers they import
    assert scripts == set(TINY) | GPU_SCRIPTS
    assert all(name in (REPO / "benchmarks" / "gpu_checks.sh").read_text() for name in GPU_SCRIPTS)


@pytest.mark.launch
@pytest.mark.parametrize("script", sorted(TINY))
def test_the_benchmark_runs_at_tiny_sizes_and_writes_its_results(script, tmp_path):
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, f"benchmarks/{script}", *TINY[script], "--out", str(out)], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(out.read_text())
