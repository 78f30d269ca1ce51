"""Pipeline bubble of the flushed schedules (GPipe, 1F1B): measured idle fraction vs. (p−1)/(m+p−1).

A flushed pipeline of p equal stages running m microbatches keeps each rank idle for a share
(p − 1) / (m + p − 1) of the step (hf_asyncpp.metrics.theoretical_bubble): the fill and drain
at both ends. This script measures the real share on the tiny MoE ("tiny-moe" preset, random
init), pp = 2, seq_len 128, micro_batch_size 8, one torch thread per rank, on 2 gloo ranks it
spawns itself, for each schedule and each m:

  - tokens/s: minibatch tokens / step time (the slowest rank's step time);
  - idle fraction per rank: 1 − busy / step time from StepResult, busy being the time inside stage
    forward/backward (ComputeTimer); the rest is waiting for activations or gradients, p2p sends,
    and the step's tail (gradient-norm all-reduce, optimizer step, loss all-reduce);
  - the slowest rank's busy time per step: the step time a bubble-free pipeline would approach,
    with the theoretical idle fraction beside it.

The measurement differs from the textbook formula because the stages are not equal: the last
stage also carries lm_head (8192-way vocabulary) and the loss, so rank 0 waits on rank 1 more than
the formula says and rank 1 less; the step's tail also counts as idle. Each figure is the mean over
--steps steps after --warmup discarded steps (the first includes torch's shape inference). All arms
run in one invocation with their steps interleaved round-robin, so drift in machine speed hits
every arm alike and their ratios are comparable. Synthetic rows (torch.randint, fixed seed): no
dataset needed.

    python benchmarks/pipeline_bubble.py [--steps 8] [--warmup 3] [--microbatches 2,4,8]
                                         [--schedules gpipe,1f1b] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import, here and in spawned ranks
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
import platform
import socket
import statistics
import time
from pathlib import Path

PRESET, SEQ_LEN, MBS, PP = "tiny-moe", 128, 8, 2
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_bubble.json"


def _rank_main(rank: int, args, port: int, arms: list[tuple[str, int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(PP), LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), PP)
    try:
        model_config = build_config(PRESET)
        total = args.warmup + args.steps
        engines, gens = [], []
        for schedule, m in arms:
            config = TrainConfig(model_config=PRESET, pp_size=PP, schedule=schedule, n_microbatches=m,
                                 micro_batch_size=MBS, seq_len=SEQ_LEN, optimizer="adamw", learning_rate=1e-3,
                                 lr_scheduler_type="constant", max_steps=total, seed=0)
            engines.append(PipelineEngine(config, model_config, layout))
            gens.append(torch.Generator().manual_seed(1234 + m))  # same rows on both ranks
        samples = [[] for _ in arms]  # per arm: (busy_s, step_time_s, tokens) of each measured step
        for step in range(total):
            for i, ((schedule, m), engine) in enumerate(zip(arms, engines)):
                rows = torch.randint(0, model_config.vocab_size, (m * MBS, SEQ_LEN), generator=gens[i])
                dist.barrier()
                result = engine.train_step(rows)
                if step >= args.warmup:
                    samples[i].append((result.busy_s, result.step_time_s, result.tokens))
        gathered = [None] * PP if rank == 0 else None
        dist.gather_object(samples, gathered, dst=0)
        if rank == 0:
            _report(args, arms, gathered)
    finally:
        shutdown_parallel()


def _report(args, arms, gathered) -> None:
    import torch
    import transformers

    from hf_asyncpp.metrics import theoretical_bubble

    results = []
    for i, (schedule, m) in enumerate(arms):
        per_rank = [gathered[r][i] for r in range(PP)]  # per rank: list of (busy, step, tokens)
        step_s = [max(per_rank[r][k][1] for r in range(PP)) for k in range(args.steps)]
        tokens = per_rank[0][0][2]
        busy_ms = [1e3 * statistics.mean(b for b, _, _ in steps) for steps in per_rank]
        idle = [statistics.mean(max(0.0, 1 - b / t) for b, t, _ in steps) for steps in per_rank]
        results.append(dict(
            schedule=schedule, n_microbatches=m, tokens_per_step=tokens,
            tokens_per_s=tokens * args.steps / sum(step_s),
            step_ms=1e3 * statistics.mean(step_s), step_ms_stdev=1e3 * statistics.stdev(step_s) if len(step_s) > 1 else 0.0,
            idle_fraction_per_rank=idle, busy_ms_per_rank=busy_ms,
            slowest_rank_busy_ms=max(busy_ms), bubble_free_tokens_per_s=tokens / (max(busy_ms) / 1e3),
            theoretical_idle=theoretical_bubble(PP, m),
            raw_per_rank=[[dict(busy_s=b, step_time_s=t) for b, t, _ in steps] for steps in per_rank],
        ))
    meta = dict(preset=PRESET, seq_len=SEQ_LEN, micro_batch_size=MBS, pp_size=PP, dp_size=1, backend="gloo",
                threads_per_rank=1, optimizer="adamw", warmup_steps=args.warmup, measured_steps=args.steps,
                torch=torch.__version__, transformers=transformers.__version__, cpu_count=os.cpu_count(),
                machine=platform.machine(), python=platform.python_version(),
                date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1) + "\n")
    print(f"\n{PRESET}, pp={PP}, seq_len={SEQ_LEN}, micro_batch_size={MBS}, 1 thread/rank, "
          f"mean of {args.steps} steps after {args.warmup} warm-up steps\n")
    print("| schedule | m | tokens/s | idle rank0 | idle rank1 | theoretical idle | step ms | slowest-rank busy ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        idle0, idle1 = r["idle_fraction_per_rank"]
        print(f"| {r['schedule']} | {r['n_microbatches']} | {r['tokens_per_s']:.0f} | {idle0:.3f} | {idle1:.3f} | "
              f"{r['theoretical_idle']:.3f} | {r['step_ms']:.1f} | {r['slowest_rank_busy_ms']:.1f} |")
    print(f"\nwrote {out}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per arm")
    parser.add_argument("--warmup", type=int, default=3, help="discarded steps per arm (first: shape inference)")
    parser.add_argument("--microbatches", default="2,4,8", help="comma-separated n_microbatches values")
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated schedule names")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step includes shape inference)")
    from hf_asyncpp.schedules import get_schedule_spec

    arms = [(s.strip(), int(m)) for s in args.schedules.split(",") for m in args.microbatches.split(",")]
    for schedule, m in arms:
        try:
            spec = get_schedule_spec(schedule)
            spec.check_microbatches(PP, m)
        except ValueError as err:
            parser.error(f"{schedule}, m={m}: {err}")
        if spec.stages_per_rank != 1:
            parser.error(f"{schedule}: only one-stage-per-rank flushed schedules are compared here")
    import torch.multiprocessing as mp

    start = time.perf_counter()
    mp.spawn(_rank_main, args=(args, _free_port(), arms), nprocs=PP, join=True)
    print(f"total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
