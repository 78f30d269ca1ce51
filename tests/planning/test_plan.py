"""`hf-asyncpp plan` plays the real runtime on fake tensors and a fake process group: its peak of live
tensor bytes per rank is what a real run of the same config measures.

The reference is a real run: two gloo ranks on this machine with real tensors, each measuring the
peak of its live tensors through start-up, the same three steps and an evaluation (MemoryTracker on real storages).
The plan builds nothing real: each rank is played alone, in its own process. Tolerance 10%: the
issue's bar for trusting the plan at scale; the two differ where a real run holds what a fake one
cannot (values received from a peer are real buffers here, fake there: same bytes), so in practice
they agree to a few percent.
"""

from __future__ import annotations

import json

import pytest

from hf_asyncpp.cli import main as cli
from hf_asyncpp.config import TrainConfig
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.parallel.spawn import run_ranks
from hf_asyncpp.planning.plan import GiB, KINDS, STEPS, allowance, overshoot, plan_layout

PRESET = "tiny-moe"


def _config(schedule: str) -> TrainConfig:
    return TrainConfig(model_config=PRESET, pp_size=2, schedule=schedule, optimizer="adamw", ef=True,
                       seq_len=128, micro_batch_size=8, n_microbatches=4, max_steps=STEPS + 1, mixed_precision="no")


def _measured_peak(rank, world_size, schedule):
    import torch

    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.planning.memory_tracker import MemoryTracker

    layout = init_parallel(read_launch(), 2)
    try:
        tracker = MemoryTracker()
        with tracker:
            engine = PipelineEngine(_config(schedule), build_config(PRESET), layout)
            rows = torch.randint(0, 8192, (32, 128), generator=torch.Generator().manual_seed(0))
            for _ in range(STEPS):
                engine.train_step(rows, rows if engine.forwards_ahead else None)
            engine.eval_step(rows)  # as the plan does after its steps
        if engine.forwards_ahead:
            engine.train_step(rows, None)  # the drain
        engine.finish()
        return tracker.peak_bytes
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["pipedream-2bw", "1f1b"])
def test_the_plan_of_a_tiny_cpu_run_is_within_10_percent_of_its_measured_peak(schedule):
    measured = run_ranks(2, _measured_peak, schedule)
    planned = plan_layout(_config(schedule), build_config(PRESET), world_size=2)
    for rank, real in enumerate(measured):
        plan = planned[rank]
        assert abs(plan["peak_bytes"] - real) <= 0.10 * real, (rank, plan["peak_bytes"], real)
        assert sum(plan[f"{k}_bytes"] for k in KINDS) == plan["peak_bytes"]  # the parts are the peak
        # Master weights, optimizer state and EF are fp32 and whole at dp 1: AdamW holds two moments.
        assert plan["optimizer_state_bytes"] >= 2 * plan["parameter_bytes"] > 0
        assert plan["ef_buffer_bytes"] == plan["parameter_bytes"]
        assert plan["syncs_per_microbatch"] == 0  # none inside a microbatch's compute


@pytest.mark.multirank
def test_plan_command_writes_every_rank_and_refuses_a_budget_too_small_in_one_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"model_config: {PRESET}\npp_size: 2\nschedule: pipedream-2bw\nseq_len: 64\n"
                      "micro_batch_size: 2\nn_microbatches: 4\nmax_steps: 10\nmixed_precision: 'no'\n")
    out = tmp_path / "plan.json"
    assert cli(["plan", str(config), "--world-size", "4", "--gpu-memory-gib", "80", "--json", str(out),
                "--schedules", "1f1b"]) == 0
    report = json.loads(out.read_text())
    assert [(r["rank"], r["pp_rank"], r["dp_rank"]) for r in report["ranks"]] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(r["peak_bytes"] > r["parameter_bytes"] > 0 for r in report["ranks"])
    out = capsys.readouterr().out
    assert "every rank of pipedream-2bw fits" in out
    # each schedule's predicted step; the fastest of the two whose memory was played (both fit) is named
    steps = {r["schedule"]: r for r in report["steps"]}
    assert list(steps) == ["1f1b", "interleaved-1f1b", "zbv", "pipedream-2bw", "wpipe", "pipedream"]
    assert list(report["other_schedules"]) == ["1f1b"] and len(report["other_schedules"]["1f1b"]) == 4
    faster = min(("1f1b", "pipedream-2bw"), key=lambda name: steps[name]["step_s"])
    assert f"fastest that fits: {faster}" in out

    budget = allowance(report["ranks"][0])["total"] + report["ranks"][0]["peak_bytes"] / 2 / GiB  # half its peak
    assert cli(["plan", str(config), "--world-size", "4", "--gpu-memory-gib", f"{budget:.6f}"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")]
    worst = max(report["ranks"], key=lambda r: r["peak_bytes"] / GiB + allowance(r)["total"])
    assert len(err) == 1 and err[0].startswith(f"rank {worst['rank']} (pp rank {worst['pp_rank']}") and "over" in err[0]


def test_plan_command_refuses_a_world_size_the_pipeline_does_not_divide(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"model_config: {PRESET}\npp_size: 2\n")
    assert cli(["plan", str(config), "--world-size", "3"]) == 2
    assert "not a multiple of pp_size 2" in capsys.readouterr().err


def test_the_allowance_is_itemised_per_rank_from_its_communicators_and_peak():
    """CUDA context 1 GiB + workspaces 0.5 + 0.75 per NCCL communicator + 5% of the peak (plan.ALLOWANCE)."""
    rank = {"rank": 3, "pp_rank": 1, "stages": [1], "peak_bytes": 40 * GiB, "nccl_communicators": 7}
    parts = allowance(rank)
    assert parts == {"cuda context": 1.0, "workspaces": 0.5, "nccl": 5.25, "fragmentation": 2.0, "total": 8.75}
    assert overshoot([rank], 48.75) is None
    line = overshoot([rank], 48.0)
    assert line.startswith("rank 3 (pp rank 1, stages [1]) peaks at 40.0 GiB, 0.8 GiB over a 48 GiB GPU") and "nccl 5.2" in line
    assert overshoot([rank], 48.0, allowance_gib=6.0) is None  # a flat allowance, as given
