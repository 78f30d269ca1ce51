"""What the runtime runs besides training: the forward-only programs of evaluation, played under
NCCL's rules like the training programs (test_validate.py) — on one stream per pair of ranks (a
synchronous schedule's `eval()`, on the pair groups) and on one stream per rank (an asynchronous
pipeline's evaluation, on its own group for the whole pipeline)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import FORWARD

from hf_asyncpp.schedules import SCHEDULES
from hf_asyncpp.schedules.comm_plan import plan_program
from hf_asyncpp.schedules.runtime import eval_actions, forward_only, stage_ranks_of, with_gradient_reductions
from hf_asyncpp.torch_internals import _Action
from hf_asyncpp.schedules.validate import check_program


@pytest.mark.parametrize("streams", ["pair", "rank"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_evaluation_programs_run_under_nccl_rules(name, streams):
    """A synchronous schedule evaluates with its own lists, backwards removed; an asynchronous one
    with build_eval_schedule's GPipe order over its loop of stages."""
    spec = SCHEDULES[name]
    for pp_size in (2, 4, 8):
        m, n_stages = 2 * pp_size, spec.n_stages(pp_size)
        lists = spec.make_actions(pp_size, m) if spec.synchronous else eval_actions(pp_size, n_stages, m)
        to_rank = spec.stage_ranks(pp_size).__getitem__
        program = {r: ops + [None] for r, ops in plan_program(forward_only(lists), to_rank, n_stages).items()}
        check_program(program, to_rank, n_stages, streams)
        forwards = sum(1 for ops in program.values() for a in ops if getattr(a, "computation_type", None) == FORWARD)
        assert forwards == n_stages * m, (pp_size, forwards)


def _text(actions) -> str:
    return " ".join(str(a) for a in actions)


@pytest.mark.parametrize("program, lowered", [
    ("0F0 0F1 0B0 0B1", "0F0 0F1 0B0 0B1 0REDUCE_GRAD"),
    # zero bubble: the weight halves are the backwards that count, the last one reduces
    ("0F0 0F1 0I0 0I1 0W0 0W1", "0F0 0F1 0I0 0I1 0W0 0W1 0REDUCE_GRAD"),
    # two stages on the rank (a V): each reduces after its own last backward
    ("0F0 3F0 0F1 3F1 3B0 3B1 0B0 0B1", "0F0 3F0 0F1 3F1 3B0 3B1 3REDUCE_GRAD 0B0 0B1 0REDUCE_GRAD"),
])
def test_a_stage_reduces_its_gradient_right_after_its_last_backward(program, lowered):
    assert _text(with_gradient_reductions([_Action.from_str(t) for t in program.split()], 2)) == lowered


def test_the_stage_to_rank_map_is_read_from_the_compute_lists():
    zbv = SCHEDULES["zbv"].make_actions(2, 4)
    assert stage_ranks_of(zbv) == {0: 0, 1: 1, 2: 1, 3: 0}
