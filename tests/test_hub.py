"""Model card and Hub upload.

The card is rendered from model_cards/template.md through huggingface_hub's ModelCard;
its YAML metadata must parse and carry the model-index, the license and language the config names,
and base_model when the run started from a Hub model. `hf-asyncpp push` runs the real huggingface_hub client
in a subprocess against a loopback server (HF_ENDPOINT) that plays the Hub: the server must receive
every file of the export, the token must reach it in the Authorization header and appear nowhere
else, and a failed upload must report the error and leave the local files as they were.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.hub_server import LoopbackHub

TOKEN = "hf_loopbackTestTokenThatMustNeverLeak"


def _facts(data_description=None, **overrides):
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.hub import model_card_facts
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.schedules import get_schedule_spec

    config = TrainConfig(**{**dict(schedule="pipedream-2bw", optimizer="muon", ef=True, ef_lambda=0.5, momentum=0.95),
                            **overrides})
    record = {"step": 200, "num_input_tokens_seen": 819200, "train_tokens_per_second": 6123.4, "idle_fraction_per_rank": [0.45, 0.031],
              "weight_version_age_per_stage": [1, 1]}
    return model_card_facts(config, build_config("tiny-moe"), (2, 2), record, get_schedule_spec(config.schedule),
                            data_description=data_description)


def _metadata(card) -> dict:
    return yaml.safe_load(card.content.split("---")[1])


def test_the_card_states_how_the_model_was_made_and_its_metadata_parses():
    from huggingface_hub import EvalResult

    from hf_asyncpp.hub import render_model_card

    result = EvalResult(task_type="text-generation", dataset_type="text", dataset_name="Shakespeare",
                        dataset_split="validation", metric_type="perplexity", metric_value=321.5)
    card = render_model_card(_facts(), "tiny-moe-2bw", eval_results=[result])
    metadata = _metadata(card)
    assert metadata["license"] == "apache-2.0" and metadata["library_name"] == "transformers"
    assert metadata["model-index"][0]["results"][0]["metrics"][0]["value"] == 321.5
    text = card.content
    for fact in ("`pipedream-2bw`", "pp = 2 × dp = 2, FSDP2 over dp", "muon", "momentum 0.95", "λ = 0.5",
                 "200 steps, 819200 tokens", "6123 tokens/s", "0.450, 0.031", "8 (top-2)", "3.87M",
                 "extrapolated point", "CC BY 2.5", "from_pretrained", "from scratch"):
        assert fact in text, fact
    assert "fine-tuned" not in text


def test_the_card_names_the_weights_it_started_from_and_the_configs_license_and_language(tmp_path):
    """init_from a Hub id is the metadata's base_model (as transformers' Trainer writes it); a local
    directory is no Hub reference, so it is named in the text only. Neither is "from scratch"."""
    from hf_asyncpp.hub import render_model_card

    default = render_model_card(_facts(), "tiny")
    assert _metadata(default)["license"] == "apache-2.0" and _metadata(default)["language"] == ["en"]
    assert "base_model" not in _metadata(default) and "pretrained from scratch" in default.content

    hub = render_model_card(_facts(init_from="someone/base-moe", license="mit", language=["en", "fr"]), "tiny")
    metadata = _metadata(hub)
    assert metadata["base_model"] == "someone/base-moe"
    assert metadata["license"] == "mit" and metadata["language"] == ["en", "fr"]
    assert "from the weights of [someone/base-moe](https://huggingface.co/someone/base-moe)" in hub.content
    assert "from scratch" not in hub.content

    local = render_model_card(_facts(init_from=str(tmp_path)), "tiny")
    assert "base_model" not in _metadata(local)
    assert f"from the weights of the local model directory `{tmp_path}`" in local.content
    assert "from scratch" not in local.content


def test_a_synchronous_card_does_not_talk_of_weight_versions():
    from hf_asyncpp.hub import render_model_card

    card = render_model_card(_facts(schedule="1f1b"), "tiny-moe-1f1b")
    assert "synchronous schedule `1f1b`" in card.content and "update(s) old" not in card.content


def test_a_hub_dataset_is_named_linked_and_listed_in_the_metadata():
    from huggingface_hub import EvalResult

    from hf_asyncpp.hub import render_model_card

    facts = _facts(dataset="HuggingFaceFW/fineweb-edu", dataset_config_name="sample-100BT", streaming=True)
    result = EvalResult(task_type="text-generation", dataset_type="text", dataset_name=facts["data"]["name"],
                        dataset_split="validation", metric_type="loss", metric_value=2.5)
    card = render_model_card(facts, "moe-2b", eval_results=[result])
    metadata = _metadata(card)
    assert metadata["datasets"] == ["HuggingFaceFW/fineweb-edu"]
    assert metadata["model-index"][0]["results"][0]["dataset"]["name"] == "HuggingFaceFW/fineweb-edu"
    assert "[HuggingFaceFW/fineweb-edu](https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu)" in card.content
    assert "configuration `sample-100BT`, split `train`, streamed" in card.content
    assert "Shakespeare" not in card.content and "Local data" not in card.content


def test_local_data_and_the_offline_corpus_list_no_hub_dataset(tmp_path):
    from hf_asyncpp.hub import render_model_card

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a b c"}\n')
    for facts in (_facts(), _facts(dataset=str(corpus))):
        assert "datasets" not in _metadata(render_model_card(facts, "tiny"))
    assert f"Local data: `{corpus}`." in render_model_card(_facts(dataset=str(corpus)), "tiny").content


def test_a_front_end_description_replaces_the_one_from_config_dataset():
    """An in-memory front end leaves config.dataset at its default; its own words describe the data."""
    from hf_asyncpp.hub import render_model_card

    described = "12,000 support tickets (in-house, not public), deduplicated.\nCollected 2025."
    facts = _facts(data_description=described)
    assert facts["data"]["name"] == "12,000 support tickets (in-house, not public), deduplicated."
    card = render_model_card(facts, "tiny")
    assert described in card.content and "Shakespeare" not in card.content
    assert "datasets" not in _metadata(card)
    hub_described = render_model_card(_facts(data_description="my rows", dataset="someone/corpus"), "tiny")
    assert "my rows" in hub_described.content and "datasets" not in _metadata(hub_described)


def _export(tmp_path):
    """A small exported model directory, as train.py writes it."""
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.hub import render_model_card
    from hf_asyncpp.models.presets import build_config

    out = tmp_path / "final"
    AutoModelForCausalLM.from_config(build_config("tiny-moe", num_hidden_layers=1)).save_pretrained(out)
    render_model_card(_facts(), "tiny").save(out / "README.md")
    return out


def _push(folder, repo_id, hub):
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN,
           "HF_HUB_DISABLE_XET": "1"}
    return subprocess.run([sys.executable, "-m", "hf_asyncpp.cli", "push", str(folder), repo_id],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.launch
def test_push_uploads_the_export_and_its_card_and_never_shows_the_token(tmp_path):
    out = _export(tmp_path)
    with LoopbackHub() as hub:
        done = _push(out, "someone/tiny", hub)
    assert done.returncode == 0, done.stderr
    files = hub.received["someone/tiny"]
    assert set(files) == {p.name for p in out.iterdir()}
    assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()
    assert _metadata_from_bytes(files["README.md"])["license"] == "apache-2.0"
    assert any(h.get("authorization") == f"Bearer {TOKEN}" or h.get("Authorization") == f"Bearer {TOKEN}"
               for _, _, h in hub.requests)
    assert TOKEN not in done.stdout + done.stderr
    assert all(TOKEN.encode() not in p.read_bytes() for p in out.iterdir())


def _metadata_from_bytes(readme: bytes) -> dict:
    return yaml.safe_load(readme.decode().split("---")[1])


@pytest.mark.launch
def test_a_failed_upload_reports_the_error_and_keeps_the_local_files(tmp_path):
    out = _export(tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with LoopbackHub() as hub:
        hub.fail_commits = True
        done = _push(out, "someone/tiny", hub)
    assert done.returncode == 1
    assert "error:" in done.stderr and "500" in done.stderr and TOKEN not in done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.launch
def test_train_py_writes_the_card_and_pushes_the_export(tmp_path):
    """train.py with push_to_hub: the card lands in final/README.md and on the (loopback) Hub beside the
    weights, on the branch hub_revision of a repository created private; the token is in no file the
    run wrote."""
    out = tmp_path / "run"
    command = [sys.executable, "training_scripts/train.py", "--config", "training_scripts/configs/tiny_moe.yaml",
               "--max_steps", "2", "--seq_len", "32", "--micro_batch_size", "2", "--eval_fraction", "0",
               "--output_dir", str(out),
               "--push_to_hub", "true", "--hub_model_id", "someone/tiny-moe", "--hub_revision", "dev",
               "--hub_private_repo", "true"]
    with LoopbackHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN,
               "HF_HUB_DISABLE_XET": "1"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    card = (out / "final" / "README.md").read_text()
    assert "pp = 1 × dp = 1" in card and "someone/tiny-moe" in card
    files = hub.received["someone/tiny-moe"]
    assert [(repo, branch) for repo, branch, _ in hub.commits] == [("someone/tiny-moe", "dev")]
    assert hub.created["someone/tiny-moe"]["visibility"] == "private"
    assert files["README.md"].decode() == card and "model.safetensors" in files and "tokenizer.json" in files
    written = [p for p in out.rglob("*") if p.is_file()]
    assert written and all(TOKEN.encode() not in p.read_bytes() for p in written)
    assert TOKEN not in done.stdout + done.stderr
