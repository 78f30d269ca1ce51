"""An asynchronous stage's update in one process (update/stage.py): the gradient moved to the master, the
norm posted and held for the pipeline's (a "fake" process group stands in for the other ranks: its
all-reduce leaves this stage's squared norm as it is), applied when `complete` asks for it, clipped by the
held norm, through Error Feedback; a non-finite update skipped with its version still published; a held
update settled, saved and resumed.

Every weight is compared with an independent replay written from the update rule alone: SGD with momentum
(its update u_t = lr · buf_t, buf_t = μ buf_{t−1} + g_t, does not depend on the weights), each unit's
gradient taken by autograd at the weight version it was computed on, clipped by max_norm / (‖g‖ + 1e-6)
clamped to 1, and Error Feedback's x ← x − u_t − λ (u_t − u_{t−1}). A held update dropped, applied twice
or applied out of order moves the weights off the replay. Tolerance 1e-6: the clip coefficient is computed
in float32 (torch's clip_grads_with_norm_) and the replay in float64, on weights of order 1."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist

from hf_asyncpp.config import TrainConfig
from hf_asyncpp.schedules import get_schedule_spec
from hf_asyncpp.update.gradients import GradientNorms
from hf_asyncpp.update.held import HeldNorms
from hf_asyncpp.update.report import StepReport
from hf_asyncpp.update.rule import UpdateRule
from hf_asyncpp.update.stage import StageUpdate
from hf_asyncpp.update.updater import Updater
from hf_asyncpp.update.versions import VersionedStage

LR, MOMENTUM, LAMBDA, MAX_NORM = 0.1, 0.9, 0.5, 0.5
START = torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.4, -0.6]])
INPUTS = [torch.tensor([[1.0, 2.0, -1.0]]), torch.tensor([[0.5, -1.5, 2.0]]), torch.tensor([[-2.0, 0.5, 1.0]]),
          torch.tensor([[1.5, 1.0, 0.5]]), torch.tensor([[-0.5, -1.0, 2.5]])]


@pytest.fixture
def pipeline_group():
    """A process group of two ranks in this one process; its collectives compute nothing."""
    from hf_asyncpp.torch_internals import fake_store

    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _loss(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x @ weight.T).pow(2).sum()


class Stage:
    """Stage 0 of PipeDream-2BW at pp 2 (two weight versions): a bias-free linear layer and its update."""

    def __init__(self, group, ef: bool, max_norm: float = MAX_NORM, max_steps: int = 5):
        self.config = TrainConfig(optimizer="sgd", learning_rate=LR, momentum=MOMENTUM, weight_decay=0.0,
                                  max_grad_norm=max_norm, lr_scheduler_type="constant", max_steps=max_steps,
                                  ef=ef, ef_lambda=LAMBDA, n_microbatches=1, pp_size=2, schedule="pipedream-2bw")
        order = get_schedule_spec("pipedream-2bw").order
        self.module = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.module.weight.copy_(START)
        self.versioned = VersionedStage(self.module, order.n_buffers(0, 2, 1))
        self.updater = Updater(self.config, [0], [0], [self.module], order)
        self.report = StepReport()
        layout = types.SimpleNamespace(pp_size=2, dp_size=1, device=torch.device("cpu"), dp_group=None,
                                       norm_pp_group=group)
        self.held = HeldNorms(GradientNorms(layout, [self.module], [0], True, self.report), global_norm=True)
        self.update = StageUpdate(0, 0, self.versioned, self.updater, None, self.held,
                                  UpdateRule(max_norm, self.report), order, self.config, 2)

    def backward(self, version: int, x: torch.Tensor) -> None:
        """A microbatch's forward and backward on weight version `version`."""
        self.versioned.active = self.update.buffer(version)
        self.versioned(x).pow(2).sum().backward()

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight.detach().clone()


class Replay:
    """The rule by hand: versions[v] the weights after v updates."""

    def __init__(self, ef: bool, max_norm: float = MAX_NORM):
        self.ef, self.max_norm = ef, max_norm
        self.versions = [START.double()]
        self.buf = self.previous = None

    def update(self, version: int, x: torch.Tensor | None) -> None:
        """Apply the gradient taken at `version` on input `x` (None: a skipped, non-finite update: the
        weights stay, but count as a version)."""
        weights = self.versions[-1]
        if x is None:
            self.versions.append(weights)
            return
        at = self.versions[version].clone().requires_grad_()
        _loss(at, x.double()).backward()
        grad = at.grad
        if self.max_norm > 0:
            grad = grad * min(1.0, self.max_norm / (grad.norm().item() + 1e-6))
        self.buf = grad if self.buf is None else MOMENTUM * self.buf + grad
        u = LR * self.buf
        step = u + LAMBDA * (u - (self.previous if self.previous is not None else torch.zeros_like(u))) if self.ef else u
        self.previous = u
        self.versions.append(weights - step)


def _unit(stage: Stage, replay: Replay | None, k: int, x: torch.Tensor) -> None:
    """Unit k in PipeDream-2BW's order on one stage, each update applied where update/held.GlobalClipping
    says: the forward on version k − 1 (0 for the first) needs the updates of units up to k − 2; the
    posting of unit k needs unit k − 1's. The gradient is posted and held."""
    version = max(k - 1, 0)
    if version > 0:
        stage.update.complete(through_unit=version - 1)
    stage.backward(version, x)
    if k > 0:
        stage.update.complete(through_unit=k - 1)
    stage.update.gradient_ready(k, version, 1.0)
    if replay is not None:
        replay.update(version, x if torch.isfinite(x).all() else None)


def _two_bw(stage: Stage, replay: Replay | None, units: range) -> None:
    for k in units:
        _unit(stage, replay, k, INPUTS[k])


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error-feedback"])
def test_held_updates_are_applied_once_each_in_order_and_match_the_replay(pipeline_group, ef):
    stage, replay = Stage(pipeline_group, ef), Replay(ef)
    stage.backward(0, INPUTS[0])
    stage.update.gradient_ready(0, 0, 1.0)
    # Posted and held for the pipeline's norm: nothing is applied yet.
    assert stage.update.held_unit == 0 and stage.versioned.master_version == 0
    torch.testing.assert_close(stage.weight, START, rtol=0, atol=0)
    # A forward on version 1 needs it: applied now, once.
    assert stage.update.complete(through_unit=0) and stage.versioned.master_version == 1
    assert not stage.update.complete(through_unit=0) and stage.versioned.master_version == 1  # nothing left
    replay.update(0, INPUTS[0])
    torch.testing.assert_close(stage.weight.double(), replay.versions[1], rtol=0, atol=1e-6)
    stage.backward(0, INPUTS[1])
    stage.update.gradient_ready(1, 0, 1.0)
    replay.update(0, INPUTS[1])
    _two_bw(stage, replay, range(2, len(INPUTS)))
    assert stage.update.complete()  # the drain
    assert stage.versioned.master_version == len(INPUTS) and stage.update.held_unit is None
    torch.testing.assert_close(stage.weight.double(), replay.versions[-1], rtol=0, atol=1e-6)
    # Clipping was active (else the test could not tell the held norm from none).
    assert stage.report.grad_sq_norm().item() > MAX_NORM ** 2


def test_a_second_update_posted_while_one_is_held_is_refused(pipeline_group):
    stage = Stage(pipeline_group, ef=False)
    stage.backward(0, INPUTS[0])
    stage.update.gradient_ready(0, 0, 1.0)
    stage.backward(0, INPUTS[1])
    with pytest.raises(RuntimeError, match="posts unit 1 while unit 0 is still held"):
        stage.update.gradient_ready(1, 0, 1.0)


def test_complete_through_an_earlier_unit_leaves_a_later_held_update_held(pipeline_group):
    stage = Stage(pipeline_group, ef=False)
    stage.update.complete(through_unit=None)  # nothing held: nothing to do
    stage.backward(0, INPUTS[0])
    stage.update.gradient_ready(0, 0, 1.0)
    stage.update.complete(0)
    stage.backward(0, INPUTS[1])
    stage.update.gradient_ready(1, 0, 1.0)
    assert not stage.update.complete(through_unit=0) and stage.update.held_unit == 1
    assert stage.update.complete(through_unit=1) and stage.versioned.master_version == 2


def test_a_non_finite_update_is_skipped_its_version_published_and_the_rest_unchanged(pipeline_group):
    stage, replay = Stage(pipeline_group, ef=True), Replay(ef=True)
    _two_bw(stage, replay, range(0, 2))
    stage.update.complete()
    before = stage.weight
    _unit(stage, replay, 2, INPUTS[2] * float("nan"))
    assert stage.update.complete()
    # Skipped: the same weights, published as version 3; the optimizer's and EF's state untouched.
    assert stage.versioned.master_version == 3 and stage.updater.skipped_updates == 1
    torch.testing.assert_close(stage.weight, before, rtol=0, atol=0)
    skipped, _ = stage.report.take_skipped()
    assert skipped == {0: 1}
    _two_bw(stage, replay, range(3, 5))
    stage.update.complete()
    torch.testing.assert_close(stage.weight.double(), replay.versions[-1], rtol=0, atol=1e-6)


def test_a_skip_decided_after_its_steps_report_is_reported_as_an_earlier_steps(pipeline_group):
    stage = Stage(pipeline_group, ef=False)
    stage.report.start_step()
    stage.backward(0, INPUTS[0] * float("nan"))
    stage.update.gradient_ready(0, 0, 1.0)
    stage.report.take_skipped()  # the step reports before its held update is decided
    stage.report.start_step()
    stage.update.complete()
    assert stage.report.take_skipped() == ({0: 1}, {0: 1})


def test_a_settled_update_saved_and_loaded_continues_bitwise(pipeline_group):
    """Held updates are settled before a save (executors/asynchronous.py: settle); the weight versions, the
    optimizer's and EF's state and the update count are what resumes (executors/asynchronous.py: restore)."""
    whole = Stage(pipeline_group, ef=True)
    _two_bw(whole, None, range(0, 5))
    whole.update.complete()

    first = Stage(pipeline_group, ef=True)
    _two_bw(first, None, range(0, 3))
    first.update.complete()  # settled
    saved = {"buffers": copy.deepcopy([{n: t.detach() for n, t in b.items()} for b in first.versioned.buffers_]),
             "stepper": copy.deepcopy(first.updater.stepper.state_dict()),
             "scheduler": first.updater.lr_scheduler.state_dict(), "master_version": first.versioned.master_version}

    resumed = Stage(pipeline_group, ef=True)
    with torch.no_grad():
        for buffer, kept in zip(resumed.versioned.buffers_, saved["buffers"]):
            for name, tensor in kept.items():
                buffer[name].copy_(tensor)
    resumed.updater.stepper.load_state_dict(saved["stepper"])
    resumed.updater.lr_scheduler.load_state_dict(saved["scheduler"])
    resumed.versioned.master_version = saved["master_version"]
    resumed.versioned.bind_master(resumed.update.buffer(saved["master_version"]), copy=False)
    resumed.versioned.drop_compute_copies()
    _two_bw(resumed, None, range(3, 5))  # unit 3's gradient is taken at version 2, which the save holds
    resumed.update.complete()
    torch.testing.assert_close(resumed.weight, whole.weight, rtol=0, atol=0)
