"""What the runtime runs besides training: the forward-only programs of evaluation, played under
NCCL's rules like the training programs (test_validate.py) — on one stream per pair of ranks (a
synchronous schedule's `eval()`, on the pair groups) and on one stream per rank (an asynchronous
pipeline's evaluation, on its own group for the whole pipeline)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import FORWARD

from hf_asyncpp.schedules import SCHEDULES
from hf_asyncpp.schedules.comm_plan import plan_program
from hf_asyncpp.schedules.runtime import eval_actions, forward_only
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
