"""The staleness emulator reproduces the delayed-update rules exactly (closed forms, by hand)."""

from __future__ import annotations

import torch

from hf_asyncpp.optim.delay import StalenessEmulator

A = [1.0, 2.0, 0.5, 1.5, 3.0, 0.7]
C = [0.3, -1.0, 2.0, 0.1, -0.5, 1.2]


def _run(delay: int, lr: float = 0.1, momentum: float = 0.0):
    x = torch.nn.Parameter(torch.tensor(1.0))
    emulator = StalenessEmulator(torch.optim.SGD([x], lr=lr, momentum=momentum), {x: delay})
    for a, c in zip(A, C):
        emulator.zero_grad()
        with emulator.stale_weights():
            (0.5 * a * (x - c) ** 2).backward()
        emulator.step()
    return x.item()


def test_delay_zero_is_plain_sgd():
    x = 1.0
    for a, c in zip(A, C):
        x -= 0.1 * a * (x - c)
    assert abs(_run(0) - x) < 1e-6


def test_delay_one_is_the_pipedream_2bw_rule():
    """x_{t+1} = x_t − lr·∇f_t(x_{t−1}), x_{−1} = x_0: every gradient one version old."""
    history = [1.0]
    for t, (a, c) in enumerate(zip(A, C)):
        stale = history[max(t - 1, 0)]
        history.append(history[-1] - 0.1 * a * (stale - c))
    assert abs(_run(1) - history[-1]) < 1e-6
    assert abs(_run(1) - _run(0)) > 1e-3  # the delay matters here


def test_momentum_consumes_the_stale_gradients_in_order():
    history, buf = [1.0], 0.0
    for t, (a, c) in enumerate(zip(A, C)):
        grad = a * (history[max(t - 1, 0)] - c)
        buf = grad if t == 0 else 0.9 * buf + grad
        history.append(history[-1] - 0.1 * buf)
    assert abs(_run(1, momentum=0.9) - history[-1]) < 1e-6


def test_each_group_sees_its_own_delay_at_a_mixed_model():
    """PipeDream-like: x is two updates stale, y fresh; the gradient is taken at (x_{t−2}, y_t)."""
    x = torch.nn.Parameter(torch.tensor(0.5))
    y = torch.nn.Parameter(torch.tensor(-0.2))
    emulator = StalenessEmulator(torch.optim.SGD([x, y], lr=0.05), {x: 2, y: 0})
    xs, ys = [0.5], [-0.2]
    for t, c in enumerate(C):
        emulator.zero_grad()
        with emulator.stale_weights():
            assert emulator.version_age(x) == min(2, t) and emulator.version_age(y) == 0
            ((x * y - c) ** 2).backward()
        emulator.step()
        xo, yo = xs[max(t - 2, 0)], ys[-1]
        r = xo * yo - c
        xs.append(xs[-1] - 0.05 * 2 * r * yo)
        ys.append(ys[-1] - 0.05 * 2 * r * xo)
    assert abs(x.item() - xs[-1]) < 1e-6 and abs(y.item() - ys[-1]) < 1e-6


def test_the_current_weights_are_restored_after_the_stale_pass():
    x = torch.nn.Parameter(torch.tensor(1.0))
    emulator = StalenessEmulator(torch.optim.SGD([x], lr=1.0), {x: 1})
    with emulator.stale_weights():
        (x * 3).backward()
    emulator.step()  # x = 1 − 3 = −2
    with emulator.stale_weights():
        assert x.item() == 1.0  # version 0
    assert x.item() == -2.0


def test_a_restart_takes_the_next_gradient_at_the_current_weights_and_builds_the_delay_up_again():
    """A sync start: two fresh units (restart after each), then delay 1 counted from the switch."""
    x = torch.nn.Parameter(torch.tensor(1.0))
    emulator = StalenessEmulator(torch.optim.SGD([x], lr=0.1), {x: 1})
    history = [1.0]
    for t, (a, c) in enumerate(zip(A, C)):
        emulator.zero_grad()
        with emulator.stale_weights():
            (0.5 * a * (x - c) ** 2).backward()
        emulator.step()
        if t < 2:
            emulator.restart()
        stale = history[t if t <= 2 else t - 1]
        history.append(history[-1] - 0.1 * a * (stale - c))
    assert abs(x.item() - history[-1]) < 1e-6
    assert emulator.version_age() == 1
