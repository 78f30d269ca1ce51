"""Tokenizers: the shipped BPE ("builtin") or an HF tokenizer directory, checked against the model."""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILTIN_TOKENIZER_DIR", "EOS_TOKEN", "check_tokenizer_source", "load_tokenizer"]

BUILTIN_TOKENIZER_DIR = Path(__file__).parents[1] / "assets" / "tokenizer"
EOS_TOKEN = "<|endoftext|>"


def check_tokenizer_source(tokenizer: str, model_vocab_size: int) -> None:
    path = BUILTIN_TOKENIZER_DIR if tokenizer == "builtin" else Path(tokenizer)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"tokenizer '{tokenizer}' is not a tokenizer directory ({path})")
    size = len(load_tokenizer(tokenizer))
    if size > model_vocab_size:
        raise ValueError(f"tokenizer '{tokenizer}' has {size} tokens but the model's vocab_size is {model_vocab_size}")


def load_tokenizer(tokenizer: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUILTIN_TOKENIZER_DIR if tokenizer == "builtin" else tokenizer))
