"""The sleeping-stage benchmark's plumbing (benchmarks/schedule_sleep.py) at small sizes: every schedule,
ZBV's split backward among them, runs the real engine on four ranks whose stages sleep, and its row holds
the measured step beside the bubble-free limit and the timing model's. What the numbers are is the
benchmark's business (benchmarks/README.md); here only what must hold whatever the machine: a step cannot
take less than its busiest rank's device clock is busy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import schedule_sleep  # noqa: E402

pytestmark = pytest.mark.launch  # the benchmark starts its own ranks


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sleep") / "rows.json"
    schedule_sleep.main(["--pp", "4", "--microbatches", "1", "--last-stage-factor", "1", "--link-ms", "2", "--forward-ms", "5",
                         "--backward-ms", "6", "--weight-ms", "4", "--optimizer-ms", "2", "--steps", "2",
                         "--out", str(out)])
    return json.loads(out.read_text())["rows"]


def test_every_schedule_runs_on_sleeping_stages_at_p4_m4(rows):
    assert [r["schedule"] for r in rows] == list(schedule_sleep.SCHEDULES)
    for r in rows:
        assert "refused" not in r, r
        assert (r["pp_size"], r["n_microbatches"]) == (4, 4)
        # the busiest rank's device is busy this long every step; the host may run behind its device clock
        assert r["measured_ms"] + r["host_lag_ms"] >= r["limit_ms"] > 0, r
        assert r["model_ms"] >= r["limit_ms"], r


def test_the_sleeps_per_step_are_the_stage_costs_the_model_plays():
    sleeps = schedule_sleep.Sleeps(0.005, 0.006, 0.004, 2.0, 0.0)
    # 1F1B at p 4, m 4: the busiest rank (the last, its sleeps doubled) computes 4 × 2 × (5 + 6 + 4) ms.
    from hf_asyncpp.planning.step_time import predict_step
    from hf_asyncpp.schedules import get_schedule_spec

    _, limit = predict_step(get_schedule_spec("1f1b"), 4, 4, sleeps.stage_costs(4, 1))
    assert limit == pytest.approx(4 * 2 * 0.015)
    # ZBV's split backward: its input half sleeps B, its weight half W, on the stage they belong to.
    # Two stages on a rank (ZBV's V) each sleep half the rank's time: rank 0 holds stages 0 and 7 (the last).
    _, limit = predict_step(get_schedule_spec("zbv"), 4, 8, sleeps.stage_costs(8, 2))
    assert limit == pytest.approx(8 * (0.015 + 2 * 0.015) / 2)


def test_each_asynchronous_schedule_is_set_beside_the_fastest_synchronous_one(rows):
    from hf_asyncpp.schedules import get_schedule_spec

    synchronous = {r["schedule"]: r["measured_ms"] for r in rows if get_schedule_spec(r["schedule"]).synchronous}
    fastest = min(synchronous, key=synchronous.get)
    for r in rows:
        if not get_schedule_spec(r["schedule"]).synchronous:
            assert r["best_synchronous"] == fastest
            assert r["tokens_per_s_over_best_synchronous"] == pytest.approx(synchronous[fastest] / r["measured_ms"], rel=1e-2)
