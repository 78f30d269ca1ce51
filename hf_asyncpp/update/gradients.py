"""An update's gradients made ready: averaged over dp, and their squared norm, a float64 device scalar
that nothing has read on the host (recorded per stage in the step's report); and the host read of a norm.

A norm stays on the device until the update needs its value (to skip a non-finite one), and the read
can carry the previous step's statistics in the same transfer (`read_norm`): on a GPU the host can then
queue the next forward while the backward still runs, instead of waiting for it there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..torch_internals import _flatten_dense_tensors, _unflatten_dense_tensors
from .report import StepReport

if TYPE_CHECKING:
    from .updater import Updater

__all__ = ["GradNorm", "GradientNorms", "read_norm"]


class GradNorm(NamedTuple):
    """An update's gradient norm as the host read it (`value`: whether to skip the update) and where it
    was computed (`on_device`, a float64 scalar): clipping scales by the coefficient computed there, so
    the value read is never copied back (on a GPU a blocking upload is a sync)."""

    value: float
    on_device: torch.Tensor


def read_norm(squared: torch.Tensor, carry=None) -> GradNorm:
    """The host read of an update's norm (from its squared norm, a float64 device scalar), with the
    statistics `carry` (a step's ReducedStepStats) in the same transfer, if given."""
    norm = squared.sqrt().reshape(())
    return GradNorm(carry.read_with(norm)[0] if carry is not None else norm.item(), norm)


class GradientNorms:
    """This rank's modules (`modules`, of stages `stage_ids`) and where their gradients are averaged."""

    def __init__(self, layout, modules: list, stage_ids: list[int], gradients_averaged: bool, report: StepReport):
        """`gradients_averaged`: FSDP has averaged the gradients over dp already (reduce-scatter)."""
        self.layout, self.modules, self.stage_ids, self.report = layout, modules, stage_ids, report
        self.gradients_averaged = gradients_averaged or layout.dp_size == 1

    def prepare(self, updater: Updater) -> torch.Tensor:
        """Average the updater's gradients over dp; this rank's squared norm of them (recorded in the
        report, per stage and in all). dp replicas then hold the same gradient."""
        if not self.gradients_averaged:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in updater.params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.layout.dp_group)
            flat /= self.layout.dp_size
            for p, synced in zip(updater.params, _unflatten_dense_tensors(flat, grads)):
                p.grad = synced
        squared, per_stage = None, []
        for index in updater.module_indices:
            grads = [p.grad for p in self.modules[index].parameters() if p.grad is not None]
            if not grads:
                norm = torch.zeros((), device=self.layout.device)
            else:
                norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if isinstance(norm, DTensor):  # sharded gradients: the norm over all dp shards
                norm = norm.full_tensor()
            stage_squared = norm.double() ** 2
            per_stage.append((self.stage_ids[index], stage_squared))
            squared = stage_squared if squared is None else squared + stage_squared
        self.report.record_norms(updater.stage, per_stage, squared)
        return squared
