"""Error Feedback: the weights follow x_{t+1} = x_t − u_t − λ(u_t − u_{t−1}) with u the base optimizer's
raw updates; λ = 0 is exactly the base optimizer; a step without extrapolation moves them by u_t alone."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_asyncpp.optim.error_feedback import ErrorFeedback

GRADS = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.5, 0.3, -0.7]), torch.tensor([-0.2, 0.8, 0.1]),
         torch.tensor([0.9, -0.4, 1.1]), torch.tensor([-1.3, 0.2, 0.6])]


def _run(make_optimizer, ef_lambda):
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = make_optimizer([x])
    wrapped = ErrorFeedback(opt, ef_lambda) if ef_lambda is not None else opt
    trajectory = [x.detach().clone()]
    for g in GRADS:
        x.grad = g.clone()
        wrapped.step()
        trajectory.append(x.detach().clone())
    return trajectory


@pytest.mark.parametrize("ef_lambda", [1.0, 0.5])
def test_weights_follow_the_formula_from_the_raw_updates(ef_lambda):
    """SGD with momentum on a fixed gradient sequence: its raw updates u_t do not depend on x, so
    the plain run gives them, and the EF run must be x_{t+1} = x_t − u_t − λ(u_t − u_{t−1})."""
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    plain = _run(make, None)
    raw = [plain[t] - plain[t + 1] for t in range(len(GRADS))]
    expected, previous = [plain[0]], torch.zeros(3)
    for u in raw:
        expected.append(expected[-1] - u - ef_lambda * (u - previous))
        previous = u
    for got, want in zip(_run(make, ef_lambda), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_step_without_extrapolation_takes_the_previous_one_back_and_is_the_next_steps_previous():
    """Step 3 of 5 with extrapolate=False: x_4 = x_3 − u_3 + λ u_2, which is z_4, the trajectory of the updates
    alone (x_t = z_t − λ u_{t−1}); step 4 then extrapolates from u_3 as usual."""
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    plain = _run(make, None)
    raw = [plain[t] - plain[t + 1] for t in range(len(GRADS))]
    x = torch.nn.Parameter(plain[0].clone())
    ef = ErrorFeedback(make([x]), 0.5)
    expected, previous = plain[0], torch.zeros(3)
    for t, (g, u) in enumerate(zip(GRADS, raw)):
        x.grad = g.clone()
        ef.step(extrapolate=t != 2)
        expected, previous = expected - u - 0.5 * ((u if t != 2 else 0.0) - previous), u
        torch.testing.assert_close(x.detach(), expected, rtol=0, atol=1e-6)
        if t == 2:  # on the trajectory of the updates alone: plain SGD's weights after the same gradients
            torch.testing.assert_close(x.detach(), plain[t + 1], rtol=0, atol=1e-6)


def test_lambda_one_extrapolates_one_step():
    """λ = 1: x_{t+1} = x_t − 2u_t + u_{t−1}."""
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    plain, ef = _run(make, None), _run(make, 1.0)
    raw = [plain[t] - plain[t + 1] for t in range(len(GRADS))]
    for t in range(1, len(GRADS)):
        torch.testing.assert_close(ef[t + 1], ef[t] - 2 * raw[t] + raw[t - 1], rtol=0, atol=1e-6)


def test_adamw_update_includes_weight_decay_and_is_corrected_the_same_way():
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = torch.optim.AdamW([x], lr=0.05, weight_decay=0.1)
    ef = ErrorFeedback(opt, 1.0)
    previous = torch.zeros(3)
    for g in GRADS:
        x.grad = g.clone()
        shadow = torch.optim.AdamW([torch.nn.Parameter(x.detach().clone())], lr=0.05, weight_decay=0.1)
        shadow.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: load shares tensors
        shadow_x = shadow.param_groups[0]["params"][0]
        shadow_x.grad = g.clone()
        shadow.step()
        u = x.detach() - shadow_x.detach()  # the raw AdamW update from this x and state
        start = x.detach().clone()
        ef.step()
        torch.testing.assert_close(x.detach(), start - u - (u - previous), rtol=0, atol=1e-6)
        previous = u


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)])
def test_lambda_zero_is_exactly_the_base_optimizer(make):
    for a, b in zip(_run(make, None), _run(make, 0.0)):
        assert torch.equal(a, b)


def test_state_round_trips_with_the_ef_buffer():
    x = torch.nn.Parameter(torch.ones(3))
    ef = ErrorFeedback(torch.optim.SGD([x], lr=0.1, momentum=0.9), 1.0)
    x.grad = torch.ones(3)
    ef.step()
    y = torch.nn.Parameter(x.detach().clone())
    restored = ErrorFeedback(torch.optim.SGD([y], lr=0.1, momentum=0.9), 0.0)
    restored.load_state_dict(copy.deepcopy(ef.state_dict()))
    for p in (x, y):
        p.grad = torch.full((3,), 2.0)
    ef.step()
    restored.step()
    assert torch.equal(x, y) and restored.ef_lambda == 1.0
