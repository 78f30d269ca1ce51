"""Bytes per rank of each kind of training state, sharded over dp = 1 and dp = 2, side by side.

Setup: the "tiny-moe" preset, pp = 2 on gloo ranks spawned here (2 ranks for dp = 1, 4 for dp = 2;
4 ranks oversubscribe 2 cores, which slows them but does not change what they hold), seq_len 128,
micro_batch_size 8, 4 microbatches. Arms: schedule × optimizer × EF; each counts, on every rank after
its third step (mid-run: weight versions and their gathered compute copies are live), the bytes of
parameters (master copy), gradients, weight versions (stored shards), compute copies (gathered
whole, transient), optimizer state and Error Feedback buffers (`PipelineEngine.state_bytes`,
hf_asyncpp/memory.py). A DTensor counts its local shard.

    python benchmarks/memory_per_rank.py [--seq-len 128] [--micro-batch-size 8] [--microbatches 4] [--dp 1,2]
        [--arms pipedream-2bw:adamw,pipedream-2bw:muon,1f1b:adamw] [--out benchmarks/results/memory_per_rank.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import, here and in spawned ranks
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
from pathlib import Path

PRESET, PP = "tiny-moe", 2
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory_per_rank.json"
ARMS = "pipedream-2bw:adamw,pipedream-2bw:muon,1f1b:adamw"  # schedule:optimizer, each with Error Feedback
KINDS = ("parameters", "gradients", "weight_versions", "compute_copies", "optimizer_state", "ef_buffers")


def _rank(rank, world_size, schedule, optimizer, ef, seq_len, mbs, m):
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), PP)
    try:
        config = TrainConfig(model_config=PRESET, pp_size=PP, schedule=schedule, optimizer=optimizer, ef=ef,
                             seq_len=seq_len, micro_batch_size=mbs, n_microbatches=m, max_steps=4)
        engine = PipelineEngine(config, build_config(PRESET), layout)
        rows = torch.randint(0, 8192, (mbs * m, seq_len), generator=torch.Generator().manual_seed(layout.dp_rank))
        for step in range(3):
            engine.train_step(rows, rows)
        held = engine.state_bytes()
        engine.train_step(rows, None)  # drain
        engine.finish()
        return dict(held, rank=rank, stage=engine.executor.stage_ids[0], dp_rank=layout.dp_rank)
    finally:
        shutdown_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dp", default="1,2", help="dp sizes, comma-separated (the first is the ratio's reference)")
    parser.add_argument("--arms", default=ARMS, help="schedule:optimizer pairs, comma-separated")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    sizes = (args.seq_len, args.micro_batch_size, args.microbatches)
    dps = [int(d) for d in args.dp.split(",")]
    from hf_asyncpp.parallel.spawn import run_ranks

    rows = []
    for schedule, optimizer in (arm.split(":") for arm in args.arms.split(",")):
        for dp in dps:
            for report in run_ranks(PP * dp, _rank, schedule, optimizer, True, *sizes):
                if report["dp_rank"] == 0:  # dp replicas of a stage hold the same amounts
                    rows.append(dict(report, schedule=schedule, optimizer=optimizer, ef=True, dp=dp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(setup=dict(preset=PRESET, pp=PP, seq_len=args.seq_len,
                                                   micro_batch_size=args.micro_batch_size,
                                                   n_microbatches=args.microbatches), rows=rows), indent=2) + "\n")
    print("| schedule | optimizer | EF | stage | dp | " + " | ".join(k.replace("_", " ") + " MiB" for k in KINDS)
          + " | state ÷ dp=1 |")
    print("|---|---|---|---:|---:|" + "---:|" * (len(KINDS) + 1))
    for row in rows:
        whole = next(r for r in rows if r["dp"] == dps[0] and r["stage"] == row["stage"] and
                     (r["schedule"], r["optimizer"]) == (row["schedule"], row["optimizer"]))
        sharded = ("parameters", "weight_versions", "optimizer_state", "ef_buffers")
        ratio = sum(row[k] for k in sharded) / sum(whole[k] for k in sharded)
        print(f"| {row['schedule']} | {row['optimizer']} | {'λ=1' if row['ef'] else 'off'} | {row['stage']} | "
              f"{row['dp']} | " + " | ".join(f"{row[k] / 2**20:.2f}" for k in KINDS) + f" | {ratio:.3f} |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
