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

    def stage_costs(self, n_stages: int, stages_per_rank: int) -> list:
        """Each stage's costs for the timing model (planning/step_time.StageCost, what `hf-asyncpp plan`
        predicts from): these sleeps per compute action, the optimizer's per update."""
        from hf_asyncpp.planning.step_time import StageCost

        return [StageCost(*self.of_stage(s, n_stages, stages_per_rank), self.optimizer_s) for s in range(n_stages)]


class DeviceClock:
    """When a rank's device is free, one clock for every process on this machine (seconds after `base`).

    With `overlap` (the default) the host's own work overlaps the device's, as a host that launches
    kernels runs ahead of its GPU: an action starts when the rank's previous action has ended and its
    input has arrived, both by this clock, and the host sleeps until the action would end. The host's
    time (the runtime, the tiny layer, gloo) is then hidden wherever the device's time covers it. Where
    the host waits for a collective (the global norm, the step's statistics) and the wait blocks, the
    collective completed as the wait ended: the clock catches up with the host (`waits_catch_up`); so it
    does through the warm-up steps (start-up work). Without `overlap` every action starts when the host
    gets to it: the host's time on 8 ranks sharing 2 cores adds to the device's (the `host` clock)."""

    def __init__(self, base: float, overlap: bool):
        self.base, self.overlap, self.free_at = base, overlap, None

    def now(self) -> float:
        return time.perf_counter() - self.base

    def catch_up(self) -> None:
        self.free_at = max(self.free_at or 0.0, self.now())

    def start(self, arrival: float = 0.0) -> float:
        """When an action whose input arrives at `arrival` starts."""
        if self.free_at is None or not self.overlap:
            self.catch_up()
        return max(self.free_at, arrival)

    def lag(self) -> float:
        """How far the host is behind the device (seconds; 0 when ahead)."""
        return max(0.0, self.now() - (self.free_at or 0.0))

    def run_until(self, end: float) -> None:
        self.free_at = end
        time.sleep(max(0.0, end - self.now()))


BLOCKED_S = 0.001  # a wait this long or longer blocked on its collective


def waits_catch_up(clock: DeviceClock):
    """Make this process's all-reduces catch `clock` up with the host when their wait blocks (see
    DeviceClock): the collective completed when the last rank reached it, as the wait ended. Returns
    what undoes it (a rank process runs many rows)."""
    import torch.distributed as dist

    all_reduce = dist.all_reduce

    def after(started: float) -> None:
        if clock.now() - started >= BLOCKED_S:
            clock.catch_up()

    class Waited:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            started = clock.now()
            done = self.work.wait(*args, **kwargs)
            after(started)
            return done

        def __getattr__(self, name):
            return getattr(self.work, name)

    def timed_all_reduce(*args, async_op: bool = False, **kwargs):
        started = clock.now()
        work = all_reduce(*args, async_op=async_op, **kwargs)
        if async_op:
            return Waited(work)
        after(started)
        return work

    dist.all_reduce = timed_all_reduce
    return lambda: setattr(dist, "all_reduce", all_reduce)


def _sleep_on(module, times: tuple[float, float, float], link_s: float, received: tuple[bool, bool],
              split_backward: bool, clock: DeviceClock) -> None:
    """Make `module` (a pipeline stage) take `times` (forward, input gradient, weight gradient) per
    microbatch by `clock`: the stage's own small compute is inside that time.

    - forward: from its start (a pre-hook) to its output, which passes through a function that sleeps;
    - backward: from the output's gradient to the end of the backward pass (a callback the autograd
      engine runs when the pass ends). A full backward also lasts the weight gradient's time; with
      `split_backward` (ZBV) the weight-gradient action computes that gradient apart and takes its time,
      as the gradient of the weight its forward used (the one bound to that microbatch, under weight
      versions) is computed.

    Each message between ranks carries, in its first element, when it was sent by `clock`; the stage
    that uses it starts no earlier than `link_s` after that (a slower link). `received`: whether the
    stage's input, and its output's gradient, come from another rank."""
    import torch
    from torch.autograd import Variable

    forward_s, backward_s, weight_s = times
    full_backward_s = backward_s + (0.0 if split_backward else weight_s)
    pending: dict = {}  # the backward pass under way: when it ends

    def arrival(t: torch.Tensor, from_another_rank: bool) -> float:
        return t.view(-1)[0].item() + link_s if from_another_rank else 0.0

    def end_backward() -> None:
        clock.run_until(pending.pop("backward_end"))

    class SleepOnOutput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            clock.run_until(clock.free_at + forward_s)
            out = x.clone()  # a view of its input here makes torch's split backward lose a gradient
            out.view(-1)[0] = clock.free_at
            return out

        @staticmethod
        def backward(ctx, grad):
            pending["backward_end"] = clock.start(arrival(grad, received[1])) + full_backward_s
            Variable._execution_engine.queue_callback(end_backward)
            return grad

    class StampInputGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()  # sent back once the pass ends, so stamped with when it ends
            grad.view(-1)[0] = pending["backward_end"]
            return grad

    def on_weight_gradient(grad):
        if split_backward and "backward_end" not in pending:  # ZBV's weight-gradient action
            clock.run_until(clock.start() + weight_s)
        return grad

    def before(_module, args):
        clock.free_at = clock.start(arrival(args[0], received[0]))  # the forward starts here
        return (StampInputGradient.apply(args[0]), *args[1:]) if received[0] else None

    def after(bound_module, _inputs, output):
        weight = next(bound_module.parameters())  # the microbatch's own (a version's copy)
        if weight.requires_grad and not getattr(weight, "_sleeps", False):
            weight.register_hook(on_weight_gradient)
            weight._sleeps = True
        first = output[0] if isinstance(output, tuple) else output
        slept = SleepOnOutput.apply(first)
        return (slept, *output[1:]) if isinstance(output, tuple) else slept

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


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
        split_backward = BACKWARD_INPUT in {a.computation_type for a in spec.actions(world_size, m)[rank] if a}
        for module, stage in zip(executor.modules, executor.stage_ids):
            received = (stage > 0 and to_rank[stage - 1] != rank, stage < n_stages - 1 and to_rank[stage + 1] != rank)
            _sleep_on(module, sleeps.of_stage(stage, n_stages, spec.stages_per_rank), sleeps.link_s, received,
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
        measured = slice(WARMUP_STEPS, WARMUP_STEPS + steps)
        engine.finish()
        restore()
        return ends, max(lags[measured]), host_s[WARMUP_STEPS + steps] - host_s[WARMUP_STEPS]
    finally:
        shutdown_parallel()


def measure(pool, schedule: str, pp_size: int, m: int, sleeps: Sleeps, steps: int, clock: str = "device") -> dict:
    """One row: the measured steady step beside the bubble-free limit and the timing model's step (ms).
    `clock`: "device" (the host's work overlaps the sleeps) or "host" (it adds to them); see DeviceClock."""
    from hf_asyncpp.planning.step_time import predict_step
    from hf_asyncpp.schedules import ScheduleError, get_schedule_spec

    spec = get_schedule_spec(schedule)
    row = dict(schedule=schedule, pp_size=pp_size, n_microbatches=m, **asdict(sleeps), clock=clock)
    clip = schedule != "wpipe"  # the one schedule that cannot clip by the global norm (config_checks)
    try:
        spec.check_microbatches(pp_size, m, clip_globally=clip and not spec.synchronous)
        costs = sleeps.stage_costs(spec.n_stages(pp_size), spec.stages_per_rank)
        model_step, limit = predict_step(spec, pp_size, m, costs, clip, sleeps.link_s)
    except (ValueError, ScheduleError) as err:
        return dict(row, refused=str(err).splitlines()[0])
    ran = pool.run(pp_size, _sleeping_run, schedule, m, sleeps, steps, time.perf_counter(), clip,
                    clock == "device", timeout_s=300)
    ends = [rank_ends for rank_ends, _, _ in ran]
    last = [max(rank[k] for rank in ends) for k in range(len(ends[0]))]
    step = (last[WARMUP_STEPS + steps - 1] - last[WARMUP_STEPS - 1]) / steps
    row.update(measured_ms=round(1000 * step, 1), limit_ms=round(1000 * limit, 1), model_ms=round(1000 * model_step, 1),
               host_lag_ms=round(1000 * max(lag for _, lag, _ in ran), 1),
               host_cores=round(sum(host_s for _, _, host_s in ran) / (step * steps), 2))
    if limit > 0:  # with no sleep at all, the step is the runtime's own cost alone
        row.update(measured_over_limit=round(step / limit, 3), measured_over_model=round(step / model_step, 3))
    return row


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
             "measured / limit | measured / model | tokens/s ÷ best sync | host cores |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = (f"| {r['schedule']} | {r['pp_size']} | {r['n_microbatches']} | {r['last_stage_factor']:g} | "
                f"{1000 * r['optimizer_s']:g} | {1000 * r['link_s']:g} | {r['clock']} | ")
        if "refused" in r:
            lines.append(head + f"refused: {r['refused'][:70]} | | | | | | |")
            continue
        speedup = r.get("tokens_per_s_over_best_synchronous")
        ratios = [f"{r[k]:.3f}" if k in r else "" for k in ("measured_over_limit", "measured_over_model")]
        lines.append(head + f"{r['measured_ms']} | {r['limit_ms']} | {r['model_ms']} | {ratios[0]} | {ratios[1]} | "
                     + (f"{speedup:.3f} ({r['best_synchronous']})" if speedup else "") + f" | {r['host_cores']:.2f} |")
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
    parser.add_argument("--clock", default="device",
                        help="device (the host's work overlaps the sleeps, as a GPU's host runs ahead), host (it "
                             "adds to them), or both, comma-separated")
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
                        for clock in args.clock.split(","):
                            for schedule in schedules:
                                rows.append(measure(pool, schedule, p, k * p, sleeps, args.steps, clock))
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
