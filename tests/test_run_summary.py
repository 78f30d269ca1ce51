"""The closing lines of a pipeline run (hf_asyncpp/run_summary.py): each pipeline rank's measured idle
share, and the same run with a flush added (an asynchronous schedule, against 1F1B) or taken away (a
synchronous one), the flush timed by the schedules' timing model at the measured compute. What a real
two-rank run prints is checked in tests/test_run.py."""

from __future__ import annotations

from hf_asyncpp.run_summary import idle_summary
from hf_asyncpp.schedules import get_schedule_spec

# Rank 0 computes 0.5 s of a step, rank 1 0.9 s; at p = 2, m = 4 1F1B's flush adds rank 0's first
# forward and last backward to rank 1's pace: 0.5/4 = 0.125 s (tests/schedules/test_registry.py).
COMPUTE_S = [0.5, 0.9]


def test_an_asynchronous_run_is_set_beside_the_same_run_with_1f1bs_flush():
    lines = idle_summary(get_schedule_spec("pipedream-2bw"), 4, 200, COMPUTE_S, [1.0, 1.0])
    assert lines == [
        "idle share by pipeline rank over 200 steps of pipedream-2bw (1 − forward/backward compute / step wall "
        "time): 0.50, 0.10",
        # 1 − 0.5/1.125, 1 − 0.9/1.125
        "1f1b's flush would add 0.125 s to each 1.000 s step, idling them 0.56, 0.20 (timing model at the "
        "measured compute; 0.20 on equal stages)",
    ]


def test_a_synchronous_run_states_its_own_flush_and_the_run_without_it():
    lines = idle_summary(get_schedule_spec("1f1b"), 4, 200, COMPUTE_S, [1.125, 1.125])
    assert lines == [
        "idle share by pipeline rank over 200 steps of 1f1b (1 − forward/backward compute / step wall time): "
        "0.56, 0.20",
        "1f1b's flush takes 0.125 s of each 1.125 s step; without it they would idle 0.50, 0.10 (timing model at "
        "the measured compute; 0.20 on equal stages)",
    ]


def test_an_asynchronous_run_with_fewer_microbatches_than_1f1b_needs_is_set_beside_gpipe():
    """PipeDream-2BW runs 2 microbatches on 4 stages; 1F1B refuses them, GPipe's flush is the same bubble."""
    lines = idle_summary(get_schedule_spec("pipedream-2bw"), 2, 10, [1.0] * 4, [1.0] * 4)
    assert lines[1].startswith("gpipe's flush would add 1.500 s to each 1.000 s step")
    assert lines[1].endswith("0.60 on equal stages)")  # (p − 1)/(m + p − 1) = 3/5
