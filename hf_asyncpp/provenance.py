"""What produced a result: the numerics it ran with, the versions of the software that ran and, from a
git checkout, its commit.

A study runs in parts, possibly at several commits and on several machines (docs/studies.md); each
finished arm's record carries these, so a number can be traced to the code that produced it, and a study
reruns the arms whose numerics are not this code's. The model card of an export states the same versions.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

__all__ = ["NUMERICS", "machine", "software_versions", "source_commit"]

PACKAGE_DIR = Path(__file__).resolve().parent

# The numerics a training run computes with, named by the date they last changed. Any change that moves a
# run's values, even by rounding (an operation's order, a kernel, a default, a schedule's shape), gives it a
# new name in the same commit: a study then reruns the arms finished under the old one instead of mixing
# them with new ones, and its report leaves them out. tests/test_numerics.py pins the losses of short runs
# under this name, so a change that moves them fails there until the name moves too.
NUMERICS = "2026-12-05"


def software_versions() -> dict[str, str]:
    import torch
    import transformers

    import hf_asyncpp

    return {"hf_asyncpp": hf_asyncpp.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "python": platform.python_version()}


def machine() -> dict:
    """The processor (its model name where Linux tells it), the vector instructions torch's CPU kernels
    dispatch to on it (AVX2, AVX512, …: two machines sold under one model name can differ, and their runs
    then round differently) and how many cores the process may use."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": name, "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def source_commit(path: Path = PACKAGE_DIR) -> str | None:
    """The commit of the git checkout holding `path`, suffixed "+modified" when tracked files under
    `path` differ from it; None where there is none (an installed wheel) or git is missing."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=True,
                              timeout=30, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        modified = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+modified" if modified else "")
