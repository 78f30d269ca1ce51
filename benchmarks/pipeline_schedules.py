"""Step time, tokens/s, idle (bubble) fraction and peak memory of the pipeline schedules, side by side.

Setup: a model (`--model`: a preset or config.json; default "tiny-moe", random init), pp = 2 on 2 gloo
ranks spawned here, seq_len 128 and micro_batch_size 8 (`--seq-len`, `--micro-batch-size`), one torch
thread per rank, AdamW, synthetic token rows (same rows for every arm).
Arms: schedule × m (n_microbatches) × clipping scope (`--clip-scopes`: max_grad_norm 1.0 by the global
norm, or each asynchronous stage by its own; synchronous schedules clip globally, and an order that
cannot clip globally, WPipe, runs by stage only); two-stage-per-rank schedules (WPipe) cut the model
into 2p stages. Each arm runs in fresh processes (so peak RSS is its own) and
takes --warmup + --steps consecutive optimizer steps without any barrier between them (a barrier
per step would re-create the bubble an asynchronous schedule removes), plus, for asynchronous
schedules, the final draining step, which is not measured.

Measured per arm and rank:
  - step time and tokens/s (step time: the slower rank's mean);
  - idle fraction: 1 − (time inside stage compute and loss) / step time, and that busy time itself
    beside 1F1B's at the same m;
  - the bubble-free limit: the same rank's forward + backward of the same m microbatches run
    directly on its stage module and its optimizer step, outside the pipeline (no communication, no
    waiting), while every rank runs its own at the same time (as in a pipeline without a bubble) —
    the step time no schedule can beat; the slowest rank's limit is the pipeline's ceiling. The slow rank's busy time
    over its limit's forward + backward shows what a schedule adds to compute (weight stashing, say):
    1.00 is nothing;
  - peak resident memory of the rank's process (CPU; includes the ~0.5 GB of libraries);
  - the CPU time the rank's other threads (gloo's transport, the norm all-reduce) take per step;
  - what one step computes, counted rather than timed (one extra step after the measured ones, under
    torch's FlopCounterMode and a dispatch mode counting aten ops): its FLOPs beside 1F1B's on the same
    rank (1.000: the schedule adds no arithmetic) and the MB its `copy_` ops write (a weight-stashing
    update copies the stage's master weights into the next version's buffer).
Theoretical idle (p − 1)/(m + p − 1) is printed for reference: stages are unequal (the last carries
lm_head and the loss), so the measured limit, not the formula, is the ceiling. With --rounds R every
arm runs R times, arms alternating (drift in the machine's load then reaches every arm alike), and
each number is the median over rounds.

    python benchmarks/pipeline_schedules.py [--schedules gpipe,1f1b,pipedream-2bw,wpipe,pipedream]
        [--microbatches 2,4,8] [--steps 8] [--warmup 3] [--model tiny-moe] [--seq-len 128]
        [--micro-batch-size 8] [--clip-scopes global] [--rounds 1]
        [--out benchmarks/results/pipeline_schedules.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import, here and in spawned ranks
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path

PP = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_schedules.json"


def _fwd_bwd_s(engine, rows) -> tuple[float, float]:
    """One forward + backward of the step's microbatches on this rank's stages, no pipeline around
    them, and the optimizer step every schedule takes once per step (without clipping, whose norm
    would need the other ranks): (forward + backward s, optimizer step s)."""
    import torch

    m = engine.config.n_microbatches
    start = time.perf_counter()
    for module in engine.executor.modules:
        for mb in rows.chunk(m):
            if module.is_first:
                args = (mb,)
            else:
                args = (torch.randn(*mb.shape, module.config.hidden_size, requires_grad=True),)
                if module.carries_router_stats:
                    args += (torch.zeros(2 * module.num_experts + 1, requires_grad=True),)
            out = module(*args)
            outputs = out if isinstance(out, tuple) else (out,)
            loss = engine.executor.loss_fn(out, mb) if module.is_last else sum(o.float().sum() for o in outputs)
            loss.backward()
    computed = time.perf_counter()
    for updater in engine.executor.updaters:
        updater.optimizer.step()
    stepped = time.perf_counter()
    for updater in engine.executor.updaters:
        updater.optimizer.zero_grad(set_to_none=True)
    engine.executor.loss_fn.records.clear()
    return computed - start, stepped - computed


def _bubble_free_ms(engine, rows, repeats: int, group) -> tuple[float, float]:
    """This rank's (forward + backward, optimizer step) of one step outside the pipeline in ms, means
    over about `repeats` repetitions, measured while every rank runs its own at the same time: a
    pipeline without a bubble keeps every rank computing all along, and on CPU cores that share caches
    and memory a rank computes 3–10% slower while the others compute too (benchmarks/README.md), so a limit
    measured alone would be one no schedule can reach. Every rank repeats for the same wall time
    (`repeats` of the slowest rank's repetitions), so the slowest is never measured alone."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor([sum(_fwd_bwd_s(engine, rows))])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    dist.barrier(group=group)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < repeats * slowest.item():
        times.append(_fwd_bwd_s(engine, rows))
    return tuple(1e3 * statistics.mean(t[i] for t in times) for i in range(2))


def _counted_step(engine, rows, next_rows) -> dict:
    """One training step with its arithmetic counted: FLOPs (matmuls, attention) and the bytes
    `aten.copy_` writes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class CopiedBytes(TorchDispatchMode):
        copied = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten.copy_:
                self.copied += out.numel() * out.element_size()
            return out

    flops, copies = FlopCounterMode(display=False), CopiedBytes()
    with flops, copies:
        engine.train_step(rows, next_rows)
    return dict(flops=flops.get_total_flops(), copied_mb=copies.copied / 2**20)


def _rank_main(rank: int, world_size: int, args, schedule: str, m: int, scope: str) -> dict:
    import torch
    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), PP)
    try:
        model_config = build_config(args.model)
        from hf_asyncpp.schedules import get_schedule_spec

        synchronous = get_schedule_spec(schedule).synchronous
        counted = args.warmup + args.steps  # the step whose arithmetic is counted
        total = counted + 1 + (0 if synchronous else 1)  # + the draining step
        config = TrainConfig(model_config=args.model, pp_size=PP, schedule=schedule, n_microbatches=m,
                             micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, optimizer="adamw", learning_rate=1e-3,
                             lr_scheduler_type="constant", max_steps=total, seed=0, grad_clip_scope=scope)
        engine = PipelineEngine(config, model_config, layout)
        gen = torch.Generator().manual_seed(1234)
        rows = [torch.randint(0, model_config.vocab_size, (m * args.micro_batch_size, args.seq_len), generator=gen)
                for _ in range(total)]
        samples, count = [], {}
        for step in range(total):
            next_rows = rows[step + 1] if step + 1 < total else None
            if step == counted:
                count = _counted_step(engine, rows[step], next_rows)
                continue
            cpu, own_cpu = time.process_time(), time.thread_time()
            result = engine.train_step(rows[step], next_rows)
            others_cpu = (time.process_time() - cpu) - (time.thread_time() - own_cpu)
            if args.warmup <= step < args.warmup + args.steps:
                samples.append((result.busy_s, result.step_time_s, result.tokens, others_cpu))
        engine.finish()
        compute_ms, optimizer_ms = _bubble_free_ms(engine, rows[0], args.steps, layout.pp_group)
        return dict(samples=samples, bubble_free_ms=compute_ms + optimizer_ms, compute_ms=compute_ms,
                    peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **count)
    finally:
        shutdown_parallel()


def _run_arm(args, schedule: str, m: int, scope: str) -> dict:
    from hf_asyncpp.metrics import theoretical_bubble
    from hf_asyncpp.parallel.spawn import run_ranks
    from hf_asyncpp.schedules import get_schedule_spec

    ranks = run_ranks(PP, _rank_main, args, schedule, m, scope, timeout_s=900)  # fresh processes per arm
    step_s = [max(ranks[r]["samples"][k][1] for r in range(PP)) for k in range(args.steps)]
    tokens = ranks[0]["samples"][0][2]
    limit_ms = max(r["bubble_free_ms"] for r in ranks)
    return dict(
        schedule=schedule, n_microbatches=m, clip_scope=scope, tokens_per_step=tokens,
        step_ms=1e3 * statistics.mean(step_s),
        step_ms_stdev=1e3 * statistics.stdev(step_s) if len(step_s) > 1 else 0.0,
        tokens_per_s=tokens * len(step_s) / sum(step_s),
        idle_fraction_per_rank=[statistics.mean(max(0.0, 1 - b / t) for b, t, *_ in r["samples"]) for r in ranks],
        busy_ms_per_rank=[1e3 * statistics.mean(b for b, *_ in r["samples"]) for r in ranks],
        # CPU the rank's other threads (gloo's transport, mostly) took per step: on 2 cores, time
        # taken from some rank's compute, which a GPU's copy engines would not take
        other_threads_cpu_ms_per_rank=[1e3 * statistics.mean(c for *_, c in r["samples"]) for r in ranks],
        bubble_free_ms_per_rank=[r["bubble_free_ms"] for r in ranks],
        optimizer_ms_per_rank=[r["bubble_free_ms"] - r["compute_ms"] for r in ranks],
        bubble_free_ms=limit_ms,
        step_over_limit=1e3 * statistics.mean(step_s) / limit_ms,
        # weight stashing or anything else a schedule adds to compute shows here (1.00: none)
        slow_rank_busy_over_limit=max((r["bubble_free_ms"], 1e3 * statistics.mean(b for b, *_ in r["samples"])
                                       / r["compute_ms"]) for r in ranks)[1],
        peak_rss_mb_per_rank=[r["peak_rss_mb"] for r in ranks],
        flops_per_rank=[r["flops"] for r in ranks],
        copied_mb_per_rank=[r["copied_mb"] for r in ranks],
        theoretical_idle=theoretical_bubble(PP, m) if get_schedule_spec(schedule).synchronous else 0.0,
        raw_step_s=step_s,
    )


def _median_of_rounds(rounds: list[dict]) -> dict:
    """One arm over its rounds: each measured number is the median of the rounds' (per rank where it
    is per rank); the rounds' own results are kept under `rounds`."""
    merged = dict(rounds[0])
    for key, value in rounds[0].items():
        if key in ("schedule", "n_microbatches", "clip_scope", "tokens_per_step", "theoretical_idle", "raw_step_s"):
            continue
        if isinstance(value, list):
            merged[key] = [statistics.median(r[key][i] for r in rounds) for i in range(len(value))]
        else:
            merged[key] = statistics.median(r[key] for r in rounds)
    merged["rounds"] = rounds
    return merged


def _print_table(results: list[dict]) -> None:
    base = {r["n_microbatches"]: r for r in results if r["schedule"] == "1f1b"}  # synchronous: clipped globally
    print("| schedule | m | clipping | step ms | tokens/s | vs 1f1b | bubble-free limit ms | step / limit | idle r0 | idle r1 "
          "| busy ms r0 / r1 | busy vs 1f1b r0 / r1 | slow rank busy / limit | FLOPs vs 1f1b r0 / r1 "
          "| copied MB r0 / r1 | other threads' CPU ms r0 / r1 | theor. idle | peak RSS MB r0 / r1 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    nan = dict(step_ms=float("nan"), busy_ms_per_rank=[float("nan")] * PP, flops_per_rank=[float("nan")] * PP)
    for r in results:
        ref = base.get(r["n_microbatches"], nan)
        speedup = ref["step_ms"] / r["step_ms"]
        idle0, idle1 = r["idle_fraction_per_rank"]
        busy0, busy1 = r["busy_ms_per_rank"]
        ratio0, ratio1 = (b / a for b, a in zip(r["busy_ms_per_rank"], ref["busy_ms_per_rank"]))
        rss0, rss1 = r["peak_rss_mb_per_rank"]
        flops0, flops1 = (f / b for f, b in zip(r["flops_per_rank"], ref["flops_per_rank"]))
        copied0, copied1 = r["copied_mb_per_rank"]
        others0, others1 = r["other_threads_cpu_ms_per_rank"]
        print(f"| {r['schedule']} | {r['n_microbatches']} | {r['clip_scope']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{speedup:.2f}× | {r['bubble_free_ms']:.0f} | {r['step_over_limit']:.3f} | {idle0:.3f} | {idle1:.3f} | "
              f"{busy0:.0f} / {busy1:.0f} | {ratio0:.3f} / {ratio1:.3f} | {r['slow_rank_busy_over_limit']:.3f} | "
              f"{flops0:.3f} / {flops1:.3f} | {copied0:.1f} / {copied1:.1f} | {others0:.1f} / {others1:.1f} | "
              f"{r['theoretical_idle']:.3f} | {rss0:.0f} / {rss1:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,pipedream-2bw,wpipe,pipedream")
    parser.add_argument("--microbatches", default="2,4,8")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per arm")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps per arm (the first: shape inference)")
    parser.add_argument("--model", default="tiny-moe", help="a preset, a config.json or a model directory")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--clip-scopes", default="global",
                        help="grad_clip_scope values to run asynchronous schedules with (global, stage)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every arm this many times, arms alternating; report medians over rounds")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if args.steps < 2 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps must be at least 2, --warmup and --rounds at least 1")
    from hf_asyncpp.schedules import get_schedule_spec

    arms = []
    for schedule, m in ((s.strip(), int(m)) for s in args.schedules.split(",") for m in args.microbatches.split(",")):
        try:
            spec = get_schedule_spec(schedule)
            spec.check_microbatches(PP, m)
        except ValueError as err:
            parser.error(f"{schedule}, m={m}: {err}")
        for scope in ["global"] if spec.synchronous else args.clip_scopes.split(","):
            try:
                spec.check_microbatches(PP, m, clip_globally=scope == "global")
            except ValueError:
                print(f"{schedule}, m={m}: cannot clip by the global norm; run by stage only")
                scope = "stage"
            if (schedule, m, scope) not in arms:
                arms.append((schedule, m, scope))
    start = time.perf_counter()
    runs = [[_run_arm(args, *arm) for arm in arms] for _ in range(args.rounds)]
    results = [_median_of_rounds([round_[i] for round_ in runs]) for i in range(len(arms))]
    import torch
    import transformers

    meta = dict(model=args.model, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, pp_size=PP, dp_size=1, backend="gloo",
                threads_per_rank=1, optimizer="adamw", warmup_steps=args.warmup, measured_steps=args.steps, rounds=args.rounds,
                torch=torch.__version__, transformers=transformers.__version__, cpu_count=os.cpu_count(),
                machine=platform.machine(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1) + "\n")
    print(f"\n{args.model}, pp={PP}, seq_len={args.seq_len}, micro_batch_size={args.micro_batch_size}, 1 thread/rank, "
          f"mean of {args.steps} steps after {args.warmup} warm-up steps, median of {args.rounds} round(s)\n")
    _print_table(results)
    print(f"\nwrote {out}; total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
