"""Weight versions for asynchronous schedules: stashed copies a microbatch is bound to.

The stage's own parameters are the optimizer's master copy: the newest weights, stepped in place.
They hold no memory of their own: the master is the newest of a few version buffers (PipeDream-2BW:
two buffers, so two copies of the stage's weights in all). An update first copies the master into
the buffer of the next version, which no in-flight microbatch uses any more, makes the parameters
that buffer's storage (in place, or by `torch.utils.swap_tensors` for DTensors, so the optimizer's parameter objects and their
state stay), then steps them: the previous version stays untouched in its buffer for the
microbatches still bound to it. Each forward runs through `torch.func.functional_call` on the
compute copy of one of the version buffers, so autograd saves references to that copy and the
microbatch's backward sees exactly the weights its forward saw (weight stashing). Gradients
accumulate over a step's microbatches in fp32 (or the compute copy's own dtype when wider): in the
compute copy's `.grad` when it is fp32, and otherwise (bf16 / fp16 compute) in one fp32 sum per
buffer and parameter, which a post-accumulate-grad hook on the compute copy feeds with each
microbatch's gradient and then frees it (as FSDP2 does for synchronous stages). An optimizer step
moves the sum to the master (the fp32 sum itself becomes the master's `.grad` when unsharded), steps
it in the buffer of the next version. Nothing a pending backward still needs is ever written in place.

Unsharded fp32 stages compute on the buffers themselves. When the stage is sharded over dp (the
master and the buffers are DTensors holding 1/dp of the rows, parallel/fsdp.py) or computes in
bf16, a buffer's compute copy is cast and gathered at its first forward (one all-gather per dtype,
parallel/fsdp.gather_whole), kept while microbatches use it, dropped when the buffer is overwritten;
its accumulated gradient is reduce-scattered (in fp32, or the compute dtype: `grad_reduce_dtype`) and
averaged over dp on its way to the master, bucketed like the gathers (what FSDP2 does with
reshard_after_forward=False and the same reduce_dtype).

Persistent buffers that training changes (DeepSeek-V3's routing biases, updated with the weights:
models/routing_bias.py) are versioned with the weights: each version buffer holds them beside the
parameters, a microbatch routes with those of its version, and `publish_master` copies them from the
module with the new master weights. They are never gathered, cast or given gradients.

Evaluation binds the stage to its master (`MASTER`): the newest weights, gathered whole (no gradient)
for the duration of `evaluating_master()`, while the version buffers and in-flight microbatches stay
untouched.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from ..parallel.fsdp import gather_whole, keeps_fp32, reduce_scatter_rows

__all__ = ["MASTER", "VersionedStage"]

MASTER = "master"  # binding of `VersionedStage.active` to the master weights (evaluation)


class VersionedStage(nn.Module):
    """Runs `inner` on version buffer `active` (an index), or on the master weights (`MASTER`)."""

    def __init__(self, inner: nn.Module, n_buffers: int, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.inner = inner
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self._fp32_patterns = tuple(getattr(inner, "fp32_patterns", ()))
        self._trainable = {n: p.requires_grad for n, p in inner.named_parameters()}
        buffers = dict(inner.named_buffers())
        self._versioned_buffers = [n for n in inner.state_dict(keep_vars=True) if n in buffers]  # persistent ones
        # Buffer 0 is the master's own storage (version 0); the others start as copies of it.
        self.buffers_ = [self._alias_of_master()] + [self._copy_of_master() for _ in range(n_buffers - 1)]
        self.master_buffer = 0  # the buffer whose storage the parameters are
        self._compute: list[dict[str, torch.Tensor] | None] = [None] * n_buffers
        # Per buffer: fp32 sums of the gradients of its low-precision compute copy (filled by hooks;
        # emptied, never replaced, so a hook holds its dict and nothing else: no reference cycles).
        self._grad_sums: list[dict[str, torch.Tensor]] = [{} for _ in range(n_buffers)]
        self.master_version = 0  # updates applied to the master so far
        self.active: int | str = 0
        self._master_copy: dict[str, torch.Tensor] | None = None

    def _master_state(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the master weights and of the versioned buffers."""
        buffers = dict(self.inner.named_buffers())
        return [*self.inner.named_parameters(), *((n, buffers[n]) for n in self._versioned_buffers)]

    def _copy_of_master(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().requires_grad_(p.requires_grad and not self._gathers(p))
                for n, p in self._master_state()}

    def _alias_of_master(self) -> dict[str, torch.Tensor]:
        """The master's parameters as buffer leaves sharing their storage (`.data`: not their autograd
        version counter), and copies of the versioned module buffers (updated in place by training)."""
        params = dict(self.inner.named_parameters())
        return {n: params[n].data.requires_grad_(params[n].requires_grad and not self._gathers(params[n]))
                if n in params else t.detach().clone() for n, t in self._master_state()}

    def _gathers(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, DTensor) or self.compute_dtype not in (None, tensor.dtype)

    def compute_copy(self, buffer: int) -> dict[str, torch.Tensor]:
        """The tensors forward and backward of microbatches bound to `buffer` run on."""
        if self._compute[buffer] is None:
            versions = self.buffers_[buffer]
            copies = self._copies({n: v for n, v in versions.items() if n not in self._versioned_buffers})
            self._compute[buffer] = {n: copies[n].requires_grad_(self._trainable[n]) if n in copies else v
                                     for n, v in versions.items()}
            sums = self._grad_sums[buffer]
            for name, tensor in self._compute[buffer].items():
                if tensor.requires_grad and torch.finfo(tensor.dtype).bits < 32:  # bf16 / fp16 compute
                    tensor.register_post_accumulate_grad_hook(_adder_into(sums, name))
        return self._compute[buffer]

    def gradient_sums(self, buffer: int) -> dict[str, torch.Tensor]:
        """The fp32 gradient sums of `buffer`'s low-precision compute copy since its last move to the
        master ({} when there are none, e.g. under fp32 compute, where `.grad` is the sum)."""
        return self._grad_sums[buffer]

    def drop_compute_copies(self) -> None:
        """Forget every gathered compute copy and gradient sum (the buffers were overwritten, e.g. by a
        checkpoint load)."""
        self._compute = [None] * len(self._compute)
        for sums in self._grad_sums:
            sums.clear()

    def live_compute_copies(self) -> list[dict[str, torch.Tensor]]:
        """The gathered (or cast) compute copies that exist now (none for unsharded fp32 stages)."""
        return [c for c, b in zip(self._compute, self.buffers_) if c is not None and any(
            c[n] is not t for n, t in b.items())]

    def _copies(self, versions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole copies in the compute dtype of those of `versions` that need one (sharded or cast),
        gathered together (parallel/fsdp.gather_whole); the others are computed on as they are."""
        def dtype_of(name: str, tensor: torch.Tensor) -> torch.dtype:
            keep = keeps_fp32(name, self._fp32_patterns) or self.compute_dtype is None
            return tensor.dtype if keep else self.compute_dtype

        needing = {n: v for n, v in versions.items() if self._gathers(v)}
        return gather_whole(needing, dtype_of) if needing else {}

    @contextlib.contextmanager
    def evaluating_master(self):
        """Bind forwards to the master weights (gathered whole, cast like training's compute copies)
        until the block ends; the previous binding is restored."""
        previous = self.active
        with torch.no_grad():
            params = dict(self.inner.named_parameters())
            self._master_copy = {**params, **self._copies(params)}
        self.active = MASTER
        try:
            yield
        finally:
            self.active, self._master_copy = previous, None

    def forward(self, *args):
        if self.active == MASTER:
            return functional_call(self.inner, self._master_copy, args, strict=False)
        return functional_call(self.inner, self.compute_copy(self.active), args, strict=False)

    @torch.no_grad()
    def move_gradients_to_master(self, buffer: int, scale: float) -> None:
        """master.grad = scale × the gradient accumulated on `buffer` (averaged over dp when sharded:
        bucketed reduce-scatters, parallel/fsdp.reduce_scatter_rows); the buffer's gradient and
        its fp32 sums are cleared."""
        computed, sums = self.compute_copy(buffer), self._grad_sums[buffer]
        params = dict(self.inner.named_parameters())
        accumulated: dict[str, torch.Tensor] = {}
        for name, param in params.items():
            grad, residual = sums.pop(name, None), computed[name].grad
            computed[name].grad = None
            if residual is not None:  # fp32 compute tensors sum in .grad (bf16 ones only if a hook was bypassed)
                grad = residual if grad is None else grad.add_(residual)
            param.grad = None
            if grad is not None and param.requires_grad:
                accumulated[name] = grad
        sums.clear()
        sharded = {n: g for n, g in accumulated.items() if isinstance(params[n], DTensor)}
        if sharded:  # what the model keeps in fp32 is reduced in fp32 too
            dtype_of = lambda name: torch.float32 if keeps_fp32(name, self._fp32_patterns) else self.reduce_dtype
            accumulated.update(reduce_scatter_rows(sharded, params, scale, dtype_of))
        for name, grad in accumulated.items():
            # unsharded: the fp32 sum itself, no copy
            params[name].grad = grad if name in sharded else grad.to(params[name].dtype).mul_(scale)

    @torch.no_grad()
    def bind_master(self, buffer: int, copy: bool = True) -> None:
        """Make the master parameters the storage of `buffer`, after copying their values into it
        (`copy`; without it the master takes the buffer's values, e.g. after a checkpoint load). No
        in-flight microbatch may be bound to `buffer`: the next update is stepped in place there."""
        if buffer == self.master_buffer:
            return
        versions = self.buffers_[buffer]
        for name, param in self.inner.named_parameters():  # each parameter object once
            if copy:
                versions[name].copy_(param)
            if not isinstance(param, DTensor):  # the same object, now on the buffer's storage
                param.data = versions[name].data
                continue
            # A DTensor's `.data` does not reach its local shard: the whole object is swapped (which a
            # tensor with weak references, e.g. any fake one, would refuse).
            alias = nn.Parameter(versions[name].data, requires_grad=param.requires_grad)
            grad, param.grad = param.grad, None
            torch.utils.swap_tensors(param, alias)
            param.grad = grad
        self.master_buffer = buffer

    @torch.no_grad()
    def publish_master(self, buffer: int) -> None:
        """Count the update just applied to the master, which `bind_master(buffer)` placed in
        `buffer`, and copy the versioned module buffers (routing biases) in beside it."""
        if buffer != self.master_buffer:
            raise RuntimeError(f"the master lives in buffer {self.master_buffer}, not in buffer {buffer}")
        self.master_version += 1
        buffers = dict(self.inner.named_buffers())
        for name in self._versioned_buffers:
            self.buffers_[buffer][name].copy_(buffers[name])
        self._compute[buffer] = None  # gathered again at the buffer's next forward


def _adder_into(sums: dict[str, torch.Tensor], name: str):
    """A post-accumulate-grad hook: add the compute copy's fresh (bf16) gradient into the fp32
    `sums[name]` and free it, so no low-precision gradient outlives its microbatch's backward."""

    def add(tensor: torch.Tensor) -> None:
        if name in sums:
            sums[name].add_(tensor.grad)  # bf16 → fp32 is exact; the sum rounds in fp32
        else:
            sums[name] = tensor.grad.to(torch.float32)
        tensor.grad = None

    return add
