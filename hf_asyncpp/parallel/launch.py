"""What the launcher gave us: world size and rank, read before any process group starts.

torchrun and `accelerate launch --multi_gpu` (also on a CPU-only machine, see
training_scripts/accelerate/) export WORLD_SIZE / RANK / LOCAL_RANK. accelerate's CPU modes
(`--cpu`, `distributed_type: MULTI_CPU`) start a single process without them even when several
were asked for; training would then silently run un-distributed, so that case stops here.

What `accelerate launch` was told reaches its processes as ACCELERATE_* variables. Its
mixed_precision is carried in `LaunchInfo.mixed_precision` (config_checks.apply_launch_settings honours it
or refuses a contradiction); settings that hand the model to another engine (accelerate's FSDP,
DeepSpeed, Megatron-LM, a dynamo backend) are refused here, since the pipeline would ignore them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import yaml

__all__ = ["GPU_ENVIRONMENT", "LaunchError", "LaunchInfo", "read_launch"]

# What a process runs with on GPUs unless its environment says otherwise, set by read_launch, which every
# front end calls before its first CUDA call (the launch files export the same: docs/scale.md, "Launch
# environment"):
#   - expandable segments: the caching allocator grows segments instead of carving new ones, which
#     cuts the fragmentation MoE routing's varying shapes leave (plan with >= 10% of the card free);
#   - eager module loading: with CUDA's default lazy loading, a kernel's first use (the first
#     checkpoint's or evaluation's kernels, many steps in) loads its module, a device-wide
#     synchronization; while PipeDream-2BW's sends wait across a step boundary for receives the peer
#     has not posted yet, that synchronization can deadlock. Eager loading does it all at start-up;
#   - NCCL's channels connected when a communicator is made (NCCL 2.22 on connects them at first use):
#     their buffers are allocated at start-up (mesh.start_communicators uses every communicator once),
#     before the first step, instead of by a large collective mid-run, when memory is tightest.
GPU_ENVIRONMENT = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_MODULE_LOADING": "EAGER",
                   "NCCL_RUNTIME_CONNECT": "0"}


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class LaunchInfo:
    world_size: int
    rank: int
    local_rank: int
    launched: bool  # started by torchrun / accelerate (False: plain `python train.py`)
    mixed_precision: str | None = None  # accelerate launch's mixed_precision (None: not launched by it)


# accelerate's switches for engines that would take the model over, and the pipeline's own counterpart.
_FOREIGN_ENGINES = {
    "ACCELERATE_USE_FSDP": "FSDP (hf_asyncpp shards over dp itself: the fsdp config key)",
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}


def _accelerate_settings(env) -> str | None:
    """accelerate launch's mixed_precision; LaunchError for a setting the pipeline cannot honour."""
    for variable, engine in _FOREIGN_ENGINES.items():
        if env.get(variable, "").lower() in ("true", "1"):
            raise LaunchError(f"accelerate launch was configured for {engine}, which hf_asyncpp does not use; "
                              "remove it from the accelerate config")
    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "NO")
    if backend.upper() != "NO":
        raise LaunchError(f"accelerate launch was configured with dynamo_backend {backend}; hf_asyncpp compiles "
                          "each decoder layer itself: set dynamo_backend to no and compile_layers (torch_compile) instead")
    mixed = env.get("ACCELERATE_MIXED_PRECISION")
    return mixed.lower() if mixed else None


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


def _check_local_gpus(local_processes: int) -> None:
    """On a machine with GPUs each process of a node takes the GPU of its LOCAL_RANK (parallel/mesh.py)."""
    import torch

    if torch.cuda.is_available() and local_processes > torch.cuda.device_count():
        raise LaunchError(f"this node runs {local_processes} processes but has {torch.cuda.device_count()} GPU(s) "
                          "visible (CUDA_VISIBLE_DEVICES), one per process: launch at most that many processes per "
                          "node, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU with gloo.")


def read_launch() -> LaunchInfo:
    env = os.environ
    for name, value in GPU_ENVIRONMENT.items():
        env.setdefault(name, value)
    mixed_precision = _accelerate_settings(env)
    if "WORLD_SIZE" in env and "RANK" in env:
        local_rank = int(env.get("LOCAL_RANK", 0))
        # torchrun and accelerate say how many processes this node runs: every one of them, rank 0 too,
        # then refuses a node with too few GPUs (one error line, from rank 0).
        _check_local_gpus(int(env.get("LOCAL_WORLD_SIZE", local_rank + 1)))
        return LaunchInfo(int(env["WORLD_SIZE"]), int(env["RANK"]), local_rank, True, mixed_precision)
    if env.get("ACCELERATE_USE_CPU", "").lower() == "true" or "ACCELERATE_DYNAMO_BACKEND" in env:
        requested = _accelerate_requested_processes(_parent_cmdline())
        if requested and requested > 1:
            raise LaunchError(
                f"accelerate was asked for {requested} processes but started one without a distributed "
                "environment (its CPU modes --cpu / MULTI_CPU do this). Launch with "
                "`accelerate launch --config_file training_scripts/accelerate/cpu_2proc.yaml ...` "
                f"(or `--multi_gpu --num_processes {requested}`, which works on CPU too), or torchrun."
            )
    return LaunchInfo(1, 0, 0, False, mixed_precision)


