"""training_scripts/train.py with a fault planted, for the failure tests (run it under torchrun).

Environment:
  POISON_TOKEN=t     the LM loss of every microbatch holding a row that starts with token t is
                     multiplied by NaN: the recorded loss is NaN, and so is its gradient on every stage
                     (the backward carries it through the whole pipeline).
  IDENTITY_UPDATE=k  the reference for a skipped update: every stage's k-th update (0-based, in the
                     order the stage applies them) is not applied — no optimizer, EF or LR-schedule
                     step, its gradient dropped; nothing non-finite is involved.
  SLOW_DATA=s        rank 0 takes s seconds longer to prepare the dataset (the others wait for it).
  RECORD_READS=dir   each rank that opens a dataset source writes dir/rank-N (no fault: a witness).
  SIGTERM_AT_STEP=k  rank 0 sends itself SIGTERM as step k begins (0-based): every rank stops one step
                     later with a checkpoint there, like a preemption, but at a known step.
  KILL_IN_SAVE=n     rank 1 kills itself (SIGKILL) in the middle of the n-th checkpoint save (1-based),
                     right after its shard is on disk: the save is not finished.
"""

from __future__ import annotations

import os
import sys

import torch

import hf_asyncpp.models.pipeline_loss as pipeline_loss
from hf_asyncpp import run
from hf_asyncpp.update.rule import UpdateRule


def plant_poison(token: int):
    """Plant the poison; returns the function that removes it (a reused rank must not keep it)."""
    original = pipeline_loss.ForCausalLMLoss

    def poisoned(logits, labels, vocab_size, **kwargs):
        loss = original(logits, labels, vocab_size, **kwargs)
        return loss * float("nan") if bool((labels[:, 0] == token).any()) else loss

    pipeline_loss.ForCausalLMLoss = poisoned

    def remove() -> None:
        pipeline_loss.ForCausalLMLoss = original

    return remove


def slow_data(seconds: float) -> None:
    import time

    import hf_asyncpp.data as data

    original = data.training_data

    def slow(*args, **kwargs):
        if os.environ.get("RANK") == "0":
            time.sleep(seconds)
        return original(*args, **kwargs)

    data.training_data = slow


def record_reads(directory: str) -> None:
    import hf_asyncpp.data.run_data as run_data

    original = run_data.load_source

    def recorded(*args, **kwargs):
        with open(os.path.join(directory, f"rank-{os.environ['RANK']}"), "a") as f:
            f.write(f"{args[0]}\n")
        return original(*args, **kwargs)

    run_data.load_source = recorded


def sigterm_at_step(k: int) -> None:
    import signal

    from hf_asyncpp.loop import LoopHooks

    original = LoopHooks.on_step_begin

    def begin(self, step):
        if step == k and os.environ.get("RANK") == "0":
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, step)

    LoopHooks.on_step_begin = begin


def kill_in_save(n: int) -> None:
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data
    calls = [0]

    def write_then_die(self, plan, planner):
        written = original(self, plan, planner)
        calls[0] += 1
        if calls[0] == n and os.environ.get("RANK") == "1":
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die


def drop_update(k: int) -> None:
    original = UpdateRule.apply
    counts: dict[int, int] = {}

    def apply_unless_kth(self, updater, norm, stepper=None):
        n = counts[id(updater)] = counts.get(id(updater), -1) + 1
        if n != k:
            return original(self, updater, norm, stepper)
        for param in updater.params:
            param.grad = None
        return False  # as a skip, so the emulator counts the unit; but neither counted nor reported as one

    UpdateRule.apply = apply_unless_kth


if __name__ == "__main__":
    torch.set_num_threads(1)
    if "POISON_TOKEN" in os.environ:
        plant_poison(int(os.environ["POISON_TOKEN"]))
    if "IDENTITY_UPDATE" in os.environ:
        drop_update(int(os.environ["IDENTITY_UPDATE"]))
    if "SLOW_DATA" in os.environ:
        slow_data(float(os.environ["SLOW_DATA"]))
    if "RECORD_READS" in os.environ:
        record_reads(os.environ["RECORD_READS"])
    if "SIGTERM_AT_STEP" in os.environ:
        sigterm_at_step(int(os.environ["SIGTERM_AT_STEP"]))
    if "KILL_IN_SAVE" in os.environ:
        kill_in_save(int(os.environ["KILL_IN_SAVE"]))
    sys.exit(run.main(sys.argv[1:]))
