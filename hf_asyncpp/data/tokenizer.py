"""Tokenizers: the model's own by default, the shipped BPE ("builtin"), an HF tokenizer directory or a
Hub id; checked against the model's vocabulary before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BUILTIN_TOKENIZER_DIR", "EOS_TOKEN", "check_tokenizer_source", "load_tokenizer", "model_tokenizer_source"]

BUILTIN_TOKENIZER_DIR = Path(__file__).parents[1] / "assets" / "tokenizer"
EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _is_tokenizer_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def model_tokenizer_source(tokenizer: str | None, init_from: str | None, model_config: str, presets) -> str:
    """The tokenizer a run uses: `tokenizer` when given; otherwise the model's, as HF ships a tokenizer
    with its model: init_from's, else model_config's (a model directory, a config.json's folder, or a
    Hub id); `builtin` (the shipped BPE) for the built-in presets. A model directory without tokenizer
    files is refused: guessing would train on another tokenization without a word."""
    if tokenizer is not None:
        return tokenizer
    source = init_from or model_config
    if init_from is None and model_config in presets:
        return "builtin"
    folder = Path(source).parent if os.path.isfile(source) else Path(source)
    if folder.is_dir():
        if not _is_tokenizer_dir(folder):
            key = "init_from" if init_from else "model_config"
            raise FileNotFoundError(
                f"{key} '{source}' has no tokenizer beside it ({folder} holds none of {', '.join(TOKENIZER_FILES)}), and "
                "`tokenizer` is not set: set it to the tokenizer the model was built for (a directory, a Hub id, or "
                "`builtin` for the shipped 8192-token BPE)")
        return str(folder)
    return source  # a Hub id: its tokenizer comes with it


def check_tokenizer_source(tokenizer: str, model_vocab_size: int) -> int:
    """The tokenizer's size, after checking it loads and fits the model's vocabulary (a tokenizer with
    fewer ids than the model's embedding, a padded vocabulary, is fine)."""
    from .sources import hub_offline, is_hub_id

    path = BUILTIN_TOKENIZER_DIR if tokenizer == "builtin" else Path(tokenizer)
    if not path.is_dir() and not (is_hub_id(tokenizer) and not hub_offline()):
        raise FileNotFoundError(f"tokenizer '{tokenizer}' is neither `builtin`, a tokenizer directory, nor a Hub id "
                                "(namespace/name) with the Hub online")
    if path.is_dir() and not _is_tokenizer_dir(path):
        raise FileNotFoundError(f"tokenizer '{tokenizer}' is not a tokenizer directory ({path} holds none of "
                                f"{', '.join(TOKENIZER_FILES)})")
    try:
        size = len(load_tokenizer(tokenizer))
    except OSError as err:  # a Hub id that does not exist, or no network
        raise FileNotFoundError(f"tokenizer '{tokenizer}' could not be loaded: {str(err).splitlines()[0]}") from None
    if size > model_vocab_size:
        raise ValueError(f"tokenizer '{tokenizer}' has {size} tokens but the model's vocab_size is {model_vocab_size}")
    return size


def load_tokenizer(tokenizer: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUILTIN_TOKENIZER_DIR if tokenizer == "builtin" else tokenizer))
