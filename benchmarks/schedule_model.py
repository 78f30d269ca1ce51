"""Every schedule's step in the timing model of the NCCL checker, at pipeline depths a CPU cannot time.

Not a measurement: the programs the runtime executes (comm_plan.py) are played by
`validate.check_program` with a cost per action — forward F = 1, backward B = 2 (a zero-bubble
schedule's input and weight halves 1 each), everything else 0, messages instant — under NCCL's
rules (one FIFO stream per pair of ranks, as each pair has its own process group: parallel/
mesh.link_groups; a send completing with its receive, a compute waiting for its receive's whole
batch, held updates waiting for the global gradient norm). What a GPU adds to
that (kernel time per stage, link latency, the norm all-reduce) is left out, so the table shows what
the schedule and its communication plan cost by themselves.

Per schedule, depth p and microbatches m: the steady step (the makespan's growth per step from 3 to
5 steps) beside the busiest rank's compute per step (the bubble-free limit), and the same with
clipping by the global norm for the asynchronous schedules that allow it, and the step with one
FIFO stream per rank instead (what one NCCL group for the whole pipeline would give). `--last-stage-factor`
makes the last stage's computes that much longer (its lm_head and loss).

    python benchmarks/schedule_model.py [--depths 2,4,8] [--last-stage-factor 1.0] [--out benchmarks/results/schedule_model.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_asyncpp.schedules import SCHEDULES, ScheduleError
from hf_asyncpp.schedules.registry import model_cost

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "schedule_model.json"


def _arm(spec, pp_size: int, m: int, last_stage_factor: float, clip_globally: bool) -> dict:
    last = spec.n_stages(pp_size) - 1

    def cost(rank, action) -> float:
        return model_cost(rank, action) * (last_stage_factor if action.stage_index == last else 1.0)

    step, limit = spec.steady_step(pp_size, m, cost, clip_globally)
    one_group, _ = spec.steady_step(pp_size, m, cost, clip_globally, streams="rank")
    return dict(schedule=spec.name, pp_size=pp_size, n_microbatches=m, clip="global" if clip_globally else "stage",
                step=step, limit=limit, step_over_limit=round(step / limit, 4),
                one_group_step_over_limit=round(one_group / limit, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="2,4,8")
    parser.add_argument("--last-stage-factor", type=float, default=1.0)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    rows = []
    for spec in SCHEDULES.values():
        for p in map(int, args.depths.split(",")):
            for m in (p, 2 * p):
                for clip in ((False,) if spec.synchronous else (False, True)):
                    try:
                        rows.append(_arm(spec, p, m, args.last_stage_factor, clip))
                    except (ValueError, ScheduleError) as err:  # a size or clipping the schedule refuses
                        rows.append(dict(schedule=spec.name, pp_size=p, n_microbatches=m,
                                         clip="global" if clip else "stage", refused=str(err).splitlines()[0]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"costs": {"forward": 1.0, "backward": 2.0},
                                          "last_stage_factor": args.last_stage_factor, "rows": rows}, indent=1))
    print("| schedule | p | m | clipping | step | limit | step / limit | one group: step / limit |\n"
          "|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        cells = ("refused: " + r["refused"][:60], "", "", "") if "refused" in r else (
            f"{r['step']:g}", f"{r['limit']:g}", f"{r['step_over_limit']:.3f}", f"{r['one_group_step_over_limit']:.3f}")
        print(f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['clip']} | " + " | ".join(cells) + " |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
