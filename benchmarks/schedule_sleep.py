"""Every schedule's step on real ranks whose stages sleep instead of computing, beside the timing model's.

This 2-core machine cannot time 4 or 8 ranks that compute, but ranks that sleep need (almost) no core.
Each of `--pp` gloo ranks runs the real engine (engine.PipelineEngine: the executor of its kind, the
schedule's runtime and communication plan, weight versions, Error Feedback, the optimizer step, clipping
by the global norm) on a tiny real model, one decoder layer per stage, whose stages take these times
(sleeping_stage.py):

- forward: `--forward-ms` per microbatch;
- backward: `--backward-ms` for the input gradient and `--weight-ms` for the weight gradient (a full
  backward takes both; ZBV's split runs them as its I and W actions);
- the last stage's three `--last-stage-factor` times as long (its LM head);
- these are a rank's times: where a schedule puts two stages on a rank (interleaved 1F1B, ZBV, WPipe),
  each takes half, as a rank's layers split in two chunks would compute;
- each optimizer step `--optimizer-ms` (a hook on the optimizer: once per stage update);
- each message between ranks `--link-ms` on its way (a slower link: the stage that uses a message starts
  no earlier than that long after it was sent, read from a timestamp the message carries).

Time is kept on a device clock per rank (`--clock device`, sleeping_stage.DeviceClock): the host's own
work (the runtime, the tiny layer, gloo; 8 ranks share 2 cores here) overlaps the sleeps, as a GPU's host
runs ahead of its kernels, and shows only where the host falls behind: each row reports the host's lag
behind its device clock and the cores the ranks' hosts used. `--clock host` adds the host's time to the
sleeps instead.

The step is measured in steady state on the latest rank: from the end of the warm-up steps to the end of
the measured ones, divided by their number (a last step, which drains what the asynchronous pipelines
forwarded ahead, is not measured). Beside it: the bubble-free limit (the busiest rank's time per step)
and the timing model's step for the same costs (planning/step_time.predict_step: schedules/play.py, what
the checker, the slowdown warnings and `hf-asyncpp plan` use: compute, the optimizer step at each update,
the global norm's wait, message time); the asynchronous schedules run with Error Feedback; every schedule
clips by the global norm but WPipe, which cannot. Timings are reported, never asserted.

    python benchmarks/schedule_sleep.py [--pp 4,8] [--microbatches 1,2,4] [--schedules all] [--forward-ms 20]
        [--backward-ms 40] [--weight-ms 0] [--last-stage-factor 1,2] [--optimizer-ms 0] [--link-ms 0,20]
        [--clock device] [--steps 4] [--figure PATH]

`--microbatches` are multiples of the depth (m = k·p); sizes a schedule refuses are listed as refused.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hf_asyncpp.planning.step_time import SCHEDULES  # every schedule, as the plan predicts them

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "schedule_sleep.json"
SEQ_LEN, WARMUP_STEPS = 4, 2


@dataclass(frozen=True)
class Sleeps:
    """Seconds each stage sleeps per microbatch (forward, input gradient, weight gradient), the last
    stage's factor on them, per optimizer step, and what each message between ranks takes."""

    forward_s: float
    backward_s: float
    weight_s: float
    last_stage_factor: float
    optimizer_s: float
    link_s: float = 0.0

    def of_stage(self, stage: int, n_stages: int, stages_per_rank: int) -> tuple[float, float, float]:
        factor = (self.last_stage_factor if stage == n_stages - 1 else 1.0) / stages_per_rank
        return self.forward_s * factor, self.backward_s * factor, self.weight_s * factor

    def stage_costs(self, n_stages: int, stages_per_rank: int) -> list:
        """Each stage's costs for the timing model (planning/step_time.StageCost, what `hf-asyncpp plan`
        predicts from): these sleeps per compute action, the optimizer's per update."""
        from hf_asyncpp.planning.step_time import StageCost

        return [StageCost(*self.of_stage(s, n_stages, stages_per_rank), self.optimizer_s) for s in range(n_stages)]


def _sleeping_run(rank, world_size, schedule: str, m: int, sleeps: Sleeps, steps: int, clock_base: float,
                  clip_globally: bool, overlap: bool) -> tuple[list[float], float, float]:
    """The end time (time.perf_counter, one clock for every process) of each step on this rank, how far
    its host was behind its device clock at the measured steps' ends (at most), and the host's CPU seconds
    over them."""
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.schedules import get_schedule_spec
    from hf_asyncpp.torch_internals import BACKWARD_INPUT
    from sleeping_stage import DeviceClock, sleep_on, waits_catch_up

    torch.set_num_threads(1)
    spec = get_schedule_spec(schedule)
    # the warm-up, the measured steps, and a last one that drains what a pipeline forwards ahead (unmeasured)
    n_stages, total = spec.n_stages(world_size), WARMUP_STEPS + steps + 1
    layout = init_parallel(read_launch(), world_size)
    try:
        model_config = build_config("tiny-llama", hidden_size=8, intermediate_size=8, num_hidden_layers=n_stages,
                                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, vocab_size=16)
        config = TrainConfig(model_config="tiny-llama", pp_size=world_size, schedule=schedule, optimizer="adamw",
                             learning_rate=1e-3, seq_len=SEQ_LEN, micro_batch_size=1, n_microbatches=m,
                             max_steps=total, ef=not spec.synchronous,
                             grad_clip_scope="global" if clip_globally else "stage")
        engine = PipelineEngine(config, model_config, layout)
        executor = engine.executor
        to_rank, clock = spec.stage_ranks(world_size), DeviceClock(clock_base, overlap)
        # the compute lists, unchecked (the engine checked them); an asynchronous order never splits a backward
        computes = spec.make_actions(world_size, m)[rank] if spec.order is None else []
        split_backward = BACKWARD_INPUT in {a.computation_type for a in computes if a}
        for module, stage in zip(executor.modules, executor.stage_ids):
            received = (stage > 0 and to_rank[stage - 1] != rank, stage < n_stages - 1 and to_rank[stage + 1] != rank)
            sleep_on(module, sleeps.of_stage(stage, n_stages, spec.stages_per_rank), sleeps.link_s, received,
                      split_backward, clock)

        def optimizer_step(*_):
            clock.run_until(clock.start() + sleeps.optimizer_s)
        for updater in executor.updaters:
            updater.optimizer.register_step_pre_hook(optimizer_step)
        rows = torch.randint(0, model_config.vocab_size, (m, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        restore = waits_catch_up(clock)
        ends, lags, host_s = [], [], []
        for k in range(total):
            if k < WARMUP_STEPS:
                clock.catch_up()
            host_s.append(time.process_time())
            engine.train_step(rows, rows if engine.forwards_ahead and k + 1 < total else None)
            ends.append(time.perf_counter())
            lags.append(clock.lag())
        engine.finish()
        restore()
        window = slice(WARMUP_STEPS - 1, WARMUP_STEPS + steps)  # the ends the measurement runs between
        return ends, max(lags[window]), host_s[WARMUP_STEPS + steps] - host_s[WARMUP_STEPS]
    finally:
        shutdown_parallel()


def modelled(row: dict) -> dict:
    """The row's bubble-free limit and the timing model's step (ms; planning/step_time.predict_step) for
    its sleeps, messages moving as gloo's do (buffered sends: what the ranks here run on) and as NCCL's
    do (what a GPU run gets, and `hf-asyncpp plan` predicts). Raises ValueError or ScheduleError where
    the schedule refuses the size."""
    from hf_asyncpp.planning.step_time import clips_globally, predict_step
    from hf_asyncpp.schedules import get_schedule_spec

    spec, p, m = get_schedule_spec(row["schedule"]), row["pp_size"], row["n_microbatches"]
    sleeps = Sleeps(**{f.name: row[f.name] for f in fields(Sleeps)})
    clip = clips_globally(spec, p, m, wanted=True)  # by the global norm wherever the order can (not WPipe)
    spec.check_microbatches(p, m)
    costs = sleeps.stage_costs(spec.n_stages(p), spec.stages_per_rank)
    step, limit = predict_step(spec, p, m, costs, clip, sleeps.link_s, transport="gloo")
    nccl, _ = predict_step(spec, p, m, costs, clip, sleeps.link_s, transport="nccl")
    return dict(clipping="global" if clip else "stage", limit_ms=round(1000 * limit, 1),
                model_ms=round(1000 * step, 1), nccl_model_ms=round(1000 * nccl, 1))


def with_ratios(row: dict) -> dict:
    if row.get("limit_ms", 0) > 0:  # with no sleep at all, the step is the runtime's own cost alone
        row.update(measured_over_limit=round(row["measured_ms"] / row["limit_ms"], 3),
                   measured_over_model=round(row["measured_ms"] / row["model_ms"], 3))
    return row


def measure(pool, schedule: str, pp_size: int, m: int, sleeps: Sleeps, steps: int, clock: str = "device") -> dict:
    """One row: the measured steady step beside the bubble-free limit and the timing model's step (ms).
    `clock`: "device" (the host's work overlaps the sleeps) or "host" (it adds to them); see DeviceClock."""
    from hf_asyncpp.schedules import ScheduleError

    row = dict(schedule=schedule, pp_size=pp_size, n_microbatches=m, **asdict(sleeps), clock=clock)
    try:
        row.update(modelled(row))
    except (ValueError, ScheduleError) as err:
        return dict(row, refused=str(err).splitlines()[0])
    ran = pool.run(pp_size, _sleeping_run, schedule, m, sleeps, steps, time.perf_counter(), row["clipping"] == "global",
                   clock == "device", timeout_s=300)
    ends = [rank_ends for rank_ends, _, _ in ran]
    last = [max(rank[k] for rank in ends) for k in range(len(ends[0]))]
    step = (last[WARMUP_STEPS + steps - 1] - last[WARMUP_STEPS - 1]) / steps
    row.update(measured_ms=round(1000 * step, 1), host_lag_ms=round(1000 * max(lag for _, lag, _ in ran), 1),
               host_cores=round(sum(host_s for _, _, host_s in ran) / (step * steps), 2))
    return with_ratios(row)


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each asynchronous schedule's tokens/s ÷ the best synchronous schedule's on the same row (its
    step time's inverse ratio), and which synchronous schedule that is."""
    from hf_asyncpp.schedules import get_schedule_spec

    def key(r):
        return tuple(r[k] for k in ("pp_size", "n_microbatches", "clock", *(f.name for f in fields(Sleeps))))

    best = {}
    for r in rows:
        if "measured_ms" in r and get_schedule_spec(r["schedule"]).synchronous:
            if key(r) not in best or r["measured_ms"] < best[key(r)]["measured_ms"]:
                best[key(r)] = r
    for r in rows:
        rival = best.get(key(r))
        if "measured_ms" in r and rival is not None and not get_schedule_spec(r["schedule"]).synchronous:
            r["best_synchronous"] = rival["schedule"]
            r["tokens_per_s_over_best_synchronous"] = round(rival["measured_ms"] / r["measured_ms"], 3)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| schedule | p | m | last stage × | optimizer ms | link ms | clock | measured ms | limit ms | model ms | "
             "measured / limit | measured / model | model, NCCL links ms | tokens/s ÷ best sync | host cores |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['last_stage_factor']:g} | "
                f"{1000 * r['optimizer_s']:g} | {1000 * r['link_s']:g} | {r['clock']} | ")
        if "refused" in r:
            lines.append(head + f"refused: {r['refused'][:70]} | | | | | | | |")
            continue
        speedup = r.get("tokens_per_s_over_best_synchronous")
        ratios = [f"{r[k]:.3f}" if k in r else "" for k in ("measured_over_limit", "measured_over_model")]
        lines.append(head + f"{r['measured_ms']} | {r['limit_ms']} | {r['model_ms']} | {ratios[0]} | {ratios[1]} | "
                     f"{r.get('nccl_model_ms', '')} | "
                     + (f"{speedup:.3f} ({r['best_synchronous']})" if speedup else "") + f" | {r.get('host_cores', '')} |")
    return "\n".join(lines)


def figure(rows: list[dict], path: Path) -> None:
    """Throughput relative to the bubble-free limit (limit ÷ measured step) per schedule against depth and
    microbatches: one panel per stage balance × link, the optimizer's time as measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    measured = [r for r in rows if "measured_ms" in r and r["clock"] == "device"]
    sizes = sorted({(r["pp_size"], r["n_microbatches"]) for r in measured})
    panels = sorted({(r["last_stage_factor"], r["link_s"]) for r in measured})
    columns = 2 if len(panels) > 2 else len(panels)
    grid_rows = -(-len(panels) // columns)
    fig = Figure(figsize=(4.6 * columns, 3.4 * grid_rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(grid_rows, columns, sharey=True, squeeze=False).ravel()
    for ax, (factor, link_s) in zip(axes, panels):
        for colour, schedule in enumerate(SCHEDULES):
            points = {(r["pp_size"], r["n_microbatches"]): r["limit_ms"] / r["measured_ms"] for r in measured
                      if (r["schedule"], r["last_stage_factor"], r["link_s"]) == (schedule, factor, link_s)}
            for depth in sorted({p for p, _ in sizes}):  # one line per depth
                xs = [i for i, size in enumerate(sizes) if size in points and size[0] == depth]
                ax.plot(xs, [points[sizes[i]] for i in xs], marker="o", color=f"C{colour}",
                        label=schedule if depth == sizes[0][0] else None)
        ax.set_xticks(range(len(sizes)), [f"p{p}\nm{m}" for p, m in sizes])
        balance = "balanced" if factor == 1 else f"last stage {factor:g}×"
        ax.set_title(f"{balance}, link {1000 * link_s:g} ms", fontsize=10)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    for ax in axes[::columns]:
        ax.set_ylabel("bubble-free limit ÷ measured step")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8, loc="lower left", ncols=2)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="4,8", help="pipeline depths, comma-separated")
    parser.add_argument("--microbatches", default="1,2,4", help="microbatches per step as multiples of the depth")
    parser.add_argument("--schedules", default="all")
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--backward-ms", type=float, default=40.0, help="the input gradient's part of a backward")
    parser.add_argument("--weight-ms", type=float, default=0.0, help="the weight gradient's part of a backward")
    parser.add_argument("--last-stage-factor", default="1,2", help="the last stage's sleeps × this, comma-separated")
    parser.add_argument("--optimizer-ms", type=float, default=0.0, help="per optimizer step")
    parser.add_argument("--link-ms", default="0", help="what a message between ranks takes, comma-separated")
    parser.add_argument("--clock", default="device",
                        help="device (the host's work overlaps the sleeps, as a GPU's host runs ahead), host (it "
                             "adds to them), or both, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="measured steps, after 2 warm-up steps")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--figure", help="also draw the rows here (PNG)")
    parser.add_argument("--report-only", action="store_true",
                        help="--out's measured rows with the model's columns recomputed: rewritten, printed (and drawn)")
    args = parser.parse_args(argv)
    if args.report_only:  # the model's columns recomputed: a change to the model needs no new measurement
        kept = json.loads(Path(args.out).read_text())
        rows = [with_ratios(r | modelled(r)) if "measured_ms" in r else r for r in kept["rows"]]
        steps = kept["steps"]
    else:
        rows, steps = _run(args), args.steps
    with_speedups(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"warmup_steps": WARMUP_STEPS, "steps": steps, "rows": rows}, indent=1))
    print(table(rows))
    if args.figure:
        figure(rows, Path(args.figure))
    print(f"wrote {args.out}" + (f" and {args.figure}" if args.figure else ""))


def _run(args) -> list[dict]:
    from hf_asyncpp.parallel.spawn import RankPool

    schedules = SCHEDULES if args.schedules == "all" else tuple(args.schedules.split(","))
    rows, pool = [], RankPool()
    try:
        for p in map(int, args.pp.split(",")):
            for k in map(int, args.microbatches.split(",")):
                for factor in map(float, args.last_stage_factor.split(",")):
                    for link_ms in map(float, args.link_ms.split(",")):
                        sleeps = Sleeps(args.forward_ms / 1000, args.backward_ms / 1000, args.weight_ms / 1000,
                                        factor, args.optimizer_ms / 1000, link_ms / 1000)
                        for clock in args.clock.split(","):
                            for schedule in schedules:
                                rows.append(measure(pool, schedule, p, k * p, sleeps, args.steps, clock))
                                print(json.dumps(rows[-1]), flush=True)
    finally:
        pool.close()
    return rows


if __name__ == "__main__":
    main()
