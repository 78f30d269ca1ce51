"""What a user installs is the wheel: it must carry every module and data file of the package, and
the model card template, which lives at the top of the repository (model_cards/) and which setup.py
ships inside the package.

`find_packages` (setup.py) only picks up folders with an `__init__.py`; a package folder without one (it
happened to hf_asyncpp/parallel) imports fine from a checkout and is silently missing from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parent.parent

# Run from the installed wheel: the card of a one-step run, written by the export's writer.
_EXPORT_A_CARD = """
import json, sys
from pathlib import Path
import hf_asyncpp, hf_asyncpp.hub as hub
from hf_asyncpp.checkpoint.hf_export import write_model_files
from hf_asyncpp.config import TrainConfig
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.schedules import get_schedule_spec

config, model_config = TrainConfig(), build_config("tiny-moe")
card = hub.run_model_card(config, model_config, (1, 1), get_schedule_spec(config.schedule), {"step": 1})
out = Path(sys.argv[1])
out.mkdir()
write_model_files(out, model_config, None, model_card=card)
print(json.dumps({"package": hf_asyncpp.__file__, "template": str(hub.TEMPLATE)}))
"""


def _tracked(*paths: str) -> list[str]:
    return subprocess.run(["git", "ls-files", *paths], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: a build/ folder left by an earlier build would lend the wheel its stale files.
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = (tmp / "dist").glob("hf_asyncpp-*.whl")
    return built


def test_the_wheel_carries_every_module_and_data_file(wheel):
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    shipped = [f for f in _tracked("hf_asyncpp") if f.endswith((".py", ".json", ".md"))]
    assert shipped, "git lists no package files"
    cards = _tracked("model_cards")
    assert "model_cards/template.md" in cards
    # model_cards/ (the template, its guide, the example card) ships as hf_asyncpp/model_cards/
    shipped += [f"hf_asyncpp/{f}" for f in cards if f.endswith(".md")]
    missing = sorted(set(shipped) - in_wheel)
    assert not missing, f"not in the wheel: {missing}"


def test_the_installed_wheel_reads_its_own_template_and_its_export_writes_the_card(wheel, tmp_path):
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.hub import run_model_card
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.schedules import get_schedule_spec

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # Outside the checkout, with only the installed copy ahead of the environment's packages.
    done = subprocess.run([sys.executable, "-c", _EXPORT_A_CARD, str(tmp_path / "final")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(read["package"]).resolve().is_relative_to(site.resolve())
    assert read["template"] == str(site.resolve() / "hf_asyncpp" / "model_cards" / "template.md")
    config, model_config = TrainConfig(), build_config("tiny-moe")
    card = run_model_card(config, model_config, (1, 1), get_schedule_spec(config.schedule), {"step": 1})
    assert (tmp_path / "final" / "README.md").read_text() == card
