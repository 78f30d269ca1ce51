"""Prepared shards are mapped, not loaded: a run reads the blocks it trains on from the shards' pages.

Specification: a run on a prepared directory sees exactly the blocks of the same corpus packed in
memory — step by step, shuffled, split over dp ranks, with a held-out tail — while the blocks stay
read-only views of the memory-mapped shard files (nothing is copied into the process).
"""

from __future__ import annotations

import numpy as np
import torch

from hf_asyncpp.config import TrainConfig
from hf_asyncpp.data import build_token_blocks, load_tokenizer, training_data
from hf_asyncpp.data.prepare import prepare_data
from hf_asyncpp.data.prepared import PreparedBlocks
from tests.data.test_blocks import _corpus


def _config(**values) -> TrainConfig:
    return TrainConfig(**{"seq_len": 8, "micro_batch_size": 2, "n_microbatches": 2, "seed": 3, **values})


def test_a_run_on_prepared_shards_reads_the_in_memory_blocks_step_by_step(tmp_path):
    corpus = _corpus(tmp_path, "jsonl", n_files=4, docs_per_file=4)
    prepare_data(corpus, str(tmp_path / "prepared"), "builtin", 8, blocks_per_shard=5)
    for shuffle, eval_fraction in ((False, 0.0), (True, 0.2)):
        for dp_rank in range(2):
            # One row a step on each rank: the 2 held-out blocks make one evaluation batch of the 2 ranks.
            one_row = dict(shuffle=shuffle, eval_fraction=eval_fraction, micro_batch_size=1, n_microbatches=1)
            mapped = training_data(_config(dataset=str(tmp_path / "prepared"), **one_row), None, dp_rank, 2)
            in_memory = training_data(_config(dataset=corpus, **one_row), load_tokenizer("builtin"), dp_rank, 2)
            assert isinstance(mapped.sampler.blocks, PreparedBlocks)
            for step in range(6):  # past the end of an epoch
                assert torch.equal(mapped.sampler.rows(step), in_memory.sampler.rows(step)), (shuffle, dp_rank, step)
            if eval_fraction:
                assert torch.equal(mapped.held_out, in_memory.held_out)


def test_prepared_blocks_are_read_only_views_of_the_mapped_files(tmp_path):
    corpus = _corpus(tmp_path, "jsonl")
    prepare_data(corpus, str(tmp_path / "prepared"), "builtin", 8, blocks_per_shard=3)
    blocks = PreparedBlocks(str(tmp_path / "prepared"))
    direct = build_token_blocks(corpus, load_tokenizer("builtin"), 8)
    assert blocks.shape == tuple(direct.shape) and len(blocks._arrays) == -(-len(direct) // 3)
    assert all(not a.flags.owndata and not a.flags.writeable for a in blocks._arrays)
    rows = torch.tensor([len(direct) - 1, 0, 4, 3])  # across shards, in any order
    assert torch.equal(blocks[rows], direct[rows]) and blocks[rows].dtype == torch.long
    tail = blocks[-2:]
    assert len(tail) == 2 and torch.equal(tail.materialize(), direct[-2:])
    assert np.array_equal(blocks[1:3][torch.tensor([1])].numpy(), direct[2:3].numpy())


def test_an_eval_set_repeating_prepared_blocks_is_refused_by_their_stored_hashes(tmp_path):
    import pytest

    from hf_asyncpp.data.errors import DataError
    from hf_asyncpp.data.packing import block_hashes

    corpus = _corpus(tmp_path, "jsonl", n_files=2)
    prepare_data(corpus, str(tmp_path / "prepared"), "builtin", 8, blocks_per_shard=4)
    blocks = PreparedBlocks(str(tmp_path / "prepared"))
    assert torch.equal(blocks.hashes(), block_hashes(blocks.materialize()))  # stored = computed
    assert torch.equal(blocks[2:5].hashes(), blocks.hashes()[2:5])
    config = _config(dataset=str(tmp_path / "prepared"), eval_dataset=corpus, shuffle=False)  # the same blocks
    with pytest.raises(DataError, match="repeats blocks of"):
        training_data(config, load_tokenizer("builtin"), 0, 1)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"text": "%s"}\n' % ("unrelated words of a held out document " * 4))
    data = training_data(_config(dataset=str(tmp_path / "prepared"), eval_dataset=str(held_out)),
                         load_tokenizer("builtin"), 0, 1)
    assert data.held_out is not None and len(data.held_out)
