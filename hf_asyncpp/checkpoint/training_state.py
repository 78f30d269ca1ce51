"""What a training checkpoint holds, as one flat state dict that torch.distributed.checkpoint writes.

Keys name what they hold by HF parameter name, never by rank or local index, so a checkpoint taken at
one (pp, dp) layout loads into another where the tensors mean the same thing:

  model.<name>                     master weights and persistent buffers (routing biases)
  optim.<name>.<key>               the optimizer's state of that parameter (moments, factors, steps)
  ef.<name>                        Error Feedback's previous update
  versions.<stage>.<buffer>.<name> an asynchronous stage's stashed weight versions (and versioned
                                   buffers: DeepSeek-V3's routing biases)
  updater.<stage>                  LR schedule state and optimizer hyperparameters of the updater that
                                   steps stage <stage> (and the stages updated with it)
  stage.<stage>                    an asynchronous stage's update count (its master version)
  emulated.<stage>[...]            an emulated asynchronous schedule's kept weight (and routing-bias)
                                   versions and unit count per stage (emulation.py: EmulatedPipeline.state)
  rng.<rank>                       torch's CPU (and CUDA) generator states of that rank

DTensor shards are saved as shards (each dp rank writes its rows) and loaded into whatever sharding
the loading run has; identical replicas are written once. Entries that are not tensors (schedule
state, Python step counters) are serialized into uint8 tensors under `<key>#obj`: torch's loader
fills tensors in place, which is what makes loading a plain function of the saved metadata. Those
load on the CPU whatever device the parameters are on: only the host unpacks them.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = ["load_training_state", "training_state"]


def _updater_names(executor) -> list[list[str]]:
    """Per updater, the parameter names in its optimizer's own index order (torch numbers the
    parameters of all param groups consecutively)."""
    names = {id(p): n for module in executor.modules for n, p in module.named_parameters()}
    return [[names[id(p)] for group in updater.optimizer.param_groups for p in group["params"]]
            for updater in executor.updaters]


def _optimizer_params(updater) -> list:
    return [p for group in updater.optimizer.param_groups for p in group["params"]]


_OBJ = "#obj"
_PER_MATRIX = ("_factor", "_basis")  # optimizer state of a whole matrix, replicated over dp


def _state_keys(keys, name: str) -> dict[str, str]:
    """{state key: checkpoint key} of parameter `name`'s optimizer entries among `keys`."""
    prefix = f"optim.{name}."
    return {k[len(prefix):].removesuffix(_OBJ): k for k in keys
            if k.startswith(prefix) and "." not in k[len(prefix):]}


def _pack(value) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack(tensor: torch.Tensor):
    return torch.load(io.BytesIO(tensor.numpy().tobytes()), weights_only=True)


def training_state(engine, rank: int) -> dict:
    """This rank's part of the training state, for `dcp.save` (tensors by reference, not copies)."""
    state = _live_state(engine.executor, rank)
    return {k if isinstance(v, torch.Tensor) else k + _OBJ: v if isinstance(v, torch.Tensor) else _pack(v)
            for k, v in state.items()}


def _live_state(executor, rank: int) -> dict:
    state: dict = {}
    for module in executor.modules:
        state.update({f"model.{k}": v for k, v in module.state_dict().items()})
    for updater, names in zip(executor.updaters, _updater_names(executor)):
        by_param = dict(zip(_optimizer_params(updater), names))
        for param, param_state in updater.optimizer.state.items():
            for key, value in param_state.items():
                state[f"optim.{by_param[param]}.{key}"] = value
        if hasattr(updater.stepper, "previous_update"):  # Error Feedback
            state.update({f"ef.{by_param[p]}": u for p, u in updater.stepper.previous_update.items()})
        state[f"updater.{updater.stage}"] = {
            "lr_scheduler": updater.lr_scheduler.state_dict(),
            "skipped_updates": updater.skipped_updates,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in updater.optimizer.param_groups],
        }
    state.update(executor.state())  # its kind of run's own (weight versions, emulated versions)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    state[f"rng.{rank}"] = rng
    return state


def _destination(saved: dict, key: str, like: torch.Tensor | None = None, like_layout: bool = True):
    """An empty tensor `dcp.load` can fill for saved entry `key`. A packed object (`#obj`) is bytes
    that only the host unpacks: always on the CPU. A tensor is laid out like the parameter `like` it
    belongs to when it is per-element state of the parameter's shape (so it is sharded like it), and
    whole on the parameter's device otherwise."""
    metadata = saved[key]
    if not isinstance(metadata, TensorStorageMetadata):
        raise ValueError(f"unexpected non-tensor entry {metadata}")
    dtype = metadata.properties.dtype
    if key.endswith(_OBJ) or like is None:
        return torch.zeros(metadata.size, dtype=dtype, device="cpu")
    if like_layout and tuple(like.shape) == tuple(metadata.size):
        return torch.zeros_like(like, dtype=dtype)
    device = like.to_local().device if isinstance(like, DTensor) else like.device
    return torch.zeros(metadata.size, dtype=dtype, device=device)


def load_training_state(engine, rank: int, saved: dict, read) -> dict:
    """Load what this rank needs from a checkpoint whose metadata entries are `saved` ({key: storage
    metadata}); `read(state)` fills a state dict in place (dcp.load). Returns the loaded objects."""
    executor = engine.executor
    params = {n: p for module in executor.modules for n, p in module.named_parameters()}
    wanted: dict = {}
    # Weights and buffers load in place, but those that load with the executor's own state (an
    # asynchronous stage's master is one of its version buffers, bound once the versions are known).
    masters = executor.masters()
    for module in executor.modules:
        wanted.update({f"model.{k}": v for k, v in module.state_dict().items() if k not in masters})
    for names in _updater_names(executor):
        for name in names:
            for state_key, key in _state_keys(saved, name).items():
                # Per-element state is laid out like its parameter; per-matrix state (SOAP's factors
                # and bases, square like a square parameter) is whole on every rank.
                wanted[key] = _destination(saved, key, params[name], not state_key.endswith(_PER_MATRIX))
            if f"ef.{name}" in saved:
                wanted[f"ef.{name}"] = _destination(saved, f"ef.{name}", params[name])
    wanted.update(executor.state_to_load(saved, lambda key, like=None: _destination(saved, key, like)))
    objects = [k for k in saved if k.split(".")[0] in ("updater", "stage", "emulated") and k.endswith(_OBJ)
               or k == f"rng.{rank}{_OBJ}"]
    wanted.update({k: _destination(saved, k) for k in objects})
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} entries this run needs, e.g. {missing[:3]}")
    read(wanted)
    loaded = {k.removesuffix(_OBJ): _unpack(v) if k.endswith(_OBJ) else v for k, v in wanted.items()}
    _restore(executor, loaded, rank)
    return loaded


@torch.no_grad()
def _restore(executor, loaded: dict, rank: int) -> None:
    for updater, names in zip(executor.updaters, _updater_names(executor)):
        state = {i: {key: loaded[k] for key, k in _state_keys(loaded, name).items()} for i, name in enumerate(names)}
        # Another pp layout groups stages differently: any updater's schedule and hyperparameters
        # serve (they advance together: one update per step per stage).
        saved_updater = loaded.get(f"updater.{updater.stage}") or next(
            loaded[k] for k in sorted(loaded) if k.startswith("updater."))
        first, groups = 0, []
        for saved_group, group in zip(saved_updater["param_groups"], updater.optimizer.param_groups):
            groups.append(dict(saved_group, params=list(range(first, first + len(group["params"])))))
            first += len(group["params"])
        updater.optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s}, "param_groups": groups})
        updater.lr_scheduler.load_state_dict(saved_updater["lr_scheduler"])
        updater.skipped_updates = saved_updater.get("skipped_updates", 0)  # absent from checkpoints before it
        if hasattr(updater.stepper, "previous_update"):
            updater.stepper.previous_update = {p: loaded[f"ef.{n}"] for p, n in zip(_optimizer_params(updater), names)
                                               if f"ef.{n}" in loaded}
    executor.restore(loaded)
    rng = loaded.get(f"rng.{rank}")
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
