"""The tokenizer follows the model, as HF ships one with the other: a run that names none uses init_from's,
else model_config's, and the shipped BPE only for the built-in presets; a model directory without one is
refused in one line instead of being trained on another tokenization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_asyncpp.config import ConfigError, TrainConfig
from hf_asyncpp.config_checks import validate_config
from hf_asyncpp.data import check_tokenizer_source, load_tokenizer, model_tokenizer_source
from hf_asyncpp.models.presets import PRESETS
from tests.test_engine import small_model_config

REPO = Path(__file__).resolve().parents[2]
OWN_TOKENIZER = REPO / "training_scripts" / "models" / "moe_cpu_1m"  # a 2048-id BPE, not the built-in one


def _model_dir(path: Path, vocab_size: int, tokenizer: Path | None = OWN_TOKENIZER, weights: bool = False) -> Path:
    from transformers import AutoModelForCausalLM

    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = vocab_size
    (AutoModelForCausalLM.from_config(config) if weights else config).save_pretrained(path)
    if tokenizer is not None:
        load_tokenizer(str(tokenizer)).save_pretrained(path)
    return path


def test_a_preset_uses_the_shipped_bpe_and_a_named_tokenizer_is_kept():
    assert model_tokenizer_source(None, None, "tiny-moe", PRESETS) == "builtin"
    assert model_tokenizer_source("some/tokenizer", "a/model", "tiny-moe", PRESETS) == "some/tokenizer"


def test_the_model_s_own_directory_gives_the_tokenizer_init_from_first(tmp_path):
    start, layout = _model_dir(tmp_path / "start", 2048), _model_dir(tmp_path / "layout", 2048)
    assert model_tokenizer_source(None, str(start), str(layout), PRESETS) == str(start)
    assert model_tokenizer_source(None, None, str(layout), PRESETS) == str(layout)
    assert model_tokenizer_source(None, None, str(layout / "config.json"), PRESETS) == str(layout)  # its folder
    assert model_tokenizer_source(None, None, "Qwen/Qwen3-30B-A3B", PRESETS) == "Qwen/Qwen3-30B-A3B"  # with it


def test_a_model_directory_without_a_tokenizer_is_refused_with_what_to_set(tmp_path):
    bare = _model_dir(tmp_path / "bare", 8192, tokenizer=None)
    with pytest.raises(FileNotFoundError, match="has no tokenizer beside it .* set it to the tokenizer the model "
                                                "was built for"):
        model_tokenizer_source(None, None, str(bare), PRESETS)
    config = TrainConfig(model_config=str(bare), pp_size=1)
    with pytest.raises(ConfigError, match="`tokenizer` is not set"):
        validate_config(config, world_size=1)
    config = TrainConfig(model_config=str(bare), pp_size=1, tokenizer="builtin")  # said, it is used
    validate_config(config, world_size=1)
    assert config.tokenizer == "builtin"


def test_a_padded_vocabulary_takes_a_smaller_tokenizer_a_larger_one_is_refused(tmp_path):
    assert check_tokenizer_source(str(OWN_TOKENIZER), 4096) == 2048  # an embedding padded past the tokenizer
    with pytest.raises(ValueError, match="has 2048 tokens but the model's vocab_size is 1024"):
        check_tokenizer_source(str(OWN_TOKENIZER), 1024)


def test_a_hub_tokenizer_needs_the_hub_and_a_directory_needs_tokenizer_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="neither `builtin`, a tokenizer directory, nor a Hub id"):
        check_tokenizer_source("Qwen/Qwen3-30B-A3B", 200_000)
    with pytest.raises(FileNotFoundError, match="is not a tokenizer directory"):
        check_tokenizer_source(str(tmp_path), 8192)


@pytest.mark.multirank  # a train.py process
def test_a_run_from_a_model_directory_trains_on_its_tokenizer_and_exports_it(tmp_path):
    """The acceptance run: init_from a local model directory holding its own tokenizer, a local text jsonl,
    no `tokenizer` key: the text is tokenized with the model's tokenizer, and the export carries it."""
    start = _model_dir(tmp_path / "start", 2048, weights=True)
    lines = [{"text": f"Shall I compare thee to a summer's day? verse {i}, thou art more lovely."} for i in range(200)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "training_scripts/train.py", "--init_from", str(start), "--dataset",
                           str(tmp_path / "text.jsonl"), "--seq_len", "16", "--micro_batch_size", "2",
                           "--n_microbatches", "2", "--max_steps", "2", "--eval_fraction", "0", "--report_to", "none",
                           "--output_dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    # The built-in BPE's 8192 ids would not even fit this model's 2048: the run used the model's own.
    assert done.returncode == 0, done.stderr[-3000:]
    exported = load_tokenizer(str(out / "final"))
    assert len(exported) == 2048 and exported.get_vocab() == load_tokenizer(str(OWN_TOKENIZER)).get_vocab()
