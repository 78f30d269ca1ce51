"""Every schedule's step on real ranks whose stages sleep instead of computing, beside the timing model's.

This 2-core machine cannot time 4 or 8 ranks that compute, but ranks that sleep need (almost) no core.
Each of `--pp` gloo ranks runs the real engine (engine.PipelineEngine: the executor of its kind, the
schedule's runtime and communication plan, weight versions, Error Feedback, the optimizer step, clipping
by the global norm) on a tiny real model, one decoder layer per stage, whose stages sleep on top of
their own small compute:

- forward: `--forward-ms` per microbatch;
- backward: `--backward-ms` for the input gradient and `--weight-ms` for the weight gradient (a full
  backward sleeps both; ZBV's split runs them as its I and W actions);
- the last stage's three `--last-stage-factor` times as long (its LM head);
- these are a rank's times: where a schedule puts two stages on a rank (interleaved 1F1B, ZBV, WPipe),
  each sleeps half, as a rank's layers split in two chunks would compute;
- each optimizer step `--optimizer-ms` (a hook on the optimizer: once per stage update);
- each message between ranks `--link-ms` on its way (a slower link: the stage that uses a message waits
  until that long after it was sent, read from a timestamp the message carries).

The step is measured in steady state: from the end of the warm-up steps to the end of the last, on the
latest rank, divided by the steps. Beside it: the bubble-free limit (the busiest rank's sleep per step)
and the timing model's step for the same costs (schedules/play.py, what the checker and the slowdown
warnings use: compute, the optimizer step at each update, the global norm's wait, message time); the
asynchronous schedules run with Error Feedback; every schedule clips by the global norm but WPipe, which
cannot. Timings are reported, never asserted.

    python benchmarks/schedule_sleep.py [--pp 4,8] [--microbatches 1,2,4] [--schedules all] [--forward-ms 20]
        [--backward-ms 40] [--weight-ms 0] [--last-stage-factor 1,2] [--optimizer-ms 0] [--link-ms 0,20] [--steps 4]

`--microbatches` are multiples of the depth (m = k·p); sizes a schedule refuses are listed as refused.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "schedule_sleep.json"
SCHEDULES = ("1f1b", "interleaved-1f1b", "zbv", "pipedream-2bw", "wpipe", "pipedream")
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

    def action_cost(self, n_stages: int, stages_per_rank: int):
        """cost(rank, action) for the timing model: these sleeps per compute action, the optimizer's
        per update (REDUCE_GRAD), nothing else."""
        from hf_asyncpp.torch_internals import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, REDUCE_GRAD

        def cost(rank, action) -> float:
            forward, backward, weight = self.of_stage(action.stage_index, n_stages, stages_per_rank)
            return {FORWARD: forward, FULL_BACKWARD: backward + weight, BACKWARD_INPUT: backward,
                    BACKWARD_WEIGHT: weight, REDUCE_GRAD: self.optimizer_s}.get(action.computation_type, 0.0)
        return cost


def _sleep_on(module, times: tuple[float, float, float], link_s: float, received: tuple[bool, bool],
              clock_base: float) -> None:
    """Make `module` (a pipeline stage) sleep `times` (forward, input gradient, weight gradient): its
    output passes through a function that sleeps the forward and, in the backward, the input gradient;
    the gradient of the weight its forward used (the one bound to that microbatch, under weight versions)
    sleeps the weight gradient as it is computed, which ZBV does in its weight-gradient action.

    A slower link: each message between ranks carries, in its first element, when it was sent (seconds
    after `clock_base`, one clock for every process on this machine); the stage that uses it waits until
    `link_s` after that before computing, as it would wait for a message still on its way. `received`:
    whether the stage's input, and its output's gradient, come from another rank."""
    import torch

    forward_s, backward_s, weight_s = times

    def stamp(t: torch.Tensor) -> torch.Tensor:
        if link_s:
            t.view(-1)[0] = time.perf_counter() - clock_base
        return t

    def arrive(t: torch.Tensor, from_another_rank: bool) -> None:
        if link_s and from_another_rank:
            time.sleep(max(0.0, clock_base + t.view(-1)[0].item() + link_s - time.perf_counter()))

    class SleepOnOutput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(forward_s)
            return stamp(x.clone())  # a view of its input here makes torch's split backward lose a gradient

        @staticmethod
        def backward(ctx, grad):
            arrive(grad, received[1])
            time.sleep(backward_s)
            return grad

    class StampInputGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return stamp(grad.clone())

    def sleep_on_weight_gradient(grad):
        time.sleep(weight_s)
        return grad

    def before(_module, args):
        if not received[0]:
            return None
        arrive(args[0], True)
        return (StampInputGradient.apply(args[0]), *args[1:])

    def after(bound_module, _inputs, output):
        weight = next(bound_module.parameters())  # the microbatch's own (a version's copy)
        if weight.requires_grad and not getattr(weight, "_sleeps", False):
            weight.register_hook(sleep_on_weight_gradient)
            weight._sleeps = True
        first = output[0] if isinstance(output, tuple) else output
        slept = SleepOnOutput.apply(first)
        return (slept, *output[1:]) if isinstance(output, tuple) else slept

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _sleeping_run(rank, world_size, schedule: str, m: int, sleeps: Sleeps, steps: int, clock_base: float,
                  clip_globally: bool) -> list[float]:
    """The end time (time.perf_counter, one clock for every process) of each step on this rank."""
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.schedules import get_schedule_spec

    torch.set_num_threads(1)
    spec = get_schedule_spec(schedule)
    n_stages, total = spec.n_stages(world_size), WARMUP_STEPS + steps
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
        to_rank = spec.stage_ranks(world_size)
        for module, stage in zip(executor.modules, executor.stage_ids):
            received = (stage > 0 and to_rank[stage - 1] != rank, stage < n_stages - 1 and to_rank[stage + 1] != rank)
            _sleep_on(module, sleeps.of_stage(stage, n_stages, spec.stages_per_rank), sleeps.link_s, received,
                      clock_base)
        for updater in executor.updaters:
            updater.optimizer.register_step_pre_hook(lambda *_: time.sleep(sleeps.optimizer_s))
        rows = torch.randint(0, model_config.vocab_size, (m, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        ends = []
        for k in range(total):
            engine.train_step(rows, rows if engine.forwards_ahead and k + 1 < total else None)
            ends.append(time.perf_counter())
        engine.finish()
        return ends
    finally:
        shutdown_parallel()


def measure(pool, schedule: str, pp_size: int, m: int, sleeps: Sleeps, steps: int) -> dict:
    """One row: the measured steady step beside the bubble-free limit and the timing model's step (ms)."""
    from hf_asyncpp.schedules import ScheduleError, get_schedule_spec

    spec = get_schedule_spec(schedule)
    row = dict(schedule=schedule, pp_size=pp_size, n_microbatches=m, **asdict(sleeps))
    clip = schedule != "wpipe"  # the one schedule that cannot clip by the global norm (config_checks)
    try:
        spec.check_microbatches(pp_size, m, clip_globally=clip and not spec.synchronous)
        model_step, limit = spec.steady_step(pp_size, m, sleeps.action_cost(spec.n_stages(pp_size), spec.stages_per_rank),
                                             clip_globally=clip, link_s=sleeps.link_s)
    except (ValueError, ScheduleError) as err:
        return dict(row, refused=str(err).splitlines()[0])
    ends = pool.run(pp_size, _sleeping_run, schedule, m, sleeps, steps, time.perf_counter(), clip, timeout_s=300)
    last = [max(rank[k] for rank in ends) for k in range(len(ends[0]))]
    step = (last[-1] - last[WARMUP_STEPS - 1]) / steps
    row.update(measured_ms=round(1000 * step, 1), limit_ms=round(1000 * limit, 1), model_ms=round(1000 * model_step, 1))
    if limit > 0:  # with no sleep at all, the step is the runtime's own cost alone
        row.update(measured_over_limit=round(step / limit, 3), measured_over_model=round(step / model_step, 3))
    return row


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each asynchronous schedule's tokens/s ÷ the best synchronous schedule's on the same row (its
    step time's inverse ratio), and which synchronous schedule that is."""
    from hf_asyncpp.schedules import get_schedule_spec

    def key(r):
        return tuple(r[k] for k in ("pp_size", "n_microbatches", *(f.name for f in fields(Sleeps))))

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
    lines = ["| schedule | p | m | last stage × | optimizer ms | link ms | measured ms | limit ms | model ms | "
             "measured / limit | measured / model | tokens/s ÷ best sync |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['last_stage_factor']:g} | "
                f"{1000 * r['optimizer_s']:g} | {1000 * r['link_s']:g} | ")
        if "refused" in r:
            lines.append(head + f"refused: {r['refused'][:70]} | | | | | |")
            continue
        speedup = r.get("tokens_per_s_over_best_synchronous")
        ratios = [f"{r[k]:.3f}" if k in r else "" for k in ("measured_over_limit", "measured_over_model")]
        lines.append(head + f"{r['measured_ms']} | {r['limit_ms']} | {r['model_ms']} | {ratios[0]} | {ratios[1]} | "
                     + (f"{speedup:.3f} ({r['best_synchronous']})" if speedup else "") + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from hf_asyncpp.parallel.spawn import RankPool

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
    parser.add_argument("--steps", type=int, default=4, help="measured steps, after 2 warm-up steps")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    schedules = SCHEDULES if args.schedules == "all" else tuple(args.schedules.split(","))
    rows, pool = [], RankPool()
    try:
        for p in map(int, args.pp.split(",")):
            for k in map(int, args.microbatches.split(",")):
                for factor in map(float, args.last_stage_factor.split(",")):
                    for link_ms in map(float, args.link_ms.split(",")):
                        sleeps = Sleeps(args.forward_ms / 1000, args.backward_ms / 1000, args.weight_ms / 1000,
                                        factor, args.optimizer_ms / 1000, link_ms / 1000)
                        for schedule in schedules:
                            rows.append(measure(pool, schedule, p, k * p, sleeps, args.steps))
                            print(json.dumps(rows[-1]), flush=True)
    finally:
        pool.close()
    with_speedups(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"warmup_steps": WARMUP_STEPS, "steps": args.steps, "rows": rows}, indent=1))
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
