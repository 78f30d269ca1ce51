"""What a user installs is the wheel: built from the files git knows, installed (not editable) in a fresh
virtual environment, and used from a folder outside the repository. It must carry every module and data
file of the package and the model card template, which lives at the top of the repository (model_cards/)
and which setup.py ships inside the package; and from there a short training saves a checkpoint and its
export, `hf-asyncpp export` exports the checkpoint, and transformers loads both.

`find_packages` (setup.py) only picks up folders with an `__init__.py`; a package folder without one (it
happened to hf_asyncpp/parallel) imports fine from a checkout and is silently missing from the wheel.
Offline and fast: the environment sees the dependencies already installed (--system-site-packages) and
pip never reaches an index.
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

# Run in the wheel's environment: imported from there, with every requirement the wheel declares met.
_IMPORTED_FROM_THE_ENVIRONMENT = """
import json, sys
from importlib.metadata import distribution
from pathlib import Path
from packaging.requirements import Requirement
import hf_asyncpp

unmet = []
for line in distribution("hf-asyncpp").requires or []:
    requirement = Requirement(line)
    if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
        found = distribution(requirement.name).version
        if not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{requirement}: {found} installed")
print(json.dumps({"package": hf_asyncpp.__file__, "prefix": sys.prefix, "unmet": unmet,
                  "metric": str(Path(hf_asyncpp.PERPLEXITY_METRIC_PATH) / "pipeline_perplexity.py")}))
"""

# The card of a one-step run, written by the export's writer.
_EXPORT_A_CARD = """
import json, sys
from pathlib import Path
import hf_asyncpp.hub as hub
from hf_asyncpp.checkpoint.hf_export import write_model_files
from hf_asyncpp.config import TrainConfig
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.schedules import get_schedule_spec

config, model_config = TrainConfig(), build_config("tiny-moe")
card = hub.run_model_card(config, model_config, (1, 1), get_schedule_spec(config.schedule), {"step": 1})
out = Path(sys.argv[1])
out.mkdir()
write_model_files(out, model_config, None, model_card=card)
print(json.dumps({"template": str(hub.TEMPLATE)}))
"""

# Both directories of a run load with plain transformers; the bf16 export is the run's fp32 export in bf16.
_LOAD_WITH_TRANSFORMERS = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState

TrainerState.load_from_json("run/checkpoint-2/trainer_state.json")
probe = AutoTokenizer.from_pretrained("exported")("To be, or not to be", return_tensors="pt").input_ids
assert AutoTokenizer.from_pretrained("run/final")("To be, or not to be", return_tensors="pt").input_ids.equal(probe)
logits = {}
for name, load in {"run/final": dict(dtype=torch.bfloat16), "exported": {}}.items():
    model = AutoModelForCausalLM.from_pretrained(name, **load).eval()
    with torch.no_grad():
        logits[name] = model(probe).logits
assert logits["exported"].dtype == torch.bfloat16 and torch.equal(logits["exported"], logits["run/final"])
for card in ("run/final/README.md", "exported/README.md"):
    assert open(card).read().startswith("---\\n"), card
"""


def _tracked(*paths: str, others: bool = False) -> list[str]:
    flags = ["--cached", "--others", "--exclude-standard"] if others else []
    return subprocess.run(["git", "ls-files", *flags, *paths], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from the files git knows: a build/ folder of an earlier build would lend the wheel stale files.
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    for name in _tracked(others=True):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (built,) = (tmp / "dist").glob("hf_asyncpp-*.whl")
    return built


@pytest.fixture(scope="module")
def environment(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel: its bin/ folder."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--force-reinstall", str(wheel)], check=True, capture_output=True, timeout=300)
    return venv / "bin"


def _run(argv, cwd: Path) -> str:
    """argv from `cwd`, outside the checkout and with nothing of it on the path: its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv[:3]}: {done.stdout[-1500:]}\n{done.stderr[-3000:]}"
    return done.stdout


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


def test_the_package_is_imported_from_the_environment_with_its_requirements_met(environment, tmp_path):
    read = json.loads(_run([environment / "python", "-c", _IMPORTED_FROM_THE_ENVIRONMENT], tmp_path).splitlines()[-1])
    assert read["package"].startswith(read["prefix"]), read
    assert not read["unmet"]
    # The evaluate metric is a folder of data, not a package: it must ship all the same.
    assert Path(read["metric"]).is_file() and read["metric"].startswith(read["prefix"])


def test_the_installed_wheel_reads_its_own_template_and_its_export_writes_the_card(environment, tmp_path):
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.hub import run_model_card
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.schedules import get_schedule_spec

    read = json.loads(_run([environment / "python", "-c", _EXPORT_A_CARD, tmp_path / "final"], tmp_path)
                      .splitlines()[-1])
    assert read["template"].startswith(str(environment.parent)) and read["template"].endswith(
        "hf_asyncpp/model_cards/template.md")
    config, model_config = TrainConfig(), build_config("tiny-moe")
    card = run_model_card(config, model_config, (1, 1), get_schedule_spec(config.schedule), {"step": 1})
    assert (tmp_path / "final" / "README.md").read_text() == card


def test_the_installed_cli_trains_and_exports_what_transformers_loads(environment, tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "corpus.txt")  # any text: the built-in tokenizer packs it
    _run([environment / "hf-asyncpp", "train", "--model_config", "tiny-moe", "--dataset", "corpus.txt",
          "--seq_len", "32", "--micro_batch_size", "2", "--n_microbatches", "2", "--max_steps", "2",
          "--save_steps", "2", "--output_dir", "run", "--report_to", "none"], tmp_path)
    _run([environment / "hf-asyncpp", "export", "run/checkpoint-2", "exported", "--dtype", "bf16"], tmp_path)
    _run([environment / "python", "-c", _LOAD_WITH_TRANSFORMERS], tmp_path)
