"""Export: the trained pipelined model, written as an HF directory by its stages, is an ordinary HF model.

For every supported family: after training on pp = 2, a fresh Python process loads the export with
`AutoModelForCausalLM.from_pretrained` (no custom code) and reproduces the pipelined logits for a probe
batch to 1e-5, whether it was written as one file or as per-stage shards with an index; `init_from`
the export splits it onto the stages again and reproduces them too. The on-disk tensors are exactly
those `save_pretrained` writes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.ranks import run_ranks

PROBE_SEED = 5


def _train_export_and_reload(rank, world_size, out_root):
    """Per family: train 3 steps on pp 2, probe logits, export (one file for half of the families,
    per-stage shards for the others), then a new engine with init_from = the export probes again.
    Returns {preset: (pipelined logits, init_from logits)} from the last stage's rank."""
    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.data import load_tokenizer
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.test_engine import FAMILIES, small_model_config

    layout = init_parallel(read_launch(), world_size)
    results = {}
    try:
        for i, preset in enumerate(FAMILIES):
            model_config = small_model_config(preset)
            config = TrainConfig(model_config=preset, pp_size=world_size, schedule="1f1b", optimizer="adamw",
                                 learning_rate=1e-2, seq_len=16, micro_batch_size=2, n_microbatches=4, seed=1)
            engine = PipelineEngine(config, model_config, layout)
            gen = torch.Generator().manual_seed(0)
            for _ in range(3):
                engine.train_step(torch.randint(0, model_config.vocab_size, (8, 16), generator=gen))
            probe = torch.randint(0, model_config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(PROBE_SEED))
            _, _, trained = engine.eval_step(probe, return_logits=True)
            out_dir = f"{out_root}/{preset}"
            export_hf_model(engine.stage_state_dict(), layout, model_config, load_tokenizer("builtin"), out_dir,
                            "5GB" if i % 2 else "100KB")
            config.init_from = out_dir
            _, _, reloaded = PipelineEngine(config, model_config, layout).eval_step(probe, return_logits=True)
            if trained is not None:
                results[preset] = (trained.tolist(), reloaded.tolist())
        return results
    finally:
        shutdown_parallel()


_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
logits = {}
for directory in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    AutoTokenizer.from_pretrained(directory)
    probe = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(int(sys.argv[1])))
    with torch.no_grad():
        logits[directory] = model(probe).logits.tolist()
print(json.dumps(logits))
"""


def _check_index(out_dir):
    """Every tensor named in the index is in its file and nowhere else; total_size is their bytes."""
    from safetensors import safe_open

    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    total, seen = 0, set()
    for filename in sorted(set(index["weight_map"].values())):
        with safe_open(str(out_dir / filename), "pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == filename}
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
            seen |= keys
    assert seen == set(index["weight_map"]) and total == index["metadata"]["total_size"]
    return sorted(set(index["weight_map"].values()))


@pytest.mark.multirank
def test_every_family_exported_reloads_with_the_pipelined_logits_and_init_from_continues_it(tmp_path):
    """from_pretrained in a fresh process (no custom code) reproduces the pipelined logits (1e-5: the
    same fp32 ops, reassociated at kernel level at most), and init_from the export gives the pipeline
    back exactly the trained weights (same stage split, same ops: 1e-6)."""
    from tests.test_engine import FAMILIES

    (results,) = [r for r in run_ranks(2, _train_export_and_reload, str(tmp_path)) if r]
    assert set(results) == set(FAMILIES)
    directories = [str(tmp_path / preset) for preset in FAMILIES]
    loaded = subprocess.run([sys.executable, "-c", _LOAD, str(PROBE_SEED), *directories], capture_output=True,
                            text=True, check=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    reloaded_hf = json.loads(loaded.stdout.strip().splitlines()[-1])
    for i, preset in enumerate(FAMILIES):
        out_dir = tmp_path / preset
        trained, init_from = (torch.tensor(x) for x in results[preset])
        assert (out_dir / "tokenizer.json").is_file() and (out_dir / "generation_config.json").is_file()
        assert not (tmp_path / f"{preset}.partial").exists()
        if i % 2:
            assert (out_dir / "model.safetensors").is_file()
        else:
            files = _check_index(out_dir)
            assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
        torch.testing.assert_close(torch.tensor(reloaded_hf[str(out_dir)]), trained, rtol=0, atol=1e-5, msg=preset)
        torch.testing.assert_close(init_from, trained, rtol=0, atol=1e-6, msg=preset)


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
def test_export_writes_the_tensors_save_pretrained_writes(tmp_path, preset):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import on_disk_state
    from hf_asyncpp.models.presets import build_config

    model = AutoModelForCausalLM.from_config(build_config(preset, num_hidden_layers=2))
    model.save_pretrained(tmp_path / "reference")
    reference = load_file(str(tmp_path / "reference" / "model.safetensors"))
    ours = on_disk_state(model.state_dict(), model)
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
    if preset == "tiny-mixtral":
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in ours  # per-expert on-disk names


def _export_without_lm_head(rank, world_size, out_dir):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), 1)
    try:
        config = build_config("tiny-llama", num_hidden_layers=2)
        state = dict(AutoModelForCausalLM.from_config(config).state_dict())
        state.pop("lm_head.weight")
        try:
            export_hf_model(state, layout, config, None, out_dir)
        except RuntimeError as err:
            return str(err)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_export_refuses_a_state_that_does_not_cover_the_model(tmp_path):
    (message,) = run_ranks(1, _export_without_lm_head, str(tmp_path / "final"))
    assert "missing ['lm_head.weight']" in message
    assert not (tmp_path / "final").exists() and not (tmp_path / "final.partial").exists()


def _groups_of_the_exports_object_collectives(rank, world_size, out_root):
    import torch.distributed as dist

    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.data import load_tokenizer
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.test_engine import small_model_config

    layout = init_parallel(read_launch(), world_size)
    used, originals = [], {name: getattr(dist, name) for name in ("gather_object", "all_gather_object")}
    try:
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=world_size, schedule="1f1b", seq_len=16,
                             micro_batch_size=2, n_microbatches=4)
        model_config = small_model_config("tiny-qwen3-moe")
        engine = PipelineEngine(config, model_config, layout)
        for name, original in originals.items():
            def spy(*args, original=original, **kwargs):
                used.append(kwargs.get("group"))
                return original(*args, **kwargs)
            setattr(dist, name, spy)
        for max_shard_size in ("5GB", "100KB"):  # one file gathered on rank 0; per-stage shards and an index
            export_hf_model(engine.stage_state_dict(), layout, model_config, load_tokenizer("builtin"),
                            f"{out_root}/{max_shard_size}", max_shard_size)
        io_groups = {id(layout.io_group), id(layout.io_pp_group)}
        return dict(n=len(used), on_io_groups=all(id(g) in io_groups for g in used),
                    backends={dist.get_backend(g) for g in used})
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        shutdown_parallel()


@pytest.mark.multirank
def test_the_export_gathers_weights_on_gloo_groups_that_wait_as_long_as_io(tmp_path):
    """The weights an export gathers as Python objects go over gloo groups with the I/O timeout: on
    NCCL they would be staged in GPU memory (pp times the largest stage on rank 0, beside the training
    state), and the stages' waits for each other's writes would count against comm_timeout_s."""
    for report in run_ranks(2, _groups_of_the_exports_object_collectives, str(tmp_path)):
        assert report["n"] >= 3 and report["on_io_groups"] and report["backends"] == {"gloo"}, report
