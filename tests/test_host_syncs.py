"""The host-sync budget of a steady training step (docs/ARCHITECTURE.md, "Host syncs"): reads and uploads.

On 2 gloo ranks (pp 2), every host read of a tensor made inside `train_step` is recorded with its call
site (tests/host_reads.py), over steps that are neither the first (torch's stage infers shapes) nor
the drain. The budget: no read inside a microbatch's forward, backward or loss (an update a forward
waits for before its compute is budgeted per update, below); per step and rank, one
read under a synchronous schedule (its gradient norm, with the previous step's reduced statistics in
the same transfer); under an asynchronous one, one per update applied — the host decides there
whether a non-finite update is skipped — and nothing more: one of them carries the previous step's
statistics (update/held.statistics_read). So PipeDream-2BW reads once a step, however it clips.
"""

from __future__ import annotations

import pytest

from tests.host_reads import READS, host_reads_recorded
from tests.ranks import run_ranks
from tests.test_engine import small_model_config
from tests.engine_runs import MBS, SEQ, M, token_rows

STEPS = 5  # steps 2..4 are steady: the first infers shapes, the fifth drains
STEADY = range(1, STEPS - 1)
# Functions a microbatch runs in: a read under one of them happens m times a step.
MICROBATCH_FRAMES = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "PipelineLoss.__call__",
                     "PipelineStageModule.forward")
# Except under the wait for an update, which a forward's weight_version hook (schedules/stage_hooks.py)
# makes before the forward's compute, once per update: what it reads is budgeted per update.
UPDATE_AWAITED = "AsyncPipelineSchedule._await_for"


def _in_microbatch(stack) -> bool:
    """Whether a read's callers, up to train_step or an awaited update, include a microbatch's compute."""
    inside = stack[:stack.index("PipelineEngine.train_step")] if "PipelineEngine.train_step" in stack else stack
    inside = inside[:inside.index(UPDATE_AWAITED)] if UPDATE_AWAITED in inside else inside
    return any(frame.endswith(MICROBATCH_FRAMES) for frame in inside)


def _reads_per_step(rank, world_size, schedule, optimizer, scope, ef):
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), 2)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=2, schedule=schedule, optimizer=optimizer,
                             ef=ef, learning_rate=3e-3, max_grad_norm=0.0 if scope == "none" else 0.05,
                             grad_clip_scope="global" if scope == "none" else scope, seq_len=SEQ,
                             micro_batch_size=MBS, n_microbatches=M, seed=4, max_steps=STEPS)
        engine = PipelineEngine(config, model_config, layout)
        rows = token_rows(model_config.vocab_size, 1)
        per_step, updates = [], []
        for k in range(STEPS):
            next_rows = rows[k + 1] if engine.forwards_ahead and k + 1 < STEPS else None
            applied = []
            original_step = engine.executor.update_rule.apply

            def counting_step(*args, **kwargs):
                applied.append(1)
                return original_step(*args, **kwargs)

            engine.executor.update_rule.apply = counting_step
            with host_reads_recorded() as reads:
                engine.train_step(rows[k], next_rows)
            engine.executor.update_rule.apply = original_step
            per_step.append([(r.kind, r.site, _in_microbatch(r.stack)) for r in reads])
            updates.append(len(applied))
        engine.finish()
        return per_step, updates, engine.executor.forwards_ahead
    finally:
        shutdown_parallel()


def test_the_recorder_sees_each_kind_of_host_read():
    import torch

    value, mask, index = torch.tensor([2.0]), torch.tensor([True]), torch.tensor(1)
    with host_reads_recorded() as reads:
        value.item(), value.tolist(), value.cpu(), float(value), bool(value), value.numpy(), int(value)
        [0, 1][index], value.nonzero(), value.unique(), value.masked_select(mask)
        torch.nonzero(value), torch.unique(value), torch.masked_select(value, mask), value.to("cpu")
        value.to(torch.float64), value.to(value.device)  # neither a host copy
        torch.tensor([1.0]), torch.as_tensor(2.0)  # host values for the device: uploads
    assert [read.kind for read in reads] == list(READS) + ["nonzero", "unique", "masked_select", "to('cpu')",
                                                           "upload: torch.tensor", "upload: torch.as_tensor"]
    assert all(read.site.startswith("tests/test_host_syncs.py:") for read in reads)


CONFIGS = [
    ("pipedream-2bw", "adamw", "global", True),
    ("1f1b", "adamw", "global", False),
    ("pipedream", "adamw", "stage", False),
    ("gpipe", "muon", "global", False),
    ("pipedream-2bw", "soap", "stage", False),
    ("wpipe", "lion", "stage", False),
    ("interleaved-1f1b", "adamw", "global", True),
    ("zbv", "sgd", "global", False),
    ("pipedream", "sgd", "global", True),
    ("pipedream-2bw", "muon", "none", False),  # no clipping: the norm still decides a skip
    ("1f1b", "soap", "none", True),
]


@pytest.mark.multirank
@pytest.mark.parametrize("schedule,optimizer,scope,ef", CONFIGS)
def test_a_steady_step_reads_the_device_once_or_once_per_asynchronous_update(schedule, optimizer, scope, ef):
    for rank, (per_step, updates, asynchronous) in enumerate(run_ranks(2, _reads_per_step, schedule, optimizer,
                                                                       scope, ef)):
        for k in STEADY:
            reads = per_step[k]
            assert not [r for r in reads if r[2]], f"rank {rank} step {k + 1}: a read per microbatch: {reads}"
            # The previous step's statistics ride with the step's gradient norm (synchronous), or with
            # one of its updates' norms (asynchronous): never a read of their own.
            budget = max(updates[k], 1) if asynchronous else 1
            assert len(reads) <= budget, f"rank {rank} step {k + 1}: {len(reads)} reads, {updates[k]} updates: {reads}"
            if schedule == "pipedream-2bw":  # issue 38: a steady 2BW step reads at most once on each rank
                assert updates[k] == 1 and len(reads) == 1, (rank, k + 1, updates[k], reads)
