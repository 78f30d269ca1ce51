"""What the launcher gave us: world size and rank, read before any process group starts.

torchrun and `accelerate launch --multi_gpu` (also on a CPU-only machine, see
training_scripts/accelerate/) export WORLD_SIZE / RANK / LOCAL_RANK. accelerate's CPU modes
(`--cpu`, `distributed_type: MULTI_CPU`) start a single process without them even when several
were asked for; training would then silently run un-distributed, so that case stops here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

__all__ = ["LaunchError", "LaunchInfo", "read_launch"]


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchInfo:
    world_size: int
    rank: int
    local_rank: int
    launched: bool  # started by torchrun / accelerate (False: plain `python train.py`)


def _parent_cmdline() -> list[str]:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _accelerate_requested_processes(cmdline: list[str]) -> int | None:
    """num_processes an `accelerate launch` command line asked for (flag, else its config file)."""
    joined = " ".join(cmdline)
    if "accelerate" not in joined or "launch" not in cmdline:
        return None
    for i, arg in enumerate(cmdline):
        if arg.startswith("--num_processes"):
            value = arg.split("=", 1)[1] if "=" in arg else cmdline[i + 1]
            return int(value)
    config_file = None
    for i, arg in enumerate(cmdline):
        if arg.startswith("--config_file"):
            config_file = arg.split("=", 1)[1] if "=" in arg else cmdline[i + 1]
    if config_file is None:
        hf_home = os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface"))
        config_file = os.path.join(hf_home, "accelerate", "default_config.yaml")
    try:
        with open(config_file) as f:
            return int((yaml.safe_load(f) or {}).get("num_processes", 1))
    except (OSError, ValueError, yaml.YAMLError):
        return None


def read_launch() -> LaunchInfo:
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return LaunchInfo(int(env["WORLD_SIZE"]), int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), True)
    if env.get("ACCELERATE_USE_CPU", "").lower() == "true" or "ACCELERATE_DYNAMO_BACKEND" in env:
        requested = _accelerate_requested_processes(_parent_cmdline())
        if requested and requested > 1:
            raise LaunchError(
                f"accelerate was asked for {requested} processes but started one without a distributed "
                "environment (its CPU modes --cpu / MULTI_CPU do this). Launch with "
                "`accelerate launch --config_file training_scripts/accelerate/cpu_2proc.yaml ...` "
                f"(or `--multi_gpu --num_processes {requested}`, which works on CPU too), or torchrun."
            )
    return LaunchInfo(1, 0, 0, False)


