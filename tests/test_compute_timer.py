"""`ComputeTimer` (hf_asyncpp/metrics.py): busy time is what runs inside the stages' "compute_time"
hook (schedules/stage_hooks.py) and inside the loss it wraps. On a GPU each call is timed by CUDA
events recorded around it and read once, at `take`: no host wait per microbatch."""

from __future__ import annotations

import time

import torch

from hf_asyncpp.metrics import ComputeTimer


class _Stage:
    """What the timer needs of a stage: `subscribe`."""

    def __init__(self):
        self.hooks = {}

    def subscribe(self, position, hook):
        self.hooks[position] = hook


def test_busy_time_is_the_time_inside_the_hook_and_the_wrapped_loss():
    stage = _Stage()
    timer = ComputeTimer([stage], torch.device("cpu"))
    with stage.hooks["compute_time"](None):
        time.sleep(0.05)
    time.sleep(0.5)  # between compute calls: not busy
    loss = timer.timed(lambda value: time.sleep(0.02) or value)
    assert loss(3) == 3
    busy = timer.take()
    assert 0.07 <= busy < 0.5, busy
    assert timer.take() == 0.0  # taken: the next step starts from nothing


def test_on_a_gpu_events_are_recorded_around_each_call_and_waited_for_once_at_take(monkeypatch):
    log = []

    class Event:  # a CUDA event whose clock is the position in the log, one second a step
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("record")

        def synchronize(self):
            log.append("synchronize")

        def elapsed_time(self, end):  # milliseconds
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    stage = _Stage()
    timer = ComputeTimer([stage], torch.device("cuda", 0))
    for _ in range(3):
        with stage.hooks["compute_time"](None):
            log.append("compute")
    assert log == ["record", "compute", "record"] * 3  # nothing waits for the device per call
    assert timer.take() == 3 * 2.0
    assert log[-1] == "synchronize" and log.count("synchronize") == 1
