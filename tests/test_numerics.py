"""The numerics this code trains with are the ones provenance.NUMERICS names.

A study skips an arm finished under the current NUMERICS and reruns the others (tests/study/test_tuning.py),
so a change that moves training values without renaming NUMERICS would mix old and new arms in one
comparison. Three short runs through `python -m hf_asyncpp.run` — AdamW synchronous, Muon under
PipeDream-2BW with Error Feedback, SOAP under PipeDream's per-microbatch updates, all on the cosine-to-a-
floor schedule the studies use — must log the losses pinned here for the current NUMERICS.

Tolerance: 1e-5 relative (3e-4 under Muon). Reruns on one machine agree bitwise, and so do torch 2.11,
2.13 and 2.15 on one machine (checked: the three runs' losses identical to the last bit); the margin is
for another processor's kernels (a different vector width rounds matrix products differently, ~1e-7 at
the first step, grown over 16 steps of a model memorising its data). Muon's Newton–Schulz iteration
amplifies that first difference: 1.4e-4 by step 16 between the processor these were pinned on and an
Intel Xeon of this project's machines; the tolerance is about twice that, still far below what a
change of schedule or formula moves. A change of schedule, default, optimizer formula or
update order moves these losses by far more (a learning-rate floor moves the last steps by > 1e-3). A change
known to move values, even by rounding below the tolerance, renames NUMERICS in the same commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from hf_asyncpp.provenance import NUMERICS, machine
from tests.test_engine import save_model_dir, small_model_config

RUNS = {
    "adamw-sync": dict(optimizer="adamw", schedule="gpipe", learning_rate=1e-2, momentum=0.9),
    "muon-2bw-ef": dict(optimizer="muon", schedule="pipedream-2bw", emulate_pp_size=2, ef=True, learning_rate=3e-2,
                        momentum=0.95),
    "soap-pipedream": dict(optimizer="soap", schedule="pipedream", emulate_pp_size=2, learning_rate=1e-2, momentum=0.9),
}
# The losses at steps 4, 8, 12 and 16 of each run, under NUMERICS "2026-12-05".
PINNED = {
    "2026-12-05": {"adamw-sync": [8.7647538, 8.2108107, 7.1643198, 7.1118037],
                   "muon-2bw-ef": [8.6437538, 6.3765398, 4.3642008, 3.8180504],
                   "soap-pipedream": [8.8329253, 6.0350361, 5.2918683, 4.666693]},
}
# Processors whose kernels take a run further than its tolerance, with their own losses for it (the same code,
# rerun there bitwise). On an AMD EPYC (AVX512) Muon's last loss is 3.5e-4 from the pin, and SOAP's first is
# 6% off: its eigenbases, taken while the gradients' statistics are still rank-deficient, are any basis of
# their degenerate eigenspaces, and that processor's LAPACK path picks another one (AdamW stays within 1e-5).
PINNED_ON = {
    ("2026-12-05", "AMD EPYC"): {"muon-2bw-ef": [8.6437197, 6.375223, 4.3626825, 3.8172351],
                                 "soap-pipedream": [8.3040371, 6.0240993, 4.9978212, 4.5983146]},
}


@pytest.fixture(scope="module")
def logged_losses(tmp_path_factory):
    """Each run's training losses at steps 4, 8, 12, 16 (the runs go two at a time, one thread each)."""
    tmp = tmp_path_factory.mktemp("numerics")
    model = small_model_config("tiny-qwen3-moe")
    model.vocab_size = 8192  # the builtin tokenizer's
    save_model_dir(model, tmp / "model")
    # Eight sequences, each seen 16 times: a model memorising them falls fast, which grows any difference.
    rows = torch.randint(0, 8192, (8, 16), generator=torch.Generator().manual_seed(0)).repeat(16, 1).tolist()
    (tmp / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    base = dict(model_config=str(tmp / "model"), dataset=str(tmp / "data.jsonl"), seq_len=16, micro_batch_size=2,
                n_microbatches=4, max_steps=16, warmup_steps=2, logging_steps=1, eval_fraction=0,
                lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, pp_size=1,
                save_final=False, report_to="none", threads_per_rank=1, seed=0)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    processes = {}
    for name, keys in RUNS.items():
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump({**base, **keys, "output_dir": str(tmp / name)}))
        if len(processes) == 2:
            next(iter(processes.values())).wait()
        processes[name] = subprocess.Popen([sys.executable, "-m", "hf_asyncpp.run", "--config", str(tmp / f"{name}.yaml")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    losses = {}
    for name, process in processes.items():
        _, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        records = map(json.loads, (tmp / name / "metrics.jsonl").read_text().splitlines())
        losses[name] = [r["loss"] for r in records if "loss" in r][3::4]
    return losses


@pytest.mark.parametrize("run", RUNS)
def test_a_short_run_logs_the_losses_pinned_for_the_current_numerics(logged_losses, run):
    assert NUMERICS in PINNED, f"no losses pinned for NUMERICS {NUMERICS!r}: add this code's below it"
    tolerance = 3e-4 if RUNS[run]["optimizer"] == "muon" else 1e-5
    pinned = PINNED[NUMERICS] | PINNED_ON.get((NUMERICS, machine()["cpu"]), {})
    assert logged_losses[run] == pytest.approx(pinned[run], rel=tolerance), (
        f"{run}'s losses moved: if the change is meant to move numerics, rename provenance.NUMERICS and pin these "
        f"under the new name: {[round(x, 7) for x in logged_losses[run]]}")
