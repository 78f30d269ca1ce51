"""The error a schedule that cannot run raises: found by the one-process checks (validate.py) or by an
asynchronous order's own rules (async_order.py), before any process group exists."""

__all__ = ["ScheduleError"]


class ScheduleError(AssertionError):
    pass
