"""The `hf-asyncpp` command line: one spelling of every option whichever separator it is typed with, the
config file positional or named, a version, and a mistyped command answered in one line."""

from __future__ import annotations

import pytest

from hf_asyncpp import __version__
from hf_asyncpp.cli import main

CONFIG = "training_scripts/configs/tiny_moe.yaml"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hf-asyncpp {__version__}"


def test_a_mistyped_command_is_one_line_with_the_nearest_one(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown command 'trian' (did you mean train?)")


def test_train_help_names_the_command_as_typed(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert capsys.readouterr().out.startswith("usage: hf-asyncpp train")


def test_train_takes_its_config_positional_or_named(monkeypatch):
    seen = []
    import hf_asyncpp.config as config

    original = config.load_config
    monkeypatch.setattr(config, "load_config", lambda path, overrides: seen.append((path, overrides)) or original(
        path, overrides + ["--max_steps", "0"]))  # refused right after: nothing runs
    for argv in (["train", CONFIG, "--seq_len", "32"], ["train", "--config", CONFIG, "--seq_len", "32"]):
        assert main(argv) == 2
    assert seen == [(CONFIG, ["--seq_len", "32"])] * 2


@pytest.mark.parametrize("spelling", ["--world-size", "--world_size"])
def test_plan_takes_either_separator_and_its_config_named_too(spelling, capsys):
    """A world size the pipeline does not divide: refused in one line before anything is played."""
    for argv in (["plan", CONFIG, spelling, "3"], ["plan", "--config", CONFIG, spelling, "3"]):
        assert main(argv) == 2
        assert "--world-size 3 is not a multiple of pp_size 2" in capsys.readouterr().err
