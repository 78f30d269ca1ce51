"""Each stage's inputs and outputs, computed up front on fake tensors (models/stage_io.py), are what a
real forward of the stages produces: shapes, dtypes and which of them carry gradients.

The reference is independent of the fake run: the whole model built with real CPU tensors, cut into
the same stages, cast to the compute dtype, and run stage after stage on real token ids.
"""

from __future__ import annotations

import pytest
import torch

from hf_asyncpp.models import build_model, build_stage_modules, plan_stages
from hf_asyncpp.models.presets import PRESETS, build_config
from hf_asyncpp.models.stage_io import _cast, stage_io

MBS, SEQ = 2, 16


def _described(tensors) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_stage_io_is_what_a_real_forward_of_the_stages_produces(preset, dtype):
    config = build_config(preset)
    plan = plan_stages(config, 3)
    declared = stage_io(config, plan, MBS, SEQ, dtype)

    stages = build_stage_modules(build_model(config, seed=0), plan, [0, 1, 2])
    inputs = (torch.randint(0, config.vocab_size, (MBS, SEQ)),)
    for s, stage in enumerate(stages):
        if dtype is not None:
            _cast(stage, dtype)
        outputs = stage(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        assert _described(declared[s][0]) == _described(inputs), f"stage {s} inputs"
        assert _described(declared[s][1]) == _described(outputs), f"stage {s} outputs"
        assert all(t.device.type == "meta" for t in declared[s][0] + declared[s][1])
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)


def test_stage_io_under_a_callers_fake_mode_is_the_same():
    """A memory plan computes it inside its own fake tensor mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = build_config("tiny-moe")
    plan = plan_stages(config, 2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inside = stage_io(config, plan, MBS, SEQ, torch.bfloat16)
    outside = stage_io(config, plan, MBS, SEQ, torch.bfloat16)
    assert [[_described(t) for t in pair] for pair in inside] == [[_described(t) for t in pair] for pair in outside]
