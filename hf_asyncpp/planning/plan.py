"""`hf-asyncpp plan`: each rank's peak device memory, measured by playing the real runtime on fake tensors.

For each pipeline rank of the layout, one process plays that rank: a fake process group of the real
world size (every collective and message returns at once, with no peer), fake tensors (shapes, dtypes
and every allocation real, no memory), and the engine the run would build — this rank's stages, the
compute policy, FSDP2 over dp, weight versions, optimizer, Error Feedback, activation checkpointing —
through start-up, three training steps of its schedule (the first one warms up: optimizer state
and receive buffers appear; the next two are steady) and an evaluation (where the order allows one
between steps). `MemoryTracker` follows every tensor it creates
and reports the peak of live bytes and what was live then; `HostReads` counts the host syncs (reads of
tensor values by the host, and blocking uploads) through the steady steps, and those made inside a
microbatch's compute. dp replicas of a stage hold the same amounts: one is played.

Bytes do not depend on the device, so fake CPU tensors stand for GPU ones. What only a GPU shows is
outside the measurement and is kept free, item by item, when judging whether a rank fits (`ALLOWANCE`,
`allowance`): the CUDA context, kernels' workspaces, each NCCL communicator's buffers (the rank's own
count of them, played here too), and the caching allocator's fragmentation. Each item is an estimate
from published reports until a GPU run measures it (docs/scale.md, "The allowance").
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from collections import Counter

from .host_reads import HostReads, in_microbatch
from .memory_tracker import MemoryTracker

__all__ = ["ALLOWANCE", "KINDS", "allowance", "label_state", "named_temporaries", "overshoot", "plan_layout", "plan_rank",
           "planned_config", "table"]

# What a GPU rank holds beyond its tensors (GiB, or a share of the rank's peak). The CUDA context with
# every module of torch's kernels loaded at start-up (CUDA_MODULE_LOADING=EAGER: parallel/launch.py):
# reported 0.5-1 GiB. Workspaces: cuBLAS / cuBLASLt per stream, attention's and the grouped GEMM's.
# NCCL: every communicator connects all its channels at start-up (NCCL_RUNTIME_CONNECT=0), so nothing
# connects mid-run; reported 0.5-1.6 GiB per communicator within a node, more with NVLS. Fragmentation
# of the caching allocator with expandable segments, as a share of the peak.
ALLOWANCE = {"cuda_context_gib": 1.0, "workspaces_gib": 0.5, "nccl_per_communicator_gib": 0.75, "fragmentation": 0.05}
GiB = 2**30
STEPS = 3  # one to warm up, two steady
# The kinds of a rank's memory at its peak, in the order they are reported.
KINDS = ("parameter", "weight_version", "compute_copy", "gradient", "optimizer_state", "ef_buffer",
         "receive_buffer", "activation", "temporary")


def label_state(tracker: MemoryTracker, held: dict[str, list]) -> None:
    """Name every kind of state a rank holds now (memory.held_tensors; called while it runs, as often as
    it helps); parameters last: a master is also one of its version buffers."""
    for kind in sorted(held, key=lambda kind: kind == "parameter"):
        tracker.label(held[kind], kind)


def _hooks(tracker: MemoryTracker, engine) -> list:
    """Label state at each stage forward and each optimizer step; mark forwards (activations)."""
    def enter(*_):
        tracker.in_forward += 1
        label_state(tracker, engine.executor.held_tensors())

    def leave(*_):
        tracker.in_forward -= 1

    handles = []
    for module in engine.executor.modules:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    for updater in engine.executor.updaters:
        label = lambda *_: label_state(tracker, engine.executor.held_tensors())  # noqa: E731
        handles += [updater.optimizer.register_step_pre_hook(label), updater.optimizer.register_step_post_hook(label)]
    return handles


def plan_rank(config, model_config, world_size: int, rank: int) -> dict:
    """Play `rank` of a `world_size` layout of `config` on fake tensors: its peak and host reads."""
    from ..torch_internals import FakeTensorMode, fake_store, unset_fake_temporarily

    from ..engine import PipelineEngine
    from ..models.fake_kernels import register_fake_kernels
    from ..parallel.launch import LaunchInfo
    from ..parallel.mesh import device_communicators, init_parallel, shutdown_parallel

    register_fake_kernels()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        layout = init_parallel(LaunchInfo(world_size, rank, rank, launched=True), config.pp_size)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        tracker, reads = MemoryTracker(fake_mode), HostReads()
        m, rows = config.n_microbatches, config.micro_batch_size * config.n_microbatches
        with fake_mode, tracker, reads:
            engine = PipelineEngine(config, model_config, layout)
            handles = _hooks(tracker, engine)
            with unset_fake_temporarily():  # the loader's rows: host memory, moved to the device by the engine
                tokens = torch.zeros(rows, config.seq_len, dtype=torch.long)
            per_step = []
            for step in range(STEPS):
                reads.take()
                engine.train_step(tokens, tokens if engine.forwards_ahead else None)
                per_step.append(reads.take())
            # An evaluation between steps, as a run makes every eval_steps (its own stages and buffers).
            if engine.evaluates_mid_run:
                engine.eval_step(tokens)
            eval_reads = reads.take() if engine.evaluates_mid_run else None
            label_state(tracker, engine.executor.held_tensors())
            for handle in handles:
                handle.remove()
        steady = per_step[1:]
        parts = tracker.peak_parts()
        sites = sorted({r.site for s in steady for r in s})
        return {
            "rank": rank, "pp_rank": layout.pp_rank, "dp_rank": layout.dp_rank, "stages": engine.executor.stage_ids,
            "peak_bytes": tracker.peak_bytes,
            **{f"{kind}_bytes": parts.get(kind, 0) for kind in KINDS},
            "temporary_bytes_by_operator": tracker.peak_temporaries(),
            "syncs_per_step": max(len(s) for s in steady),
            # inside a microbatch's forward, backward or loss (m of them a step)
            "syncs_per_microbatch": max(sum(in_microbatch(r.stack) for r in s) for s in steady) / m,
            "uploads_per_step": max(sum(r.kind.startswith("upload") for r in s) for s in steady),
            "sync_sites": {site: max(Counter(r.site for r in s)[site] for s in steady) for site in sites},
            "syncs_per_evaluation": None if eval_reads is None else len(eval_reads),
            "nccl_communicators": device_communicators(layout),
        }
    finally:
        shutdown_parallel(peers_alive=False)  # no peers to wait for: destroys the fake groups


def planned_config(config):
    """The run as a GPU would make it: the compute dtype `auto` picks there, no weights read (they
    take the same bytes as initialized ones)."""
    from ..parallel.fsdp import compute_dtype

    dtype = compute_dtype(config.mixed_precision, torch.device("cuda"), config.fsdp)
    return replace(config, mixed_precision="bf16" if dtype == torch.bfloat16 else "no", init_from=None)


def plan_layout(config, model_config, world_size: int, processes: int = 2) -> list[dict]:
    """Every rank's plan (dp replicas of a stage copy the one played), in rank order; pipeline ranks
    are played in `processes` fresh processes at a time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    config = planned_config(config)
    dp = world_size // config.pp_size
    # torch keeps process groups and meshes in module state: one rank per process.
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        futures = {pp: pool.submit(plan_rank, config, model_config, world_size, pp * dp)
                   for pp in range(config.pp_size)}
        played = {pp: future.result() for pp, future in futures.items()}
    return [dict(played[r // dp], rank=r, dp_rank=r % dp) for r in range(world_size)]


def allowance(rank: dict, items: dict = ALLOWANCE) -> dict[str, float]:
    """What `rank` (a plan_rank record) keeps free beyond its peak, item by item, and in all (GiB)."""
    parts = {"cuda context": items["cuda_context_gib"], "workspaces": items["workspaces_gib"],
             "nccl": items["nccl_per_communicator_gib"] * rank["nccl_communicators"],
             "fragmentation": items["fragmentation"] * rank["peak_bytes"] / GiB}
    return parts | {"total": sum(parts.values())}


def overshoot(ranks: list[dict], gpu_memory_gib: float, allowance_gib: float | None = None) -> str | None:
    """One line naming the rank that exceeds a `gpu_memory_gib` GPU the most (after its allowance for
    what the plan does not measure: `allowance`, or `allowance_gib` for every rank), or None when every
    rank fits."""
    def kept(rank):
        return allowance_gib if allowance_gib is not None else allowance(rank)["total"]

    worst = max(ranks, key=lambda r: r["peak_bytes"] / GiB + kept(r))
    over = worst["peak_bytes"] / GiB + kept(worst) - gpu_memory_gib
    if over <= 0:
        return None
    parts = ("" if allowance_gib is not None else " (" + ", ".join(
        f"{name} {gib:.1f}" for name, gib in allowance(worst).items() if name != "total") + ")")
    return (f"rank {worst['rank']} (pp rank {worst['pp_rank']}, stages {worst['stages']}) peaks at "
            f"{worst['peak_bytes'] / GiB:.1f} GiB, {over:.1f} GiB over a {gpu_memory_gib:g} GiB GPU after "
            f"{kept(worst):.1f} GiB kept for what the plan cannot see{parts}")


def named_temporaries(ranks: list[dict], shown: int = 3) -> list[str]:
    """One line per pipeline rank: the operators whose outputs make up its "temporary" column at the
    peak, largest first (what is neither labelled state nor a forward's activations)."""
    lines = []
    for r in (r for r in ranks if r["dp_rank"] == 0):
        top = list(r["temporary_bytes_by_operator"].items())[:shown]
        if top:
            lines.append(f"pp rank {r['pp_rank']} temporaries at its peak: "
                         + ", ".join(f"{op} {size / GiB:.2f}" for op, size in top) + " GiB")
    return lines


def table(ranks: list[dict]) -> str:
    """Markdown: one row per pipeline rank (its dp replicas hold the same), GiB."""
    shown = [r for r in ranks if r["dp_rank"] == 0]
    head = ["pp rank", "stages", "peak GiB", *(k.replace("_", " ") for k in KINDS), "syncs / step",
            "syncs / microbatch", "NCCL comms", "allowance GiB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in shown:
        cells = [str(r["pp_rank"]), ",".join(map(str, r["stages"])), f"{r['peak_bytes'] / GiB:.2f}",
                 *(f"{r[f'{k}_bytes'] / GiB:.2f}" for k in KINDS), str(r["syncs_per_step"]),
                 f"{r['syncs_per_microbatch']:g}", str(r["nccl_communicators"]), f"{allowance(r)['total']:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
