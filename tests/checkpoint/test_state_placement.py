"""Where a resumed run's training state lands before torch's loader fills it (training_state.py).

The stage parameters sit on the meta device, standing in for an accelerator: a tensor placed there
by mistake cannot be read on the host, so whatever the loader would unpack there fails, as it would
on CUDA. Per-element optimizer state and Error Feedback's buffers belong beside their parameter;
packed objects (`#obj`: Muon's and SOAP's integer steps, LR schedules, RNG states) are bytes only
the host unpacks, so they load on the CPU whatever device the parameters are on. That the values
round-trip is the bitwise resume tests' part (test_checkpoints.py).
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.test_engine import small_model_config


class _Read(Exception):
    """Raised by the stand-in reader: the destinations are all this test looks at."""


def _engine(optimizer: str, ef: bool, stepped: bool):
    """An engine as load_training_state sees it: its executor, of a synchronous run (no state of its own
    beyond weights and optimizer): one stage (a whole tiny model) and its updater; with `stepped` its
    optimizer has taken one step (so it holds state to save)."""
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.models import build_model
    from hf_asyncpp.update.updater import Updater

    model_config = small_model_config("tiny-qwen3-moe")
    config = TrainConfig(model_config="tiny-qwen3-moe", optimizer=optimizer, ef=ef, learning_rate=1e-3)
    model = build_model(model_config, 3)
    updater = Updater(config, [0], [0], [model], None)
    if stepped:
        for p in updater.params:
            p.grad = torch.randn_like(p)
        updater.stepper.step()
    executor = types.SimpleNamespace(modules=[model], updaters=[updater], state=dict, masters=set,
                                     state_to_load=lambda saved, destination: {}, restore=lambda loaded: None)
    return types.SimpleNamespace(executor=executor)


def _metadata(state: dict) -> dict:
    """{key: storage metadata} of a saved state dict, as a checkpoint's metadata lists it."""
    from torch.distributed.checkpoint.metadata import (
        TensorProperties,
        TensorStorageMetadata,
    )

    return {k: TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(), []) for k, v in state.items()}


def _on_meta(engine) -> None:
    """Move the stage's parameters to the meta device, the same Parameter objects (the optimizer's)."""
    for p in [p for module in engine.executor.modules for p in module.parameters()]:
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "soap", "lion", "sgd"])
@pytest.mark.parametrize("ef", [False, True])
def test_packed_objects_load_on_the_cpu_and_tensor_state_beside_its_parameter(optimizer, ef):
    from hf_asyncpp.checkpoint.training_state import load_training_state, training_state

    saved = _metadata(training_state(_engine(optimizer, ef, stepped=True), 0))
    engine = _engine(optimizer, ef, stepped=False)
    _on_meta(engine)
    destinations: dict = {}

    def read(state):
        destinations.update(state)
        raise _Read

    with pytest.raises(_Read):
        load_training_state(engine, 0, saved, read)
    state_keys = [k for k in destinations if k.split(".")[0] in ("optim", "ef")]
    assert state_keys and (not ef or any(k.startswith("ef.") for k in state_keys))
    if optimizer in ("muon", "soap"):  # their integer step is a packed object
        assert any(k.endswith(".step#obj") for k in state_keys)
    misplaced = {k: (t.device.type, t.dtype) for k, t in destinations.items() if k.endswith("#obj")
                 and (t.device.type, t.dtype) != ("cpu", torch.uint8)}
    misplaced.update({k: (t.device.type, t.dtype) for k, t in destinations.items()
                      if k in state_keys and not k.endswith("#obj") and t.device.type != "meta"})
    assert not misplaced
