"""What a user installs is the wheel: it must carry every module and data file of the package.

`packages = find:` only picks up folders with an `__init__.py`; a package folder without one (it
happened to hf_asyncpp/parallel) imports fine from a checkout and is silently missing from the wheel.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_module_and_data_file(tmp_path):
    # Built from a copy: a build/ folder left by an earlier build would lend the wheel its stale files.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("hf_asyncpp-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "hf_asyncpp"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    shipped = [f for f in tracked if f.endswith((".py", ".json", ".md"))]  # .md: the model card template
    assert shipped, "git lists no package files"
    missing = sorted(set(shipped) - in_wheel)
    assert not missing, f"not in the wheel: {missing}"
