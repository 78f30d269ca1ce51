"""Checkpoints written in the background (checkpoint/saving.py): a checkpoint holds the state of the
step it was staged at, whatever training does while its files are written; a write that fails is
raised on every rank where the run waits for it, and leaves nothing that looks like a checkpoint;
each save is timed.

Engines on real gloo ranks stage a checkpoint after step AT and go on training to the end before
waiting for the write: the live weights, optimizer state, EF buffers and weight versions all change
under the write. A fresh engine loaded from that checkpoint must then continue bit for bit as the
straight run (tests/checkpoint/test_checkpoints.py's reference: same kernels, same order, fp32).
"""

from __future__ import annotations

import json

import pytest

from tests.checkpoint.test_checkpoints import AT, STEPS, _config, _rows, _run_part, _steps
from tests.ranks import run_ranks
from tests.test_engine import small_model_config


def _save_while_training(rank, world_size, pp_size, schedule, optimizer, ef, output_dir, fail_rank=None):
    """Steps 0..AT−1, a background save, the remaining steps, then the wait. Returns the losses, the
    save's timing and what the wait said."""
    from pathlib import Path

    from hf_asyncpp.checkpoint import saving
    from hf_asyncpp.checkpoint.saving import CheckpointWriter
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.resilience import RunFailure

    class FailingWriter(saving.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    original = saving.FileSystemWriter
    layout = init_parallel(read_launch(), pp_size)
    try:
        if rank == fail_rank:
            saving.FileSystemWriter = FailingWriter
        model_config = small_model_config("tiny-qwen3-moe")
        engine = PipelineEngine(_config(layout, schedule, optimizer, ef, output_dir), model_config, layout)
        rows = _rows(layout, model_config.vocab_size)
        writer = CheckpointWriter(layout)
        losses = _steps(engine, rows, 0, AT)
        path = writer.save(engine, output_dir, AT, {})
        in_flight = writer.pending and not path.exists()  # the steps below run while it is written
        losses += _steps(engine, rows, AT, STEPS)
        try:
            done, error = writer.wait(), None
        except RunFailure as err:
            done, error = None, str(err)
        engine.finish()
        timing = writer.last
        return dict(losses=losses, in_flight=in_flight, done=None if done is None else str(done), error=error,
                    timing=None if timing is None else (timing.step, timing.bytes, timing.staging_s, timing.writing_s),
                    again=writer.wait(), leftovers=sorted(p.name for p in Path(output_dir).iterdir()))
    finally:
        saving.FileSystemWriter = original
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, pp_size, schedule, optimizer, ef", [
    (2, 2, "pipedream-2bw", "adamw", True),  # weight versions and EF buffers, microbatches in flight
    (2, 1, "gpipe", "muon", True),  # dp 2 under FSDP2: the state's DTensors staged as shards
])
def test_a_checkpoint_written_while_training_goes_on_holds_its_step_and_resumes_bitwise(
        tmp_path, world_size, pp_size, schedule, optimizer, ef):
    args = (pp_size, schedule, optimizer, ef, str(tmp_path))
    saved = run_ranks(world_size, _save_while_training, *args)
    straight, resumed = (run_ranks(world_size, _run_part, *args, part) for part in ("straight", "resumed"))
    checkpoint = tmp_path / f"checkpoint-{AT}"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for rank in range(world_size):
        assert saved[rank]["in_flight"] and saved[rank]["error"] is None and saved[rank]["done"] == str(checkpoint)
        assert saved[rank]["again"] is None  # a completed save is reported once
        assert saved[rank]["losses"] == straight[rank]["losses"]  # the background write changed nothing
        assert resumed[rank]["losses"] == straight[rank]["losses"][AT:], rank
        assert resumed[rank]["digests"] == straight[rank]["digests"], rank
        step, written, staging_s, writing_s = saved[rank]["timing"]
        assert step == AT and written == sum(f["bytes"] for f in manifest.values()) and staging_s > 0 and writing_s > 0
    assert saved[0]["timing"] == saved[1]["timing"]  # the slowest rank's times, agreed


@pytest.mark.multirank
def test_a_write_that_fails_on_one_rank_is_raised_on_every_rank_at_the_wait_and_leaves_no_checkpoint(tmp_path):
    saved = run_ranks(2, _save_while_training, 2, "pipedream-2bw", "adamw", False, str(tmp_path), 1)
    for rank in range(2):
        assert saved[rank]["done"] is None and saved[rank]["timing"] is None
        assert saved[rank]["error"].startswith(f"saving checkpoint {tmp_path / f'checkpoint-{AT}'} failed on rank 1 "
                                               "(OSError: [Errno 28] No space left on device")
        assert saved[rank]["error"].endswith("the previous checkpoint is kept")
        assert saved[rank]["leftovers"] == []  # no .partial directory


@pytest.mark.multirank  # train.py processes
def test_a_checkpoint_loads_with_from_pretrained_as_its_export_does(tmp_path):
    """checkpoint_hf_weights (the default): the weights are written beside the state, so
    `AutoModelForCausalLM.from_pretrained('…/checkpoint-N')` gives the logits of that checkpoint's
    export (`hf-asyncpp export`); without them, the directory names the command."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.checkpoint import export_checkpoint

    repo = Path(__file__).resolve().parents[2]
    command = [sys.executable, "training_scripts/train.py", "--config", "training_scripts/configs/tiny_moe.yaml",
               "--seq_len", "32", "--n_microbatches", "2", "--micro_batch_size", "2", "--eval_fraction", "0",
               "--max_steps", "2", "--save_steps", "2", "--save_final", "false", "--report_to", "none"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for out, extra in ((tmp_path / "with", []), (tmp_path / "without", ["--checkpoint_hf_weights", "false"])):
        done = subprocess.run([*command, *extra, "--output_dir", str(out)], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = tmp_path / "with" / "checkpoint-2"
    exported = export_checkpoint(checkpoint, tmp_path / "exported")
    tokens = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        direct = AutoModelForCausalLM.from_pretrained(checkpoint)(tokens).logits
        via_export = AutoModelForCausalLM.from_pretrained(exported)(tokens).logits
    assert torch.equal(direct, via_export)
    note = (tmp_path / "without" / "checkpoint-2" / "HOW_TO_LOAD.txt").read_text()
    assert f"hf-asyncpp export {tmp_path / 'without' / 'checkpoint-2'} OUT_DIR" in note
    assert not list((tmp_path / "without" / "checkpoint-2").glob("*.safetensors"))
