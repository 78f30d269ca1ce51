"""`hf-asyncpp export`: a training checkpoint, read on one process, is the model the run exports.

Engines on real gloo ranks train and save a checkpoint in some pp × dp layout (FSDP2 shards at dp 2),
then write the run's own export from their stages. The export of the checkpoint, made afterwards in
this process without a process group, must hold the same tensors to the bit in fp32, so
`from_pretrained` gives the same logits to the bit; in bf16 it must be exactly what transformers
makes of the fp32 export when it loads it in bf16 (`dtype=torch.bfloat16`, which keeps DeepSeek-V3's
router in fp32). An asynchronous checkpoint, saved with microbatches in flight, holds the stages'
master weights of that moment: its export loads into exactly those. Reading goes a group of layers
at a time, no group above max_shard_size unless one layer alone is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.checkpoint.test_hf_export import _check_index
from tests.ranks import run_ranks
from tests.test_engine import small_model_config

SEQ, MBS, M, STEPS, AT = 16, 2, 4, 3, 2
PROBE = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(7))


def _train_save_export(rank, world_size, pp_size, schedule, preset, out_root, max_shard_size):
    """Train; a synchronous run saves after its last step and exports from its stages (final/); an
    asynchronous one saves after step AT, in flight, and returns its stages' master weights then."""
    import dataclasses

    from hf_asyncpp.checkpoint import export_hf_model, save_checkpoint
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config(preset)
        config = TrainConfig(model_config=preset, pp_size=pp_size, schedule=schedule, optimizer="adamw",
                             learning_rate=3e-3, seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=3,
                             max_steps=STEPS, output_dir=out_root, max_shard_size=max_shard_size)
        engine = PipelineEngine(config, model_config, layout)
        gen = torch.Generator().manual_seed(5)
        rows = [torch.randint(0, 128, (layout.dp_size * MBS * M, SEQ), generator=gen).chunk(layout.dp_size)[layout.dp_rank]
                for _ in range(STEPS)]
        last = STEPS if engine.spec.synchronous else AT
        for k in range(last):
            engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None)
        run_state = {"config": dataclasses.asdict(config)}
        save_checkpoint(engine, layout, out_root, last, run_state, model_config=model_config)
        if not engine.spec.synchronous:
            return engine.stage_state_dict() if layout.dp_rank == 0 else {}
        engine.finish()
        export_hf_model(engine.stage_state_dict(), layout, model_config, None, f"{out_root}/final", max_shard_size)
        return {}
    finally:
        shutdown_parallel()


def _weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _logits(directory, **load) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, **load).eval()
    with torch.no_grad():
        return model(PROBE).logits


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    """One rank, DeepSeek-V3 (fp32 router under bf16), one weights file: checkpoint-3 and final/."""
    out = tmp_path_factory.mktemp("deepseek")
    run_ranks(1, _train_save_export, 1, "gpipe", "tiny-deepseek-v3", str(out), "5GB")
    return out


@pytest.mark.multirank
def test_a_sharded_pipeline_checkpoint_exports_the_runs_own_weights_bitwise(tmp_path):
    """pp 2 × dp 2 with FSDP2, written in several files (max_shard_size below the model's size)."""
    from hf_asyncpp.checkpoint import export_checkpoint

    run_ranks(4, _train_save_export, 2, "1f1b", "tiny-qwen3-moe", str(tmp_path), "100KB")
    exported = export_checkpoint(tmp_path / f"checkpoint-{STEPS}", tmp_path / "exported", "fp32")
    ours, run = _weights(exported), _weights(tmp_path / "final")
    assert ours.keys() == run.keys() and all(torch.equal(ours[k], run[k]) for k in run)
    assert len(_check_index(exported)) > 1 and not (tmp_path / "exported.partial").exists()
    assert torch.equal(_logits(exported), _logits(tmp_path / "final"))


@pytest.mark.multirank  # its run is a rank's of the pool (deepseek_run)
def test_a_bf16_export_is_the_fp32_export_as_transformers_loads_it_in_bf16(deepseek_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import export_checkpoint

    exported = export_checkpoint(deepseek_run / f"checkpoint-{STEPS}", tmp_path / "bf16", "bf16")
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"
    ours = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(deepseek_run / "final", dtype=torch.bfloat16).state_dict()
    assert ours.keys() == reference.keys()
    assert all(ours[k].dtype == reference[k].dtype and torch.equal(ours[k], reference[k]) for k in reference)
    # What the model class keeps in fp32 stays fp32: the router's correction bias in every supported
    # transformers, its gate weight too from 5.24 on.
    kept = {k for k, v in ours.items() if v.dtype == torch.float32}
    strict = type(AutoModelForCausalLM.from_pretrained(exported))._keep_in_fp32_modules_strict
    assert kept >= {"model.layers.1.mlp.gate.e_score_correction_bias"}
    assert ("model.layers.1.mlp.gate.weight" in kept) == ("gate.weight" in strict)
    assert torch.equal(_logits(exported), _logits(deepseek_run / "final", dtype=torch.bfloat16))
    fp32 = export_checkpoint(deepseek_run / f"checkpoint-{STEPS}", tmp_path / "fp32")  # the run's export_dtype
    assert torch.equal(_logits(fp32), _logits(deepseek_run / "final"))


@pytest.mark.multirank
def test_an_asynchronous_checkpoint_exports_the_stages_master_weights_of_its_step(tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import export_checkpoint

    stages = run_ranks(2, _train_save_export, 2, "pipedream-2bw", "tiny-qwen3-moe", str(tmp_path), "5GB")
    masters = {k: v for stage in stages for k, v in stage.items()}
    exported = export_checkpoint(tmp_path / f"checkpoint-{AT}", tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert loaded.keys() == masters.keys() and all(torch.equal(loaded[k], masters[k]) for k in masters)


@pytest.mark.multirank  # its run is a rank's of the pool (deepseek_run)
def test_the_weights_are_read_a_group_of_layers_at_a_time(deepseek_run, tmp_path, monkeypatch):
    """With max_shard_size below the model, every read holds whole layers and no more than the limit
    (or one layer, when a layer alone is larger)."""
    import hf_asyncpp.checkpoint.checkpoint_export as export
    from hf_asyncpp.checkpoint.checkpoints import PIPELINE_STATE

    checkpoint = _old_or_edited(deepseek_run, tmp_path, lambda state: state["config"].update(max_shard_size="40KB"))
    groups = []
    read = export._read
    monkeypatch.setattr(export, "_read", lambda *args: groups.append(read(*args)) or groups[-1])
    exported = export.export_checkpoint(checkpoint, tmp_path / "exported")
    assert json.loads((checkpoint / PIPELINE_STATE).read_text())["config"]["max_shard_size"] == "40KB"
    sizes = [sum(t.numel() * t.element_size() for t in group.values()) for group in groups]
    layers = [{k.split(".")[2] for k in group if k.startswith("model.layers.")} for group in groups]
    assert len(groups) > 2 and all(size <= 40_000 or len(names) == 1 for size, names in zip(sizes, layers))
    assert sorted(k for group in groups for k in group) == sorted(_weights_in_memory(deepseek_run))
    assert torch.equal(_logits(exported), _logits(deepseek_run / "final"))


def _weights_in_memory(run) -> list[str]:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(run / "final").state_dict())


def _old_or_edited(run, tmp_path, edit=None):
    """A copy of the run's checkpoint, its pipeline_state.json edited (manifest updated), or, without
    `edit`, in the format of earlier versions: the pipeline's keys in trainer_state.json, no pipeline_state.json."""
    import hashlib

    from hf_asyncpp.checkpoint.checkpoints import (
        MANIFEST,
        PIPELINE_STATE,
        TRAINER_STATE,
    )

    copy = shutil.copytree(run / f"checkpoint-{STEPS}", tmp_path / f"checkpoint-{STEPS}")
    state = json.loads((copy / PIPELINE_STATE).read_text())
    manifest = json.loads((copy / MANIFEST).read_text())
    if edit is None:
        (copy / PIPELINE_STATE).unlink()
        del manifest[PIPELINE_STATE]
        name, state = TRAINER_STATE, {k: v for k, v in state.items() if k != "format"}
    else:
        name = PIPELINE_STATE
        edit(state)
    (copy / name).write_text(json.dumps(state))
    data = (copy / name).read_bytes()
    manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def _cli_export(*args):
    return subprocess.run([sys.executable, "-m", "hf_asyncpp.cli", "export", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.launch
def test_a_checkpoint_of_an_earlier_version_is_refused_with_one_error_line_and_nothing_written(deepseek_run, tmp_path):
    from hf_asyncpp.config import ConfigError, TrainConfig
    from hf_asyncpp.config_checks import validate_config

    old = _old_or_edited(deepseek_run, tmp_path)
    done = _cli_export(old, tmp_path / "out")
    assert done.returncode == 1 and done.stderr.count("error:") == 1, done.stderr
    assert "written by an earlier version of hf_asyncpp (it has no pipeline_state.json)" in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(ConfigError, match="earlier version of hf_asyncpp"):  # nor does a run resume it
        validate_config(TrainConfig(model_config="tiny-qwen3-moe", resume_from_checkpoint=str(old),
                                    output_dir=str(tmp_path / "run")), 2)


@pytest.mark.launch
def test_a_directory_that_is_no_checkpoint_and_an_occupied_out_dir_are_refused(deepseek_run, tmp_path):
    from hf_asyncpp.checkpoint import CheckpointError, export_checkpoint

    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        export_checkpoint(deepseek_run / "final", tmp_path / "out")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_checkpoint(deepseek_run / f"checkpoint-{STEPS}", occupied)
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"] and not (tmp_path / "occupied.partial").exists()
    done = _cli_export(deepseek_run / f"checkpoint-{STEPS}", tmp_path / "x", "--dtype", "fp16")
    assert done.returncode == 2 and "invalid choice: 'fp16'" in done.stderr and not (tmp_path / "x").exists()
