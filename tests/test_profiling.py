"""`profile_steps` (hf_asyncpp/profiling.py): every rank writes a Chrome trace of each chosen step, in which
its pipeline program's actions are named; the other steps are not profiled. The run's metrics carry
achieved TFLOP/s and each rank's peak memory (here, on a CPU: resident memory, no MFU)."""

from __future__ import annotations

import json

import pytest

from tests.ranks import train_py

ARGS = ["--config", "training_scripts/configs/tiny_moe.yaml", "--pp_size", "2", "--seq_len", "32",
        "--micro_batch_size", "2", "--n_microbatches", "4", "--max_steps", "3", "--eval_fraction", "0",
        "--save_final", "false", "--report_to", "none", "--threads_per_rank", "1"]


@pytest.mark.multirank
def test_each_rank_writes_a_trace_of_the_chosen_step_naming_its_actions(tmp_path):
    out = tmp_path / "run"
    results = train_py(2, [*ARGS, "--output_dir", str(out), "--profile_steps", "[2]"], tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["step2_rank0.json", "step2_rank1.json"]
    for rank in (0, 1):
        names = {event.get("name") for event in json.loads((out / "profile" / f"step2_rank{rank}.json").read_text())
                 ["traceEvents"]}
        # Stage `rank`'s forwards and backwards (by chunk slot) and its messages to the other stage.
        assert {f"{rank}F0", f"{rank}B0"} <= names, sorted(n for n in names if n and n[0].isdigit())[:20]
        assert any(n and n.startswith(f"{rank}SEND_") for n in names) and any(n and "RECV_" in n for n in names)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["train_tflops_per_device"] > 0 and last["mfu"] is None
    assert len(last["peak_rss_gib_per_rank"]) == 2 and min(last["peak_rss_gib_per_rank"]) > 0.1
