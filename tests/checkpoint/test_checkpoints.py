"""Training checkpoints: a run resumed from a checkpoint continues exactly as if never stopped.

Engines on real gloo ranks train STEPS steps straight through, and again as A steps → save → a fresh
engine (new process state: new model, optimizer, schedule) → load → STEPS − A steps. fp32 on CPU with
the same kernels in the same order: the per-step losses and the final weights must be bitwise equal.
"""

from __future__ import annotations

import pytest

from hf_asyncpp.parallel.spawn import run_ranks
from tests.test_engine import small_model_config

SEQ, MBS, M, STEPS, AT = 16, 2, 4, 6, 3


def _config(layout, schedule, optimizer, ef, output_dir, **extra):
    from hf_asyncpp.config import TrainConfig

    lr = {"adamw": 3e-3, "muon": 2e-2, "soap": 3e-3, "sgd": 0.3, "lion": 3e-4}[optimizer]
    return TrainConfig(model_config="tiny-qwen3-moe", pp_size=layout.pp_size, schedule=schedule, optimizer=optimizer,
                       learning_rate=lr, ef=ef, seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=3,
                       max_steps=STEPS, warmup_steps=2, output_dir=output_dir, **extra)


def _rows(layout, vocab):
    import torch

    gen = torch.Generator().manual_seed(5)
    full = [torch.randint(0, vocab, (layout.dp_size * MBS * M, SEQ), generator=gen) for _ in range(STEPS)]
    return [r.chunk(layout.dp_size)[layout.dp_rank] for r in full]


def _steps(engine, rows, start, stop):
    return [engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None).loss for k in range(start, stop)]


def _resume_equals_straight_run(rank, world_size, pp_size, schedule, optimizer, ef, output_dir):
    from hf_asyncpp.checkpoint.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = _config(layout, schedule, optimizer, ef, output_dir)
        rows = _rows(layout, model_config.vocab_size)
        straight = PipelineEngine(config, model_config, layout)
        straight_losses = _steps(straight, rows, 0, STEPS)
        straight.finish()
        expected = straight.stage_state_dict()

        first = PipelineEngine(config, model_config, layout)
        losses = _steps(first, rows, 0, AT)
        save_checkpoint(first, layout, output_dir, AT, {"schedule": schedule}, save_total_limit=1)
        resumed = PipelineEngine(config, model_config, layout)  # fresh weights, optimizer, schedule
        trainer_state = load_checkpoint(resumed, layout, find_checkpoint("latest", output_dir))
        resumed.step_count = trainer_state["step"]
        losses += _steps(resumed, rows, AT, STEPS)
        resumed.finish()
        state = resumed.stage_state_dict()
        return dict(loss_diff=max(abs(a - b) for a, b in zip(losses, straight_losses)),
                    param_diff=max((state[n] - expected[n]).abs().max().item() for n in expected))
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, pp_size, schedule, optimizer, ef", [
    (2, 2, "1f1b", "adamw", False),
    (2, 1, "gpipe", "muon", True),  # dp 2, sharded with FSDP2: optimizer state and EF as DTensors
    (2, 2, "interleaved-1f1b", "soap", False),
])
def test_a_resumed_synchronous_run_continues_bitwise(tmp_path, world_size, pp_size, schedule, optimizer, ef):
    for row in run_ranks(world_size, _resume_equals_straight_run, pp_size, schedule, optimizer, ef, str(tmp_path)):
        assert row == dict(loss_diff=0.0, param_diff=0.0), row
