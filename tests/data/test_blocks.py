"""Data: files → token blocks in file order; step k's rows; dp sharding; deterministic shuffle;
streaming (packed on the fly, the same rows as in memory); datasets given in memory; a held-out eval set."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_asyncpp.config import TrainConfig
from hf_asyncpp.data import (
    BlockPacker,
    MinibatchSampler,
    StreamingSampler,
    TrainingData,
    build_token_blocks,
    check_tokenizer_source,
    load_source,
    load_tokenizer,
    resolve_dataset_files,
    shakespeare_files,
    training_data,
)
from hf_asyncpp.data.errors import DataError


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_rows_with_input_ids_are_used_as_given_in_file_order(tmp_path):
    rows = [{"input_ids": list(range(i, i + 8))} for i in range(10)]
    blocks = build_token_blocks(_write_jsonl(tmp_path / "d.jsonl", rows), tokenizer=None, seq_len=8)
    assert blocks.tolist() == [r["input_ids"] for r in rows]


def test_input_ids_of_the_wrong_length_are_refused(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}] * 4)
    with pytest.raises(ValueError, match="row 0 holds 3 input_ids, but .* seq_len is 8: set seq_len 3"):
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


# Streaming and in-memory datasets. A small corpus: several files of short distinct documents.
WORDS = "King Queen Duke Lord night sword crown blood heart love death honour fair sweet grave moon".split()


def _documents(n: int) -> list[str]:
    return [" ".join(words) for words in itertools.islice(itertools.permutations(WORDS, 4), 0, 7 * n, 7)]


def _corpus(tmp_path, kind: str, n_files: int = 3, docs_per_file: int = 5) -> str:
    """A directory of jsonl or text files (one document per file for text); returns its path."""
    folder = tmp_path / f"corpus_{kind}"
    folder.mkdir()
    docs = _documents(n_files * docs_per_file)
    for f in range(n_files):
        if kind == "txt":
            (folder / f"{f}.txt").write_text(". ".join(docs[f * docs_per_file:(f + 1) * docs_per_file]))
        else:
            _write_jsonl(folder / f"{f}.jsonl", [{"text": d} for d in docs[f * docs_per_file:(f + 1) * docs_per_file]])
    return str(folder)


def _config(**values) -> TrainConfig:
    return TrainConfig(**{"seq_len": 8, "micro_batch_size": 2, "n_microbatches": 2, "shuffle": False, **values})


def _steps(sampler, steps) -> list[list[list[int]]]:
    return [sampler.rows(k).tolist() for k in steps]


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_streaming_gives_the_in_memory_rows_at_one_dp_rank_without_shuffle(tmp_path, kind):
    tokenizer, dataset = load_tokenizer("builtin"), _corpus(tmp_path, kind)
    in_memory = training_data(_config(dataset=dataset), tokenizer, 0, 1).sampler
    streamed = training_data(_config(dataset=dataset, streaming=True), tokenizer, 0, 1).sampler
    n_steps = 2 * in_memory.blocks.shape[0] // 4 + 1  # two epochs and more: the stream wraps like the tensor
    assert _steps(streamed, range(n_steps)) == _steps(in_memory, range(n_steps))


def _one_block_documents(tokenizer, n: int, seq_len: int) -> list[str]:
    """Distinct documents of exactly seq_len − 1 tokens, so each packs (with its EOS) into one block."""
    docs = (" ".join(words) for words in itertools.permutations(WORDS, seq_len - 1))
    return list(itertools.islice(
        (d for d in docs if len(tokenizer(d, add_special_tokens=False)["input_ids"]) == seq_len - 1), n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_streaming_dp_ranks_read_disjoint_documents_that_cover_the_corpus_each_epoch(tmp_path, shuffle):
    tokenizer = load_tokenizer("builtin")
    docs = _one_block_documents(tokenizer, 12, seq_len=4)
    for f in range(4):
        _write_jsonl(tmp_path / f"{f}.jsonl", [{"text": d} for d in docs[f * 3:(f + 1) * 3]])
    config = _config(dataset=str(tmp_path), streaming=True, seq_len=4, micro_batch_size=3, n_microbatches=1,
                     shuffle=shuffle)
    expected = {tuple(tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for d in docs}
    for epoch in range(2):  # an epoch: 2 steps × 3 rows on each of 2 ranks = the 12 documents
        per_rank = [{tuple(row) for step in (2 * epoch, 2 * epoch + 1)
                     for row in training_data(config, tokenizer, d, 2).sampler.rows(step).tolist()} for d in range(2)]
        assert not per_rank[0] & per_rank[1]
        assert per_rank[0] | per_rank[1] == expected


def test_a_fresh_streaming_sampler_continues_where_the_original_was(tmp_path):
    tokenizer, dataset = load_tokenizer("builtin"), _corpus(tmp_path, "jsonl")
    config = _config(dataset=dataset, streaming=True, shuffle=True, seed=5)
    original = training_data(config, tokenizer, 1, 2).sampler
    served = _steps(original, range(9))  # past the end of the rank's first epoch
    for k in (3, 8):
        assert training_data(config, tokenizer, 1, 2).sampler.rows(k).tolist() == served[k]
    assert original.rows(2).tolist() == served[2]  # a step behind the stream's position is read again


def test_a_loop_that_reads_one_step_ahead_packs_every_streamed_block_once(tmp_path):
    tokenizer, packed = load_tokenizer("builtin"), []

    class CountingPacker(BlockPacker):
        def cut(self, carry, documents):
            blocks, carry = super().cut(carry, documents)
            packed.extend(blocks.tolist())
            return blocks, carry

    stream = load_source(_corpus(tmp_path, "jsonl"), streaming=True)  # 9 blocks of 8 tokens an epoch
    sampler = StreamingSampler(stream, CountingPacker(tokenizer, 8), 4, 0, 1, shuffle=False, seed=0, shuffle_window=1)
    for step in range(6):  # the training loop's order: the next step's rows, then this step's
        assert sampler.rows(step + 1).tolist() == packed[4 * (step + 1):4 * (step + 2)]
        assert sampler.rows(step).tolist() == packed[4 * step:4 * (step + 1)]
    assert len(packed) == 4 * 9  # 7 steps of 4 blocks reach into a 4th epoch (packed a window at a time), none twice


def test_streaming_shuffle_is_seeded_and_reshuffles_each_epoch(tmp_path):
    tokenizer, dataset = load_tokenizer("builtin"), _corpus(tmp_path, "jsonl")
    n_blocks = training_data(_config(dataset=dataset), tokenizer, 0, 1).sampler.blocks.shape[0]

    def epochs(seed):  # the first token of each block of the first two epochs, in the order served
        config = _config(dataset=dataset, streaming=True, shuffle=True, seed=seed, micro_batch_size=1, n_microbatches=1)
        rows = _steps(training_data(config, tokenizer, 0, 1).sampler, range(2 * n_blocks + 2))
        return [r[0] for r in rows]

    first = epochs(3)
    assert first == epochs(3)
    assert first != epochs(4)
    unshuffled = _steps(training_data(_config(dataset=dataset, micro_batch_size=1, n_microbatches=1), tokenizer, 0,
                                      1).sampler, range(n_blocks))
    assert first[:n_blocks] != [r[0] for r in unshuffled]
    assert first[:n_blocks] != first[n_blocks:2 * n_blocks]  # set_epoch: a new order in the next epoch


def test_datasets_in_memory_give_the_rows_of_the_same_files(tmp_path):
    from datasets import Dataset

    tokenizer, dataset = load_tokenizer("builtin"), _corpus(tmp_path, "jsonl")
    config = _config(dataset=dataset, eval_fraction=0.25, n_microbatches=1)  # its 2 held-out blocks: one batch
    from_files = training_data(config, tokenizer, 0, 1)
    docs = [json.loads(line)["text"] for f in sorted((tmp_path / "corpus_jsonl").iterdir())
            for line in f.read_text().splitlines()]
    text = TrainingData.from_datasets(Dataset.from_dict({"text": docs}), None, tokenizer, config, 0, 1)
    assert torch.equal(text.held_out, from_files.held_out)
    assert _steps(text.sampler, range(5)) == _steps(from_files.sampler, range(5))
    streamed = TrainingData.from_datasets(Dataset.from_dict({"text": docs}).to_iterable_dataset(num_shards=3),
                                          from_files.held_out, tokenizer, _config(n_microbatches=1), 0, 1)
    all_files = training_data(_config(dataset=dataset, n_microbatches=1), tokenizer, 0, 1)
    assert _steps(streamed.sampler, range(5)) == _steps(all_files.sampler, range(5))

    rows = torch.randint(0, 100, (12, 8), generator=torch.Generator().manual_seed(0))
    held = rows[:4] + 100  # blocks the training rows do not hold
    for given in (Dataset.from_dict({"input_ids": rows.tolist()}), rows):
        data = TrainingData.from_datasets(given, held, None, _config(), 0, 1)
        assert torch.equal(data.sampler.rows(1), rows[4:8]) and torch.equal(data.held_out, held)


def test_an_eval_dataset_is_held_out_whole_and_never_trained_on(tmp_path):
    tokenizer, dataset = load_tokenizer("builtin"), _corpus(tmp_path, "jsonl")
    held = _write_jsonl(tmp_path / "held_out.jsonl", [{"text": d} for d in _documents(40)[-6:]])
    for streaming in (False, True):
        # Two rows a step: the eval set's 3 blocks hold one evaluation batch.
        data = training_data(_config(dataset=dataset, eval_dataset=held, streaming=streaming, n_microbatches=1),
                             tokenizer, 0, 1)
        assert torch.equal(data.held_out, build_token_blocks(held, tokenizer, 8))
        trained = build_token_blocks(dataset, tokenizer, 8)
        assert _steps(data.sampler, range(2)) == [trained[:2].tolist(), trained[2:4].tolist()]


def test_text_is_tokenized_once_and_a_second_load_reads_the_cache(tmp_path, monkeypatch):
    """The map-style path tokenizes through datasets' cached map; its blocks are the ones the
    row-by-row packer (the streaming path) cuts, and loading again calls no tokenizer."""
    tokenizer, dataset = load_tokenizer("builtin"), _corpus(tmp_path, "jsonl")
    packer = BlockPacker(tokenizer, 8, num_proc=2)
    first = packer.tensor(load_source(dataset), "corpus")
    assert torch.equal(first, torch.from_numpy(np.stack(list(BlockPacker(tokenizer, 8).blocks(load_source(dataset))))))
    assert torch.equal(first, BlockPacker(tokenizer, 8).tensor(load_source(dataset, streaming=True)))  # a stream whole

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(type(tokenizer), "__call__", no_tokenizing)
    assert torch.equal(BlockPacker(tokenizer, 8, num_proc=2).tensor(load_source(dataset), "corpus"), first)


def _prepare(*args) -> subprocess.CompletedProcess:
    from tests.test_run import _env

    return subprocess.run([sys.executable, "-m", "hf_asyncpp.cli", "prepare-data", *args], capture_output=True,
                          text=True, env=_env(), timeout=300)


@pytest.mark.launch
def test_prepared_shards_train_on_the_blocks_of_the_corpus_itself(tmp_path):
    """`hf-asyncpp prepare-data` streams the corpus through the one packing rule into Arrow shards and
    a manifest; a run on the shards reads the corpus's own blocks (in order) without tokenizing."""
    corpus, out = _corpus(tmp_path, "jsonl"), tmp_path / "prepared"
    done = _prepare(corpus, str(out), "--seq_len", "8", "--blocks_per_shard", "4")
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    direct = build_token_blocks(corpus, load_tokenizer("builtin"), 8)
    assert manifest["blocks"] == len(direct) and manifest["seq_len"] == 8 and manifest["vocab_size"] == 8192
    assert [s["blocks"] for s in manifest["shards"]] == [4] * (len(direct) // 4) + ([len(direct) % 4] if len(direct) % 4 else [])
    assert torch.equal(build_token_blocks(str(out), None, 8), direct)  # no tokenizer needed
    config = _config(dataset=str(out))
    assert _steps(training_data(config, None, 0, 1).sampler, range(3)) == _steps(
        training_data(_config(dataset=corpus), load_tokenizer("builtin"), 0, 1).sampler, range(3))


@pytest.mark.launch
def test_prepared_shards_are_refused_at_another_seq_len_and_never_left_half_written(tmp_path):
    from hf_asyncpp.config import ConfigError
    from hf_asyncpp.config_checks import validate_config

    corpus, out = _corpus(tmp_path, "jsonl"), tmp_path / "prepared"
    assert _prepare(corpus, str(out), "--seq_len", "8").returncode == 0
    with pytest.raises(ConfigError, match=f"dataset '{out}' was prepared for seq_len 8, not 16: set seq_len 8"):
        validate_config(TrainConfig(model_config="tiny-moe", dataset=str(out), seq_len=16, pp_size=1), 1)
    again = _prepare(corpus, str(out), "--seq_len", "8")  # a finished directory is never overwritten
    assert again.returncode == 1 and again.stderr.startswith(f"error: {out} exists")
    (tmp_path / "corpus_jsonl" / "z.jsonl").write_bytes(b"\xff\xfe not json")  # read after the good files
    broken = _prepare(str(tmp_path / "corpus_jsonl"), str(tmp_path / "broken"), "--seq_len", "8")
    assert broken.returncode == 1 and "z.jsonl: line 1 (byte 0) is not UTF-8 text" in broken.stderr, broken.stderr
    assert not (tmp_path / "broken").exists() and not (tmp_path / "broken.partial").exists()


class _CountingSampler:
    """rows(step) = a tensor naming the step; counts calls; fails at `fail_at`."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at = [], fail_at

    def rows(self, step):
        self.calls.append(step)
        if step == self.fail_at:
            raise DataError(f"bad row in step {step}")
        return torch.full((2, 3), step)

    def position(self, step):
        return {"step": step}


def test_prefetched_rows_are_the_samplers_in_any_order_of_requests():
    from hf_asyncpp.data.prefetch import Prefetcher

    sampler = _CountingSampler()
    prefetcher = Prefetcher(sampler, ahead=2)
    asked = [1, 0, 2, 1, 3, 2, 0, 9, 8, 10, 9]  # ask-ahead pairs, a restart behind, a resume far ahead
    assert [int(prefetcher.rows(s)[0, 0]) for s in asked] == asked
    prefetcher.close()


def test_the_next_steps_are_read_before_they_are_asked_for():
    import time

    from hf_asyncpp.data.prefetch import Prefetcher

    sampler = _CountingSampler()
    prefetcher = Prefetcher(sampler, ahead=2)
    prefetcher.rows(0)
    deadline = time.time() + 10
    while len(sampler.calls) < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert sampler.calls == [0, 1, 2]  # steps 1 and 2 ready while step 0 trains, and no further
    prefetcher.close()


def test_a_prefetched_steps_error_reaches_the_step_that_asks_for_it():
    from hf_asyncpp.data.prefetch import Prefetcher

    prefetcher = Prefetcher(_CountingSampler(fail_at=2), ahead=2)
    assert int(prefetcher.rows(1)[0, 0]) == 1
    with pytest.raises(DataError, match="bad row in step 2"):
        prefetcher.rows(2)


def test_a_held_out_set_that_repeats_training_blocks_is_refused():
    rows = torch.randint(0, 100, (12, 8), generator=torch.Generator().manual_seed(0))
    held = torch.cat([rows[:2] + 100, rows[7:8]])  # its block 2 is training block 7
    with pytest.raises(DataError, match=r"eval_dataset repeats blocks of train_dataset \(block 2, and up to 1"):
        TrainingData.from_datasets(rows, held, None, _config(n_microbatches=1), 0, 1)
    TrainingData.from_datasets(rows, held[:2], None, _config(n_microbatches=1), 0, 1)  # disjoint: accepted


def test_hub_datasets_are_read_at_the_configured_splits_and_revision(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append((args, kwargs)) or [])
    monkeypatch.setattr("hf_asyncpp.data.run_data._build", lambda *args, **kwargs: None)
    config = _config(dataset="org/corpus", dataset_split="train[:90%]", eval_dataset="org/heldout",
                     eval_dataset_split="test", dataset_revision="v1.2", dataset_config_name="en")
    training_data(config, None, 0, 1)
    assert calls == [(("org/corpus",), dict(name="en", split="train[:90%]", streaming=False, revision="v1.2")),
                     (("org/heldout",), dict(name="en", split="test", streaming=False, revision="v1.2"))]


# Bad data is refused like a bad config: one `error:` line naming the file, the place and the fix.

SEQ_BAD = 16


def _bad_data(tmp_path, case: str) -> tuple[str, str]:
    """(a dataset path of kind `case`, what its error must say)."""
    rows = [list(range(i, i + SEQ_BAD)) for i in range(64)]
    lines = "".join(json.dumps({"input_ids": r}) + "\n" for r in rows)
    path = tmp_path / f"{case}.jsonl"
    if case == "empty":
        path.write_text("")
        return str(path), f"file {path} is empty"
    if case == "cut":  # the last line lost its end, as a write cut short leaves it
        path.write_text(lines[:-20])
        return str(path), f"{path}: line 64 \\(byte {len(lines) - len(lines.splitlines()[-1]) - 1}\\) is not valid JSON"
    if case == "short":
        path.write_text("".join(json.dumps({"input_ids": r[:10]}) + "\n" for r in rows))
        return str(path), "row 0 holds 10 input_ids, but .* seq_len is 16: set seq_len 10"
    if case == "vocabulary":
        rows[5][3] = 9000
        path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
        return str(path), "block 5 holds token id 9000, outside the model's vocabulary of 8192 ids"
    path = tmp_path / "binary.txt"
    path.write_bytes(bytes(range(128)) + bytes(range(128, 256)) * 16)
    return str(path), f"{path}: byte 128 is not UTF-8 text"


BAD_DATA = ["empty", "cut", "short", "vocabulary", "binary"]


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_refused_with_the_file_the_place_and_the_fix(tmp_path, case):
    dataset, expected = _bad_data(tmp_path, case)
    config = _config(dataset=dataset, seq_len=SEQ_BAD)
    with pytest.raises(DataError, match=expected):
        training_data(config, load_tokenizer("builtin"), 0, 1, vocab_size=8192)


def test_a_streamed_token_beyond_the_vocabulary_is_refused_when_its_step_is_read(tmp_path):
    dataset, _ = _bad_data(tmp_path, "vocabulary")
    config = _config(dataset=dataset, seq_len=SEQ_BAD, streaming=True)
    sampler = training_data(config, load_tokenizer("builtin"), 0, 1, vocab_size=8192).sampler
    with pytest.raises(DataError, match="block 5 holds token id 9000"):
        sampler.rows(5 // config.rows_per_step)


def _bad_data_argv(dataset: str, out) -> list[str]:
    """train.py's arguments for a pp 2 run on `dataset`."""
    return ["--model_config", "tiny-moe", "--dataset", dataset, "--seq_len", str(SEQ_BAD), "--micro_batch_size", "2",
            "--n_microbatches", "2", "--pp_size", "2", "--max_steps", "2", "--threads_per_rank", "1",
            "--report_to", "none", "--output_dir", str(out)]


@pytest.mark.multirank
@pytest.mark.parametrize("case", BAD_DATA)
def test_under_a_two_rank_launch_bad_data_ends_every_rank_with_one_error_and_writes_nothing(tmp_path, case):
    """Rank 0 reads the data first; a failure there (or on any rank) ends every rank at the same
    point with the same message — not one traceback and a "lost contact" on the other rank. Every kind
    of bad data is one DataError out of training_data (loop.load_main_process_first), so each runs
    train.py's main on two ranks of the suite's pool; the torchrun launch itself is the next test's."""
    from tests.ranks import train_py

    dataset, expected = _bad_data(tmp_path, case)
    out = tmp_path / "out"
    results = train_py(2, _bad_data_argv(dataset, out), tmp_path / "logs")
    assert [code for code, _ in results] == [1, 1]  # both ranks exit 1, as torchrun's report of them says
    stderr = "".join(err for _, err in results)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(expected, errors[0]), stderr[-3000:]
    assert [line for line in results[0][1].splitlines() if line.startswith("error:")] == errors  # said by rank 0
    assert "Traceback" not in stderr and "lost contact" not in stderr, stderr[-3000:]
    assert not out.exists()


@pytest.mark.multirank
def test_under_torchrun_bad_data_ends_every_rank_with_one_error_and_writes_nothing(tmp_path):
    """The same under torchrun itself, for one kind (a file cut short): one `error:` line, no rank's
    traceback, exit code 1 in the launcher's report, no output directory."""
    import subprocess
    import sys

    from tests.test_run import _env

    dataset, expected = _bad_data(tmp_path, "cut")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "training_scripts/train.py", *_bad_data_argv(dataset, out)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(expected, errors[0]), done.stderr[-3000:]
    ranks_said = done.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]  # not torchrun's report
    assert "Traceback" not in ranks_said and "lost contact" not in ranks_said, ranks_said[-3000:]
    assert "exitcode  : 1" in done.stderr
    assert not out.exists()


@pytest.mark.multirank
def test_only_the_ranks_of_the_first_and_last_stage_read_the_data(tmp_path):
    """pp 3: rank 1 holds the middle stage, which never looks at a token, and opens no dataset
    (tests/faults.py RECORD_READS); the run trains and evaluates to the losses of the same run on one
    process (pp 1), to fp32 reordering of the same arithmetic."""
    import subprocess
    import sys

    from tests.ranks import train_py
    from tests.test_run import _env

    rows = torch.randint(0, 8192, (96, SEQ_BAD), generator=torch.Generator().manual_seed(0))
    dataset = _write_jsonl(tmp_path / "d.jsonl", [{"input_ids": r} for r in rows.tolist()])
    reads = tmp_path / "reads"
    reads.mkdir()
    losses = {}
    for pp in (3, 1):
        out = tmp_path / f"pp{pp}"
        arguments = ["--model_config", "tiny-moe", "--dataset", dataset, "--seq_len", str(SEQ_BAD),
                     "--micro_batch_size", "2", "--n_microbatches", "3", "--pp_size", str(pp), "--max_steps", "4",
                     "--eval_fraction", "0.25", "--eval_steps", "2", "--lr_scheduler_type", "constant",
                     "--shuffle", "false", "--threads_per_rank", "1", "--report_to", "none", "--save_final", "false",
                     "--output_dir", str(out)]
        if pp > 1:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(pp),
                                   "tests/faults.py", *arguments], capture_output=True, text=True, timeout=600,
                                  env={**_env(), "RECORD_READS": str(reads)})
            assert done.returncode == 0, done.stderr[-3000:]
        else:  # the one-process run, train.py's main on a rank of the suite's pool
            [(code, stderr)] = train_py(1, arguments, tmp_path / "pp1-logs")
            assert code == 0, stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[pp] = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in records]
    assert sorted(p.name for p in reads.iterdir()) == ["rank-0", "rank-2"]
    assert [s for s, _, _ in losses[3]] == [s for s, _, _ in losses[1]]
    for (_, loss, eval_loss), (_, loss_1, eval_loss_1) in zip(losses[3], losses[1]):
        assert (loss is None) == (loss_1 is None) and (eval_loss is None) == (eval_loss_1 is None)
        assert loss is None or abs(loss - loss_1) <= 1e-5
        assert eval_loss is None or abs(eval_loss - eval_loss_1) <= 1e-5
    assert any(e is not None for _, _, e in losses[3])  # the middle rank took part in evaluating
