"""An asynchronous schedule emulated on one process: the same update rule, no pipeline.

The model is cut into the stages the schedule would have at depth `emulate_pp_size`, and the stages
run one after another in this process. Each stage's parameters carry that stage's delay in the
staleness emulator (optim/delay.py), each stage has its own optimizer and LR schedule, clips by the
norm of its unit's gradient over all stages as the pipeline does (its own with grad_clip_scope:
stage), and updates per minibatch or per microbatch as the schedule does. So a researcher without a
pipeline runs the experiment a pipeline would: PipeDream-2BW (every stage one update stale), WPipe
(first half stale, second half fresh) or PipeDream (stage s p−1−s updates stale).

DeepSeek-V3's routing biases follow the rule of their stage's weights (models/routing_bias.py): a
unit routes with the biases its weights' version had (d updates old), and the bias update of a
minibatch, from the loads of its own microbatches, comes with its (last) weight update. The emulator
keeps its own history of bias versions (`_DelayedRoutingBiases`), independently of the pipeline's
weight-version buffers.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

from .optim.delay import StalenessEmulator

__all__ = ["EmulatedPipeline"]


class _DelayedRoutingBiases:
    """One stage's routing biases under its weights' delay d: the last d + 1 versions are kept (one
    appended per unit, as the staleness emulator does for the weights), each unit routes with the
    oldest, and a minibatch's bias update is applied after its last unit's weight update."""

    def __init__(self, counter, delay: int):
        self.counter = counter
        self.history = deque([self._current()], maxlen=delay + 1)

    def restart(self) -> None:
        """As StalenessEmulator.restart: the next unit routes with the current biases."""
        self.history.clear()
        self.history.append(self._current())

    def _current(self) -> list[torch.Tensor]:
        return [r.e_score_correction_bias.detach().clone() for r in self.counter.routers]

    @contextlib.contextmanager
    def stale_biases(self):
        """Run the unit's forward and backward inside: each router holds its bias of version t − d."""
        current = self._current()
        self._set(self.history[0])
        try:
            yield
        finally:
            self._set(current)

    @torch.no_grad()
    def _set(self, biases: list[torch.Tensor]) -> None:
        for router, bias in zip(self.counter.routers, biases):
            router.e_score_correction_bias.copy_(bias)

    def after_unit(self, applied: bool, ends_minibatch: bool, n_microbatches: int, rate: float, dp_group) -> None:
        self.counter.after_update(applied, ends_minibatch, n_microbatches, rate, dp_group)
        if ends_minibatch and self.counter.n_recorded():
            raise RuntimeError("routing loads were counted beyond the minibatch's microbatches")
        self.history.append(self._current())


class EmulatedPipeline:
    def __init__(self, modules, stage_ids: list[int], order, depth: int, n_microbatches: int, updaters: list,
                 updates, router_bias_update_rate: float = 0.0, dp_group=None):
        """`updates` (update/together.EmulatedUpdates) clips, steps or skips each updater through its emulator."""
        self.modules, self.stage_ids, self.order, self.m, self.depth = modules, stage_ids, order, n_microbatches, depth
        self.updaters, self.updates = updaters, updates
        delays = [order.delay(stage, depth, n_microbatches) for stage in stage_ids]
        self.emulators = [
            StalenessEmulator(updater.stepper, dict.fromkeys(updater.params, delay))
            for updater, delay in zip(updaters, delays)
        ]
        self.bias_rate, self.dp_group = router_bias_update_rate, dp_group
        self.steps_run = 0
        self.biases = [
            _DelayedRoutingBiases(module.routing_load, delay) if getattr(module, "routing_load", None) else None
            for module, delay in zip(modules, delays)
        ]

    def _parameter_names(self) -> dict[int, str]:
        return {id(p): n for module in self.modules for n, p in module.named_parameters()}

    def state(self) -> dict:
        """What a checkpoint holds of the emulation between steps, where nothing is in flight: per stage its
        unit count and kept weight versions (oldest first, the last the current weights) and routing-bias
        versions. Keys `emulated.<stage>` (the counts) and `emulated.<stage>.versions.<i>.<parameter name>`,
        `emulated.<stage>.biases.<i>.<router>`."""
        names = self._parameter_names()
        state = {}
        for stage, emulator, biases in zip(self.stage_ids, self.emulators, self.biases):
            lengths = {len(versions) for versions in emulator.history.values()}
            state[f"emulated.{stage}"] = {"units": emulator.units, "versions": max(lengths, default=0),
                                          "bias_versions": len(biases.history) if biases else 0}
            for p, versions in emulator.history.items():
                state.update({f"emulated.{stage}.versions.{i}.{names[id(p)]}": v for i, v in enumerate(versions)})
            for i, version in enumerate(biases.history if biases else ()):
                state.update({f"emulated.{stage}.biases.{i}.{j}": bias for j, bias in enumerate(version)})
        return state

    def restore(self, loaded: dict) -> None:
        """Take back what `state` held (`loaded`: its keys; the weight versions laid out like their
        parameters, the routing biases wherever they were read)."""
        names = self._parameter_names()
        for stage, emulator, biases in zip(self.stage_ids, self.emulators, self.biases):
            counts = loaded[f"emulated.{stage}"]
            emulator.units = counts["units"]
            for p, versions in emulator.history.items():
                versions.clear()
                versions.extend(loaded[f"emulated.{stage}.versions.{i}.{names[id(p)]}"]
                                for i in range(counts["versions"]))
            if biases:
                routers = [r.e_score_correction_bias for r in biases.counter.routers]
                biases.history.clear()
                biases.history.extend([loaded[f"emulated.{stage}.biases.{i}.{j}"].to(bias.device)
                                       for j, bias in enumerate(routers)] for i in range(counts["bias_versions"]))

    def forward(self, rows: torch.Tensor):
        """The last stage's output for `rows` (the stages run one after another)."""
        carried = (rows,)
        for module in self.modules:
            out = module(*carried)
            carried = out if isinstance(out, tuple) else (out,)
        return carried if len(carried) > 1 else carried[0]

    def _forward_backward(self, rows: torch.Tensor, loss_fn: Callable, scale: float) -> None:
        (loss_fn(self.forward(rows), rows) * scale).backward()

    def run_step(self, rows: torch.Tensor, loss_fn: Callable) -> dict[int, int]:
        """One minibatch: forward/backward on each stage's stale version, then every stage's update,
        clipped by the norm of the unit's gradient over all stages (or each stage's own), once or
        after each microbatch, each followed by the stage's routing-bias update when it ends the
        minibatch. In a sync start's steps the emulators restart after every unit, so
        the next starts from the current weights and the delays build up again from the switch.
        Returns the weight-version age per stage."""
        synchronous = self.order.synchronous_step(self.steps_run)
        self.steps_run += 1
        ages = dict.fromkeys(self.stage_ids, 0)  # per stage, the largest over the step's units (as the pipeline)
        units = [[mb] for mb in rows.chunk(self.m)] if self.order.per_microbatch_updates else [rows.chunk(self.m)]
        for biases in filter(None, self.biases):
            biases.counter.reset()  # count this minibatch's forwards only (not an evaluation's)
        for t, unit in enumerate(units):
            for stage, emulator in zip(self.stage_ids, self.emulators):
                emulator.zero_grad()
                ages[stage] = max(ages[stage], emulator.version_age())
            with contextlib.ExitStack() as stack:
                for emulator in self.emulators:
                    stack.enter_context(emulator.stale_weights())
                for biases in filter(None, self.biases):
                    stack.enter_context(biases.stale_biases())
                for microbatch in unit:
                    self._forward_backward(microbatch, loss_fn, 1.0 / len(unit))
            applied_by_stage = self.updates.apply(self.updaters, self.emulators)
            for applied, biases in zip(applied_by_stage, self.biases):
                if biases:
                    biases.after_unit(applied, t == len(units) - 1, self.m, self.bias_rate, self.dp_group)
            for history in [*self.emulators, *filter(None, self.biases)] if synchronous else ():
                history.restart()  # the next unit starts from the weights this one produced
        return ages
