"""The hooks around a stage's compute (hf_asyncpp/schedules/stage_hooks.py).

One list, `HOOKS`, states them and their order, outermost first: the weight version (bound before
anything else of the forward runs, and an update it awaits is no compute), the routing loads, the
compute time (innermost: torch's compute alone). A stage enters the hooks subscribed to it in that
order, whatever order they were subscribed in, around every compute call torch's runtime dispatches
— forward, full backward, backward-input, backward-weight — and a hook may hand the forward other
inputs. The engine subscribes what each kind of run needs, and nothing replaces a stage's methods.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    _ComputationType,
)

from hf_asyncpp.schedules.stage_hooks import HOOKS
from tests.ranks import run_ranks
from tests.test_engine import small_model_config

COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
# Two stages on one rank, loop placement: stage 1's backwards split into input and weight halves.
PROGRAM = "0F0 0F1 1F0 1F1 1I0 1W0 1I1 1W1 0B0 0B1"


def test_the_hook_list_states_the_order_and_the_calls_each_hook_wraps():
    assert list(HOOKS) == ["weight_version", "routing_loads", "compute_time"]
    assert HOOKS["weight_version"] == HOOKS["routing_loads"] == {FORWARD}
    assert HOOKS["compute_time"] == {FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}


def _calls_around_compute(rank, world_size):
    """PROGRAM run by torch's runtime over two HookedStages, each with a recorder subscribed at every
    position, last position first; the first stage's weight_version hook doubles its input. Returns
    the events in order, the inputs the first stage's module saw, and the refusals of bad subscriptions."""
    import contextlib

    import torch
    from torch.distributed.pipelining.schedules import _Action

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.schedules.runtime import ActionListSchedule
    from hf_asyncpp.schedules.stage_hooks import HookedStage

    layout = init_parallel(read_launch(), 1)
    events, first_inputs, refusals = [], [], []

    def recorder(position):
        @contextlib.contextmanager
        def hook(call):
            events.append(("enter", position, call.kind.name, call.stage.stage_index, call.chunk_id))
            if position == "weight_version" and call.stage.is_first:
                call.args = (2 * call.args[0],)
            yield
            events.append(("exit", position, call.kind.name, call.stage.stage_index, call.chunk_id))

        return hook

    try:
        stages = []
        for s in range(2):
            module = torch.nn.Linear(4, 4)
            module.register_forward_pre_hook(lambda m, args, s=s: events.append(("torch forward", s))
                                             or (first_inputs.append(args[0].clone()) if s == 0 else None))
            stage = HookedStage(module, s, 2, layout.device, torch.ones(2, 4, requires_grad=s > 0),
                                torch.ones(2, 4, requires_grad=True), group=layout.pp_group)
            for position in reversed(list(HOOKS)):
                stage.subscribe(position, recorder(position))
            stages.append(stage)
        for position in ("compute_time", "no_such_position"):
            try:
                stages[0].subscribe(position, recorder(position))
            except ValueError as error:
                refusals.append(str(error))
        program = {0: [_Action.from_str(text) for text in PROGRAM.split()]}
        schedule = ActionListSchedule(stages, 2, lambda output, target: output.sum(), program, None)
        schedule.step(torch.ones(4, 4), target=torch.ones(4, 4))
        return events, [x.tolist() for x in first_inputs], refusals
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_every_compute_call_torch_dispatches_runs_inside_the_hooks_in_the_stated_order():
    [(events, first_inputs, refusals)] = run_ranks(1, _calls_around_compute)
    calls, depth = [], 0  # per compute call: its events, from its outermost hook's enter to that hook's exit
    for event in events:
        if depth == 0:
            calls.append([])
        calls[-1].append(event)
        depth += {"enter": 1, "exit": -1}.get(event[0], 0)
    kinds = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}
    assert [tuple(call[0][2:]) for call in calls] == [(kinds[a[1]], int(a[0]), int(a[2])) for a in PROGRAM.split()]
    for call in calls:
        kind, stage, chunk = call[0][2:]
        wrapping = [position for position, wrapped in HOOKS.items() if _ComputationType[kind] in wrapped]
        torch_compute = [("torch forward", stage)] if kind == "FORWARD" else []
        assert call == ([("enter", p, kind, stage, chunk) for p in wrapping] + torch_compute
                        + [("exit", p, kind, stage, chunk) for p in reversed(wrapping)]), call
    # The weight_version hook's inputs are what the first stage computes on.
    assert first_inputs == [[[2.0] * 4] * 2] * 2
    assert "already has a 'compute_time' hook" in refusals[0] and "no hook position 'no_such_position'" in refusals[1]


def _hooks_of_a_run(rank, world_size, schedule):
    """The hooks subscribed to this rank's training stages and (after an evaluation) evaluation
    stages, which of those modules hold bias-balanced routers, and the compute methods any stage
    holds as instance attributes."""
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.schedules.stage_hooks import HookedStage

    layout = init_parallel(read_launch(), 2)
    try:
        model_config = small_model_config("tiny-deepseek-v3")
        config = TrainConfig(model_config="tiny-deepseek-v3", pp_size=2, schedule=schedule, seq_len=8,
                             micro_batch_size=1, n_microbatches=2, max_steps=2, seed=4, router_bias_update_rate=0.01)
        engine = PipelineEngine(config, model_config, layout)
        rows = torch.randint(0, model_config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        engine.train_step(rows, rows if engine.forwards_ahead else None)
        engine.eval_step(rows)
        every_stage = engine.executor.torch_stages()  # training's and the evaluation's
        return dict(
            training=[set(stage.hooks) for stage in engine.executor.stages],
            evaluation=[set(stage.hooks) for stage in every_stage[len(engine.executor.stages):]],
            routers=[bool(module.routing_load and module.routing_load.routers) for module in engine.executor.modules],
            replaced=[name for stage in every_stage for name in COMPUTE_METHODS if name in vars(stage)],
            hooked=all(isinstance(stage, HookedStage) for stage in every_stage),
        )
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["pipedream-2bw", "1f1b"])
def test_a_run_subscribes_what_it_needs_and_replaces_no_stage_method(schedule):
    """An asynchronous pipeline binds weight versions, counts routing loads of its microbatches only
    (where the stage has bias-balanced routers) and times compute; its evaluation stages have no
    hooks. A synchronous pipeline times compute only (its routing loads are taken per step)."""
    runs = run_ranks(2, _hooks_of_a_run, schedule)
    assert any(routers for run in runs for routers in run["routers"])  # the routing-load hook has stages to go to
    for rank, run in enumerate(runs):
        assert run["hooked"] and run["replaced"] == [], (rank, run)
        if schedule == "pipedream-2bw":
            assert run["training"] == [{p for p in HOOKS if p != "routing_loads" or routers}
                                       for routers in run["routers"]], (rank, run)
            assert run["evaluation"] and all(hooks == set() for hooks in run["evaluation"]), (rank, run)
        else:
            assert run["training"] == [{"compute_time"}] * len(run["routers"]), (rank, run)
