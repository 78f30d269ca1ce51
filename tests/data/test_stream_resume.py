"""A streamed dataset resumes from the position its checkpoint saved (data/stream_blocks.py,
data/samplers.py): the rows after the resume are exactly the uninterrupted run's, and the resume
tokenizes a bounded number of rows whatever the step — it never replays the stream.

The corpus is 8 jsonl files (shards) of short documents of varied length, packed into 8-token
blocks, read in windows of a few rows so that a run crosses many windows and several epochs.
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from hf_asyncpp.data import BlockPacker, StreamingSampler, load_source, load_tokenizer
from hf_asyncpp.data.errors import DataError
from hf_asyncpp.data.prefetch import Prefetcher

WORDS = "King Queen Duke Lord night sword crown blood heart love death honour fair sweet grave moon".split()
SEQ, ROWS_PER_STEP, WINDOW, BATCH, STEPS = 8, 2, 5, 3, 40


def _corpus(tmp_path, n_files: int = 8, docs_per_file: int = 4) -> str:
    rng = random.Random(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in range(n_files):
        docs = [" ".join(rng.choices(WORDS, k=rng.randint(2, 14))) for _ in range(docs_per_file)]
        (folder / f"{f:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(folder)


class CountingTokenizer:
    """The built-in tokenizer, counting the documents it tokenizes (a witness, not a substitute)."""

    def __init__(self):
        self.inner, self.documents = load_tokenizer("builtin"), 0

    def __call__(self, texts, **kwargs):
        self.documents += len(texts)
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _sampler(corpus, dp_rank, dp_size, shuffle, tokenizer=None, ahead=2):
    packer = BlockPacker(tokenizer or load_tokenizer("builtin"), SEQ, batch_size=BATCH)
    sampler = StreamingSampler(load_source(corpus, streaming=True), packer, ROWS_PER_STEP, dp_rank, dp_size,
                               shuffle=shuffle, seed=11, shuffle_window=WINDOW, name="corpus")
    return Prefetcher(sampler, ahead=ahead)


def _straight_run(corpus, dp_size, shuffle):
    """Per dp rank: every step's rows, read in the loop's order (step k+1 before step k, prefetched),
    and the position a checkpoint after step k saves (as written: through JSON)."""
    rows, positions = [], []
    for d in range(dp_size):
        sampler, served, saved = _sampler(corpus, d, dp_size, shuffle), {}, {}
        for step in range(STEPS):
            served[step + 1] = sampler.rows(step + 1).tolist()
            served[step] = sampler.rows(step).tolist()
            saved[step + 1] = json.loads(json.dumps(sampler.position(step + 1)))
        sampler.close()
        rows.append(served)
        positions.append(saved)
    return rows, positions


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_stream_resumed_at_step_k_gives_the_uninterrupted_runs_rows_on_every_dp_rank(tmp_path, shuffle):
    corpus = _corpus(tmp_path)
    rows, positions = _straight_run(corpus, 2, shuffle)
    assert rows[0][0] != rows[1][0]  # the dp ranks read different documents
    assert positions[0][STEPS]["epoch"] >= 3  # the run crosses epochs, and windows within them
    assert max(p["blocks"]["window"] for p in positions[0].values()) >= 2
    for k in range(1, STEPS):
        saved = [positions[d][k] for d in range(2)]
        for d in range(2):
            resumed = _sampler(corpus, d, 2, shuffle)
            assert resumed.resume(k, copy.deepcopy(saved)) is None  # no replay warning
            following = {}
            for step in range(k, min(k + 8, STEPS)):
                following[step + 1] = resumed.rows(step + 1).tolist()
                following[step] = resumed.rows(step).tolist()
            resumed.close()
            assert following == {s: rows[d][s] for s in following}, (k, d)


def test_a_resume_tokenizes_a_bounded_number_of_documents_whatever_the_step(tmp_path):
    corpus = _corpus(tmp_path, n_files=16)
    _, positions = _straight_run(corpus, 1, True)
    counts = {}
    for k in (2, STEPS // 2, STEPS - 2):
        tokenizer = CountingTokenizer()
        resumed = _sampler(corpus, 0, 1, True, tokenizer, ahead=0)  # reads only what is asked: counts are exact
        resumed.resume(k, [positions[0][k]])
        resumed.rows(k)
        resumed.rows(k + 1)
        resumed.close()
        counts[k] = tokenizer.documents
    # At most the window the position names, read again, and one more window per block of the two
    # steps (5 documents of >= 3 tokens each, EOS included, hold at least one 8-token block).
    assert max(counts.values()) <= WINDOW * (1 + 2 * ROWS_PER_STEP), counts
    replayed = CountingTokenizer()
    replay = _sampler(corpus, 0, 1, True, replayed, ahead=0)
    assert "read again from its start" in replay.resume(STEPS - 2, None)
    replay.rows(STEPS - 2)
    replay.close()
    assert replayed.documents > 3 * max(counts.values())  # what a replay costs at the last k


def test_positions_of_another_stream_are_refused_and_of_another_dp_size_replayed_with_a_warning(tmp_path):
    corpus = _corpus(tmp_path)
    _, positions = _straight_run(corpus, 2, True)
    saved = [positions[d][5] for d in range(2)]
    with pytest.raises(DataError, match="taken reading dataset corpus.*seed 11.*this run reads .*seed 12"):
        packer = BlockPacker(load_tokenizer("builtin"), SEQ, batch_size=BATCH)
        StreamingSampler(load_source(corpus, streaming=True), packer, ROWS_PER_STEP, 0, 2, shuffle=True, seed=12,
                         shuffle_window=WINDOW, name="corpus").resume(5, saved)
    (tmp_path / "corpus" / "99.jsonl").write_text(json.dumps({"text": "a file added since"}) + "\n")
    with pytest.raises(DataError, match="shards 8.*this run reads .*shards 9"):
        _sampler(corpus, 0, 2, True).resume(5, saved)
    (tmp_path / "corpus" / "99.jsonl").unlink()
    straight = _straight_run(corpus, 1, True)[0][0]
    at_dp_1 = _sampler(corpus, 0, 1, True)
    assert "for dp_size 2" in at_dp_1.resume(5, saved)
    assert at_dp_1.rows(5).tolist() == straight[5]  # read again as a run at dp 1 reads it
    at_dp_1.close()


def test_datasets_own_shuffle_buffer_is_not_in_its_state_which_is_why_rows_are_shuffled_by_window():
    """What `IterableDataset.shuffle` does on resume (datasets 5.2, BufferShuffledExamplesIterable): the
    state is the source's read position, which runs ahead of the rows yielded by the buffer's fill;
    a resumed stream starts with an empty buffer and its generator from the seed again, so the rows
    that were in the buffer are never yielded in that epoch and the order differs."""
    from datasets import Dataset

    stream = Dataset.from_dict({"a": list(range(100))}).to_iterable_dataset(num_shards=1).shuffle(seed=0, buffer_size=10)
    rows = iter(stream)
    before = [next(rows)["a"] for _ in range(30)]
    state = stream.state_dict()
    after = [row["a"] for row in rows]
    resumed = copy.deepcopy(stream)
    resumed.load_state_dict(state)
    after_resume = [row["a"] for row in resumed]
    assert sorted(before + after) == list(range(100))
    assert after_resume != after and len(set(before) | set(after_resume)) < 100  # reordered, and rows lost
