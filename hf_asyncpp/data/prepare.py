"""`hf-asyncpp prepare-data`: a corpus → pre-tokenized, packed parquet shards and a manifest.

The corpus (local files or a Hub dataset, read as a stream: it never has to fit in memory) is cut
into seq_len blocks by the one packing rule (packing.py: each document's tokens, an EOS, concatenated
and cut; the tail dropped), in order, and written as `shard-NNNNN.parquet` files of `input_ids` rows
beside `manifest.json` (source, tokenizer, vocabulary size, seq_len, counts). Training reads the
directory as a dataset of rows given as `input_ids`: no tokenizer and no network at training time,
and the same blocks as training on the corpus directly. Everything is written to a `.partial`
directory first and renamed when complete, so an interrupted preparation leaves nothing that looks
finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["MANIFEST", "prepare_data", "read_manifest"]

MANIFEST = "manifest.json"


def prepare_data(source: str, out_dir: str, tokenizer_name: str, seq_len: int, text_column: str = "text",
                 blocks_per_shard: int = 100_000, config_name: str | None = None, split: str = "train",
                 revision: str | None = None) -> dict:
    """Write the blocks of `source` under `out_dir`; returns the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .errors import DataError
    from .packing import BlockPacker
    from .sources import load_source, read_failure
    from .tokenizer import load_tokenizer

    out = Path(out_dir)
    if out.exists():
        raise DataError(f"{out} exists: prepare into a new directory (a finished one is never overwritten)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted preparation left
    partial.mkdir(parents=True)
    tokenizer = load_tokenizer(tokenizer_name)
    stream = load_source(source, config_name, split, streaming=True, revision=revision)
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    shards, n_blocks, pending = [], 0, []

    def flush() -> None:
        name = f"shard-{len(shards):05d}.parquet"
        pq.write_table(pa.table({"input_ids": pending}, schema=schema), partial / name)
        shards.append({"file": name, "blocks": len(pending)})
        pending.clear()

    try:
        for block in BlockPacker(tokenizer, seq_len, text_column).blocks(stream, f"dataset '{source}'"):
            pending.append(block)
            n_blocks += 1
            if len(pending) == blocks_per_shard:
                flush()
        if pending:
            flush()
        if not n_blocks:
            raise DataError(f"dataset '{source}' yields no block of {seq_len} tokens")
    except BaseException as err:  # a bad file, an interrupt: leave nothing behind
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, Exception):
            raise read_failure(source, err) from err
        raise
    manifest = dict(source=source, config_name=config_name, split=split, revision=revision, tokenizer=tokenizer_name,
                    vocab_size=len(tokenizer), seq_len=seq_len, text_column=text_column, blocks=n_blocks,
                    tokens=n_blocks * seq_len, shards=shards)
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(partial, out)
    return manifest


def read_manifest(dataset: str) -> dict | None:
    """The manifest of a prepared directory, or None for any other dataset."""
    path = Path(dataset) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None
