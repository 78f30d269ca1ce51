"""The optimizer, Error Feedback and LR schedule of parameters that are updated together, and when the run's
last update is decided (Error Feedback's extrapolation left out of it under ef_last_update trajectory)."""

from __future__ import annotations

from ..config import TrainConfig
from ..optim import lr_scheduler_from_config, optimizer_from_config
from ..optim.error_feedback import ErrorFeedback
from ..optim.param_groups import decay_parameter_names

__all__ = ["Updater"]


class Updater:
    """The optimizer and LR schedule of parameters that are updated together (the engine's modules
    `module_indices`, which hold stages `stages`)."""

    def __init__(self, config: TrainConfig, module_indices: list[int], stages: list[int], modules: list, order):
        self.module_indices, self.stages = module_indices, stages
        self.stage = stages[0]
        named_params = [np for module in modules for np in module.named_parameters()]
        self.params = [p for _, p in named_params]
        self.optimizer = optimizer_from_config(config, named_params, decay_parameter_names(modules))
        # What applies an update: the optimizer, or Error Feedback around it.
        self.stepper = ErrorFeedback(self.optimizer, config.ef_lambda) if config.ef else self.optimizer
        # The LR schedule advances once per update: m times a step when stages update per microbatch.
        per_step = config.n_microbatches if order is not None and order.per_microbatch_updates else 1
        self.lr_scheduler = lr_scheduler_from_config(config, self.optimizer, per_step)
        self.updates_planned = config.max_steps * per_step
        # Updates skipped (non-finite norm) so far: the LR schedule does not count them, the run's length does.
        # A checkpoint keeps it (checkpoint/training_state.py), as it keeps the schedule.
        self.skipped_updates = 0
        self.trajectory_last_update = config.ef and config.ef_last_update == "trajectory"

    @property
    def next_update_is_last(self) -> bool:
        """Whether the next update decided is the run's last of these parameters (its max_steps-th step's
        last): the LR schedule counts the updates applied, and a resumed run restores it. A run a callback
        stops before max_steps has its last update decided before the stop is known."""
        return self.lr_scheduler.last_epoch + self.skipped_updates + 1 == self.updates_planned

    @property
    def extrapolates_next_update(self) -> bool:
        """Whether Error Feedback applies its extrapolation λ(u_t − u_{t−1}) to the next update: always, but
        to the run's last under ef_last_update trajectory (then the final weights lie on the trajectory)."""
        return not (self.trajectory_last_update and self.next_update_is_last)
