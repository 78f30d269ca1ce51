"""Training checkpoints: a run resumed from a checkpoint continues exactly as if never stopped.

Engines on real gloo ranks train STEPS steps straight through, and again as A steps → save → a fresh
engine (new process state: new model, optimizer, schedule) → load → STEPS − A steps. fp32 on CPU with
the same kernels in the same order: the per-step losses and the final weights must be bitwise equal.
Asynchronous schedules are saved with microbatches in flight (nothing is drained); the resumed run
replays the actions whose updates were still due (async_order.replay_after) from the saved weight
versions, which must rebuild exactly the state the straight run carried across the boundary.
"""

from __future__ import annotations

import json

import pytest

from hf_asyncpp.loop import MEASURED_KEYS
from tests.ranks import run_ranks
from tests.test_engine import save_model_dir, small_model_config

SEQ, MBS, M, STEPS, AT = 16, 2, 4, 6, 3


def _config(layout, schedule, optimizer, ef, output_dir, preset="tiny-qwen3-moe", **extra):
    from hf_asyncpp.config import TrainConfig

    lr = {"adamw": 3e-3, "muon": 2e-2, "soap": 3e-3, "sgd": 0.3, "lion": 3e-4}[optimizer]
    return TrainConfig(model_config=preset, pp_size=layout.pp_size, schedule=schedule, optimizer=optimizer,
                       learning_rate=lr, ef=ef, seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=3,
                       max_steps=STEPS, warmup_steps=2, output_dir=output_dir, **extra)


def _rows(layout, vocab):
    import torch

    gen = torch.Generator().manual_seed(5)
    full = [torch.randint(0, vocab, (layout.dp_size * MBS * M, SEQ), generator=gen) for _ in range(STEPS)]
    return [r.chunk(layout.dp_size)[layout.dp_rank] for r in full]


def _steps(engine, rows, start, stop):
    return [engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None).loss for k in range(start, stop)]


def _run_part(rank, world_size, pp_size, schedule, optimizer, ef, output_dir, part, preset="tiny-qwen3-moe",
              sync_steps=0, emulate_pp_size=0):
    """One process-group lifetime, as a real run: "straight" (all steps), "first" (steps 0..AT−1,
    then save) or "resumed" (load, then the remaining steps). Returns losses and weight digests."""
    import hashlib

    from hf_asyncpp.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config(preset)
        # A large routing-bias step makes DeepSeek-V3's versioned biases matter within a few steps.
        config = _config(layout, schedule, optimizer, ef, output_dir, preset, router_bias_update_rate=0.05,
                         sync_steps=sync_steps, emulate_pp_size=emulate_pp_size)
        rows = _rows(layout, model_config.vocab_size)
        engine = PipelineEngine(config, model_config, layout)
        start, stop = {"straight": (0, STEPS), "first": (0, AT), "resumed": (AT, STEPS)}[part]
        if part == "resumed":
            engine.resume_after(load_checkpoint(engine, layout, find_checkpoint("latest", output_dir))["step"])
        losses = _steps(engine, rows, start, stop)
        if part == "first":  # saved with microbatches in flight; this process then just stops
            save_checkpoint(engine, layout, output_dir, AT, {})
            return dict(losses=losses)
        engine.finish()
        digests = {n: hashlib.sha1(t.numpy().tobytes()).hexdigest() for n, t in engine.stage_state_dict().items()}
        return dict(losses=losses, digests=digests)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, pp_size, schedule, optimizer, ef, preset", [
    (2, 2, "1f1b", "adamw", False, "tiny-qwen3-moe"),
    (2, 1, "gpipe", "muon", True, "tiny-qwen3-moe"),  # dp 2, sharded with FSDP2: optimizer state and EF as DTensors
    (2, 2, "interleaved-1f1b", "soap", False, "tiny-qwen3-moe"),
    (2, 1, "gpipe", "soap", False, "tiny-qwen3-moe"),  # dp 2: square matrices' factors stay whole, their moments sharded
    (4, 2, "pipedream-2bw", "muon", True, "tiny-qwen3-moe"),  # pp 2 × dp 2: sharded weight versions, EF
    (4, 4, "pipedream", "sgd", False, "tiny-qwen3-moe"),  # per-microbatch updates; three stages have forwards in flight
    # DeepSeek-V3: stage 0 saved with minibatch 3 forwarded on version 2 (weights and routing biases)
    # while its master is version 3; the replay must route with version 2's biases
    (2, 2, "pipedream-2bw", "adamw", False, "tiny-deepseek-v3"),
])
def test_a_resumed_run_continues_bitwise(tmp_path, world_size, pp_size, schedule, optimizer, ef, preset, sync_steps=0,
                                        emulate_pp_size=0):
    args = (world_size, _run_part, pp_size, schedule, optimizer, ef, str(tmp_path))
    straight, first, resumed = (run_ranks(*args, part, preset, sync_steps, emulate_pp_size)
                                for part in ("straight", "first", "resumed"))
    for rank in range(world_size):
        assert first[rank]["losses"] + resumed[rank]["losses"] == straight[rank]["losses"], rank
        assert resumed[rank]["digests"] == straight[rank]["digests"], rank
    if preset == "tiny-deepseek-v3":
        assert any(n.endswith("e_score_correction_bias") for n in straight[0]["digests"])



@pytest.mark.multirank
@pytest.mark.parametrize("sync_steps", [2, 4])
def test_a_sync_start_resumes_across_its_switch_bitwise(tmp_path, sync_steps):
    """Saved after step 3: one asynchronous step past the switch, with minibatch 3 forwarded ahead
    (sync_steps 2), or inside the synchronous steps, resumed across the switch (sync_steps 4)."""
    test_a_resumed_run_continues_bitwise(tmp_path, 2, 2, "pipedream-2bw", "adamw", True, "tiny-qwen3-moe", sync_steps)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, schedule, depth, optimizer, ef, preset, sync_steps", [
    (1, "pipedream-2bw", 2, "muon", True, "tiny-qwen3-moe", 0),  # every stage's previous version kept
    (1, "pipedream", 4, "adamw", False, "tiny-qwen3-moe", 0),  # stage s keeps 3 − s versions, per-microbatch units
    (1, "wpipe", 2, "soap", False, "tiny-qwen3-moe", 0),  # one group delayed, the other not
    (1, "pipedream-2bw", 2, "adamw", False, "tiny-deepseek-v3", 0),  # the routing biases' versions too
    (1, "pipedream-2bw", 2, "adamw", True, "tiny-qwen3-moe", 4),  # saved inside a sync start, resumed across it
    (2, "pipedream-2bw", 2, "adamw", True, "tiny-qwen3-moe", 2),  # dp 2: replicated versions, written once
])
def test_an_emulated_schedule_resumes_bitwise(tmp_path, world_size, schedule, depth, optimizer, ef, preset, sync_steps):
    """The single-process emulator (pp_size 1) holds nothing in flight between steps: its checkpoint keeps
    each stage's weight versions still to be used, and the resumed run continues as the straight one."""
    test_a_resumed_run_continues_bitwise(tmp_path, world_size, 1, schedule, optimizer, ef, preset, sync_steps, depth)


def _train_and_save(rank, world_size, output_dir):
    from hf_asyncpp.checkpoint import save_checkpoint
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), 2)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        engine = PipelineEngine(_config(layout, "1f1b", "adamw", False, output_dir), model_config, layout)
        _steps(engine, _rows(layout, model_config.vocab_size), 0, 1)
        save_checkpoint(engine, layout, output_dir, 1, {"tokens_seen": 0})
    finally:
        shutdown_parallel()


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    run_ranks(2, _train_and_save, str(out))
    return out / "checkpoint-1"


def _validation_error(checkpoint, tmp_path) -> str:
    from hf_asyncpp.config import ConfigError, TrainConfig
    from hf_asyncpp.config_checks import validate_config

    config = TrainConfig(model_config="tiny-qwen3-moe", resume_from_checkpoint=str(checkpoint),
                         output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as err:
        validate_config(config, 2)
    assert not (tmp_path / "out").exists()
    return str(err.value)


def _copy(checkpoint, tmp_path):
    import shutil

    return shutil.copytree(checkpoint, tmp_path / checkpoint.name)


@pytest.mark.multirank  # its checkpoint is a two-rank run's (saved_checkpoint)
def test_a_truncated_checkpoint_file_is_named_before_anything_starts(saved_checkpoint, tmp_path):
    copy = _copy(saved_checkpoint, tmp_path)
    shard = sorted(copy.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    message = _validation_error(copy, tmp_path)
    assert shard.name in message and "truncated" in message
    assert shard.read_bytes() == data[: len(data) // 2]  # nothing was overwritten or repaired


@pytest.mark.multirank  # its checkpoint is a two-rank run's (saved_checkpoint)
def test_a_missing_file_is_named_before_anything_starts(saved_checkpoint, tmp_path):
    copy = _copy(saved_checkpoint, tmp_path)
    (copy / ".metadata").unlink()
    assert ".metadata is missing" in _validation_error(copy, tmp_path)


def _verify_checksums(rank, world_size, path):
    from pathlib import Path

    from hf_asyncpp.checkpoint.checkpoints import CheckpointError, verify_checksums
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), 1)
    read = []
    import hf_asyncpp.checkpoint.checkpoints as checkpoints

    original = checkpoints.digest
    checkpoints.digest = lambda p: read.append(p.name) or original(p)
    try:
        verify_checksums(Path(path), layout)
        return None, read
    except CheckpointError as err:
        return str(err), read
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_an_altered_file_is_named_by_every_rank_at_load_and_each_file_is_read_once(saved_checkpoint, tmp_path):
    """The checksums are checked by the ranks between them: no rank reads the whole checkpoint."""
    copy = _copy(saved_checkpoint, tmp_path)
    shard = sorted(copy.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size: only a checksum can tell
    shard.write_bytes(bytes(data))
    from hf_asyncpp.checkpoint.checkpoints import verify_checkpoint

    verify_checkpoint(copy)  # what runs before any process group: present, sizes right, nothing read
    results = run_ranks(2, _verify_checksums, str(copy))
    assert all(message and f"{shard.name} is damaged" in message for message, _ in results)
    files = [name for _, read in results for name in read]
    assert sorted(files) == sorted(json.loads((copy / "manifest.json").read_text()))  # each file once in all
    assert all(len(read) < len(files) for _, read in results)
    intact = run_ranks(2, _verify_checksums, str(saved_checkpoint))
    assert [message for message, _ in intact] == [None, None]


@pytest.mark.multirank  # its checkpoint is a two-rank run's (saved_checkpoint)
def test_an_interrupted_save_is_never_taken_for_a_checkpoint(saved_checkpoint, tmp_path):
    from hf_asyncpp.checkpoint.checkpoints import list_checkpoints

    partial = _copy(saved_checkpoint, tmp_path)
    (partial / "manifest.json").unlink()  # what a save killed before its last write leaves
    partial.rename(tmp_path / "checkpoint-2.partial")
    assert list_checkpoints(tmp_path) == []
    assert "not a complete checkpoint" in _validation_error(tmp_path / "checkpoint-2.partial", tmp_path)
    from hf_asyncpp.checkpoint.checkpoints import find_checkpoint

    assert find_checkpoint("latest", tmp_path) is None  # "latest" then starts from step 0


def _digests(engine) -> dict[str, str]:
    """sha1 of every whole weight and whole AdamW moment this rank's stages hold."""
    import hashlib

    from torch.distributed.tensor import DTensor

    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous()

    digests = {f"model.{n}": hashlib.sha1(t.numpy().tobytes()).hexdigest() for n, t in engine.stage_state_dict().items()}
    for updater in engine.executor.updaters:
        names = {id(p): n for module in engine.executor.modules for n, p in module.named_parameters()}
        for p, state in updater.optimizer.state.items():
            digests[f"exp_avg.{names[id(p)]}"] = hashlib.sha1(whole(state["exp_avg"]).numpy().tobytes()).hexdigest()
    return digests


def _save_or_load(rank, world_size, pp_size, schedule, output_dir, save):
    from hf_asyncpp.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        engine = PipelineEngine(_config(layout, schedule, "adamw", True, output_dir), model_config, layout)
        if save:
            _steps(engine, _rows(layout, model_config.vocab_size), 0, 2)
            save_checkpoint(engine, layout, output_dir, 2, {})
        else:
            load_checkpoint(engine, layout, find_checkpoint("latest", output_dir))
        return _digests(engine)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_a_checkpoint_loads_into_another_dp_and_pp_layout(tmp_path):
    """Saved from pp 2 × dp 2 (FSDP2 shards); loaded at pp 2 × dp 1 (whole tensors) and pp 1 × dp 2
    (one stage, resharded): every weight and optimizer moment is the same, bit for bit."""
    def merged(reports):
        return {k: v for report in reports for k, v in report.items()}

    saved = merged(run_ranks(4, _save_or_load, 2, "1f1b", str(tmp_path), True))
    for world_size, pp_size, schedule in [(2, 2, "1f1b"), (2, 1, "gpipe")]:
        loaded = merged(run_ranks(world_size, _save_or_load, pp_size, schedule, str(tmp_path), False))
        assert loaded == saved, [k for k in saved if loaded.get(k) != saved[k]][:5]


def _resume_with(rank, world_size, pp_size, n_microbatches, output_dir, sync_steps=0):
    from hf_asyncpp.checkpoint.checkpoints import (
        CheckpointError,
        find_checkpoint,
        load_checkpoint,
    )
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        config = _config(layout, "pipedream-2bw", "adamw", False, output_dir)
        config.n_microbatches, config.sync_steps = n_microbatches, sync_steps
        engine = PipelineEngine(config, small_model_config("tiny-qwen3-moe"), layout)
        try:
            load_checkpoint(engine, layout, find_checkpoint("latest", output_dir))
        except CheckpointError as err:
            return str(err)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_an_asynchronous_checkpoint_refuses_another_pipeline_order(tmp_path):
    """Its in-flight state is rebuilt by replaying the order, so pp_size, schedule, microbatch count
    and sync start must match; a pp 4 checkpoint must not be taken up by pp 2 (whose stage indices it
    also holds)."""
    run_ranks(4, _run_part, 4, "pipedream-2bw", "adamw", False, str(tmp_path), "first")
    for pp_size, n_microbatches, sync_steps in [(2, M, 0), (4, 2 * M, 0), (4, M, 1)]:
        messages = run_ranks(pp_size, _resume_with, pp_size, n_microbatches, str(tmp_path), sync_steps)
        assert all("needs the same pp_size, schedule and n_microbatches" in m for m in messages), messages


@pytest.mark.multirank
def test_an_asynchronous_checkpoint_resumes_with_another_dp_size(tmp_path):
    """pp 2 × dp 2 (sharded versions) → pp 2 × dp 1: the versions are resharded, the in-flight forwards
    replayed from them, and training continues (with one replica the global batch is another one,
    so the trajectory is not the dp 2 one; what must hold is that it loads, replays and trains)."""
    import math

    run_ranks(4, _run_part, 2, "pipedream-2bw", "adamw", True, str(tmp_path), "first")
    for report in run_ranks(2, _run_part, 2, "pipedream-2bw", "adamw", True, str(tmp_path), "resumed"):
        assert len(report["losses"]) == STEPS - AT and all(math.isfinite(x) for x in report["losses"]), report


_TIMING = MEASURED_KEYS


def _train_py(out, *overrides):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "training_scripts/train.py", "--output_dir", str(out), *overrides],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.launch
def test_a_checkpoint_carries_transformers_trainer_state_and_a_resumed_run_continues_its_log(tmp_path):
    """train.py on one process, evaluating and saving every 2 steps: each checkpoint's
    trainer_state.json is a `transformers.TrainerState` of that step; the run's own resume keys are in
    pipeline_state.json; a run resumed from checkpoint-2 saves a checkpoint-4 with the same log history
    as the run that never stopped (timings aside)."""
    import shutil

    import torch
    from transformers import TrainerState

    from hf_asyncpp.checkpoint.checkpoints import PIPELINE_STATE

    model = small_model_config("tiny-qwen3-moe")
    model.vocab_size = 8192  # the built-in tokenizer's, which the checkpoint then carries
    save_model_dir(model, tmp_path / "model")
    rows = torch.randint(0, 8192, (40, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    settings = ["--model_config", str(tmp_path / "model"), "--dataset", str(tmp_path / "data.jsonl"),
                "--seq_len", str(SEQ), "--micro_batch_size", str(MBS), "--n_microbatches", str(M), "--max_steps", "4",
                "--save_steps", "2", "--eval_steps", "2", "--eval_fraction", "0.2", "--report_to", "none",
                "--save_final", "false"]
    _train_py(tmp_path / "straight", *settings)
    states = {step: TrainerState.load_from_json(str(tmp_path / "straight" / f"checkpoint-{step}" / "trainer_state.json"))
              for step in (2, 4)}
    blocks_per_epoch = 32  # 40 rows, the last 20% held out
    for step, state in states.items():
        assert (state.global_step, state.max_steps, state.train_batch_size) == (step, 4, MBS * M)
        assert (state.logging_steps, state.eval_steps, state.save_steps) == (1, 2, 2)
        assert state.epoch == pytest.approx(step * MBS * M / blocks_per_epoch)
        assert state.best_metric is None and state.best_model_checkpoint is None
        assert [r["step"] for r in state.log_history if "loss" in r] == list(range(1, step + 1))
        assert [r["step"] for r in state.log_history if "eval_loss" in r] == [2]
    pipeline = json.loads((tmp_path / "straight" / "checkpoint-2" / PIPELINE_STATE).read_text())
    assert (pipeline["step"], pipeline["pp_size"], pipeline["schedule"]) == (2, 1, "1f1b")
    assert {"config.json", "tokenizer.json"} <= {p.name for p in (tmp_path / "straight" / "checkpoint-2").iterdir()}

    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    _train_py(tmp_path / "resumed", *settings, "--resume_from_checkpoint", "latest")
    resumed = TrainerState.load_from_json(str(tmp_path / "resumed" / "checkpoint-4" / "trainer_state.json"))

    def untimed(log):
        return [{k: v for k, v in r.items() if k not in _TIMING} for r in log]

    assert untimed(resumed.log_history) == untimed(states[4].log_history)

