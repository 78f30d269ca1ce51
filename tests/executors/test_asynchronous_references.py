"""Asynchronous pipelines follow their update rules as written, checked against references that use
nothing of this project: the unsplit HF model, torch.optim.AdamW, and the rule replayed by hand.

Written rules (docs/ARCHITECTURE.md, "Update semantics"; x_s(v): stage s's weights after v updates,
t: the update unit, versions never below 0):

- PipeDream: an update per microbatch; the gradient of microbatch t is taken at a model whose stage s
  holds x_s(t − (p − 1 − s)), and applied to the current x_s(t).
- WPipe: 2p stages, an update per minibatch; the gradient of minibatch k is taken at
  (a(k − 1), b(k)) — the first half of the stages (group 1) one update old, the second half
  (group 2) current — and applied to the current weights.
- sync_steps N: the units of steps 0 … N−1 are plain synchronous updates; from step N on, the rule
  starts afresh from the weights they reached (versions never below the N steps' update count U):
  2BW's minibatch k runs on x(max(k − 1, N)), PipeDream's stage s on x_s(max(t − (p − 1 − s), U)).

The model is dense (tiny-llama): top-k routing is discontinuous, so a rounding difference of 1e-7
can send a near-tied token to another expert and move weights by a whole update (seen once: 5e-3
after 24 AdamW updates of tiny-qwen3-moe); the rules are about weight versions, not routing, and the
MoE families are held to the emulator in tests/executors/test_asynchronous.py.

The pipeline runs on 2 and 4 gloo ranks with the same initial weights (handed in as the model) and
explicit stage boundaries, so the reference knows which stage a parameter belongs to without asking
the project. Clipping is off in the rules' tests, and the subject of its own: the stale gradient
being applied is clipped by its norm over the whole model (grad_clip_scope global; 2BW and PipeDream),
or each stage's part by its own norm (stage; WPipe, which cannot clip globally). Those run SGD with
momentum, where a clipping factor changes the update in proportion (AdamW nearly divides it out).
Tolerance 1e-5 on every weight and
per-step loss: both sides are fp32 and run the same kernels on the same microbatches (fused AdamW,
as the engine), and are seen equal bit for bit here; a different summation order (other thread
counts, foreach AdamW) moves them by ~1e-7 per update, which AdamW amplifies in tiny second moments
(foreach on the reference side: 1.2e-5 after 24 updates — so fused it is). Each test also replays
a plausible wrong rule (one update more stale, both WPipe groups stale, no sync start) and requires
it to miss the pipeline by more than 100× the tolerance (seen: 2e-2 to 7e-2), so the comparison can
fail; making the engine's WPipe second half stale fails it by 2e-2, and decaying norm weights
(which Trainer's rule, and so the engine, exempts) by 2e-4.
"""

from __future__ import annotations

import bisect
import copy

import pytest

from tests.ranks import run_ranks
from tests.test_engine import small_model_config

TOL = 1e-5
SEQ, MBS, M, STEPS = 16, 2, 4, 6
PRESET = "tiny-llama"  # dense: see the module docstring
LR, BETAS, WEIGHT_DECAY = 3e-3, (0.9, 0.95), 0.01
# Clipping's tests: a norm below every gradient's (0.7 to 2.3 here), so every update is clipped.
CLIPPED_SGD = dict(lr=0.1, momentum=0.9, max_norm=0.2)
# Error Feedback's λ where a test turns it on (tests/update/test_updates.py): not 1, so that a rule dropping λ fails;
# a power of two, so that λ·(u − u_prev) rounds alike on both sides.
EF_LAMBDA = 2.0


def _initial_model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(small_model_config(PRESET)).float().train()


def _rows(vocab_size):
    import torch

    gen = torch.Generator().manual_seed(21)
    return [torch.randint(0, vocab_size, (MBS * M, SEQ), generator=gen) for _ in range(STEPS)]


def _boundaries(n_stages: int) -> list[int]:
    """First layer of each stage after the first: the 8 layers cut evenly."""
    return [8 * s // n_stages for s in range(1, n_stages)]


def _pipeline(rank, world_size, schedule, n_stages, sync_steps=0, emulate_depth=0, clip=None, ef_last_update=None):
    """The engine on `world_size` ranks (one pipeline; on one rank the emulator at `emulate_depth`):
    per-step losses, final weights and version ages (on rank 0). `clip`: (scope, max_grad_norm),
    with SGD (CLIPPED_SGD); None: AdamW, no clipping. `ef_last_update`: Error Feedback on (EF_LAMBDA),
    its last update this (None: off)."""
    from hf_asyncpp.checkpoint import gather_full_state_dict
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), world_size)
    try:
        model = _initial_model()
        optimizer = dict(optimizer="adamw", learning_rate=LR, momentum=BETAS[0], beta2=BETAS[1], max_grad_norm=0.0)
        if clip is not None:
            optimizer = dict(optimizer="sgd", learning_rate=CLIPPED_SGD["lr"], momentum=CLIPPED_SGD["momentum"],
                             grad_clip_scope=clip[0], max_grad_norm=clip[1])
        config = TrainConfig(model_config=PRESET, pp_size=world_size, schedule=schedule, **optimizer,
                             weight_decay=WEIGHT_DECAY, lr_scheduler_type="constant", seq_len=SEQ, micro_batch_size=MBS,
                             n_microbatches=M, max_steps=STEPS, stage_boundaries=_boundaries(n_stages),
                             sync_steps=sync_steps, emulate_pp_size=emulate_depth, ef=ef_last_update is not None,
                             ef_lambda=EF_LAMBDA, ef_last_update=ef_last_update or "extrapolate")
        engine = PipelineEngine(config, model.config, layout, model=model)
        rows = _rows(model.config.vocab_size)
        results = [engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None) for k in range(STEPS)]
        engine.finish()
        state = gather_full_state_dict(engine.stage_state_dict(), layout)
        ages = [r.weight_version_age_per_stage for r in results]
        return None if state is None else ([r.loss for r in results], {k: v.tolist() for k, v in state.items()}, ages)
    finally:
        shutdown_parallel()


def replay(n_stages: int, delay_of_stage, per_microbatch: bool, sync_steps: int = 0, clip=None, ef_last_update=None):
    """The written rule on the unsplit HF model with torch.optim.AdamW: each unit's gradient is taken
    on a copy holding every parameter at the version its stage's delay says, then applied to the
    current weights. `clip` (scope, max_grad_norm): torch.optim.SGD instead, the gradient clipped
    first by torch's clip_grad_norm_ over the whole model ("global") or over each stage's part
    ("stage"). `ef_last_update`: Error Feedback's formula on top (the weights move by u_t + λ(u_t − u_{t−1}),
    u the optimizer's update, λ EF_LAMBDA); with "trajectory" the run's last unit sets the weights to the
    trajectory of the updates alone, z_0 − Σ u_t, kept apart from the EF weights (None: no EF).
    Returns (per-step mean LM losses, final named parameters)."""
    import torch
    from transformers import Trainer

    current = _initial_model()
    stale = copy.deepcopy(current)
    coef = getattr(current.config, "router_aux_loss_coef", 0.0)
    boundaries = _boundaries(n_stages)

    def stage_of(name: str) -> int:
        if name.startswith("model.layers."):
            return bisect.bisect_right(boundaries, int(name.split(".")[2]))
        return 0 if name.startswith("model.embed_tokens") else n_stages - 1

    delay = {name: delay_of_stage(stage_of(name)) for name, _ in current.named_parameters()}
    # Weight decay on what transformers.Trainer decays (not biases, not norm weights), as documented.
    decayed = set(Trainer.get_decay_parameter_names(None, current))
    groups = [dict(params=[p for n, p in current.named_parameters() if (n in decayed) == decay],
                   weight_decay=WEIGHT_DECAY if decay else 0.0) for decay in (True, False)]
    if clip is None:
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=True)
    else:
        optimizer = torch.optim.SGD(groups, lr=CLIPPED_SGD["lr"], momentum=CLIPPED_SGD["momentum"], foreach=True)
    scope, max_norm = clip or ("global", 0.0)
    clipped_together = [[p for n, p in current.named_parameters() if scope == "global" or stage_of(n) == s]
                        for s in range(1 if scope == "global" else n_stages)]
    history = [{n: p.detach().clone() for n, p in current.named_parameters()}]  # history[v]: after v updates
    units_per_step = M if per_microbatch else 1
    previous_update = {n: torch.zeros_like(p) for n, p in current.named_parameters()}  # EF's u_{t−1}
    trajectory = {n: p.detach().clone() for n, p in current.named_parameters()}  # z_t: the updates alone
    losses = []
    for k, rows in enumerate(_rows(current.config.vocab_size)):
        microbatches = rows.chunk(M)
        units = [[mb] for mb in microbatches] if per_microbatch else [list(microbatches)]
        lm = 0.0
        for unit in units:
            t = len(history) - 1  # updates so far
            start = sync_steps * units_per_step  # where the delayed rule starts afresh
            with torch.no_grad():
                for name, param in stale.named_parameters():
                    version = t if k < sync_steps else max(t - delay[name], start)
                    param.copy_(history[version][name])
            stale.zero_grad(set_to_none=True)
            for mb in unit:
                out = stale(input_ids=mb, labels=mb)
                (out.loss / len(unit)).backward()
                lm += (out.loss - coef * getattr(out, "aux_loss", 0.0)).item() / M
            for p, q in zip(current.parameters(), stale.parameters()):
                p.grad = q.grad.clone()
            for params in clipped_together if max_norm else ():
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
            last_unit = k == STEPS - 1 and unit is units[-1]
            with torch.no_grad():
                for name, param in current.named_parameters() if ef_last_update else ():
                    update = history[-1][name] - param  # u_t: the weights before the step minus after it
                    trajectory[name].sub_(update)
                    if last_unit and ef_last_update == "trajectory":
                        param.copy_(trajectory[name])
                    else:
                        param.sub_(update - previous_update[name], alpha=EF_LAMBDA)
                    previous_update[name] = update
            history.append({n: p.detach().clone() for n, p in current.named_parameters()})
        losses.append(lm)
    return losses, dict(current.named_parameters())


def _distance(pipeline, reference) -> tuple[float, float]:
    """(largest weight difference, largest per-step loss difference)."""
    import torch

    losses, state, _ = pipeline
    ref_losses, ref_params = reference
    assert ref_params.keys() <= state.keys()
    weights = max((torch.tensor(state[n]) - ref_params[n].detach()).abs().max().item() for n in ref_params)
    return weights, max(abs(a - b) for a, b in zip(losses, ref_losses))


def _check(pipeline, rule, wrong_rule):
    weights, losses = _distance(pipeline, rule)
    assert weights < TOL and losses < TOL, (weights, losses)
    missed_by, _ = _distance(pipeline, wrong_rule)
    assert missed_by > 100 * TOL, missed_by


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size", [2, 4])
def test_pipedream_follows_its_per_stage_delay_rule(pp_size):
    """Stage s's gradient is taken at weights p − 1 − s microbatch updates old."""
    pipeline = next(r for r in run_ranks(pp_size, _pipeline, "pipedream", pp_size) if r)
    rule = replay(pp_size, lambda s: pp_size - 1 - s, per_microbatch=True)
    off_by_one = replay(pp_size, lambda s: pp_size - s, per_microbatch=True)
    _check(pipeline, rule, off_by_one)
    assert pipeline[2][-1] == [pp_size - 1 - s for s in range(pp_size)]


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size", [2, 4])
def test_wpipe_follows_its_one_stale_half_rule(pp_size):
    """Group 1 (stages 0 … p−1) one minibatch update old, group 2 (p … 2p−1) current."""
    n_stages = 2 * pp_size
    pipeline = next(r for r in run_ranks(pp_size, _pipeline, "wpipe", n_stages) if r)
    rule = replay(n_stages, lambda s: 1 if s < pp_size else 0, per_microbatch=False)
    both_stale = replay(n_stages, lambda s: 1, per_microbatch=False)
    _check(pipeline, rule, both_stale)



SYNC_START = {  # schedule: (stages at pp 2, the delay of stage s, per-microbatch updates)
    "pipedream-2bw": (2, lambda s: 1, False),
    "pipedream": (2, lambda s: 1 - s, True),
    "wpipe": (4, lambda s: 1 if s < 2 else 0, False),
}


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", sorted(SYNC_START))
def test_sync_start_runs_synchronous_steps_then_the_delayed_rule_and_the_emulator_agrees(schedule):
    """sync_steps 2 at pp 2: steps 0 and 1 synchronous (every gradient at the current weights), then
    the schedule from the weights they reached, as from the start of training (2BW: step 2
    undelayed, as 2BW's first step is, then one update stale). The emulator at depth 2 runs the same
    steps. Wrong rule: the same schedule without sync start."""
    import torch

    n_stages, delay, per_microbatch = SYNC_START[schedule]
    pipeline = next(r for r in run_ranks(2, _pipeline, schedule, n_stages, 2) if r)
    rule = replay(n_stages, delay, per_microbatch, sync_steps=2)
    without_sync_start = replay(n_stages, delay, per_microbatch)
    _check(pipeline, rule, without_sync_start)
    ages = pipeline[2]
    assert ages[:2] == [[0] * n_stages] * 2 and ages[-1] == [delay(s) for s in range(n_stages)], ages
    if schedule == "pipedream-2bw":
        assert ages == [[0, 0]] * 3 + [[1, 1]] * (STEPS - 3)
    emulated = run_ranks(1, _pipeline, schedule, n_stages, 2, 2)[0]
    assert emulated[0] == pytest.approx(pipeline[0], abs=TOL)
    if schedule != "wpipe":  # WPipe's pipeline reports a group-1 update in the step that applies it, the next
        assert emulated[2] == ages
    for name, value in pipeline[1].items():
        assert (torch.tensor(emulated[1][name]) - torch.tensor(value)).abs().max().item() < TOL, name


CLIPPING = {  # (schedule, sync_steps, pp size, stages, the delay of stage s, per-microbatch updates, scope, the other)
    "pipedream-2bw, pp 2": ("pipedream-2bw", 0, 2, 2, lambda s: 1, False, "global", "stage"),
    "pipedream-2bw, pp 4": ("pipedream-2bw", 0, 4, 4, lambda s: 1, False, "global", "stage"),
    "pipedream-2bw after 2 synchronous steps, pp 2": ("pipedream-2bw", 2, 2, 2, lambda s: 1, False, "global", "stage"),
    "pipedream, pp 2": ("pipedream", 0, 2, 2, lambda s: 1 - s, True, "global", "stage"),
    "pipedream-2bw by stage, pp 2": ("pipedream-2bw", 0, 2, 2, lambda s: 1, False, "stage", "global"),
    "wpipe by stage, pp 2": ("wpipe", 0, 2, 4, lambda s: 1 if s < 2 else 0, False, "stage", "global"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CLIPPING))
def test_clipping_scales_the_applied_gradient_by_the_norm_its_scope_says(case):
    """max_grad_norm below every gradient's norm: the delayed gradient being applied is scaled by
    max_grad_norm / its norm over the whole model (global), or each stage's part by its own (stage),
    as torch's clip_grad_norm_ does on the unsplit model. Wrong rule: the other scope."""
    schedule, sync_steps, pp_size, n_stages, delay, per_microbatch, scope, other = CLIPPING[case]
    max_norm = CLIPPED_SGD["max_norm"]
    pipeline = next(r for r in run_ranks(pp_size, _pipeline, schedule, n_stages, sync_steps, 0, (scope, max_norm)) if r)
    rule = replay(n_stages, delay, per_microbatch, sync_steps, clip=(scope, max_norm))
    other_scope = replay(n_stages, delay, per_microbatch, sync_steps, clip=(other, max_norm))
    _check(pipeline, rule, other_scope)


@pytest.mark.multirank
@pytest.mark.parametrize("depth", [2, 4])
def test_the_emulator_clips_by_the_global_norm_at_any_depth(depth):
    """One process emulating 2BW at depth 2 or 4 (its stages chained, each with its own optimizer)
    clips each update by the norm over all of them, as the written rule and the pipeline do."""
    max_norm = CLIPPED_SGD["max_norm"]
    emulated = run_ranks(1, _pipeline, "pipedream-2bw", depth, 0, depth, ("global", max_norm))[0]
    rule = replay(depth, lambda s: 1, False, clip=("global", max_norm))
    by_stage = replay(depth, lambda s: 1, False, clip=("stage", max_norm))
    _check(emulated, rule, by_stage)
