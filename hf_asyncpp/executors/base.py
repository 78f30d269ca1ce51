"""What every kind of run holds, and the interface the engine drives it through.

An executor owns this rank's stages (cut by models.plan_stages, built on this rank only), the updaters
that step them, the pieces of their update (update/: gradient norms, the update rule, the step's report;
each kind adds how its stages update) and the loss. The kinds differ in how
those are built (compute dtype, how parameters are sharded over dp, which stages update together) and
in how a step, an evaluation, a checkpoint, a stop and a resume run: synchronous.py, asynchronous.py,
emulated.py. The engine (engine.py) calls the methods below and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

from ..memory import held_tensors
from ..models import build_model, build_stage_modules, build_stages, plan_stages
from ..models.compile import compile_layers
from ..models.construct import has_safetensors
from ..models.pipeline_loss import PipelineLoss
from ..models.recompute import apply_activation_checkpointing
from ..models.split import release_foreign_modules
from ..parallel.mesh import broadcast_from_first_replica
from ..update.gradients import GradientNorms
from ..update.report import StepReport
from ..update.rule import UpdateRule
from ..update.updater import Updater

__all__ = ["Executor", "StepOutcome", "build_full_model"]


def build_full_model(config, model_config) -> torch.nn.Module:
    """The whole HF model, identically on every rank: from init_from, or initialized from the seed
    exactly as the stages a pipeline builds for itself (models/construct.py)."""
    if config.init_from:
        return AutoModelForCausalLM.from_pretrained(config.init_from, config=model_config, dtype=torch.float32).train()
    return build_model(model_config, config.seed)


@dataclass
class StepOutcome:
    """What one training step did on this rank; the engine reduces it over ranks (metrics.ReducedStepStats).
    Tensors stay on the device: nothing here has been read on the host."""

    losses: list  # per microbatch whose loss this rank computed: (LM loss, aux loss) device scalars
    busy_s: float | None  # seconds inside stage compute; None: all of the step was compute (one process)
    ages: dict[int, int]  # per local stage, the largest weight-version age among its updates
    grad_sq_norm: torch.Tensor | None  # this rank's squared gradient norm (the mean over its updates)
    nonfinite_stages: dict = field(default_factory=dict)  # stage → 0/1 device scalar
    skipped: dict[int, int] = field(default_factory=dict)  # stage → updates skipped, reported now
    skipped_earlier: dict[int, int] = field(default_factory=dict)  # of them, of an earlier step's gradient


class Executor:
    """This rank's part of one kind of run. Subclasses set the class attributes and implement the methods
    that raise NotImplementedError."""

    forwards_ahead = False  # a step also forwards into the next minibatch (train_step needs its rows)
    evaluates_mid_run = True  # the weights between two steps can be evaluated
    # A step's report is reviewed after this many later steps: 2 where an update may be decided after
    # its step has reported (held for its global norm), else 1.
    review_lag = 1
    # Its state between steps depends on the run's layout (microbatches in flight, kept versions): a
    # checkpoint then resumes only into the same layout (`run_layout`).
    layout_bound = False
    versioned: tuple = ()  # weight-versioned stages (an asynchronous pipeline's VersionedStage per local stage)
    emulated_depth = 0  # the pipeline depth an emulated run plays (0: not emulated)

    def __init__(self, config, model_config, layout, spec, model, depth: int, stage_ids: list[int],
                 dtype: torch.dtype | None, fsdp_managed: bool, per_stage_updates: bool):
        self.config, self.layout, self.spec = config, layout, spec
        self.plan = plan_stages(model_config, spec.n_stages(depth), config.stage_balance, config.stage_boundaries)
        self.stage_ids, self.dtype, self.fsdp_managed = stage_ids, dtype, fsdp_managed
        self.modules = self._build_modules(model_config, model)
        for module in self.modules:
            if config.compile_layers:  # first: the checkpoint wraps the compiled forward
                compile_layers(module, config.activation_checkpointing)
            apply_activation_checkpointing(module, config.activation_checkpointing)
        self.holds_first_stage = 0 in stage_ids
        self.holds_last_stage = len(self.plan) - 1 in stage_ids
        if fsdp_managed:
            for module in self.modules:
                self._shard(module, layout.mesh["dp"])
        self.loss_fn = PipelineLoss(model_config.vocab_size, getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0)
        self.params = [p for module in self.modules for p in module.parameters()]
        # What steps together: each stage on its own where stages update at different times, all local
        # stages at once where they update together.
        groups = [[i] for i in range(len(self.modules))] if per_stage_updates else [list(range(len(self.modules)))]
        self.updaters = [Updater(config, g, [stage_ids[i] for i in g], [self.modules[i] for i in g], spec.order)
                         for g in groups]
        self.report = StepReport()
        self.norms = GradientNorms(layout, self.modules, stage_ids, fsdp_managed, self.report)
        self.update_rule = UpdateRule(config.max_grad_norm, self.report)

    def _build_modules(self, model_config, model) -> list[torch.nn.Module]:
        config, layout = self.config, self.layout
        if model is None and (not config.init_from or has_safetensors(config.init_from)):
            # Only this rank's stages are allocated, and only their tensors of init_from read: when
            # sharded over dp, only this replica's rows of them.
            read_rows = self.fsdp_managed and layout.dp_size > 1 and config.init_from
            return build_stages(model_config, self.plan, self.stage_ids, layout.device, config.seed, config.init_from,
                                layout.mesh["dp"] if read_rows else None)
        # A model given (the Trainer's, tests'), or a checkpoint without safetensors.
        given = model is not None
        model = model if given else build_full_model(config, model_config)
        modules = [m.to(layout.device) for m in build_stage_modules(model, self.plan, self.stage_ids)]
        release_foreign_modules(model, self.plan, self.stage_ids)  # the caller may keep `model`
        if given:  # the caller's processes may have drawn different weights (no seed set)
            broadcast_from_first_replica(modules, layout)
        return modules

    def _shard(self, module: torch.nn.Module, dp_mesh) -> None:
        """Shard one stage's parameters over dp (FSDP2, parallel/fsdp.py)."""
        raise NotImplementedError

    def _outcome(self, busy_s: float | None) -> StepOutcome:
        """The step's outcome from what the loss and the updates recorded; dp replicas hold the same
        gradients, so only the first reports them."""
        report, replica = self.report, self.layout.dp_rank == 0
        skipped, skipped_earlier = report.take_skipped()
        return StepOutcome(self.loss_fn.take(self.config.n_microbatches), busy_s, report.ages if replica else {},
                           report.grad_sq_norm() if replica else None,
                           report.nonfinite_stages() if replica else {},
                           skipped if replica else {}, skipped_earlier if replica else {})

    @property
    def learning_rate(self) -> float:
        return self.updaters[0].optimizer.param_groups[0]["lr"]

    # --- the interface the engine drives ---------------------------------------------------------

    def train_step(self, rows: torch.Tensor, next_rows: torch.Tensor | None, previous, drains: bool) -> StepOutcome:
        """One optimizer step on minibatch `rows` (on this rank's device). `next_rows`: the next
        minibatch's, where `forwards_ahead` (None on the last step). `previous`: the previous step's
        statistics (metrics.ReducedStepStats, not read yet), which the step's one host read reads along.
        `drains`: this is the run's last step."""
        raise NotImplementedError

    def evaluate(self, rows: torch.Tensor, return_logits: bool) -> tuple[list, torch.Tensor | None]:
        """(per microbatch (LM loss, aux loss), the logits on the last stage's rank if asked) of a minibatch,
        updating nothing."""
        raise NotImplementedError

    def settle(self) -> None:
        """Apply every update still held for its norm (collective: call on every rank before anything reads
        the weights or their state). Only an asynchronous pipeline holds any."""

    def resume_after(self, step: int) -> None:
        """Continue after `step` completed steps whose training state was just loaded."""

    def stop_after(self, step: int) -> int:
        """End the run early; returns the step count it ends at: `step`, where nothing is in flight."""
        return step

    def finish(self, wait_for_sends: bool) -> None:
        """The run is over (`wait_for_sends` False: stopped by a signal, its last sends feed nothing)."""
        self.settle()

    # --- its part of a checkpoint (checkpoint/training_state.py) ----------------------------------

    def run_layout(self) -> dict:
        """What a checkpoint records of the run's layout (checked on resume where `layout_bound`)."""
        return dict(pp_size=self.layout.pp_size, schedule=self.spec.name, n_microbatches=self.config.n_microbatches,
                    sync_steps=self.config.sync_steps, emulate_pp_size=self.emulated_depth)

    def state(self) -> dict:
        """What a checkpoint holds of this kind of run beyond weights, optimizer and EF state."""
        return {}

    def state_to_load(self, saved: dict, destination) -> dict:
        """{key: an empty tensor to fill} of `state`'s entries in a checkpoint whose metadata is `saved`;
        `destination(key, like=None)` makes one. ValueError when the checkpoint lacks them."""
        return {}

    def masters(self) -> set[str]:
        """Names of parameters whose weights load with `state` rather than with the model's."""
        return set()

    def restore(self, loaded: dict) -> None:
        """Take back `state` from the loaded entries (after weights and optimizer state)."""

    # --- what it holds -------------------------------------------------------------------------

    def torch_stages(self) -> list:
        """Every torch PipelineStage this rank has built (training's, and an evaluation's); none when
        emulating."""
        return []

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors by kind of state (memory.held_tensors: memory.py counts them, planning
        labels them)."""
        return held_tensors(self.params, self.updaters, self.versioned, self.torch_stages(), self.modules)
