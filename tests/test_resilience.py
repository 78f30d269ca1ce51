"""Non-finite values: every rank takes the same decision, nothing non-finite is ever applied or
written, and `skip` continues as if the update had never been computed.

Runs of training_scripts/train.py under torchrun (pp 2, fp32, fixed seeds, constant LR, no shuffle)
through tests/faults.py, which makes the loss of one microbatch of minibatch K (0-based; step K + 1)
NaN — and with it that microbatch's gradient on every stage. The reference runs the others are
compared with (below; and the uninterrupted run of the preemption tests) run train.py's main on
ranks of the suite's pool (tests/ranks.py train_py).

- `stop`: every rank exits non-zero one step later with the message (step, stages, tensors); the
  checkpoints written before hold finite values only; no export is written.
- `skip`, 1F1B: the final weights equal, bit for bit, a run on the same data without minibatch K
  (one step fewer), and the logged losses of every other step are that run's.
- `skip`, PipeDream-2BW + Error Feedback: the final weights equal, bit for bit, the same run in which
  each stage's update of minibatch K is simply not applied (faults.py IDENTITY_UPDATE; minibatch K+1
  was already forwarded on the older weights, so "without minibatch K" means exactly that), so the
  weight versions and EF buffers stayed consistent.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.ranks import train_py
from tests.test_engine import save_model_dir, small_model_config
from tests.test_run import _env

SEQ, MBS, M, STEPS, K = 16, 2, 4, 8, 3
ROWS = MBS * M
POISON = 8191  # the first token of one row of minibatch K; no other row starts with it


def _data(tmp_path, drop_minibatch: int | None = None):
    config = small_model_config("tiny-qwen3-moe")
    config.vocab_size = 8192  # the built-in tokenizer's
    save_model_dir(config, tmp_path / "model")
    rows = torch.randint(0, 8000, (STEPS * ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    rows[K * ROWS + MBS, 0] = POISON  # the first row of microbatch 1 of minibatch K
    if drop_minibatch is not None:
        rows = torch.cat([rows[:drop_minibatch * ROWS], rows[(drop_minibatch + 1) * ROWS:]])
    path = tmp_path / ("data.jsonl" if drop_minibatch is None else "data_without.jsonl")
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))
    return path


def _arguments(tmp_path, out, data, schedule, *extra) -> list[str]:
    return ["--model_config", str(tmp_path / "model"), "--dataset", str(data), "--seq_len", str(SEQ),
            "--micro_batch_size", str(MBS), "--n_microbatches", str(M), "--pp_size", "2", "--schedule", schedule,
            "--optimizer", "adamw", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--shuffle", "false",
            "--max_steps", str(STEPS), "--logging_steps", "1", "--report_to", "none", "--seed", "3",
            "--output_dir", str(out), *extra]


def _train(tmp_path, out, data, schedule, *extra, fault: dict | None = None):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "tests/faults.py",
               *_arguments(tmp_path, out, data, schedule, *extra)]
    env = {**_env(), **{k: str(v) for k, v in (fault or {}).items()}}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def _reference(tmp_path, out, data, schedule, *extra) -> None:
    """A run without faults, to compare with: train.py's main on two ranks of the suite's pool."""
    ran = train_py(2, _arguments(tmp_path, out, data, schedule, *extra), out.parent / f"{out.name}-logs")
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]


def _main_without_update(rank, world_size, k, argv, log_dir):
    """tests/faults.py with IDENTITY_UPDATE=k, on a rank of the suite's pool: its drop_update(k) for
    train.py's main(argv) (tests/ranks.py), then the update rule put back for the rank's next run."""
    from hf_asyncpp.update.rule import UpdateRule
    from tests.faults import drop_update
    from tests.ranks import _train_py_main

    os.makedirs(log_dir, exist_ok=True)
    original = UpdateRule.apply
    drop_update(k)
    try:
        return _train_py_main(rank, world_size, argv, str(log_dir))
    finally:
        UpdateRule.apply = original


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def _checkpoint_tensors(path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    return torch.load(path.parent / f"{path.name}.pt", weights_only=False)


@pytest.mark.multirank
def test_stop_ends_every_rank_at_the_next_step_and_writes_nothing_non_finite(tmp_path):
    out = tmp_path / "stop"
    start = time.time()
    done = _train(tmp_path, out, _data(tmp_path), "1f1b", "--nonfinite_policy", "stop", "--save_steps", "2",
                  fault={"POISON_TOKEN": POISON})
    assert done.returncode != 0
    assert time.time() - start < 120
    assert (f"error: step {K + 1}: NaN or infinity in the loss of 1 microbatch (computed on stage 1) and in the "
            "gradient of stages 0, 1; the update of stages 0, 1 was skipped. nonfinite_policy is stop") in done.stderr
    # Decided on every rank at the end of the next step, before that step is logged.
    assert [r["step"] for r in _records(out)] == list(range(1, K + 2))
    assert not (out / "final").exists()
    for name in ("checkpoint-2", "checkpoint-4"):  # checkpoint-4 holds the weights the NaN never reached
        tensors = _checkpoint_tensors(out / name)
        floats = [v for v in tensors.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        assert floats and all(bool(torch.isfinite(v).all()) for v in floats)


@pytest.mark.multirank
def test_skip_gives_the_weights_of_a_run_that_never_saw_the_minibatch(tmp_path):
    skipped, reference = tmp_path / "skipped", tmp_path / "reference"
    done = _train(tmp_path, skipped, _data(tmp_path), "1f1b", "--nonfinite_policy", "skip",
                  fault={"POISON_TOKEN": POISON})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"warning: step {K + 1}: NaN or infinity in the loss of 1 microbatch" in done.stderr
    _reference(tmp_path, reference, _data(tmp_path, drop_minibatch=K), "1f1b", "--max_steps", str(STEPS - 1))

    records, expected = _records(skipped), _records(reference)
    assert math.isnan(records[K]["loss"]) and records[K]["skipped_updates_per_stage"] == [1, 1]
    assert [r["loss"] for r in records[:K] + records[K + 1:]] == [r["loss"] for r in expected]
    got, want = _weights(skipped), _weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.multirank
def test_skip_under_an_asynchronous_schedule_drops_exactly_that_update(tmp_path):
    skipped, reference = tmp_path / "skipped", tmp_path / "reference"
    data = _data(tmp_path)
    args = ("pipedream-2bw", "--ef", "true", "--nonfinite_policy", "skip")
    done = _train(tmp_path, skipped, data, *args, fault={"POISON_TOKEN": POISON})
    assert done.returncode == 0, done.stderr[-3000:]
    from tests.ranks import (
        run_ranks,  # the reference on the suite's pool, as faults.py IDENTITY_UPDATE=K runs it
    )

    dropped = run_ranks(2, _main_without_update, K, _arguments(tmp_path, reference, data, *args), tmp_path / "logs")
    assert [code for code, _ in dropped] == [0, 0], dropped[0][1][-3000:]

    records = _records(skipped)
    assert sum(sum(r["skipped_updates_per_stage"]) for r in records) == 2  # one update on each stage
    got, want = _weights(skipped), _weights(reference)
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.multirank
def test_waiting_for_rank_0_to_prepare_the_data_does_not_count_against_comm_timeout_s(tmp_path):
    """Waits on another rank's I/O (here: rank 0 packing the dataset for 6 s) go through a group with a
    long timeout; comm_timeout_s (2 s) bounds only training's messages."""
    done = _train(tmp_path, tmp_path / "slow", _data(tmp_path), "1f1b", "--comm_timeout_s", "2", "--max_steps", "2",
                  fault={"SLOW_DATA": 6})
    assert done.returncode == 0, done.stderr[-3000:]


class _Stats:
    """What one step's reduced statistics report (metrics.ReducedStepStats.value)."""

    def __init__(self, losses=0, stages=(), skipped=(0, 0), earlier=None):
        self.values = {"nonfinite_loss_microbatches": losses, "nonfinite_grad_stages": list(stages),
                       "skipped_updates_per_stage": list(skipped),
                       "skipped_earlier_updates_per_stage": list(earlier or [0] * len(skipped))}

    def value(self, key):
        return self.values[key]


def test_skip_stops_once_more_steps_than_the_limit_were_skipped(capsys):
    from hf_asyncpp.resilience import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("skip", skip_limit=2, last_stage=1)
    guard.review(1, _Stats())
    guard.review(2, _Stats(stages=[0], skipped=(1, 0)))
    guard.review(3, _Stats(losses=1))  # a loss reported before its update: not a skipped step
    guard.review(4, _Stats(losses=1, stages=[0, 1], skipped=(1, 1)))
    assert ("step 2: NaN or infinity in the gradient of stage 0; the update of stage 0 was skipped (1 of 2 allowed)"
            in capsys.readouterr().err)  # the hf_asyncpp logger's stream
    with pytest.raises(NonFiniteError, match=r"step 7: .* 3 steps with skipped updates \(steps 2, 4, 7\), more than "
                                             r"nonfinite_skip_limit \(2\)"):
        guard.review(7, _Stats(stages=[1], skipped=(0, 1)))


def test_stop_names_the_step_the_stages_and_the_tensors():
    from hf_asyncpp.resilience import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard("stop", skip_limit=10, last_stage=3)
    guard.review(5, _Stats())
    with pytest.raises(NonFiniteError, match=r"^step 6: NaN or infinity in the loss of 2 microbatches \(computed on stage 3\) "
                                             r"and in the gradient of stages 1, 3; the update of stages 1, 3 was skipped"):
        guard.review(6, _Stats(losses=2, stages=[1, 3], skipped=(0, 1, 0, 1)))


# --- preemption and lost ranks --------------------------------------------------------------------
#
# PipeDream-2BW + EF at pp 2 (microbatches in flight at every step boundary, the harder case), 30
# steps, checkpoints every 3, and `--resume_from_checkpoint latest` in the command from the start:
# the command a cluster job would rerun or a launcher restart. Every variant ends with the same final
# weights and per-step losses as the run that was never interrupted.

LONG = 30


def _long_command(tmp_path, out, *launcher, timeout_s: float = 600):
    return [*launcher, "training_scripts/train.py", *_long_arguments(tmp_path, out, timeout_s)]


def _long_arguments(tmp_path, out, timeout_s: float = 600):
    return ["--model_config", str(tmp_path / "model"),
            "--dataset", str(tmp_path / "long.jsonl"), "--seq_len", str(SEQ), "--micro_batch_size", str(MBS),
            "--n_microbatches", str(M), "--pp_size", "2", "--schedule", "pipedream-2bw", "--ef", "true",
            "--optimizer", "adamw", "--learning_rate", "3e-3", "--warmup_steps", "3", "--max_steps", str(LONG),
            "--save_steps", "3", "--save_total_limit", "2", "--threads_per_rank", "1", "--report_to", "none",
            "--comm_timeout_s", str(timeout_s), "--resume_from_checkpoint", "latest", "--output_dir", str(out)]


def _torchrun(*extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    _data(tmp_path)
    rows = torch.randint(0, 8000, (LONG * ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows.tolist()))
    out = tmp_path / "run"
    ran = train_py(2, _long_arguments(tmp_path, out), tmp_path / "run-logs")  # on the suite's pool
    assert [code for code, _ in ran] == [0, 0], ran[0][1][-3000:]
    return tmp_path, out


def _same_run(out, reference) -> None:
    losses = {r["step"]: r["loss"] for r in _records(out)}
    assert losses == {r["step"]: r["loss"] for r in _records(reference)} and len(losses) == LONG
    got, want = _weights(out), _weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _rank_process(launcher: subprocess.Popen, rank: int):
    for process in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "train.py" in " ".join(process.cmdline()) and process.environ().get("RANK") == str(rank):
                return process
        except psutil.NoSuchProcess:
            pass
    return None


def _wait_for(condition, launcher, seconds=300):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    assert condition(), "the run ended (or stalled) before the fault could be planted"


def _logged_steps(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.multirank
def test_sigterm_to_one_rank_checkpoints_every_rank_and_the_same_command_continues_bitwise(uninterrupted):
    tmp_path, reference = uninterrupted
    out = tmp_path / "preempted"
    command = _long_command(tmp_path, out, *_torchrun())
    launcher = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: _logged_steps(out) >= 4 and _rank_process(launcher, 1), launcher)
    _rank_process(launcher, 1).send_signal(signal.SIGTERM)  # one rank only: the others learn it from the step stats
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-3000:]
    stopped = int(re.search(r"stopped after step (\d+) on SIGTERM", output).group(1))
    assert 4 <= stopped < LONG and (out / f"checkpoint-{stopped}").is_dir() and not (out / "final").exists()
    assert _logged_steps(out) == stopped

    rerun = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in rerun.stderr
    _same_run(out, reference)


@pytest.mark.multirank
def test_a_job_near_its_time_limit_saves_and_stops_by_itself_and_the_same_command_continues_bitwise(uninterrupted):
    """SLURM_JOB_END_TIME already reached: the first step boundary asks for the stop, every rank saves
    at the same step, and the requeued job (the same command, no time limit) continues bit for bit."""
    tmp_path, reference = uninterrupted
    out = tmp_path / "time-limited"
    command = _long_command(tmp_path, out, *_torchrun())
    stopped_run = subprocess.run(command, env={**_env(), "SLURM_JOB_END_TIME": str(int(time.time()))},
                                 capture_output=True, text=True, timeout=600)
    assert stopped_run.returncode == 0, stopped_run.stderr[-3000:]
    assert "and a checkpoint takes about" in stopped_run.stderr  # the reason, said by the ranks that asked
    stopped = int(re.search(r"stopped after step (\d+) on the job's time limit", stopped_run.stderr).group(1))
    assert 1 <= stopped <= 3 and [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{stopped}"]
    rerun = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in rerun.stderr
    _same_run(out, reference)


def test_the_time_limit_stop_leaves_two_steps_and_one_and_a_half_saves_and_a_margin():
    from hf_asyncpp.resilience import TimeLimit

    limit = TimeLimit(end_time=1000.0)
    # 2 × 10 s steps + 1.5 × 40 s save + 30 s margin = 110 s before the end
    assert not limit.due(step_time_s=10, save_s=40, now=889.9) and limit.due(step_time_s=10, save_s=40, now=890.0)
    assert limit.save_estimate_s(measured_s=12.5, state_bytes=10**12) == 12.5  # a measured save wins
    assert limit.save_estimate_s(measured_s=None, state_bytes=4 * 10**9) == 4e9 / TimeLimit.ASSUMED_WRITE_RATE


def test_the_job_end_time_comes_from_the_environment(monkeypatch, capsys):
    from hf_asyncpp.resilience import TimeLimit

    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    assert TimeLimit.from_environment() is None
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1765000000")
    assert TimeLimit.from_environment().end_time == 1765000000
    monkeypatch.setenv("SLURM_JOB_END_TIME", "Unknown")
    assert TimeLimit.from_environment() is None and "no time-limit stop" in capsys.readouterr().err


@pytest.mark.multirank
def test_sigterm_to_the_one_process_emulator_checkpoints_and_the_same_command_continues_bitwise(uninterrupted):
    """`python train.py` (no launcher) emulates the 2BW pipeline at depth 2 in one process; preempted,
    it saves its kept weight versions at the step boundary, and the rerun equals an emulated run that
    was never interrupted (the emulator's own reference: it agrees with the pipeline only to rounding;
    run as train.py's main on one rank of the suite's pool, which counts as launched, so it asks for
    the emulation that `python train.py` chooses by itself)."""
    tmp_path, _ = uninterrupted
    straight, out = tmp_path / "emulated", tmp_path / "emulated-preempted"
    arguments = [*_long_arguments(tmp_path, straight), "--pp_size", "1", "--emulate_pp_size", "2"]  # the last --pp_size wins
    ran = train_py(1, arguments, tmp_path / "emulated-logs")
    assert [code for code, _ in ran] == [0], ran[0][1][-3000:]
    command = [sys.executable, *_long_command(tmp_path, out)]
    process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: _logged_steps(out) >= 4, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output[-3000:]
    assert "one process (no launcher): emulating pipedream-2bw at depth 2" in output
    stopped = int(re.search(r"stopped after step (\d+) on SIGTERM", output).group(1))
    assert 4 <= stopped < LONG and (out / f"checkpoint-{stopped}").is_dir() and not (out / "final").exists()

    rerun = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{stopped}'}" in rerun.stderr
    _same_run(out, straight)


@pytest.mark.multirank
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stalled_rank_stops_the_others_within_the_timeout(uninterrupted, fault):
    """Ranks started without an elastic agent (as a cluster's own launcher starts them), so nothing
    but the run itself can notice the lost peer: a killed rank closes its connections (noticed at the
    next message), a stopped one just never answers (noticed after comm_timeout_s)."""
    from hf_asyncpp.parallel.mesh import free_port

    tmp_path, _ = uninterrupted
    out, timeout_s = tmp_path / f"lost-{fault}", 10
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen(_long_command(tmp_path, out, sys.executable, timeout_s=timeout_s),
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        _wait_for(lambda: _logged_steps(out) >= 4, ranks[0])
        ranks[1].send_signal(getattr(signal, fault))
        faulted = time.time()
        _, stderr = ranks[0].communicate(timeout=timeout_s + 30)
        assert time.time() - faulted < timeout_s + 30
        assert ranks[0].returncode == 1, stderr[-3000:]
        assert "error: rank 0 lost contact with the other ranks" in stderr and "comm_timeout_s (10 s)" in stderr
        assert re.search("Timed out" if fault == "SIGSTOP" else "Connection (closed|reset) by peer", stderr)
        assert not (out / "final").exists()
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


@pytest.mark.multirank
def test_with_a_restart_budget_a_killed_rank_costs_only_the_steps_since_the_last_checkpoint(uninterrupted):
    tmp_path, reference = uninterrupted
    out = tmp_path / "restarted"
    from hf_asyncpp.checkpoint.checkpoints import list_checkpoints

    launcher = subprocess.Popen(_long_command(tmp_path, out, *_torchrun("--max_restarts", "1")), env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: list_checkpoints(out) and _logged_steps(out) >= 5 and _rank_process(launcher, 1), launcher)
    _rank_process(launcher, 1).send_signal(signal.SIGKILL)
    output, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, output[-3000:]
    assert re.search(r"resumed from .*checkpoint-\d+ after step \d+", output)  # the launcher's restart resumed
    _same_run(out, reference)


def _poisoned_run(rank, world_size, pp_size: int):
    """2BW (AdamW + EF, skip policy) with the losses of minibatch K and of the last poisoned: on a pp 2
    pipeline, or emulated on one process at depth 2. The final weights (whole, on rank 0) and the
    skipped updates per step."""
    from hf_asyncpp.checkpoint import gather_full_state_dict
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from tests.faults import plant_poison

    remove_poison = plant_poison(127)
    layout = init_parallel(read_launch(), pp_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=pp_size, emulate_pp_size=2 if pp_size == 1 else 0,
                             schedule="pipedream-2bw", optimizer="adamw", ef=True, learning_rate=3e-3,
                             lr_scheduler_type="linear", warmup_steps=2, seq_len=SEQ, micro_batch_size=MBS,
                             n_microbatches=M, seed=4, max_steps=STEPS, nonfinite_policy="skip")
        engine = PipelineEngine(config, model_config, layout)
        rows = torch.randint(0, 120, (STEPS, ROWS, SEQ), generator=torch.Generator().manual_seed(2))
        rows[K, MBS, 0] = rows[STEPS - 1, MBS, 0] = 127
        results = [engine.train_step(rows[k], rows[k + 1] if k + 1 < STEPS else None) for k in range(STEPS)]
        engine.finish()
        skipped = [r.skipped_updates_per_stage for r in results]
        state = gather_full_state_dict(engine.stage_state_dict(), layout)
        return None if state is None else ({k: v.tolist() for k, v in state.items()}, skipped)
    finally:
        shutdown_parallel()
        remove_poison()


@pytest.mark.multirank
def test_the_one_process_emulator_skips_an_update_as_the_pipeline_does():
    """The emulator's history must count the skipped unit as a version, as the pipeline publishes its
    unchanged master: otherwise every later gradient would be taken at weights one update older.
    Tolerance: the emulator and the pipeline agree to float rounding (tests/executors/test_asynchronous.py)."""
    from tests.ranks import run_ranks
    from tests.executors.test_asynchronous import TOL

    pipeline, skipped = run_ranks(2, _poisoned_run, 2)[0]
    emulated, emulated_skipped = run_ranks(1, _poisoned_run, 1)[0]
    assert emulated_skipped[K] == emulated_skipped[-1] == [1, 1] and sum(map(sum, emulated_skipped)) == 4
    # Held for its global norm (update/held.py), the pipeline's update of minibatch K is applied — here
    # skipped — and so reported in the next step; the last step's own, applied as it drains, with it.
    assert skipped[K + 1] == skipped[-1] == [1, 1] and sum(map(sum, skipped)) == 4
    assert pipeline.keys() == emulated.keys()
    for name in pipeline:
        assert torch.allclose(torch.tensor(pipeline[name]), torch.tensor(emulated[name]), rtol=0, atol=TOL), name


def _node(tmp_path, out, port: int, timeout_s: float):
    """One "node" of a two-node job as training_scripts/slurm/moe_10b.sbatch starts it: a launcher for
    its one rank, meeting the other node's at a c10d rendezvous (here on localhost)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"]
    return subprocess.Popen(_long_command(tmp_path, out, *launcher, timeout_s=timeout_s), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL a node's launcher and its ranks (torchrun starts them in sessions of their own)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    launcher.wait()


@pytest.mark.multirank
def test_two_nodes_lose_one_and_the_requeued_job_resumes_from_its_latest_checkpoint_bitwise(uninterrupted):
    """The cluster's way: the launchers of two nodes (one rank each), the second node killed whole
    (launcher and rank) once a checkpoint exists; the surviving node's launcher ends by itself, non-zero,
    with its rank (srun --kill-on-bad-exit would end it too); the requeued job starts both nodes again with the same
    command, and `--resume_from_checkpoint latest` continues the run to the uninterrupted one's losses
    and weights, bit for bit."""
    from hf_asyncpp.checkpoint.checkpoints import list_checkpoints
    from hf_asyncpp.parallel.mesh import free_port

    tmp_path, reference = uninterrupted
    out, timeout_s = tmp_path / "two-nodes", 20
    first = _node(tmp_path, out, port := free_port(), timeout_s)
    second = _node(tmp_path, out, port, timeout_s)
    try:
        _wait_for(lambda: list_checkpoints(out) and _logged_steps(out) >= 5, first)
        survivors = psutil.Process(first.pid).children(recursive=True)
        _kill_node(second)
        lost = time.time()
        output, _ = first.communicate(timeout=timeout_s + 30)  # seen: 1.3 s
        assert first.returncode != 0 and time.time() - lost < timeout_s + 30, output[-3000:]
        # Its rank saw the lost peer, or its launcher lost the rendezvous the other node hosted first.
        assert re.search("lost contact with the other ranks|connection to the C10d store has failed", output)
        assert not psutil.wait_procs(survivors, timeout=30)[1], "a rank outlived its node's launcher"
        assert not (out / "final").exists()
        checkpoint = list_checkpoints(out)[-1]
    finally:
        for node in (first, second):
            _kill_node(node)

    requeued = [_node(tmp_path, out, port := free_port(), timeout_s), _node(tmp_path, out, port, timeout_s)]
    outputs = [node.communicate(timeout=600)[0] for node in requeued]
    assert [node.returncode for node in requeued] == [0, 0], [o[-3000:] for o in outputs]
    assert any(f"resumed from {checkpoint}" in o for o in outputs), outputs
    _same_run(out, reference)
