"""Data: files → token blocks in file order; step k's rows; dp sharding; deterministic shuffle."""

from __future__ import annotations

import json

import pytest
import torch

from hf_asyncpp.data import (
    MinibatchSampler,
    build_token_blocks,
    check_tokenizer_source,
    load_tokenizer,
    resolve_dataset_files,
    shakespeare_files,
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_with_input_ids_are_used_as_given_in_file_order(tmp_path):
    rows = [{"input_ids": list(range(i, i + 8))} for i in range(10)]
    blocks = build_token_blocks(_write_jsonl(tmp_path / "d.jsonl", rows), tokenizer=None, seq_len=8)
    assert blocks.tolist() == [r["input_ids"] for r in rows]


def test_input_ids_of_the_wrong_length_are_refused(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}] * 4)
    with pytest.raises(ValueError, match="expected \\(n, 8\\)"):
        build_token_blocks(path, tokenizer=None, seq_len=8)


def test_text_is_tokenized_with_eos_between_documents_and_packed(tmp_path):
    tokenizer = load_tokenizer("builtin")
    docs = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind to suffer"]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    stream = []
    for d in docs:
        stream += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = build_token_blocks(path, tokenizer, seq_len=4)
    assert blocks.flatten().tolist() == stream[: len(stream) // 4 * 4]


def test_the_offline_corpus_and_builtin_tokenizer_are_available():
    assert len(shakespeare_files()) > 30
    tokenizer = load_tokenizer("builtin")
    assert len(tokenizer) == 8192 and tokenizer.eos_token_id == 0
    text = "Now is the winter of our discontent"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused():
    with pytest.raises(ValueError, match="8192 tokens but the model's vocab_size is 128"):
        check_tokenizer_source("builtin", 128)


def test_sources_must_exist_and_be_of_one_kind(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no files"):
        resolve_dataset_files(str(tmp_path / "none*.txt"))
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.parquet").write_text("x")
    with pytest.raises(ValueError, match="files of one kind"):
        resolve_dataset_files(str(tmp_path))


def test_step_k_takes_rows_k_times_g_in_order_without_shuffle():
    blocks = torch.arange(40).view(20, 2)
    sampler = MinibatchSampler(blocks, rows_per_step=6, dp_rank=0, dp_size=1, shuffle=False, seed=0)
    assert sampler.rows(0)[:, 0].tolist() == [0, 2, 4, 6, 8, 10]
    assert sampler.rows(1)[:, 0].div(2).tolist() == [6, 7, 8, 9, 10, 11]
    assert sampler.rows(3)[:, 0].div(2).tolist() == [18, 19, 0, 1, 2, 3]  # wraps into the next epoch


def test_dp_ranks_take_disjoint_consecutive_slices_of_one_step():
    blocks = torch.arange(24).view(24, 1)
    rows = [MinibatchSampler(blocks, 3, d, 2, False, 0).rows(1).flatten().tolist() for d in range(2)]
    assert rows == [[6, 7, 8], [9, 10, 11]]


def test_shuffle_is_a_seeded_permutation_per_epoch():
    blocks = torch.arange(12).view(12, 1)
    a = MinibatchSampler(blocks, 12, 0, 1, True, seed=3)
    b = MinibatchSampler(blocks, 12, 0, 1, True, seed=3)
    assert a.rows(0).tolist() == b.rows(0).tolist()
    assert sorted(a.rows(0).flatten().tolist()) == list(range(12))
    assert a.rows(0).tolist() != a.rows(1).tolist()  # a new order each epoch
    assert a.rows(0).tolist() != MinibatchSampler(blocks, 12, 0, 1, True, seed=4).rows(0).tolist()


def test_within_an_epoch_no_block_is_seen_twice_by_any_dp_rank_and_a_resumed_sampler_continues():
    blocks = torch.arange(48).view(48, 1)
    steps = 48 // (2 * 4)  # an epoch: 6 steps of 2 dp ranks × 4 rows
    seen = [b for step in range(steps) for d in range(2)
            for b in MinibatchSampler(blocks, 4, d, 2, True, 7).rows(step).flatten().tolist()]
    assert sorted(seen) == list(range(48))
    # A sampler built afresh (a resumed run) at step 3 gives the blocks the original would have: the
    # ones no rank has seen in steps 0..2 of this epoch.
    resumed = [b for d in range(2) for b in MinibatchSampler(blocks, 4, d, 2, True, 7).rows(3).flatten().tolist()]
    assert resumed == seen[3 * 8:4 * 8] and not set(resumed) & set(seen[:3 * 8])
