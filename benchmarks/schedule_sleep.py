"""The timing model of schedule_model.py checked on real ranks: stages that sleep instead of computing.

This 2-core machine cannot time 4 or 8 ranks that compute, but ranks that sleep need no core, so
their step time is the schedule's and its communication plan's alone. Each of `--pp` gloo ranks
holds one stage whose forward sleeps `--forward-ms` and whose backward sleeps twice that, and runs
the schedule's real runtime (runtime.ActionListSchedule over torch's PipelineStage, the programs of
comm_plan.py, messages of a few bytes). Reported per schedule: the measured step (median of
`--steps` after one warm-up step) beside the model's, both in milliseconds.

    python benchmarks/schedule_sleep.py [--pp 4] [--microbatches 8] [--schedules 1f1b,gpipe] [--forward-ms 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "schedule_sleep.json"


def _sleeping_stage_times(rank, world_size, schedule: str, m: int, forward_s: float, steps: int) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, link_groups, shutdown_parallel
    from hf_asyncpp.schedules import get_schedule_spec
    from hf_asyncpp.schedules.runtime import build_schedule

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(forward_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * forward_s)
            return grad

    class SleepingStage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return Sleep.apply(x * self.weight)

    layout = init_parallel(read_launch(), world_size)
    try:
        # Static inputs and outputs (one microbatch: a row of 4), as the runtime requires (models/stage_io.py);
        # a rank holds the stages the schedule places on it (two under ZBV's V).
        spec = get_schedule_spec(schedule)
        n_stages, indices = spec.n_stages(world_size), spec.stage_indices(world_size, rank)
        example = torch.empty(1, 4, device="meta")
        stages = [PipelineStage(SleepingStage(), s, n_stages, layout.device, example.clone().requires_grad_(s > 0),
                                example.clone().requires_grad_(True), group=layout.pp_group)  # outputs carry a gradient
                  for s in indices]
        runtime = build_schedule(spec, stages, m, lambda out, target: out.sum(),
                                 link_groups(layout, spec.rank_pairs(world_size)))
        times = []
        for _ in range(steps + 1):
            dist.barrier(group=layout.pp_group)
            start = time.perf_counter()
            runtime.step(*([torch.ones(m, 4)] if 0 in indices else []),
                         target=torch.ones(m, 4) if n_stages - 1 in indices else None)
            times.append(time.perf_counter() - start)
        return times[1:]
    finally:
        shutdown_parallel()


def _model_step_s(schedule: str, pp_size: int, m: int, forward_s: float) -> float:
    from hf_asyncpp.torch_internals import FORWARD, FULL_BACKWARD

    from hf_asyncpp.schedules import get_schedule_spec

    costs = {FORWARD: forward_s, FULL_BACKWARD: 2 * forward_s}
    return get_schedule_spec(schedule).timeline(pp_size, m, 1, lambda r, a: costs.get(a.computation_type, 0.0)).makespan


def main() -> None:
    from hf_asyncpp.parallel.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,gpipe")
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    forward_s, rows = args.forward_ms / 1000, []
    for schedule in args.schedules.split(","):
        per_rank = run_ranks(args.pp, _sleeping_stage_times, schedule, args.microbatches, forward_s, args.steps)
        measured = statistics.median(max(step) for step in zip(*per_rank))  # a step ends with its last rank
        rows.append(dict(schedule=schedule, pp_size=args.pp, n_microbatches=args.microbatches,
                         forward_ms=args.forward_ms, measured_ms=round(1000 * measured, 1),
                         model_ms=round(1000 * _model_step_s(schedule, args.pp, args.microbatches, forward_s), 1)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| schedule | p | m | measured step ms | model ms | measured / model |\n|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['measured_ms']} | {r['model_ms']} | "
              f"{r['measured_ms'] / r['model_ms']:.3f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
