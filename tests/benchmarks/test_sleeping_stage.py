"""The sleeping stage (benchmarks/sleeping_stage.py) in one process: on its device clock a forward takes
its time from when it may start, a full backward its input and weight gradients' times, a message
carries when it was sent, and a stage that receives it starts no earlier than that plus the link."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sleeping_stage import DeviceClock, sleep_on  # noqa: E402

F, B, W, LINK = 0.004, 0.006, 0.002, 0.003


def _stage(received: tuple[bool, bool], split_backward: bool = False):
    clock = DeviceClock(time.perf_counter(), overlap=True)
    module = torch.nn.Linear(4, 4)
    sleep_on(module, (F, B, W), LINK, received, split_backward, clock)
    return module, clock


def test_a_forward_takes_its_time_on_the_device_clock_and_stamps_its_output_with_its_end():
    module, clock = _stage((False, False))
    out = module(torch.ones(2, 4))
    started = clock.free_at - F
    assert out.view(-1)[0].item() == pytest.approx(clock.free_at)
    assert clock.now() >= clock.free_at  # the host slept until the device would be done
    again = module(torch.ones(2, 4))  # the next starts when the device is free: one forward later
    assert again.view(-1)[0].item() == pytest.approx(started + 2 * F, abs=1e-3)


def test_a_received_input_starts_the_forward_no_earlier_than_its_stamp_plus_the_link():
    module, clock = _stage((True, False))
    clock.catch_up()
    sent_at = clock.now() + 0.010  # a message stamped in the future: its sender's device ends then
    x = torch.ones(2, 4, requires_grad=True)
    with torch.no_grad():
        x.view(-1)[0] = sent_at
    out = module(x)
    assert clock.free_at == pytest.approx(sent_at + LINK + F)
    assert out.view(-1)[0].item() == pytest.approx(sent_at + LINK + F)


def test_a_full_backward_takes_both_gradients_times_and_stamps_the_gradient_it_sends_back():
    module, clock = _stage((True, False))
    x = torch.zeros(2, 4, requires_grad=True)
    out = module(x)
    forward_end = clock.free_at
    out.sum().backward()  # the loss's gradient is local: the backward starts when the device is free
    assert clock.free_at == pytest.approx(forward_end + B + W, abs=1e-3)
    assert x.grad.view(-1)[0].item() == pytest.approx(clock.free_at)


def test_a_split_backward_leaves_the_weight_gradient_to_its_own_action():
    module, clock = _stage((False, False), split_backward=True)
    x = torch.zeros(2, 4, requires_grad=True)
    out = module(x)
    forward_end = clock.free_at
    (grad_x,) = torch.autograd.grad(out.sum(), x, retain_graph=True)  # ZBV's input-gradient action
    assert clock.free_at == pytest.approx(forward_end + B, abs=1e-3)
    # its weight-gradient action: a pass that reaches the weight (torch's runs from the saved intermediates)
    torch.autograd.grad((module.weight * 1.0).sum(), module.weight)
    assert clock.free_at == pytest.approx(forward_end + B + W, abs=1e-3)
