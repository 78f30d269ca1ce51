"""Step times of two revisions of the package side by side: did a change (a refactor, say) move speed?

Each revision is checked out into a temporary git worktree and measured by its own copy of
`benchmarks/pipeline_schedules.py` (real pipelines: pp = 2 on 2 gloo ranks, one thread per rank, the
same synthetic rows; see that script) and by its own one-process emulation of an asynchronous
schedule (`training_scripts/train.py` with pp_size 1: the median of its logged `step_time_s` after
the first steps). The revisions alternate within each round (base, head; then head, base), so drift
in the machine's load reaches both alike; each number is the median over rounds, and the ratio
head / base is the median of the rounds' ratios.

    python benchmarks/revision_step_times.py --base REV [--head HEAD] [--schedules 1f1b,pipedream-2bw,pipedream]
        [--microbatches 4] [--steps 8] [--warmup 3] [--emulated-steps 30] [--rounds 3] [--seq-len N] [--micro-batch-size N]
        [--out benchmarks/results/revision_step_times.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "revision_step_times.json"
# The emulated arm: PipeDream-2BW at depth 2 with Muon and Error Feedback on one process, keys every
# revision since 544ee76 understands; measured steps skip the first `_SKIPPED`.
_EMULATED = ["--pp_size", "1", "--schedule", "pipedream-2bw", "--emulate_pp_size", "2", "--optimizer", "muon",
             "--learning_rate", "0.01", "--ef", "true", "--eval_fraction", "0", "--save_final", "false",
             "--report_to", "none", "--logging_steps", "1"]
_SKIPPED = 5


def _commit(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()


def _run(worktree: Path, command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(worktree), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, *command], cwd=worktree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {worktree}:\n{done.stderr[-3000:]}")


def _pipelines(worktree: Path, args, out: Path) -> dict[str, float]:
    """(schedule, m) → step ms of the revision's pipelines, one round."""
    sizes = [*(["--seq-len", str(args.seq_len)] if args.seq_len else []),
             *(["--micro-batch-size", str(args.micro_batch_size)] if args.micro_batch_size else [])]
    _run(worktree, ["benchmarks/pipeline_schedules.py", "--schedules", args.schedules, "--microbatches",
                    args.microbatches, "--steps", str(args.steps), "--warmup", str(args.warmup), *sizes, "--out", str(out)])
    return {f"{r['schedule']} m={r['n_microbatches']}": r["step_ms"] for r in json.loads(out.read_text())["results"]}


def _emulated(worktree: Path, args, out_dir: Path) -> dict[str, float]:
    """The one-process emulation's median step ms, one round."""
    _run(worktree, ["training_scripts/train.py", "--config", "training_scripts/configs/tiny_moe.yaml", *_EMULATED,
                    "--max_steps", str(args.emulated_steps), "--output_dir", str(out_dir)])
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > _SKIPPED]
    return {"pipedream-2bw emulated at depth 2": 1000 * statistics.median(times)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--schedules", default="1f1b,pipedream-2bw,pipedream")
    parser.add_argument("--microbatches", default="4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--emulated-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, help="passed to both revisions' pipeline_schedules.py (default: theirs)")
    parser.add_argument("--micro-batch-size", type=int, help="likewise")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    if args.emulated_steps <= _SKIPPED + 1 or args.rounds < 1:
        parser.error(f"--emulated-steps must exceed {_SKIPPED + 1}, --rounds be at least 1")
    commits = {"base": _commit(args.base), "head": _commit(args.head)}
    start = time.perf_counter()
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="revision_step_times_") as tmp:
        trees = {name: Path(tmp) / name for name in commits}
        for name, commit in commits.items():
            subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(trees[name]), commit], cwd=REPO, check=True)
        try:
            for index in range(args.rounds):
                measured = {}
                for name in ("base", "head") if index % 2 == 0 else ("head", "base"):
                    work = Path(tmp) / f"round{index}_{name}"
                    work.mkdir()
                    measured[name] = {**_pipelines(trees[name], args, work / "pipelines.json"),
                                      **_emulated(trees[name], args, work / "emulated")}
                    print(f"round {index + 1} {name}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in measured[name].items()),
                          flush=True)
                rounds.append(measured)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    arms = list(rounds[0]["base"])
    results = [dict(arm=arm, base_ms=statistics.median(r["base"][arm] for r in rounds),
                    head_ms=statistics.median(r["head"][arm] for r in rounds),
                    head_over_base=statistics.median(r["head"][arm] / r["base"][arm] for r in rounds),
                    ratio_range=[min(r["head"][arm] / r["base"][arm] for r in rounds),
                                 max(r["head"][arm] / r["base"][arm] for r in rounds)]) for arm in arms]
    import torch

    meta = dict(base=args.base, base_commit=commits["base"], head=args.head, head_commit=commits["head"],
                rounds=args.rounds, pipeline_steps=args.steps, pipeline_warmup=args.warmup,
                emulated_steps=args.emulated_steps, emulated_skipped=_SKIPPED, torch=torch.__version__,
                cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results, rounds=rounds), indent=1) + "\n")
    print(f"\n{args.base} ({commits['base'][:7]}) against {args.head} ({commits['head'][:7]}), median of "
          f"{args.rounds} alternating rounds\n")
    print("| arm | base step ms | head step ms | head / base (median, range over rounds) |")
    print("|---|---:|---:|---:|")
    for r in results:
        low, high = r["ratio_range"]
        print(f"| {r['arm']} | {r['base_ms']:.0f} | {r['head_ms']:.0f} | {r['head_over_base']:.3f} ({low:.3f}–{high:.3f}) |")
    print(f"\nwrote {out}; total {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
