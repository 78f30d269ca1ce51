"""One pipeline stage of `moe_2b` on one GPU: tokens/s and model FLOPs utilization of forward + backward.

Setup: a middle stage (no embeddings, no LM head) of `--layers` decoder layers with `moe_2b`'s shapes
(training_scripts/models/moe_2b: hidden 1024, 64 experts top-8, expert width 384; 24 layers over pp 4
gives 6 per stage), built by `models/construct.py` on the GPU, bf16 weights, one microbatch of
`--micro_batch_size` × `--seq_len` tokens (moe_2b.yaml: 8 × 2048). Arms: transformers' expert
implementations (`config._experts_implementation`: eager and the ones its ExpertsInterface offers) ×
activation checkpointing (none / full) × torch.compile of each decoder layer (off / on, with
grouped_mm only, to stay in time). Each arm: `--warmup` untimed steps, then the median of `--steps`
forward + backward steps timed with CUDA events. Model FLOPs per token: 6 × the parameters a token
touches (attention, router, top-k of the experts, norms) + 12 × layers × attention width × seq_len
(attention scores and values, PaLM's count: hf_asyncpp/utilization.py); MFU = achieved / `--peak_tflops` (989: H100 / H200 SXM bf16 dense).
The arms run fastest path first, so a short budget measures what matters: grouped_mm compiled, then
grouped_mm, batched_mm, and the eager loop over experts last (it reads the host once per expert). An arm
whose path cannot fit is skipped with a line saying why: batched_mm gathers each token's experts'
weights, at least tokens × top-k × hidden × 2 × expert width in bf16 for the gate/up projection (206 GB at
8 × 2048 tokens, top-8: more than any GPU holds). An arm that runs out of memory or fails is recorded with
its error; arms that would pass `--max_minutes` are skipped. JSON out.

    python benchmarks/gpu_stage.py [--out benchmarks/results/gpu_stage.json]
    python benchmarks/gpu_stage.py --device cpu --layers 1 --seq_len 64 --micro_batch_size 1 --steps 1   # smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_stage.json"


FASTEST_FIRST = ("grouped_mm", "batched_mm", "eager")


def _arms(experts: list[str]) -> list[tuple[str, str, bool]]:
    """(experts, activation checkpointing, compiled) in the order they run: the compiled grouped GEMM first,
    then each implementation from the fastest."""
    ordered = sorted(experts, key=lambda e: FASTEST_FIRST.index(e) if e in FASTEST_FIRST else len(FASTEST_FIRST))
    arms = [("grouped_mm", c, True) for c in ("none", "full")] if "grouped_mm" in experts else []
    return arms + [(e, c, False) for e in ordered for c in ("none", "full")]


def _cannot_fit(experts: str, config, tokens: int, device) -> str | None:
    """Why an implementation cannot run at this size on `device`, or None."""
    if experts != "batched_mm":
        return None
    import torch

    gathered = tokens * config.num_experts_per_tok * config.hidden_size * 2 * config.moe_intermediate_size * 2
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if gathered <= memory:
        return None
    return (f"batched_mm gathers each token's experts' weights: at least {gathered / 2**30:.0f} GiB for the "
            f"gate/up projection ({tokens} tokens × top-{config.num_experts_per_tok}), over the "
            f"{memory / 2**30:.0f} GiB of the {device.type} device")


def _run_arm(args, experts: str, checkpointing: str, compiled: bool) -> dict:
    import torch
    from moe_2b_stage import middle_stage

    from hf_asyncpp.models.compile import compile_layers
    from hf_asyncpp.models.recompute import apply_activation_checkpointing
    from hf_asyncpp.utilization import active_parameters, attention_flops_per_token

    device = torch.device(args.device)
    config, stage = middle_stage(args.layers, device, experts)
    stage.to(torch.bfloat16)
    if compiled:  # what `compile_layers: true` does, before the checkpointing that wraps it
        compile_layers(stage, checkpointing)
    apply_activation_checkpointing(stage, checkpointing)
    hidden = torch.randn(args.micro_batch_size, args.seq_len, config.hidden_size, device=device,
                         dtype=torch.bfloat16, requires_grad=True)

    def step():
        out = stage(hidden)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens = args.micro_batch_size * args.seq_len
    achieved = (6 * active_parameters(stage.named_parameters(), config)
                + attention_flops_per_token(config, len(stage.model.layers), args.seq_len)) * tokens / seconds
    peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(step_s=seconds, tokens_per_s=tokens / seconds, tflops=achieved / 1e12,
                mfu=achieved / (args.peak_tflops * 1e12), peak_memory_gib=peak_memory and peak_memory / 2**30)


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--experts", default="eager,batched_mm,grouped_mm")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak_tflops", type=float, default=989.0)
    parser.add_argument("--max_minutes", type=float, default=7.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from moe_2b_stage import MOE_2B

    began = time.perf_counter()
    rows = []
    shapes = AutoConfig.from_pretrained(MOE_2B)
    for experts, checkpointing, compiled in _arms(args.experts.split(",")):
        row = dict(experts=experts, activation_checkpointing=checkpointing, compile=compiled)
        why = _cannot_fit(experts, shapes, args.micro_batch_size * args.seq_len, torch.device(args.device))
        if why is not None:
            row["skipped"] = why
        elif (time.perf_counter() - began) / 60 > args.max_minutes:
            row["skipped"] = f"over --max_minutes {args.max_minutes}"
        else:
            try:
                row.update(_run_arm(args, experts, checkpointing, compiled))
            except Exception as err:  # an arm that fails (OOM, an implementation this GPU lacks) is reported
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        rows.append(row)
        print(json.dumps(row), flush=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else args.device
    result = dict(setup=vars(args) | {"out": str(args.out), "device_name": device_name, "torch": torch.__version__},
                  rows=rows, minutes=(time.perf_counter() - began) / 60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'experts':12} {'ckpt':5} {'compile':7} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        if "step_s" in r:
            print(f"{r['experts']:12} {r['activation_checkpointing']:5} {str(r['compile']):7} {r['tokens_per_s']:10.0f} "
                  f"{r['tflops']:8.1f} {r['mfu']:6.3f} {r['peak_memory_gib'] or 0:9.1f}")
        else:
            print(f"{r['experts']:12} {r['activation_checkpointing']:5} {str(r['compile']):7} {r.get('error') or r.get('skipped')}")


if __name__ == "__main__":
    main()
