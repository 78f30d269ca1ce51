"""A pipeline stage that sleeps instead of computing, on a device clock: what benchmarks/schedule_sleep.py
runs on real ranks (its docstring says what it measures)."""

from __future__ import annotations

import time

__all__ = ["BLOCKED_S", "DeviceClock", "sleep_on", "waits_catch_up"]


class DeviceClock:
    """When a rank's device is free, one clock for every process on this machine (seconds after `base`).

    With `overlap` (the default) the host's own work overlaps the device's, as a host that launches
    kernels runs ahead of its GPU: an action starts when the rank's previous action has ended and its
    input has arrived, both by this clock, and the host sleeps until the action would end. The host's
    time (the runtime, the tiny layer, gloo) is then hidden wherever the device's time covers it. Where
    the host waits for a collective (the global norm, the step's statistics) and the wait blocks, the
    collective completed as the wait ended: the clock catches up with the host (`waits_catch_up`); so it
    does through the warm-up steps (start-up work). Without `overlap` every action starts when the host
    gets to it: the host's time on 8 ranks sharing 2 cores adds to the device's (the `host` clock)."""

    def __init__(self, base: float, overlap: bool):
        self.base, self.overlap, self.free_at = base, overlap, None

    def now(self) -> float:
        return time.perf_counter() - self.base

    def catch_up(self) -> None:
        self.free_at = max(self.free_at or 0.0, self.now())

    def start(self, arrival: float = 0.0) -> float:
        """When an action whose input arrives at `arrival` starts."""
        if self.free_at is None or not self.overlap:
            self.catch_up()
        return max(self.free_at, arrival)

    def lag(self) -> float:
        """How far the host is behind the device (seconds; 0 when ahead)."""
        return max(0.0, self.now() - (self.free_at or 0.0))

    def run_until(self, end: float) -> None:
        self.free_at = end
        time.sleep(max(0.0, end - self.now()))


BLOCKED_S = 0.001  # a wait this long or longer blocked on its collective


def waits_catch_up(clock: DeviceClock):
    """Make this process's all-reduces catch `clock` up with the host when their wait blocks (see
    DeviceClock): the collective completed when the last rank reached it, as the wait ended. Returns
    what undoes it (a rank process runs many rows)."""
    import torch.distributed as dist

    all_reduce = dist.all_reduce

    def after(started: float) -> None:
        if clock.now() - started >= BLOCKED_S:
            clock.catch_up()

    class Waited:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            started = clock.now()
            done = self.work.wait(*args, **kwargs)
            after(started)
            return done

        def __getattr__(self, name):
            return getattr(self.work, name)

    def timed_all_reduce(*args, async_op: bool = False, **kwargs):
        started = clock.now()
        work = all_reduce(*args, async_op=async_op, **kwargs)
        if async_op:
            return Waited(work)
        after(started)
        return work

    dist.all_reduce = timed_all_reduce
    return lambda: setattr(dist, "all_reduce", all_reduce)


def sleep_on(module, times: tuple[float, float, float], link_s: float, received: tuple[bool, bool],
              split_backward: bool, clock: DeviceClock) -> None:
    """Make `module` (a pipeline stage) take `times` (forward, input gradient, weight gradient) per
    microbatch by `clock`: the stage's own small compute is inside that time.

    - forward: from its start (a pre-hook) to its output, which passes through a function that sleeps;
    - backward: from the output's gradient to the end of the backward pass (a callback the autograd
      engine runs when the pass ends). A full backward also lasts the weight gradient's time; with
      `split_backward` (ZBV) the weight-gradient action computes that gradient apart and takes its time,
      as the gradient of the weight its forward used (the one bound to that microbatch, under weight
      versions) is computed.

    Each message between ranks carries, in its first element, when it was sent by `clock`; the stage
    that uses it starts no earlier than `link_s` after that (a slower link). `received`: whether the
    stage's input, and its output's gradient, come from another rank."""
    import torch
    from torch.autograd import Variable

    forward_s, backward_s, weight_s = times
    full_backward_s = backward_s + (0.0 if split_backward else weight_s)
    pending: dict = {}  # the backward pass under way: when it ends

    def arrival(t: torch.Tensor, from_another_rank: bool) -> float:
        return t.view(-1)[0].item() + link_s if from_another_rank else 0.0

    def end_backward() -> None:
        clock.run_until(pending.pop("backward_end"))

    class SleepOnOutput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock.run_until(clock.free_at + forward_s)
            out = x.clone()  # a view of its input here makes torch's split backward lose a gradient
            out.view(-1)[0] = clock.free_at
            return out

        @staticmethod
        def backward(ctx, grad):
            pending["backward_end"] = clock.start(arrival(grad, received[1])) + full_backward_s
            Variable._execution_engine.queue_callback(end_backward)
            return grad

    class StampInputGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()  # sent back once the pass ends, so stamped with when it ends
            grad.view(-1)[0] = pending["backward_end"]
            return grad

    def on_weight_gradient(grad):
        if split_backward and "backward_end" not in pending:  # ZBV's weight-gradient action
            clock.run_until(clock.start() + weight_s)
        return grad

    def before(_module, args):
        clock.free_at = clock.start(arrival(args[0], received[0]))  # the forward starts here
        return (StampInputGradient.apply(args[0]), *args[1:]) if received[0] else None

    def after(bound_module, _inputs, output):
        weight = next(bound_module.parameters())  # the microbatch's own (a version's copy)
        if weight.requires_grad and not getattr(weight, "_sleeps", False):
            weight.register_hook(on_weight_gradient)
            weight._sleeps = True
        first = output[0] if isinstance(output, tuple) else output
        slept = SleepOnOutput.apply(first)
        return (slept, *output[1:]) if isinstance(output, tuple) else slept

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
