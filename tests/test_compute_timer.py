"""`ComputeTimer` (hf_asyncpp/metrics.py): busy time is what runs inside the stages' "compute_time"
hook (schedules/stage_hooks.py) and inside the loss it wraps, not what runs while it is paused (an
evaluation). On a GPU each call is timed by CUDA events recorded around it and read at `take`, without
any host wait on an event: calls the device has not finished count at a later take."""

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


def test_an_evaluation_while_paused_is_not_busy_time():
    stage = _Stage()
    timer = ComputeTimer([stage], torch.device("cpu"))
    with timer.paused(), stage.hooks["compute_time"](None):
        time.sleep(0.05)
    assert timer.take() == 0.0


def test_on_a_gpu_events_are_recorded_around_each_call_and_read_without_waiting(monkeypatch):
    log, finished = [], [0]  # finished[0]: how many log positions the device has reached

    class Event:  # a CUDA event whose clock is the position in the log, one second a step
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("record")

        def query(self):  # non-blocking: whether the device has passed the event
            return self.at < finished[0]

        def synchronize(self):
            raise AssertionError("a host wait on an event is a sync")

        def elapsed_time(self, end):  # milliseconds; CUDA refuses events not yet reached
            assert self.query() and end.query()
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    stage = _Stage()
    timer = ComputeTimer([stage], torch.device("cuda", 0))
    for _ in range(3):
        with stage.hooks["compute_time"](None):
            log.append("compute")
    assert log == ["record", "compute", "record"] * 3  # nothing waits for the device per call
    finished[0] = 6  # the device is in the third call
    assert timer.take() == 2 * 2.0
    finished[0] = len(log)
    assert timer.take() == 2.0  # the third, once finished
    assert timer.take() == 0.0
