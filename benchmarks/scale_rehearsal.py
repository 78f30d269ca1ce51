"""CPU scale rehearsal: moe_2b's layer shapes at pp 4, each rank's peak memory beside its state.

Setup: training_scripts/models/moe_2b (Qwen3-MoE, hidden 1024, 64 experts top-8, expert width 384,
vocab 49152) with `--layers` decoder layers (the machine's memory, not the code, sets the count),
pp = 4 on 4 gloo ranks spawned here (they oversubscribe 2 cores: times are for orientation only),
PipeDream-2BW + Muon + Error Feedback, fp32, no dp, synthetic token rows, short sequences.

Each rank reports, in order: its RSS after importing everything (the baseline), the start-up
(per-stage construction: meta model, cut, allocate and seed-initialize this rank's stages), a few
training steps (2BW keeps its microbatches in flight), a checkpoint save, the HF export, and, in a
second set of fresh processes, a resume from that checkpoint and one more step (whose loss must equal
the first run's next step: the resume is exact). Beside each peak RSS stands what the rank's state
should need: `PipelineEngine.state_bytes()` (parameters, gradients, weight versions, optimizer state,
EF buffers), measured mid-run.

    python benchmarks/scale_rehearsal.py [--layers 8] [--out benchmarks/results/scale_rehearsal.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import, here and in spawned ranks
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "training_scripts" / "models" / "moe_2b"  # --model: another config folder (the smoke test's tiny one)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "scale_rehearsal.json"
PP = 4
MiB = 2**20


def _rss() -> tuple[float, float]:
    """(current, peak since the process started) resident memory in MiB."""
    import resource

    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return current / MiB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _config(args, output_dir: str, resume: bool):
    from hf_asyncpp.config import TrainConfig

    return TrainConfig(model_config=str(args.model / "config.json"), pp_size=PP, schedule="pipedream-2bw",
                       optimizer="muon", momentum=0.95, ef=True, learning_rate=1e-3, max_grad_norm=1.0,
                       seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, n_microbatches=args.microbatches,
                       max_steps=args.steps + 2, seed=42, output_dir=output_dir, max_shard_size="1GB",
                       resume_from_checkpoint="latest" if resume else None)


def _rank(rank, world_size, args, output_dir: str, resume: bool):
    import time

    import torch
    from transformers import AutoConfig

    from hf_asyncpp.checkpoint import export_hf_model
    from hf_asyncpp.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    report = {"rank": rank}

    def mark(phase: str, started: float) -> None:
        current, peak = _rss()
        report[phase] = dict(seconds=round(time.perf_counter() - started, 2), rss_mib=round(current),
                             peak_rss_mib=round(peak))

    layout = init_parallel(read_launch(), PP)
    try:
        model_config = AutoConfig.from_pretrained(args.model, num_hidden_layers=args.layers)
        config = _config(args, output_dir, resume)
        rows = torch.randint(0, model_config.vocab_size, (args.steps + 2, args.micro_batch_size * args.microbatches,
                                                          args.seq_len), generator=torch.Generator().manual_seed(0))
        mark("baseline", time.perf_counter())
        t = time.perf_counter()
        engine = PipelineEngine(config, model_config, layout)
        mark("start_up", t)
        report["stage_ids"] = engine.executor.stage_ids
        if resume:
            t = time.perf_counter()
            state = load_checkpoint(engine, layout, find_checkpoint("latest", output_dir))
            engine.resume_after(state["step"])
            mark("resume", t)
            t = time.perf_counter()
            report["loss_after_resume"] = engine.train_step(rows[args.steps], rows[args.steps + 1]).loss
            mark("step_after_resume", t)
            return report
        t = time.perf_counter()
        for k in range(args.steps):
            engine.train_step(rows[k], rows[k + 1])
        mark("steps", t)
        report["state_bytes"] = engine.state_bytes()  # mid-run: versions, gradients and moments all live
        t = time.perf_counter()
        save_checkpoint(engine, layout, output_dir, args.steps, {"tokens_seen": 0})
        mark("save", t)
        report["next_loss"] = engine.train_step(rows[args.steps], rows[args.steps + 1]).loss
        t = time.perf_counter()
        export_hf_model(engine.stage_state_dict(), layout, model_config, None, Path(output_dir) / "final",
                        config.max_shard_size)
        mark("export", t)
        engine.train_step(rows[args.steps + 1], None)  # drain
        engine.finish()
        return report
    finally:
        shutdown_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="the model config folder")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    from hf_asyncpp.parallel.spawn import run_ranks

    with tempfile.TemporaryDirectory(prefix="scale_rehearsal_") as output_dir:
        trained = run_ranks(PP, _rank, args, output_dir, False, timeout_s=3600)
        resumed = run_ranks(PP, _rank, args, output_dir, True, timeout_s=3600)
        on_disk = {p.name: p.stat().st_size for p in Path(output_dir).rglob("*") if p.is_file()}
    last = PP - 1
    exact = resumed[last]["loss_after_resume"] == trained[last]["next_loss"]
    rows = []
    for run, again in zip(trained, resumed):
        state = sum(run["state_bytes"].values()) / MiB
        baseline = run["baseline"]["rss_mib"]
        row = dict(rank=run["rank"], stages=run["stage_ids"], baseline_mib=baseline, state_mib=round(state),
                   state_bytes=run["state_bytes"])
        for phase, source in (("start_up", run), ("steps", run), ("save", run), ("export", run),
                              ("resume", again), ("step_after_resume", again)):
            row[phase] = dict(source[phase], over_baseline_per_state=round(
                (source[phase]["peak_rss_mib"] - source["baseline"]["rss_mib"]) / state, 3))
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps(dict(setup=dict(setup, pp=PP, model=str(args.model.resolve().relative_to(ROOT))), ranks=rows,
                                        resume_exact=exact, checkpoint_and_export_bytes=sum(on_disk.values())),
                                   indent=2) + "\n")
    print(f"{args.model.name} shapes, {args.layers} layers, pp {PP}; "
          f"resumed step's loss equals the uninterrupted run's: {exact}")
    phases = ("start_up", "steps", "save", "export", "resume")
    print("| rank | stages | baseline MiB | state MiB | "
          + " | ".join(f"{p} s / peak MiB / (peak − base) ÷ state" for p in phases) + " |")
    print("|---:|---|---:|---:|" + "---|" * len(phases))
    for row in rows:
        cells = [f"{row[p]['seconds']} / {row[p]['peak_rss_mib']} / {row[p]['over_baseline_per_state']}" for p in phases]
        print(f"| {row['rank']} | {row['stages']} | {row['baseline_mib']} | {row['state_mib']} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
