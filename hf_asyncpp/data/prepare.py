"""`hf-asyncpp prepare-data`: a corpus → pre-tokenized, packed Arrow shards and a manifest.

The corpus (local files or a Hub dataset, read as a stream: it never has to fit in memory) is cut
into seq_len blocks by the one packing rule (packing.py: each document's tokens, an EOS, concatenated
and cut; the tail dropped), in order, and written as `shard-NNNNN.arrow` files (Arrow IPC streams,
what `datasets` caches in, loadable with `load_dataset("arrow", ...)`) of fixed-length `input_ids`
rows, each with its `hash` (packing.block_hashes: what an eval set is checked against), beside
`manifest.json` (source, tokenizer, vocabulary size, seq_len, counts). Training maps the
shards into memory (prepared.py: no copy, no tokenizer, no network) and reads the same blocks as
training on the corpus directly.

It runs in two parallel passes over `num_proc` processes. First each of the source's files (its
stream shards, in order) is tokenized into a flat file of token ids; then the output shards are
cut from those files read as one stream, each written by whichever process is free. Shard k holds
blocks [k·B, (k+1)·B) whatever the parallelism, so any `num_proc` writes the same shards. With
`max_tokens` only the first max_tokens tokens are kept, and files beyond those are not tokenized
(at most num_proc − 1 files are read in vain). Everything is written to a `.partial` directory
first and renamed when complete, so an interrupted preparation leaves nothing that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from .prepared import MANIFEST

__all__ = ["prepare_data"]


@dataclass(frozen=True)
class _Corpus:
    """What a worker process needs to read and tokenize one file of the corpus."""

    source: str
    config_name: str | None
    split: str
    revision: str | None
    tokenizer: str
    seq_len: int
    text_column: str

    def stream(self):
        from .sources import load_source

        return load_source(self.source, self.config_name, self.split, streaming=True, revision=self.revision)


def prepare_data(source: str, out_dir: str, tokenizer_name: str, seq_len: int, text_column: str = "text",
                 blocks_per_shard: int = 100_000, config_name: str | None = None, split: str = "train",
                 revision: str | None = None, num_proc: int = 1, max_tokens: int | None = None) -> dict:
    """Write the blocks of `source` under `out_dir`; returns the manifest."""
    from .errors import DataError
    from .sources import read_failure
    from .tokenizer import load_tokenizer

    if num_proc < 1 or blocks_per_shard < 1 or (max_tokens is not None and max_tokens < seq_len):
        raise DataError(f"num_proc and blocks_per_shard must be at least 1, and max_tokens at least seq_len "
                        f"({seq_len}); got {num_proc}, {blocks_per_shard}, {max_tokens}")
    out = Path(out_dir)
    if out.exists():
        raise DataError(f"{out} exists: prepare into a new directory (a finished one is never overwritten)")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted preparation left
    partial.mkdir(parents=True)
    corpus = _Corpus(source, config_name, split, revision, tokenizer_name, seq_len, text_column)
    try:
        vocab_size = len(load_tokenizer(tokenizer_name))
        with _workers(num_proc) as pool:
            parts = _tokenize_files(pool, corpus, partial, num_proc, max_tokens)
            n_tokens = sum(n for _, n in parts) if max_tokens is None else min(max_tokens, sum(n for _, n in parts))
            n_blocks = n_tokens // seq_len
            if not n_blocks:
                raise DataError(f"dataset '{source}' yields no block of {seq_len} tokens")
            cuts = [(k, k * blocks_per_shard, min(blocks_per_shard, n_blocks - k * blocks_per_shard))
                    for k in range(-(-n_blocks // blocks_per_shard))]
            shards = [f.result() for f in [pool.submit(_write_shard, partial, parts, seq_len, *cut) for cut in cuts]]
        for path, _ in parts:
            os.remove(path)
    except BaseException as err:  # a bad file, an interrupt: leave nothing behind
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, Exception):
            raise read_failure(source, err) from err
        raise
    manifest = dict(source=source, config_name=config_name, split=split, revision=revision, tokenizer=tokenizer_name,
                    vocab_size=vocab_size, seq_len=seq_len, text_column=text_column, max_tokens=max_tokens,
                    blocks=n_blocks, tokens=n_blocks * seq_len, shards=shards)
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(partial, out)
    return manifest


def _tokenize_files(pool, corpus: _Corpus, partial: Path, num_proc: int, max_tokens: int | None
                    ) -> list[tuple[str, int]]:
    """(token file, tokens) of the corpus's files in order — all of them, or the first ones that
    hold max_tokens. At most num_proc files are tokenized at once."""
    n_files = corpus.stream().num_shards
    running: dict[Future, int] = {}
    counts: dict[int, int] = {}
    prefix, prefix_tokens, next_file = 0, 0, 0  # files 0 … prefix − 1 are done: prefix_tokens tokens
    while True:
        while next_file < n_files and len(running) < num_proc and (max_tokens is None or prefix_tokens < max_tokens):
            path = str(partial / f"tokens-{next_file:05d}.bin")
            running[pool.submit(_tokenize_file, corpus, next_file, n_files, path)] = next_file
            next_file += 1
        if not running:
            break
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in done:
            counts[running.pop(future)] = future.result()
        while prefix in counts:
            prefix_tokens += counts[prefix]
            prefix += 1
    return [(str(partial / f"tokens-{i:05d}.bin"), counts[i]) for i in range(prefix)]


def _tokenize_file(corpus: _Corpus, index: int, n_files: int, path: str) -> int:
    """Tokenize file `index` of the corpus's stream into `path` (int32 ids); returns its token count."""
    import numpy as np

    from .packing import BlockPacker
    from .tokenizer import load_tokenizer

    stream = corpus.stream().shard(num_shards=n_files, index=index, contiguous=True)
    packer = BlockPacker(load_tokenizer(corpus.tokenizer), corpus.seq_len, corpus.text_column)
    name = f"dataset '{corpus.source}'" + (f" (file {index + 1} of {n_files})" if n_files > 1 else "")
    n_tokens, row = 0, 0
    with open(path, "wb") as f:
        for batch in stream.iter(batch_size=packer.batch_size):
            documents = packer.documents(batch, row, name)
            row += len(documents)
            if documents:
                ids = np.concatenate([np.asarray(d, dtype=np.int32) for d in documents])
                ids.tofile(f)
                n_tokens += len(ids)
    return n_tokens


def _write_shard(partial: Path, parts: list[tuple[str, int]], seq_len: int, index: int, first_block: int,
                 n_blocks: int) -> dict:
    """Shard `index`: blocks first_block … + n_blocks of the token files read as one stream."""
    import numpy as np
    import pyarrow as pa

    start, stop = first_block * seq_len, (first_block + n_blocks) * seq_len
    pieces, offset = [], 0
    for path, n in parts:
        if offset < stop and start < offset + n:
            tokens = np.memmap(path, dtype=np.int32, mode="r", shape=(n,))
            pieces.append(np.array(tokens[max(start - offset, 0):min(stop - offset, n)]))
        offset += n
    tokens = np.concatenate(pieces)
    rows = pa.FixedSizeListArray.from_arrays(pa.array(tokens, type=pa.int32()), seq_len)
    table = pa.table({"input_ids": rows, "hash": pa.array(_hashes(tokens.reshape(n_blocks, seq_len)))})
    name = f"shard-{index:05d}.arrow"
    with pa.OSFile(str(partial / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return {"file": name, "blocks": n_blocks}


def _hashes(blocks):
    """`block_hashes` of (rows, seq_len) int32 blocks, a few thousand rows at a time (int64 copies)."""
    import numpy as np
    import torch

    from .packing import block_hashes

    return np.concatenate([block_hashes(torch.from_numpy(blocks[i:i + 4096])).numpy()
                           for i in range(0, len(blocks), 4096)])


class _InProcess:
    """The executor of num_proc 1: runs each task at once, here."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as err:
            future.set_exception(err)
        return future

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _one_thread() -> None:
    """A worker process's tokenizer runs on one thread: num_proc processes share the cores (one
    process alone lets the tokenizer's batch encoding use all of them)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _workers(num_proc: int):
    # spawn: tokenizers' thread pools do not survive a fork
    if num_proc == 1:
        return _InProcess()
    return ProcessPoolExecutor(num_proc, mp_context=get_context("spawn"), initializer=_one_thread)
