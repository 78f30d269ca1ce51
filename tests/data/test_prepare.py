"""Preparing a corpus in parallel: the same shards as one process, the corpus's own blocks, a prefix
when asked for one, and nothing left behind by a failure.

The reference is the training path's packer run over the whole stream in one process
(`build_token_blocks`): prepared shards must hold exactly its blocks, in order, cut into shards of
`blocks_per_shard` — whatever the number of processes that tokenized and wrote them.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_asyncpp.data import build_token_blocks, load_tokenizer
from hf_asyncpp.data.errors import DataError
from hf_asyncpp.data.prepare import prepare_data
from tests.data.test_blocks import _corpus


def _shards(out) -> list[torch.Tensor]:
    """Each shard's rows, read by the datasets library as an HF user would load them."""
    from datasets import load_dataset

    manifest = json.loads((out / "manifest.json").read_text())
    return [torch.tensor(load_dataset("arrow", data_files=str(out / s["file"]), split="train")["input_ids"])
            for s in manifest["shards"]]


@pytest.mark.launch  # worker processes of datasets.map
def test_any_number_of_processes_writes_the_corpus_blocks_into_the_same_shards(tmp_path):
    corpus = _corpus(tmp_path, "jsonl", n_files=5, docs_per_file=3)
    direct = build_token_blocks(corpus, load_tokenizer("builtin"), 8)
    one = prepare_data(corpus, str(tmp_path / "one"), "builtin", 8, blocks_per_shard=7)
    two = prepare_data(corpus, str(tmp_path / "two"), "builtin", 8, blocks_per_shard=7, num_proc=2)
    assert one == two and one["blocks"] == len(direct) and len(one["shards"]) == -(-len(direct) // 7)
    for a, b in zip(_shards(tmp_path / "one"), _shards(tmp_path / "two")):
        assert torch.equal(a, b)
    # documents straddle the source files' ends and the blocks cross them: the stream is cut as a whole
    assert torch.equal(torch.cat(_shards(tmp_path / "two")), direct)


def test_max_tokens_keeps_a_prefix_of_the_corpus_and_tokenizes_no_file_far_beyond_it(tmp_path, monkeypatch):
    from hf_asyncpp.data import prepare

    corpus = _corpus(tmp_path, "jsonl", n_files=6, docs_per_file=3)
    direct = build_token_blocks(corpus, load_tokenizer("builtin"), 8)
    tokenized = []
    original = prepare._tokenize_file
    monkeypatch.setattr(prepare, "_tokenize_file", lambda corpus, i, *rest: tokenized.append(i) or original(corpus, i, *rest))
    manifest = prepare_data(corpus, str(tmp_path / "out"), "builtin", 8, blocks_per_shard=4, max_tokens=8 * 5 + 3)
    assert manifest["blocks"] == 5 and manifest["tokens"] == 40 and manifest["max_tokens"] == 43
    assert torch.equal(torch.cat(_shards(tmp_path / "out")), direct[:5])
    assert tokenized and max(tokenized) < 5, tokenized  # one process: it stops at the file that completes the prefix


def test_a_bad_file_read_by_a_worker_fails_the_preparation_with_its_name_and_leaves_nothing(tmp_path):
    corpus = _corpus(tmp_path, "jsonl", n_files=3)
    (tmp_path / "corpus_jsonl" / "1.jsonl").write_bytes(b"\xff\xfe not json")
    with pytest.raises(DataError, match=r"1\.jsonl: line 1 \(byte 0\) is not UTF-8 text"):
        prepare_data(corpus, str(tmp_path / "out"), "builtin", 8, num_proc=2)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
