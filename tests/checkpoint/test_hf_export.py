"""Export: the trained pipelined model, written as an HF directory, is an ordinary HF model.

A fresh Python process loads `<out>/final` with `AutoModelForCausalLM.from_pretrained` (no custom
code) and reproduces the logits the pipeline computes for a probe batch after training, to 1e-5
(fp32; the same ops run in the same order, the bound only absorbs kernel-level reassociation).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_asyncpp.parallel.spawn import run_ranks

PROBE_SEED = 5


def _train_and_export(rank, world_size, preset, schedule, out_dir, max_shard_size):
    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.data import load_tokenizer
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.test_engine import small_model_config

    layout = init_parallel(read_launch(), world_size)
    try:
        model_config = small_model_config(preset)
        config = TrainConfig(model_config=preset, pp_size=world_size, schedule=schedule, optimizer="adamw",
                             learning_rate=1e-2, seq_len=16, micro_batch_size=2, n_microbatches=4, seed=1)
        engine = PipelineEngine(config, model_config, layout)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            engine.train_step(torch.randint(0, model_config.vocab_size, (8, 16), generator=gen))
        probe = torch.randint(0, model_config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(PROBE_SEED))
        _, _, logits = engine.eval_step(probe)
        export_hf_model(engine.stage_state_dict(), layout, model_config, load_tokenizer("builtin"), out_dir,
                        max_shard_size)
        return None if logits is None else logits.tolist()
    finally:
        shutdown_parallel()


_LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
AutoTokenizer.from_pretrained(sys.argv[1])
probe = torch.randint(0, model.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(int(sys.argv[2])))
with torch.no_grad():
    print(json.dumps(model(probe).logits.tolist()))
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
@pytest.mark.parametrize("preset, schedule, max_shard_size", [
    ("tiny-mixtral", "1f1b", "5GB"),  # small: one model.safetensors, as save_pretrained writes it
    ("tiny-qwen2-moe", "zbv", "100KB"),  # sharded: each rank writes its stages' shard files
])
def test_exported_model_reproduces_pipelined_logits_in_a_fresh_process(tmp_path, preset, schedule, max_shard_size):
    out_dir = tmp_path / "final"
    results = run_ranks(2, _train_and_export, preset, schedule, str(out_dir), max_shard_size)
    pipelined = torch.tensor(next(r for r in results if r is not None))
    assert (out_dir / "tokenizer.json").is_file() and (out_dir / "generation_config.json").is_file()
    assert not (tmp_path / "final.partial").exists()
    if max_shard_size == "5GB":
        assert (out_dir / "model.safetensors").is_file()
    else:
        files = _check_index(out_dir)
        assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    loaded = subprocess.run([sys.executable, "-c", _LOAD, str(out_dir), str(PROBE_SEED)], capture_output=True,
                            text=True, check=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    reloaded = torch.tensor(json.loads(loaded.stdout.strip().splitlines()[-1]))
    assert reloaded.shape == pipelined.shape
    torch.testing.assert_close(reloaded, pipelined, rtol=0, atol=1e-5)


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


def test_export_refuses_a_state_that_does_not_cover_the_model(tmp_path):
    (message,) = run_ranks(1, _export_without_lm_head, str(tmp_path / "final"))
    assert "missing ['lm_head.weight']" in message
    assert not (tmp_path / "final").exists() and not (tmp_path / "final.partial").exists()
