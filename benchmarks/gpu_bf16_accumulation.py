"""bf16 compute, fp32 gradient accumulation: an asynchronous stage's summed gradient vs a bf16 sum.

Setup: one HF Qwen3 MLP block (SwiGLU: gate/up/down projections, Llama-8B-like sizes on CUDA,
smaller on CPU) followed by an RMSNorm that stays fp32 (as `_keep_in_fp32_modules_strict` modules
do), wrapped in `VersionedStage` with bf16 compute copies. m microbatches (default 8) run forward and
backward on one version buffer; `move_gradients_to_master(buffer, 1/m)` then gives the master's fp32
gradient. Each microbatch's bf16 gradient is also computed on its own, outside VersionedStage, and
summed three ways: in fp64 (exact for these bf16 values), in fp32 and in bf16 (microbatch order,
what an accumulator of that dtype holds; the bf16 one is what autograd's `.grad` accumulation of a
bf16 compute copy gives). Reported per parameter and overall: max |error| and max |error| / max
|exact| of the stage's gradient and of the bf16 sum against the fp64 sum, the stage's error against
the fp32 sum (0 when it adds the same values in the same order), the accumulator dtype and bytes, the
device, and the time of the m forward + backward passes with the fp32 accumulator next to the same
passes accumulating in the bf16 `.grad` (interleaved, `--repeats` rounds).

    python benchmarks/gpu_bf16_accumulation.py [--microbatches 8] [--hidden 4096] [--intermediate 14336]
        [--tokens 4096] [--repeats 3] [--out benchmarks/results/gpu_bf16_accumulation.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_bf16_accumulation.json"
# (hidden, intermediate, tokens per microbatch): Llama-3-8B's MLP on a GPU; a quarter width on CPU.
SIZES = {"cuda": (4096, 14336, 4096), "cpu": (1024, 3584, 512)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--tokens", type=int, help="tokens per microbatch")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per arm")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch
    from torch import nn
    from torch.func import functional_call
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    from hf_asyncpp.update.versions import VersionedStage

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hidden, intermediate, tokens = (a or d for a, d in zip((args.hidden, args.intermediate, args.tokens),
                                                           SIZES[device.type]))
    m = args.microbatches

    class Block(nn.Module):
        fp32_patterns = ("norm",)

        def __init__(self):
            super().__init__()
            config = Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu")
            self.mlp, self.norm = Qwen3MLP(config), Qwen3RMSNorm(hidden)

        def forward(self, x):
            return self.norm(self.mlp(x.to(self.mlp.down_proj.weight.dtype)).float())

    def loss_of(out):
        return out.pow(2).mean()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    block = Block().to(device)
    for p in block.parameters():  # a trained-looking RMSNorm scale, not all ones
        if p.dim() == 1:
            nn.init.normal_(p, 1.0, 0.1)
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [torch.randn(tokens, hidden, device=device, generator=gen) for _ in range(m)]
    names = [n for n, _ in block.named_parameters()]

    def bf16_leaves():
        return {n: p.detach().to(torch.float32 if n.startswith("norm") else torch.bfloat16).requires_grad_()
                for n, p in block.named_parameters()}

    # Each microbatch's bf16 gradient on its own (the per-microbatch values every accumulator adds).
    per_microbatch = []
    for x in xs:
        leaves = bf16_leaves()
        loss_of(functional_call(block, leaves, (x,))).backward()
        per_microbatch.append({n: leaves[n].grad for n in names})

    def summed(grads, dtype):
        out = {}
        for n in names:
            total = grads[0][n].to(dtype)
            for g in grads[1:]:
                total = total + g[n].to(dtype)
            out[n] = total.double() / m
        return out

    exact, fp32_sum, bf16_sum = (summed(per_microbatch, dtype) for dtype in (torch.float64, torch.float32, torch.bfloat16))
    del per_microbatch

    stage = VersionedStage(block, n_buffers=1, compute_dtype=torch.bfloat16)
    stage.active = 0
    for x in xs:
        loss_of(stage(x)).backward()
    sums = stage.gradient_sums(0)
    accumulator = dict(dtypes=sorted({str(t.dtype) for t in sums.values()}),
                       bytes=sum(t.numel() * t.element_size() for t in sums.values()),
                       compute_copy_grad_left=any(t.grad is not None for n, t in stage.compute_copy(0).items()
                                                  if n in sums))
    stage.move_gradients_to_master(0, 1.0 / m)
    ours = {n: p.grad.double() for n, p in block.named_parameters()}

    def errors(grads, reference):
        rows = {}
        for n in names:
            diff = (grads[n] - reference[n]).abs().max().item()
            rows[n] = dict(max_abs=diff, max_rel=diff / reference[n].abs().max().item())
        return dict(max_abs=max(r["max_abs"] for r in rows.values()),
                    max_rel=max(r["max_rel"] for r in rows.values()), per_parameter=rows)

    # Time: m forward + backward with the fp32 accumulator (VersionedStage) vs accumulating in the
    # bf16 `.grad` of plain bf16 leaves, interleaved round by round.
    def with_fp32_accumulator():
        for x in xs:
            loss_of(stage(x)).backward()
        stage.move_gradients_to_master(0, 1.0 / m)

    plain = bf16_leaves()

    def with_bf16_grad():
        for x in xs:
            loss_of(functional_call(block, plain, (x,))).backward()
        for n in names:
            block.get_parameter(n).grad = plain[n].grad.float().mul_(1.0 / m)
            plain[n].grad = None

    times = {"fp32_accumulator": [], "bf16_grad": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        for arm, run in (("fp32_accumulator", with_fp32_accumulator), ("bf16_grad", with_bf16_grad)):
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[arm].append(1e3 * (time.perf_counter() - start))
    ms = {arm: statistics.mean(t[1:]) for arm, t in times.items()}

    result = dict(
        setup=dict(device=torch.cuda.get_device_name() if device.type == "cuda" else
                   (platform.processor() or platform.machine()),
                   device_type=device.type, hidden=hidden, intermediate=intermediate, tokens_per_microbatch=tokens,
                   microbatches=m, parameters=sum(p.numel() for p in block.parameters()),
                   torch=torch.__version__, repeats=args.repeats),
        accumulator=accumulator,
        stage_vs_exact=errors(ours, exact),
        stage_vs_fp32_sum=errors(ours, fp32_sum),
        bf16_sum_vs_exact=errors(bf16_sum, exact),
        fp32_sum_vs_exact=errors(fp32_sum, exact),
        forward_backward_ms=ms,
        forward_backward_ms_per_round={arm: t[1:] for arm, t in times.items()},
        fp32_accumulator_time_ratio=ms["fp32_accumulator"] / ms["bf16_grad"],
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    s = result["setup"]
    print(f"{s['device']} ({s['device_type']}): Qwen3 MLP {hidden}→{intermediate}→{hidden} + fp32 RMSNorm, "
          f"{s['parameters'] / 1e6:.1f}M parameters, {m} microbatches × {tokens} tokens, bf16 compute\n")
    print(f"accumulator dtype {', '.join(accumulator['dtypes'])}, {accumulator['bytes'] / 2**20:.1f} MiB; "
          f"bf16 .grad left on the compute copy: {accumulator['compute_copy_grad_left']}\n")
    print("| gradient (mean over microbatches) | vs | max abs error | max rel error |")
    print("|---|---|---:|---:|")
    for label, key in (("VersionedStage (fp32 accumulator)", "stage_vs_exact"),
                       ("VersionedStage (fp32 accumulator)", "stage_vs_fp32_sum"),
                       ("fp32 sum", "fp32_sum_vs_exact"), ("bf16 sum (bf16 .grad)", "bf16_sum_vs_exact")):
        vs = "fp32 sum" if key == "stage_vs_fp32_sum" else "exact (fp64) sum"
        print(f"| {label} | {vs} | {result[key]['max_abs']:.3e} | {result[key]['max_rel']:.3e} |")
    print(f"\n{m} × forward + backward (+ move to master): fp32 accumulator {ms['fp32_accumulator']:.1f} ms, "
          f"bf16 .grad {ms['bf16_grad']:.1f} ms ({result['fp32_accumulator_time_ratio']:.3f}×)")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
