"""From gradients to an update (hf_asyncpp/update/): when the host reads a gradient norm, and how the run's
last update ends under Error Feedback (ef_last_update).

On a GPU a host read of a device value waits for every kernel queued before it. A stage of an
asynchronous pipeline that clips by its own norm needs the value at once (to clip, or skip a non-finite
update); one that clips by the global norm posts its squared norm to an all-reduce and holds the update,
and must read nothing until the update is applied, or the host would wait for the backward there
instead of queueing the next forward. CPU tensors have no queue, so the rule is checked where it lives:
the Python-level reads (tests/host_reads.py) made while an update is posted.

Error Feedback moves the weights by u_t + λ(u_t − u_{t−1}); under `ef_last_update: trajectory` the run's
last update of each stage lands them on the trajectory of the optimizer's updates alone, z_0 − Σ u_t. Every kind of run is held to the written rule replayed by
hand with torch.optim (tests/executors/test_asynchronous_references.py, `replay`), where the last update is the last
unit of the last step by construction, and to the other setting's rule, which must miss it.
"""

from __future__ import annotations

import pytest
import torch

from tests.host_reads import host_reads_recorded
from tests.ranks import run_ranks
from tests.test_engine import small_model_config
from tests.engine_runs import MBS, SEQ, M, token_rows
from tests.executors.test_asynchronous_references import CLIPPED_SGD, _check, _pipeline, replay


def _reads_while_posting(rank, world_size, scope, steps):
    """PipeDream-2BW on 2 ranks clipping by `scope`: the host reads made inside each `HeldNorms.post`."""
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.update.held import HeldNorms

    layout = init_parallel(read_launch(), 2)
    posted, original = [], HeldNorms.post

    def post_recording_reads(self, *args, **kwargs):
        with host_reads_recorded() as reads:
            original(self, *args, **kwargs)
        posted.append([read.kind for read in reads])

    HeldNorms.post = post_recording_reads
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=2, schedule="pipedream-2bw", optimizer="adamw",
                             learning_rate=3e-3, max_grad_norm=0.05, grad_clip_scope=scope, seq_len=SEQ,
                             micro_batch_size=MBS, n_microbatches=M, seed=4, max_steps=steps)
        engine = PipelineEngine(config, model_config, layout)
        rows = token_rows(model_config.vocab_size, 1)
        results = [engine.train_step(rows[k], rows[k + 1] if k + 1 < steps else None) for k in range(steps)]
        engine.finish()
        return posted, [r.grad_norm for r in results]
    finally:
        HeldNorms.post = original
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


EF_LAST_UPDATE = {  # (schedule, ranks, stages, emulated depth, the delay of stage s, per-microbatch updates, clip)
    "synchronous (gpipe), one process": ("gpipe", 1, 1, 0, lambda s: 0, False, None),
    "pipedream-2bw emulated at depth 2": ("pipedream-2bw", 1, 2, 2, lambda s: 1, False, None),
    "pipedream emulated at depth 2 (an update per microbatch)": ("pipedream", 1, 2, 2, lambda s: 1 - s, True, None),
    # The last updates applied in the draining step, once the pipeline's norm is in.
    "pipedream-2bw at pp 2, held for the global norm": ("pipedream-2bw", 2, 2, 0, lambda s: 1, False,
                                                        ("global", CLIPPED_SGD["max_norm"])),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(EF_LAST_UPDATE))
def test_ef_last_update_trajectory_ends_at_the_sum_of_the_optimizer_s_updates(case):
    """Both settings train identically (the same per-step losses, bit for bit: the last update follows the
    last loss), and end at the weights of their own rule: trajectory's at z_T = z_0 − Σ u_t, which the
    reference sums apart from the EF weights; extrapolate's λ u_T past it, far above the tolerance."""
    schedule, ranks, n_stages, depth, delay, per_microbatch, clip = EF_LAST_UPDATE[case]
    runs = {mode: next(r for r in run_ranks(ranks, _pipeline, schedule, n_stages, 0, depth, clip, mode) if r)
            for mode in ("extrapolate", "trajectory")}
    rules = {mode: replay(n_stages, delay, per_microbatch, clip=clip, ef_last_update=mode) for mode in runs}
    assert runs["trajectory"][0] == runs["extrapolate"][0]
    _check(runs["trajectory"], rules["trajectory"], rules["extrapolate"])
    _check(runs["extrapolate"], rules["extrapolate"], rules["trajectory"])


def test_the_last_update_is_counted_with_the_skipped_ones():
    """max_steps 4, the second update skipped (a non-finite norm): the fourth decided is the run's last and
    plain, though the LR schedule has counted two applied updates before it. Reference: SGD with momentum on
    the applied gradients (its updates u do not depend on the weights), and EF's formula by hand."""
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.update.gradients import GradNorm
    from hf_asyncpp.update.report import StepReport
    from hf_asyncpp.update.rule import UpdateRule
    from hf_asyncpp.update.updater import Updater

    grads = [torch.tensor([[0.5, -1.0, 2.0]]), None, torch.tensor([[-0.2, 0.8, 0.1]]), torch.tensor([[0.9, -0.4, 1.1]])]
    sgd = dict(lr=0.1, momentum=0.9)
    config = TrainConfig(optimizer="sgd", learning_rate=sgd["lr"], momentum=sgd["momentum"], weight_decay=0.0,
                         max_grad_norm=0.0, lr_scheduler_type="constant", max_steps=len(grads), ef=True,
                         ef_lambda=0.5, ef_last_update="trajectory")
    module = torch.nn.Linear(3, 1, bias=False)
    start = module.weight.detach().clone()
    updater = Updater(config, [0], [0], [module], order=None)
    rule = UpdateRule(config.max_grad_norm, StepReport())
    for grad in grads:
        module.weight.grad = torch.zeros(1, 3) if grad is None else grad.clone()
        value = float("inf") if grad is None else 1.0
        rule.apply(updater, GradNorm(value, torch.tensor(value, dtype=torch.float64)))

    plain_sgd = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.SGD([plain_sgd], **sgd)
    # SGD's updates do not depend on the weights: the trajectory of the applied gradients is plain SGD's end.
    for grad in (g for g in grads if g is not None):
        plain_sgd.grad = grad.clone()
        optimizer.step()
    torch.testing.assert_close(module.weight.detach(), plain_sgd.detach(), rtol=0, atol=1e-6)
    assert updater.skipped_updates == 1 and updater.lr_scheduler.last_epoch == 3
