"""Optimizer step time, with and without Error Feedback, next to a forward + backward step.

Setup: the "tiny-moe" preset (random init) as one HF model on one process, one torch thread, a
minibatch of --microbatches × 8 rows × 128 tokens (gradient accumulation, as a pipeline step does).
Arms: every registered optimizer, each plain and wrapped in Error Feedback (λ = 1), all timed in
this one process on the same gradients, interleaved round by round so that drift of the machine
hits every arm alike. An optimizer's own warm-up (state allocation; SOAP's first eigendecomposition)
is excluded; SOAP's periodic eigenbasis refresh (every 10 updates) falls inside the measured
updates in its due proportion when --updates is a multiple of 10.

Reported per arm: mean update ms; update / (forward + backward); the whole step (forward + backward
+ update) relative to AdamW's; for the EF arm, what EF adds to the whole step.

    python benchmarks/optimizer_cost.py [--updates 20] [--rounds 3] [--out benchmarks/results/optimizer_cost.json]
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

PRESET, SEQ_LEN, MBS = "tiny-moe", 128, 8
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "optimizer_cost.json"
LEARNING_RATE = {"sgd": 0.1, "adamw": 1e-3, "muon": 2e-2, "soap": 1e-3, "lion": 1e-4}


def _forward_backward_ms(model, rows, microbatches: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for mb in rows.chunk(microbatches):
            (model(input_ids=mb, labels=mb).loss / microbatches).backward()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20, help="measured updates per arm and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.models.presets import build_config
    from hf_asyncpp.optim import OPTIMIZER_NAMES, build_optimizer
    from hf_asyncpp.optim.error_feedback import ErrorFeedback

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = build_config(PRESET)
    model = AutoModelForCausalLM.from_config(config).train()
    n_params = sum(p.numel() for p in model.parameters())
    rows = torch.randint(0, config.vocab_size, (args.microbatches * MBS, SEQ_LEN))
    _forward_backward_ms(model, rows, args.microbatches, 1)  # warm-up
    fwd_bwd_ms = _forward_backward_ms(model, rows, args.microbatches, 5)
    gradients = [p.grad.clone() for p in model.parameters()]  # every arm steps on these

    arms = {}
    for name in OPTIMIZER_NAMES:
        for ef in (False, True):
            copy = AutoModelForCausalLM.from_config(config)
            copy.load_state_dict(model.state_dict())
            optimizer = build_optimizer(name, copy.named_parameters(), LEARNING_RATE[name], 0.9, 0.95, 0.01)
            stepper = ErrorFeedback(optimizer, 1.0) if ef else optimizer
            params = list(copy.parameters())
            for p, g in zip(params, gradients):
                p.grad = g.clone()
            stepper.step()  # state allocation, SOAP's first eigendecomposition
            arms[(name, ef)] = dict(stepper=stepper, times=[])

    for _ in range(args.rounds):
        for arm in arms.values():
            start = time.perf_counter()
            for _ in range(args.updates):
                arm["stepper"].step()
            arm["times"].append(1e3 * (time.perf_counter() - start) / args.updates)

    adamw_step = fwd_bwd_ms + statistics.mean(arms[("adamw", False)]["times"])
    rows_out = []
    for (name, ef), arm in arms.items():
        update_ms = statistics.mean(arm["times"])
        row = dict(optimizer=name, ef=ef, update_ms=update_ms, update_over_fwd_bwd=update_ms / fwd_bwd_ms,
                   step_vs_adamw=(fwd_bwd_ms + update_ms) / adamw_step)
        if ef:
            plain = statistics.mean(arms[(name, False)]["times"])
            row["ef_adds_to_step"] = (update_ms - plain) / (fwd_bwd_ms + plain)
        rows_out.append(row)

    result = dict(
        setup=dict(preset=PRESET, parameters=n_params, seq_len=SEQ_LEN, micro_batch_size=MBS,
                   microbatches=args.microbatches, updates=args.updates, rounds=args.rounds, threads=1,
                   torch=torch.__version__, machine=platform.processor() or platform.machine(),
                   cpus=os.cpu_count()),
        forward_backward_ms=fwd_bwd_ms,
        arms=rows_out,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"tiny-moe ({n_params / 1e6:.1f}M parameters), forward + backward of {args.microbatches}×{MBS}×{SEQ_LEN} "
          f"tokens: {fwd_bwd_ms:.0f} ms\n")
    print("| optimizer | EF | update ms | update / fwd+bwd | step vs AdamW | EF adds to step |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows_out:
        ef_cost = f"{100 * row['ef_adds_to_step']:+.1f}%" if row["ef"] else ""
        print(f"| {row['optimizer']} | {'λ=1' if row['ef'] else 'off'} | {row['update_ms']:.1f} | "
              f"{row['update_over_fwd_bwd']:.3f} | {row['step_vs_adamw']:.2f}× | {ef_cost} |")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
