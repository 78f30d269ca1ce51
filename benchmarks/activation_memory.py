"""Activation memory and step time of one pipeline stage under each activation_checkpointing mode.

Setup: a middle stage (no embeddings, no LM head) of `moe_2b`'s layer shapes (training_scripts/models/
moe_2b: hidden 1024, 64 experts top-8, expert width 384, 16 heads), `--layers` decoder layers, fp32 on
this CPU, one microbatch of `--micro_batch_size` × `--seq_len` tokens. Per mode: the bytes autograd
keeps for the backward after the forward (saved tensors, each storage counted once, the stage's
weights excluded), the same × pp for the first stage of PipeDream-2BW (which holds up to pp
microbatches in flight), and the median forward + backward time over `--repeats` runs (the recompute
cost). The arms run side by side in one process.

    python benchmarks/activation_memory.py [--layers 2 --seq_len 512 --micro_batch_size 2 --pp 4]
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
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "activation_memory.json"
MODES = ("none", "selective", "full")


def _stage(n_layers: int, mode: str):
    from moe_2b_stage import middle_stage

    from hf_asyncpp.models.recompute import apply_activation_checkpointing

    config, stage = middle_stage(n_layers)
    apply_activation_checkpointing(stage, mode)
    return config, stage


def _measure(stage, hidden, repeats: int) -> tuple[int, float]:
    import torch

    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(hidden)
    saved = sum(storages.values())
    (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    times = []
    for _ in range(repeats):
        stage.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = stage(hidden)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
        times.append(time.perf_counter() - start)
    return saved, statistics.median(times)


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--micro_batch_size", type=int, default=2)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for mode in MODES:
        config, stage = _stage(args.layers, mode)
        hidden = torch.randn(args.micro_batch_size, args.seq_len, config.hidden_size, requires_grad=True)
        saved, seconds = _measure(stage, hidden, args.repeats)
        rows.append(dict(mode=mode, saved_bytes=saved, first_stage_2bw_bytes=saved * args.pp, step_s=seconds))
    base = rows[0]
    for row in rows:
        row["saved_vs_none"] = row["saved_bytes"] / base["saved_bytes"]
        row["time_vs_none"] = row["step_s"] / base["step_s"]
    result = dict(setup=vars(args) | {"out": str(args.out), "shapes": "moe_2b layers", "dtype": "fp32", "device": "cpu"},
                  rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':10} {'saved MiB':>10} {'2BW stage 0 MiB':>16} {'vs none':>8} {'fwd+bwd s':>10} {'time vs none':>13}")
    for r in rows:
        print(f"{r['mode']:10} {r['saved_bytes'] / 2**20:10.1f} {r['first_stage_2bw_bytes'] / 2**20:16.1f} "
              f"{r['saved_vs_none']:8.2f} {r['step_s']:10.3f} {r['time_vs_none']:13.2f}")


if __name__ == "__main__":
    main()
