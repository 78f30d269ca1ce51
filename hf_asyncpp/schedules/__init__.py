"""Pipeline schedules: a registry of names, action lists as data, one-process validation."""

from .registry import SCHEDULES, ScheduleSpec, get_schedule_spec, register_schedule
from .runtime import ActionListSchedule, build_schedule
from .errors import ScheduleError
from .validate import check_schedule

__all__ = [
    "SCHEDULES",
    "ActionListSchedule",
    "ScheduleError",
    "ScheduleSpec",
    "build_schedule",
    "check_schedule",
    "get_schedule_spec",
    "register_schedule",
]
