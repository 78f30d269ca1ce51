"""The configs in training_scripts/configs/ validate at the world size they are written for, and the 2B and
10B MoE configs describe the models their headers, README.md and training_scripts/models/README.md advertise.

The scale configs name files their header tells the user to prepare with Hub access (the SmolLM2 tokenizer,
a held-out parquet file): stand-ins replace them here — the shipped tokenizer, a one-row file. Their
training set is a Hub dataset id, which validation only parses (`check_dataset_source` never contacts the
Hub), so it is checked as written with HF_HUB_OFFLINE lifted for validation alone; huggingface_hub itself
stays offline (it read the variable at import), so nothing can reach the network.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_asyncpp.config import load_config, validate_config
from hf_asyncpp.hub import parameter_counts

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "training_scripts" / "configs").glob("*.yaml"))


@dataclass(frozen=True)
class Advertised:
    world_size: int  # the launch the config is written for (its accelerate config's process count)
    total: str  # parameters, as the docs print them
    active: str  # parameters active per token


SCALE = {"moe_2b.yaml": Advertised(8, "2.04B", "0.45B"), "moe_10b.yaml": Advertised(32, "10.12B", "1.66B")}
TOKENS_PER_PARAMETER = 20  # the study's budget, which max_steps is sized to
TOLERANCE = 0.03


def _billions(text: str) -> float:
    return float(text.removesuffix("B")) * 1e9


def _with_stand_ins(config, tmp_path):
    """The config with the files a user prepares replaced by stand-ins when they are not there."""
    if config.tokenizer != "builtin" and not os.path.isdir(config.tokenizer):
        config.tokenizer = "builtin"
    if config.eval_dataset is not None and not os.path.exists(config.eval_dataset):
        held_out = tmp_path / "held_out.jsonl"
        held_out.write_text('{"text": "a held-out document"}\n')
        config.eval_dataset = str(held_out)
    return config


def _validated(path: Path, tmp_path, monkeypatch):
    """(config, HF model config) for a shipped YAML, validated at its world size from the repository root."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE  # read at import, before the variable is lifted below: the client stays offline
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # for hf_asyncpp's own check, which reads it at call time
    config = _with_stand_ins(load_config(str(path)), tmp_path)
    advertised = SCALE.get(path.name)
    return config, validate_config(config, advertised.world_size if advertised else 2)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path, tmp_path, monkeypatch):
    config, _ = _validated(path, tmp_path, monkeypatch)
    assert config.model_config and config.output_dir.startswith("outputs/")


@pytest.mark.parametrize("name", sorted(SCALE))
def test_a_scale_config_builds_the_model_it_advertises(name, tmp_path, monkeypatch):
    path = REPO / "training_scripts" / "configs" / name
    advertised = SCALE[name]
    config, model_config = _validated(path, tmp_path, monkeypatch)
    total, active = parameter_counts(model_config)  # a meta-device build: nothing is allocated
    assert total == pytest.approx(_billions(advertised.total), rel=TOLERANCE)
    assert active == pytest.approx(_billions(advertised.active), rel=TOLERANCE)

    assert model_config.model_type == "qwen3_moe" and not model_config.tie_word_embeddings
    assert (config.schedule, config.optimizer, config.ef, config.seq_len) == ("pipedream-2bw", "muon", True, 2048)
    dp_size = advertised.world_size // config.pp_size
    tokens = config.max_steps * config.rows_per_step * dp_size * config.seq_len
    assert tokens == pytest.approx(TOKENS_PER_PARAMETER * total, rel=TOLERANCE)

    docs = {"its header": path.read_text(), "README.md": (REPO / "README.md").read_text(),
            "training_scripts/models/README.md": (REPO / "training_scripts" / "models" / "README.md").read_text()}
    for where, text in docs.items():
        assert advertised.total in text and advertised.active in text, f"{name}: counts not stated in {where}"
