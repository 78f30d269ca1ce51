"""From gradients to an update (hf_asyncpp/updates.py): when the host reads a gradient norm.

On a GPU a host read of a device value waits for every kernel queued before it. A stage of an
asynchronous pipeline that clips by its own norm needs the value at once (to clip, or skip a non-finite
update); one that clips by the global norm posts its squared norm to an all-reduce and holds the update,
and must read nothing until the update is applied, or the host would wait for the backward there
instead of queueing the next forward. CPU tensors have no queue, so the rule is checked where it lives:
the Python-level reads (tests/host_reads.py) made while an update is posted.
"""

from __future__ import annotations

import pytest

from tests.host_reads import host_reads_recorded
from tests.ranks import run_ranks
from tests.test_engine import small_model_config
from tests.test_engine_async import M, MBS, SEQ, _rows


def _reads_while_posting(rank, world_size, scope, steps):
    """PipeDream-2BW on 2 ranks clipping by `scope`: the host reads made inside each `Updates.post`."""
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.updates import Updates

    layout = init_parallel(read_launch(), 2)
    posted, original = [], Updates.post

    def post_recording_reads(self, *args, **kwargs):
        with host_reads_recorded() as reads:
            original(self, *args, **kwargs)
        posted.append([read.kind for read in reads])

    Updates.post = post_recording_reads
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=2, schedule="pipedream-2bw", optimizer="adamw",
                             learning_rate=3e-3, max_grad_norm=0.05, grad_clip_scope=scope, seq_len=SEQ,
                             micro_batch_size=MBS, n_microbatches=M, seed=4, max_steps=steps)
        engine = PipelineEngine(config, model_config, layout)
        rows = _rows(model_config.vocab_size, 1)
        results = [engine.train_step(rows[k], rows[k + 1] if k + 1 < steps else None) for k in range(steps)]
        engine.finish()
        return posted, [r.grad_norm for r in results]
    finally:
        Updates.post = original
        shutdown_parallel()


@pytest.mark.multirank
def test_an_update_held_for_the_global_norm_is_posted_without_a_host_read():
    for posted, grad_norms in run_ranks(2, _reads_while_posting, "global", 3):
        assert len(posted) == 3 and posted == [[]] * 3  # one update a step on each rank, none read
        assert all(norm > 0.05 for norm in grad_norms)  # clipping was active: the norm was computed


@pytest.mark.multirank
def test_a_stage_clipped_by_its_own_norm_reads_it_when_posting():
    """The same recorder, where a read is due: the update is applied inside post, its norm read once —
    from the second step on together with the previous step's statistics (one `tolist`)."""
    for posted, _ in run_ranks(2, _reads_while_posting, "stage", 3):
        assert posted == [["item"], ["tolist"], ["tolist"]]
