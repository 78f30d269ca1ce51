"""The memory plan against a real run at `moe_2b`'s layer shapes: each rank's peak of live tensors.

Setup: training_scripts/models/moe_2b (Qwen3-MoE, hidden 1024, 64 experts top-8, vocab 49152) cut to
`--layers` decoder layers, pp 4 on 4 gloo ranks spawned here (they oversubscribe 2 cores: slow, but
what they hold does not depend on it), PipeDream-2BW + Muon + Error Feedback with global clipping,
fp32, `--seq-len` × `--micro-batch-size` tokens per microbatch, `--microbatches` per step. The real run
measures, on every rank, the peak of its live tensors (planning/memory_tracker.py on real storages)
through start-up, three steps and an evaluation; `hf-asyncpp plan`'s machinery plays the same config
on fake tensors with a fake process group (planning/plan.py). Printed: both peaks per rank, their
ratio, and the plan's parts.

    python benchmarks/plan_accuracy.py [--layers 6] [--out benchmarks/results/plan_accuracy.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import, here and in spawned ranks
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "training_scripts" / "models" / "moe_2b"  # --model: another config folder (the smoke test's tiny one)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "plan_accuracy.json"
PP = 4
MiB = 2**20


def _setup(args):
    from transformers import AutoConfig

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.planning.plan import STEPS

    config = TrainConfig(model_config=str(args.model / "config.json"), pp_size=PP, schedule="pipedream-2bw",
                         optimizer="muon", momentum=0.95, ef=True, learning_rate=1e-3, max_grad_norm=1.0,
                         seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                         n_microbatches=args.microbatches, max_steps=STEPS + 1, mixed_precision="no", seed=42)
    return config, AutoConfig.from_pretrained(args.model, num_hidden_layers=args.layers)


def _measured(rank, world_size, args):
    import torch

    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel
    from hf_asyncpp.planning.memory_tracker import MemoryTracker
    from hf_asyncpp.planning.plan import STEPS

    config, model_config = _setup(args)
    layout = init_parallel(read_launch(), PP)
    try:
        tracker = MemoryTracker()
        with tracker:
            engine = PipelineEngine(config, model_config, layout)
            rows = torch.randint(0, model_config.vocab_size, (args.micro_batch_size * args.microbatches, args.seq_len),
                                 generator=torch.Generator().manual_seed(0))
            for _ in range(STEPS):
                engine.train_step(rows, rows)
            engine.eval_step(rows)
        engine.train_step(rows, None)  # the drain
        engine.finish()
        return tracker.peak_bytes
    finally:
        shutdown_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="the model config folder")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    from hf_asyncpp.parallel.spawn import run_ranks
    from hf_asyncpp.planning.plan import KINDS, plan_layout

    measured = run_ranks(PP, _measured, args, timeout_s=3600)
    planned = plan_layout(*_setup(args), world_size=PP)
    rows = [dict(plan, measured_peak_bytes=real, plan_over_measured=plan["peak_bytes"] / real)
            for plan, real in zip(planned, measured)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(setup=dict(model=args.model.name, layers=args.layers, pp=PP, seq_len=args.seq_len,
                                                   micro_batch_size=args.micro_batch_size,
                                                   n_microbatches=args.microbatches, schedule="pipedream-2bw",
                                                   optimizer="muon", ef=True, dtype="fp32"), rows=rows), indent=2) + "\n")
    print(f"{args.model.name} shapes, {args.layers} layers, pp {PP}, {args.microbatches} × {args.micro_batch_size} × "
          f"{args.seq_len} tokens, 2BW + Muon + EF, fp32")
    print("| rank | stages | measured MiB | plan MiB | plan ÷ measured | " + " | ".join(KINDS) + " |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(KINDS))
    for r in rows:
        print(f"| {r['rank']} | {','.join(map(str, r['stages']))} | {r['measured_peak_bytes'] / MiB:.0f} | "
              f"{r['peak_bytes'] / MiB:.0f} | {r['plan_over_measured']:.3f} | "
              + " | ".join(f"{r[f'{k}_bytes'] / MiB:.0f}" for k in KINDS) + " |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
