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


def _train_and_export(rank, world_size, preset, schedule, out_dir):
    from hf_asyncpp.checkpoint import export_hf_model, gather_full_state_dict
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
        state = gather_full_state_dict(engine.stage_state_dict(), layout)
        if layout.rank == 0:
            export_hf_model(state, model_config, load_tokenizer("builtin"), out_dir)
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


@pytest.mark.multirank
@pytest.mark.parametrize("preset,schedule", [("tiny-mixtral", "1f1b"), ("tiny-qwen2-moe", "zbv")])
def test_exported_model_reproduces_pipelined_logits_in_a_fresh_process(tmp_path, preset, schedule):
    out_dir = tmp_path / "final"
    results = run_ranks(2, _train_and_export, preset, schedule, str(out_dir))
    pipelined = torch.tensor(next(r for r in results if r is not None))
    assert (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file()
    assert not (tmp_path / "final.partial").exists()
    loaded = subprocess.run([sys.executable, "-c", _LOAD, str(out_dir), str(PROBE_SEED)], capture_output=True,
                            text=True, check=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    reloaded = torch.tensor(json.loads(loaded.stdout.strip().splitlines()[-1]))
    assert reloaded.shape == pipelined.shape
    torch.testing.assert_close(reloaded, pipelined, rtol=0, atol=1e-5)


def test_export_writes_the_on_disk_names_save_pretrained_writes(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.models.presets import build_config

    config = build_config("tiny-mixtral", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "reference")
    export_hf_model(dict(model.state_dict()), config, None, tmp_path / "ours")
    keys = {}
    for name in ("reference", "ours"):
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
            keys[name] = set(f.keys())
    assert keys["ours"] == keys["reference"]
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys["ours"]  # per-expert on-disk names


def test_export_refuses_a_state_that_does_not_cover_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.models.presets import build_config

    config = build_config("tiny-llama", num_hidden_layers=2)
    state = dict(AutoModelForCausalLM.from_config(config).state_dict())
    state.pop("lm_head.weight")
    with pytest.raises(RuntimeError, match="missing.*lm_head.weight"):
        export_hf_model(state, config, None, tmp_path / "final")
    assert not (tmp_path / "final").exists()
