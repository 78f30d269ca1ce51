"""The data path's speed per rank beside what a training step needs, and what it leaves on the step's
critical path, with and without read-ahead.

Setup: the offline Shakespeare corpus (`shakespeare` registry package) written as a jsonl file of one
paragraph per row (~40k documents, as a web corpus has many short ones), the built-in 8192-token
tokenizer, seq_len 128 (`--seq-len`), 32 rows a step (`--rows-per-step`: micro_batch_size 8 × 4
microbatches), one process, one torch thread, datasets' cache in a fresh temporary directory.
Measured:
  - map-style: the first load (read, tokenize through the cached `datasets.map`, pack) and a second
    load (from the cache), in tokens/s of the whole corpus;
  - streamed: `rows(step)` of `StreamingSampler` back to back (tokenize and pack on the fly), tokens/s;
  - prepared: `hf-asyncpp prepare-data` of the same paragraphs written as 4 files (`--prepare-copies`
    times over), with 1 and with 2 processes (`num_proc`), tokens/s of the preparation; then a run's `rows(step)` from the prepared
    shards, shuffled (random rows of the memory-mapped shards), tokens/s;
  - on the critical path: a loop that "trains" for `--step-ms` per step (torch matmuls standing for
    the step's compute) and asks for each step's rows, streamed, directly and through `Prefetcher`:
    the mean time per step spent waiting for rows;
  - the step's need: rows-per-step × seq_len tokens per `--step-ms`.

    python benchmarks/data_path.py [--seq-len 128] [--rows-per-step 32] [--step-ms 100] [--steps 40]
        [--prepare-copies 1] [--out benchmarks/results/data_path.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "data_path.json"


def _busy(seconds: float) -> None:
    """A step's compute: torch matmuls until `seconds` have passed. Like a training step's ops, they
    release the GIL while they run (a pure-Python busy wait would not, and would starve the read-ahead
    thread of it)."""
    import torch

    a = torch.randn(192, 192)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.mm(a, a).clamp_(-1, 1)


def _waits(sampler, steps: int, step_s: float) -> float:
    """Mean seconds a training loop waits for each step's rows when a step computes for `step_s`."""
    waits = []
    for step in range(steps):
        start = time.perf_counter()
        sampler.rows(step)
        waits.append(time.perf_counter() - start)
        _busy(step_s)
    return statistics.mean(waits[1:])  # the first request also opens the stream


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows-per-step", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prepare-copies", type=int, default=1,
                        help="the prepare-data corpus holds the paragraphs this many times (its start-up amortized)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="hf_asyncpp_data_path_")
    os.environ["HF_DATASETS_CACHE"] = cache  # before datasets is imported: a cold cache for the first load

    import torch

    torch.set_num_threads(1)
    from hf_asyncpp.data import BlockPacker, StreamingSampler, load_source, load_tokenizer
    from hf_asyncpp.data.prefetch import Prefetcher

    from hf_asyncpp.data import shakespeare_files

    corpus = os.path.join(cache, "paragraphs.jsonl")
    with open(corpus, "w") as f:
        for path in shakespeare_files():
            for paragraph in Path(path).read_text(encoding="utf-8", errors="replace").split("\n\n"):
                if paragraph.strip():
                    f.write(json.dumps({"text": paragraph}) + "\n")
    tokenizer = load_tokenizer("builtin")
    packer = BlockPacker(tokenizer, args.seq_len)
    timings = {}
    for name in ("map-style, first load", "map-style, from the cache"):
        start = time.perf_counter()
        blocks = packer.tensor(load_source(corpus), "corpus")
        timings[name] = (time.perf_counter() - start, blocks.numel())

    def stream():
        return StreamingSampler(load_source(corpus, streaming=True), packer, args.rows_per_step, 0, 1,
                                shuffle=False, seed=0, shuffle_window=1)  # unshuffled: the window is unused

    from hf_asyncpp.data import MinibatchSampler
    from hf_asyncpp.data.prepare import prepare_data
    from hf_asyncpp.data.prepared import PreparedBlocks

    lines = Path(corpus).read_text().splitlines(keepends=True)
    files = os.path.join(cache, "files")
    os.makedirs(files)
    for i in range(4):  # prepare-data works in parallel over a source's files
        part = "".join(lines[i * len(lines) // 4:(i + 1) * len(lines) // 4])
        Path(files, f"{i}.jsonl").write_text(part * args.prepare_copies)
    for num_proc in (1, 2):
        start = time.perf_counter()
        manifest = prepare_data(files, os.path.join(cache, f"prepared_{num_proc}"), "builtin", args.seq_len,
                                num_proc=num_proc)
        timings[f"prepare-data, {num_proc} process{'es' if num_proc > 1 else ''}"] = (
            time.perf_counter() - start, manifest["tokens"])
    mapped = MinibatchSampler(PreparedBlocks(os.path.join(cache, "prepared_2")), args.rows_per_step, 0, 1,
                              shuffle=True, seed=0)
    start = time.perf_counter()
    for step in range(args.steps):
        mapped.rows(step)
    timings["prepared shards, rows(step) back to back (shuffled)"] = (
        time.perf_counter() - start, args.steps * args.rows_per_step * args.seq_len)

    tokens_per_step = args.rows_per_step * args.seq_len
    sampler, start = stream(), time.perf_counter()
    for step in range(args.steps):
        sampler.rows(step)
    timings["streamed, rows(step) back to back"] = (time.perf_counter() - start, args.steps * tokens_per_step)

    step_s = args.step_ms / 1e3
    direct_wait = _waits(stream(), args.steps, step_s)
    prefetcher = Prefetcher(stream(), ahead=2)
    ahead_wait = _waits(prefetcher, args.steps, step_s)
    prefetcher.close()

    import datasets
    import transformers

    results = dict(
        rates={name: dict(seconds=s, tokens=n, tokens_per_s=n / s) for name, (s, n) in timings.items()},
        step_need_tokens_per_s=tokens_per_step / step_s,
        wait_ms_per_step=dict(direct=1e3 * direct_wait, prefetched=1e3 * ahead_wait),
        meta=dict(prepare_copies=args.prepare_copies, seq_len=args.seq_len, rows_per_step=args.rows_per_step, step_ms=args.step_ms, steps=args.steps,
                  torch=torch.__version__, transformers=transformers.__version__, datasets=datasets.__version__,
                  cpu_count=os.cpu_count(), machine=platform.machine(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nshakespeare paragraphs, seq_len {args.seq_len}, {args.rows_per_step} rows a step, one process\n")
    print("| data path | tokens/s | × a step's need |")
    print("|---|---:|---:|")
    for name, row in results["rates"].items():
        print(f"| {name} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / results['step_need_tokens_per_s']:.1f}× |")
    print(f"\na step of {args.step_ms:.0f} ms needs {results['step_need_tokens_per_s']:,.0f} tokens/s; waiting for "
          f"streamed rows per step: {results['wait_ms_per_step']['direct']:.1f} ms read when asked, "
          f"{results['wait_ms_per_step']['prefetched']:.2f} ms read ahead\nwrote {out}")


if __name__ == "__main__":
    main()
