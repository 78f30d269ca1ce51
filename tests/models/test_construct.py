"""A rank builds only its stages: on the meta device first, then allocated and initialized in place.

Specification: every tensor of a stage is initialized (none is left as allocated memory), the
buffers HF computes at construction (rotary frequencies, routing biases) equal those of the model
built normally, and the same seed gives bitwise the same weights whatever the stage split: a tensor's
value depends on the seed and its name only. The whole model built the same way is the union of the
stages, so references built with `build_model` start where the pipeline starts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_asyncpp.models import PRESETS, build_stages, plan_stages
from hf_asyncpp.models import construct
from hf_asyncpp.models.construct import build_model, meta_model
from tests.test_engine import small_model_config


def _poisoned_to_empty(monkeypatch):
    """Make freshly allocated memory NaN, so a tensor nobody initialized cannot pass for one."""
    original = torch.nn.Module.to_empty

    def to_empty(module, *, device, recurse=True):
        out = original(module, device=device, recurse=recurse)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.nn.Module, "to_empty", to_empty)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_tensor_of_every_stage_is_initialized_and_buffers_equal_hf_construction(preset, monkeypatch):
    config = small_model_config(preset)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # HF's own construction
    ref_buffers = dict(reference.named_buffers())
    _poisoned_to_empty(monkeypatch)
    stages = build_stages(config, plan_stages(config, 4), [0, 1, 2, 3], "cpu", seed=3)
    seen = set()
    for stage in stages:
        for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
            assert not tensor.is_meta and torch.isfinite(tensor).all(), f"{preset}: {name} was not initialized"
            if name in ref_buffers:
                assert torch.equal(tensor, ref_buffers[name]), f"{preset}: buffer {name} differs from HF's"
            seen.add(name)
    assert seen >= set(dict(reference.named_parameters())), "a parameter belongs to no stage"


def test_the_same_seed_gives_the_same_weights_under_every_stage_split():
    config = small_model_config("tiny-qwen3-moe")
    whole = dict(build_model(config, seed=7).named_parameters())
    for n_stages, boundaries in ((1, None), (2, None), (4, None), (3, [1, 2])):
        plan = plan_stages(config, n_stages, boundaries=boundaries)
        # Each stage built alone, as the rank holding it would build it.
        for s in range(n_stages):
            (stage,) = build_stages(config, plan, [s], "cpu", seed=7)
            for name, param in stage.named_parameters():
                assert torch.equal(param, whole[name]), f"{name} differs in stage {s} of {n_stages}"
    other_seed = dict(build_model(config, seed=8).named_parameters())
    assert not torch.equal(whole["model.layers.0.mlp.experts.gate_up_proj"],
                           other_seed["model.layers.0.mlp.experts.gate_up_proj"])


def test_initialization_follows_the_model_class_and_leaves_the_callers_random_stream_alone():
    config = small_model_config("tiny-mixtral")
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    model = build_model(config, seed=1)
    assert torch.equal(torch.rand(1), before)
    std = config.initializer_range
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.embed_tokens.weight", "lm_head.weight"):
        weight = dict(model.named_parameters())[name]
        assert abs(weight.std().item() - std) < 0.15 * std, name  # normal(0, initializer_range)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(config.hidden_size))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tensors_off_the_cpu_are_initialized_through_cpu_copies_with_the_cpu_draws(preset, monkeypatch):
    """A GPU's tensors are initialized as CPU copies and copied back, so the CPU generator draws the same
    numbers for every device. Here every tensor takes that path (all of them are on the CPU): the
    stages, poisoned with NaN when allocated, come out bitwise the directly initialized model's, and
    every parameter is still the object the stage was built with."""
    config = small_model_config(preset)
    direct = dict(build_model(config, seed=5).state_dict())
    drawn_on_cpu = construct._drawn_on_cpu
    monkeypatch.setattr(construct, "_drawn_on_cpu", lambda module: drawn_on_cpu(module, always=True))
    _poisoned_to_empty(monkeypatch)
    built = []
    original_initialize = construct._initialize

    def initialize(causal_lm, seed):  # the parameters as allocated, before initialization
        built.extend((name, id(p)) for name, p in causal_lm.named_parameters())
        original_initialize(causal_lm, seed)

    monkeypatch.setattr(construct, "_initialize", initialize)
    stages = build_stages(config, plan_stages(config, 2), [0, 1], "cpu", seed=5)
    after = {name: p for stage in stages for name, p in stage.named_parameters()}
    for name, tensor in [(n, t) for stage in stages for n, t in stage.state_dict().items()]:
        assert torch.equal(tensor, direct[name]), f"{preset}: {name} differs from the direct initialization"
    assert all(id(after[name]) == identity for name, identity in built if name in after)


def test_building_a_stage_allocates_only_that_stage():
    config = small_model_config("tiny-qwen3-moe")
    plan = plan_stages(config, 4)
    (stage,) = build_stages(config, plan, [1], "cpu", seed=0)
    full = sum(p.numel() for p in meta_model(config).parameters())
    mine = sum(p.numel() for p in stage.parameters())
    assert all(not p.is_meta for p in stage.parameters())
    assert mine < full / 3  # a middle stage: two of eight layers, no embeddings or head


@pytest.mark.parametrize("preset,shard", [("tiny-mixtral", None), ("tiny-qwen3-moe", "60KB"), ("tiny-deepseek-v3", "60KB")])
def test_init_from_loads_each_stage_from_only_its_own_tensors_as_from_pretrained_does(tmp_path, preset, shard, monkeypatch):
    """Checkpoints as transformers writes them (per-expert tensors for Mixtral, converted back on
    load; several shard files with an index), loaded stage by stage: equal to from_pretrained, and
    no tensor of another stage is read."""
    from hf_asyncpp.models import construct

    config = small_model_config(preset)
    saved = build_model(config, seed=5)
    saved.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    expected = dict(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict())
    read = []
    original = construct._TensorInFile.__getitem__
    monkeypatch.setattr(construct._TensorInFile, "__getitem__", lambda self, i: read.append(self.key) or original(self, i))
    plan = plan_stages(config, 4)
    for s in range(4):
        read.clear()
        (stage,) = build_stages(config, plan, [s], "cpu", seed=0, init_from=str(tmp_path))
        state = stage.state_dict()
        for name, tensor in state.items():
            assert torch.equal(tensor, expected[name]), f"stage {s}: {name}"
        layers = {f"model.layers.{i}." for i in plan[s]}
        foreign = [k for k in read if k.startswith("model.layers.") and not any(k.startswith(p) for p in layers)]
        assert read and not foreign, f"stage {s} read {foreign}"
        assert ("model.embed_tokens.weight" in read) == (s == 0) and ("lm_head.weight" in read) == (s == 3)


def test_init_from_refuses_a_checkpoint_that_lacks_a_stage_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    config = small_model_config("tiny-qwen3-moe")
    build_model(config, seed=5).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    plan = plan_stages(config, 4)
    build_stages(config, plan, [0], "cpu", seed=0, init_from=str(tmp_path))  # stage 0 has what it needs
    with pytest.raises(ValueError, match=r"missing: \['model.layers.2.self_attn.q_proj.weight'\]"):
        build_stages(config, plan, [1], "cpu", seed=0, init_from=str(tmp_path))


def _load_rows_on_each_replica(rank, world_size, directory, preset):
    """Each stage of a 2-stage plan built by this dp replica with `dp_mesh`: {stage: (its local
    tensors, whole buffers, bytes read)}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hf_asyncpp.models import construct
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.test_engine import small_model_config

    init_parallel(read_launch(), 1)
    read = {"bytes": 0}
    original = construct._TensorInFile.__getitem__

    def counting(self, index):
        tensor = original(self, index)
        read["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    construct._TensorInFile.__getitem__ = counting
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        config = small_model_config(preset)
        plan = plan_stages(config, 2)
        out = {}
        for s in range(2):
            read["bytes"] = 0
            (stage,) = build_stages(config, plan, [s], "cpu", seed=0, init_from=directory, dp_mesh=mesh)
            params = {n: p.to_local().detach().clone() for n, p in stage.named_parameters()}
            assert all(isinstance(p, DTensor) for p in stage.parameters())
            persistent = set(stage.state_dict())
            buffers = {n: b.clone() for n, b in stage.named_buffers() if n in persistent}
            out[s] = (params, buffers, read["bytes"])
        return out
    finally:
        construct._TensorInFile.__getitem__ = original
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("preset,shard", [("tiny-mixtral", None), ("tiny-deepseek-v3", "60KB"), ("tiny-gpt-oss", None)])
def test_a_sharded_replica_reads_only_the_rows_it_keeps(tmp_path, preset, shard):
    """Stages built for row-sharding over 2 dp replicas (`dp_mesh`) come back holding this replica's
    Shard(0) rows of from_pretrained's weights bit for bit — per-expert checkpoint tensors fused,
    already-fused expert tensors and dense ones alike — with whole buffers, and each replica reads
    exactly the bytes it keeps: its rows (0-d tensors whole, being replicated) and its buffers."""
    from tests.ranks import run_ranks

    config = small_model_config(preset)
    build_model(config, seed=5).save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    expected = dict(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict())
    replicas = run_ranks(2, _load_rows_on_each_replica, str(tmp_path), preset)
    for s in range(2):
        params = replicas[0][s][0]
        whole_bytes = sum(expected[n].numel() * expected[n].element_size() for n in params)
        for rank, replica in enumerate(replicas):
            local, buffers, read_bytes = replica[s]
            for name, tensor in local.items():
                rows = expected[name] if expected[name].ndim == 0 else torch.chunk(expected[name], 2)[rank]
                assert torch.equal(tensor, rows), f"stage {s}, rank {rank}: {name}"
            for name, buffer in buffers.items():
                assert torch.equal(buffer, expected[name]), f"stage {s}, rank {rank}: buffer {name}"
            # Exactly what it keeps (the checkpoint is fp32, as the stage): its rows, and whole buffers.
            kept = sum(t.numel() * t.element_size() for t in [*local.values(), *buffers.values()])
            assert read_bytes == kept, (s, rank, read_bytes, kept)
        assert sum(r[s][2] for r in replicas) < whole_bytes * 1.01, "the replicas together read about one copy"
