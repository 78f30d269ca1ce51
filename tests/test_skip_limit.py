"""`nonfinite_skip_limit` stops an asynchronous pipeline, whatever decides its updates' fate.

Engines on two gloo ranks (pp 2, `nonfinite_policy: skip`, limit 1) train minibatches of which two,
far apart, hold a row whose loss tests/faults.py makes NaN. Each such minibatch costs its update on
every stage; the first is allowed, the second exceeds the limit: the run stops with NonFiniteError
then, and not before, each skipped update counted once, with the step of its gradient.

- PipeDream-2BW clipped by the global norm: a stage holds its update until the pipeline's norm is in
  (update/held.py), so the skip is decided in the step after the gradient's; it is still counted with the
  gradient's step, and the stop comes two steps after it (the outcome travels in the next step's
  statistics).
- PipeDream clipped per stage: each stage decides at once, one step after the step it reviews.
"""

from __future__ import annotations

import pytest
import torch

from tests.ranks import run_ranks
from tests.test_engine import small_model_config

SEQ, MBS, M, STEPS, POISONED = 16, 2, 4, 9, (1, 4)
TOKEN = 127  # starts one row of each poisoned minibatch, and no other


def _run_until_stopped(rank, world_size, schedule: str, clip_scope: str):
    """Train until NonFiniteError: (steps run, its message, the steps the guard counted)."""
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.resilience import NonFiniteError
    from tests.faults import plant_poison

    remove_poison = plant_poison(TOKEN)
    layout = init_parallel(read_launch(), 2)
    try:
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=2, schedule=schedule, optimizer="adamw",
                             learning_rate=3e-3, grad_clip_scope=clip_scope, seq_len=SEQ, micro_batch_size=MBS,
                             n_microbatches=M, seed=4, max_steps=STEPS, nonfinite_policy="skip",
                             nonfinite_skip_limit=1)
        engine = PipelineEngine(config, small_model_config("tiny-qwen3-moe"), layout)
        rows = torch.randint(0, 120, (STEPS, MBS * M, SEQ), generator=torch.Generator().manual_seed(2))
        for k in POISONED:
            rows[k, MBS, 0] = TOKEN  # the first row of microbatch 1
        try:
            for k in range(STEPS):
                engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None)
            engine.finish()
        except NonFiniteError as err:
            return engine.step_count, str(err), engine.guard.skipped_steps
        return engine.step_count, None, engine.guard.skipped_steps
    finally:
        shutdown_parallel()
        remove_poison()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, clip_scope, gradient_steps, stopped_at", [
    # Minibatch k's loss and gradient come in step k + 1; its held update is decided in step k + 2 and
    # reviewed with that step's statistics at the end of step k + 3.
    ("pipedream-2bw", "global", [2, 5], 7),
    # Per-microbatch updates, each decided at once; reviewed at the end of the next step.
    ("pipedream", "stage", [2, 5], 6),
])
def test_the_skip_limit_stops_the_run_at_the_first_skip_beyond_it(schedule, clip_scope, gradient_steps, stopped_at):
    results = run_ranks(2, _run_until_stopped, schedule, clip_scope)
    for steps, message, counted in results:  # every rank, identically
        assert (steps, counted) == (stopped_at, gradient_steps), (steps, counted, message)
        first, second = gradient_steps
        assert message.startswith(f"step {second}: NaN or infinity ")
        assert "in the gradient of stages 0, 1; the update of stages 0, 1 was skipped. That is 2 steps with " \
               f"skipped updates (steps {first}, {second}), more than nonfinite_skip_limit (1)" in message
