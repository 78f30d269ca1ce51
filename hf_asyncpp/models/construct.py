"""Building a rank's stages without the whole model: meta-device construction and seeded init.

The HF model is built on the meta device (no memory, no initialization), cut into stages (split.py),
and only this rank's stages are materialized, on its device. Every module is then initialized by the
model class's own `_init_weights` (which also rebuilds non-persistent buffers such as rotary
frequencies) with the random generator seeded from (seed, the module's name in the full model). A
tensor's initial value therefore depends on the seed and its name only: every pp/dp layout and stage
split starts from the same weights, and the whole model built here (`build_model`) is the union of
the stages. The numbers are drawn by the CPU's generator whatever the device (a module's tensors are
initialized on CPU copies, then copied to it), so a seed gives the same weights on CPU and on GPUs.

With `init_from` (an HF model directory of safetensors, one file or sharded with an index), the
stages are then loaded by transformers' own loader (`convert_and_load_state_dict_in_model`, which
applies the model type's checkpoint conversions, e.g. per-expert tensors fused into one) into a copy
of the model pruned to this rank's stages: tensors of other stages are never read. When the stages
will be row-sharded over dp replicas (`dp_mesh`), their parameters are sharded before loading, and the
loader reads only this replica's rows of each tensor (for per-expert checkpoint tensors: only its
experts) — transformers' shard-on-read for DTensor parameters. The loader is a private transformers
API, pinned with transformers and covered by tests/models/test_construct.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch
from ..torch_internals import own_slots, unset_fake_temporarily
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

from ..parallel.fsdp import shard_parameters
from .split import StagePlan, build_stage_modules, foreign_modules
from .stage import PipelineStageModule

__all__ = ["build_model", "build_stages", "has_safetensors", "meta_model", "module_seed"]


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module `name` (its name in the full model, "" for the model itself)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch takes seeds below 2**63


def meta_model(model_config) -> nn.Module:
    """The HF causal LM of `model_config` on the meta device (fp32 master weights, nothing allocated).
    Real meta tensors even under a fake tensor mode (a memory plan, plan.py): a module moves from
    them into fake ones with `to_empty`, where fake meta parameters could not be swapped out."""
    with unset_fake_temporarily(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def _post_order(module: nn.Module, prefix: str = ""):
    """(name, module) children before parents, as HF initializes them (`initialize_weights`)."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


@contextlib.contextmanager
def _drawn_on_cpu(module: nn.Module, always: bool = False):
    """While `module` is initialized, its own tensors off the CPU are CPU copies, copied back into the
    originals afterwards: CUDA's generator draws other numbers than the CPU's for the same seed.
    `always` copies CPU tensors too (how a CPU-only test takes the path a GPU's tensors take)."""
    placed = []  # (the module's slots, a key, the original tensor)
    parameters, buffers = own_slots(module)
    for slots in (parameters, buffers):
        for key, tensor in slots.items():
            if tensor is not None and (always or tensor.device.type != "cpu"):
                placed.append((slots, key, tensor))
                copy = tensor.detach().to("cpu", copy=True)
                slots[key] = nn.Parameter(copy, tensor.requires_grad) if slots is parameters else copy
    try:
        yield
    finally:
        for slots, key, tensor in placed:
            tensor.copy_(slots[key])
            slots[key] = tensor


@torch.no_grad()
def _initialize(causal_lm: nn.Module, seed: int) -> None:
    """Initialize every module of `causal_lm` whose own tensors are materialized (the rest is meta),
    drawing on the CPU."""
    cpu_state = torch.get_rng_state()
    try:
        for name, module in _post_order(causal_lm):
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if own and not any(t.is_meta for t in own):
                torch.manual_seed(module_seed(seed, name))
                with _drawn_on_cpu(module):
                    causal_lm._init_weights(module)
    finally:  # the caller's random stream is left as it was
        torch.set_rng_state(cpu_state)


def build_stages(model_config, plan: StagePlan, stage_indices: list[int], device: torch.device | str,
                 seed: int, init_from: str | None = None, dp_mesh=None) -> list[PipelineStageModule]:
    """Stages `stage_indices` of `plan`, allocated on `device` only, initialized from `seed`, then
    loaded from the safetensors of `init_from` when given. With `dp_mesh`, the stages' parameters
    come back row-sharded over it (`shard_parameters`), and only this replica's rows were read."""
    causal_lm = meta_model(model_config)
    stages = build_stage_modules(causal_lm, plan, stage_indices)
    for stage in stages:  # modules shared by stages (rotary embeddings) are materialized once more: harmless
        stage.to_empty(device=device)
    _initialize(causal_lm, seed)
    if dp_mesh is not None:  # the stages' modules are the pruned model's: the loader sees the shards
        for stage in stages:
            shard_parameters(stage, dp_mesh)
    if init_from is not None:
        _prune(causal_lm, plan, stage_indices)
        _load(causal_lm, init_from, device)
    return [stage.train() for stage in stages]


def has_safetensors(directory: str) -> bool:
    """Whether `directory` holds its weights as safetensors (what per-stage loading reads)."""
    return bool(_safetensors_files(directory))


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(directory, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(directory, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def _prune(causal_lm: nn.Module, plan: StagePlan, stage_indices: list[int]) -> None:
    """Drop every module of `causal_lm` no local stage holds, so that its state dict (what the loader
    fills) names this rank's tensors only; parameter names stay those of the full model."""
    foreign = foreign_modules(causal_lm, plan, stage_indices)
    layers = causal_lm.model.layers
    causal_lm.model.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)
                                            if f"model.layers.{i}" not in foreign})
    for name in foreign:
        if not name.startswith("model.layers."):
            parent, _, attr = name.rpartition(".")
            delattr(causal_lm.get_submodule(parent), attr)


class _TensorInFile:
    """A checkpoint tensor read only when the loader indexes it (`tensor[...]`, or the rows of a
    DTensor parameter's shard), as safetensors slices are; the loader never indexes the tensors of
    modules the pruned model does not hold."""

    def __init__(self, file, key: str):
        self.file, self.key = file, key  # `file`: the open safetensors file (its header parsed once)

    def get_shape(self) -> list[int]:
        return self.file.get_slice(self.key).get_shape()

    def __getitem__(self, index):
        return self.file.get_slice(self.key)[index]


def _load(causal_lm: nn.Module, directory: str, device) -> None:
    with contextlib.ExitStack() as files:
        tensors = {}
        for path in _safetensors_files(directory):
            f = files.enter_context(safe_open(path, framework="pt", device="cpu"))
            tensors.update((key, _TensorInFile(f, key)) for key in f.keys())
        _load_tensors(causal_lm, directory, device, tensors)


def _load_tensors(causal_lm: nn.Module, directory: str, device, tensors: dict) -> None:
    config = LoadStateDictConfig(pretrained_model_name_or_path=directory, dtype=torch.float32,
                                 device_map={"": str(device)}, weight_mapping=get_model_conversion_mapping(causal_lm))
    info, _ = convert_and_load_state_dict_in_model(causal_lm, tensors, config)
    problems = [f"missing: {sorted(info.missing_keys)}" if info.missing_keys else "",
                f"wrong shape: {sorted(info.mismatched_keys)}" if info.mismatched_keys else "",
                f"conversion failed: {info.conversion_errors}" if info.conversion_errors else ""]
    if any(problems):
        raise ValueError(f"init_from '{directory}' does not fit this model's stages: "
                         + "; ".join(p for p in problems if p))


def build_model(model_config, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """The whole HF model with the weights `build_stages` gives its parts (references, export tests)."""
    causal_lm = meta_model(model_config)
    causal_lm.to_empty(device=device)
    _initialize(causal_lm, seed)
    return causal_lm.train()
