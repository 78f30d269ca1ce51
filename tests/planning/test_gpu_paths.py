"""Every schedule family and optimizer runs its training steps and an evaluation on fake tensors: a GPU
run waits for the device only where it is budgeted.

Each case is one `plan` of a tiny model at pp 2 (hf_asyncpp/planning/plan.py): a fake process group,
fake tensors (a host read of one cannot return a value; it is counted, and answered with zeros), the
real engine through start-up, three steps and an evaluation. A sync is a host read or a blocking upload
(planning/host_reads.py). A steady step syncs nowhere inside a microbatch's compute; its syncs per step
are pinned here per kind of run.
"""

from __future__ import annotations

import pytest

from hf_asyncpp.config import TrainConfig
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.planning.plan import plan_layout

# (schedule, optimizer, EF, clipping, syncs per steady step at most, uploads included). One read per
# step: the step's statistics with an update's norm. WPipe updates two stages per rank per step, PipeDream every
# microbatch (m = 4): each update reads its norm (to clip it, and to skip it when it is not finite).
CASES = [
    ("1f1b", "adamw", True, "global", 1),
    ("gpipe", "muon", False, "global", 1),
    ("interleaved-1f1b", "soap", True, "global", 1),
    ("zbv", "lion", False, "global", 1),
    ("pipedream-2bw", "adamw", True, "global", 1),
    ("pipedream-2bw", "muon", True, "stage", 1),
    ("pipedream-2bw", "soap", False, "global", 1),
    ("pipedream-2bw", "sgd", True, "global", 1),
    ("pipedream", "lion", True, "stage", 4),
    ("wpipe", "adamw", False, "stage", 2),
]


@pytest.mark.multirank
@pytest.mark.parametrize("schedule, optimizer, ef, clipping, budget", CASES,
                         ids=["-".join(map(str, c[:4])) for c in CASES])
def test_training_and_evaluation_run_on_fake_tensors_within_the_sync_budget(schedule, optimizer, ef, clipping,
                                                                                budget):
    config = TrainConfig(model_config="tiny-moe", pp_size=2, schedule=schedule, optimizer=optimizer, ef=ef,
                         grad_clip_scope=clipping, max_grad_norm=1.0, seq_len=32, micro_batch_size=2,
                         n_microbatches=4, max_steps=10, mixed_precision="no")
    for rank in plan_layout(config, build_config("tiny-moe"), world_size=2):
        assert rank["syncs_per_step"] <= budget, rank["sync_sites"]  # uploads counted
        assert rank["syncs_per_microbatch"] == 0, rank["sync_sites"]
        assert rank["optimizer_state_bytes"] > 0 and rank["gradient_bytes"] + rank["parameter_bytes"] > 0
        if schedule != "wpipe":  # its updates straddle step boundaries: it evaluates only when done
            # the held updates settled, the losses read, the rows uploaded
            assert rank["syncs_per_evaluation"] <= 3
