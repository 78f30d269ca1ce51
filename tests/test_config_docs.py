"""Every config key is described once, in its TrainConfig field, and shown from there: `train.py --help`
lists each key with its type, default and meaning, and docs/config.md holds the same keys as tables that
must match what `python -m hf_asyncpp.config_docs docs/config.md` generates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hf_asyncpp.config import TrainConfig
from hf_asyncpp.config_docs import (
    BEGIN_MARKER,
    END_MARKER,
    keys_reference,
    update_reference,
)
from hf_asyncpp.run import main

pytestmark = pytest.mark.repo

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
KEYS = [field.name for field in dataclasses.fields(TrainConfig)]


def test_every_key_has_a_one_line_meaning():
    for field in dataclasses.fields(TrainConfig):
        meaning = field.metadata.get("help", "")
        assert meaning.strip() and "\n" not in meaning, f"config key '{field.name}' needs help: _key(default, meaning)"


def test_train_py_help_lists_every_key_with_its_type_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # wrapping undone
    for key, line in [("seq_len", "--seq_len int (default: 128) tokens per sample"),
                      ("report_to", "--report_to list[str] (default: [tensorboard]) trackers"),
                      ("init_from", "--init_from str or none (default: none) an HF model directory")]:
        assert line in text, key
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name} " in text and " ".join(field.metadata["help"].split()) in text, field.name


def test_docs_config_md_is_generated_from_trainconfig():
    text = REFERENCE.read_text()
    generated = text.split(BEGIN_MARKER)[1].split(END_MARKER)[0].strip()
    assert generated == keys_reference(), (
        "docs/config.md is out of date: run python -m hf_asyncpp.config_docs docs/config.md")
    keys, aliases = generated.split("### TrainingArguments' names")
    rows = [line.split("|")[1].strip().strip("`") for line in keys.splitlines() if line.startswith("| `")]
    assert rows == KEYS  # every key once, in the dataclass's order
    from hf_asyncpp.config import ALIASES

    named = [line.split("|")[1].strip().strip("`") for line in aliases.splitlines() if line.startswith("| `")]
    assert named == list(ALIASES)  # then every TrainingArguments name the config takes


def test_regenerating_changes_only_the_part_between_the_markers(tmp_path, monkeypatch):
    page = tmp_path / "config.md"
    page.write_text(f"# prose kept\n\n{BEGIN_MARKER}\nstale\n{END_MARKER}\nmore prose\n")
    assert update_reference(page) is True
    assert update_reference(page) is False  # a second run finds it up to date
    text = page.read_text()
    assert text.startswith("# prose kept\n\n") and text.endswith(f"{END_MARKER}\nmore prose\n")
    assert "stale" not in text and "| `pp_size` | int | `2` |" in text
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="lacks the markers"):
        update_reference(page)


def test_the_trainers_pipeline_arguments_carry_the_keys_default_and_meaning():
    from hf_asyncpp.trainer_args import _PIPELINE_KEYS, AsyncPPTrainingArguments

    arguments = {field.name: field for field in dataclasses.fields(AsyncPPTrainingArguments)}
    keys = {field.name: field for field in dataclasses.fields(TrainConfig)}
    for name in _PIPELINE_KEYS:
        assert arguments[name].default == keys[name].default and arguments[name].metadata == keys[name].metadata
