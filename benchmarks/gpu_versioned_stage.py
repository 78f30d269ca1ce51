"""One versioned PipeDream-2BW stage on one GPU, as a pipeline rank runs it: ms per microbatch, MFU, peak
memory beside the plan's prediction for the same loop, and host syncs.

Setup (defaults: `training_scripts/configs/moe_10b.yaml`, stage 0): the stage `plan_stages(config, pp_size)`
cuts (for moe_10b at pp 8: the embeddings and decoder layers 0-2), built on the device by
`models/construct.build_stages` with its seeded init, wrapped in `VersionedStage` as the engine wraps an
asynchronous stage: fp32 master, `order.n_buffers` weight versions, bf16 compute copies and fp32 gradient
sums. The loop plays the stage's own actions of the schedule's order (`order.segment` of the rank that
holds the stage: at pp 8 stage 0 forwards 8 microbatches ahead of their backwards), binding each
forward to its version's buffer as the asynchronous runtime does (`versioned.active = buffer`), on
micro_batch_size × seq_len random tokens; each backward takes its output gradients from one of
`order.n_slots` receive buffers, as a stage's backward receives them. Where the order says the stage
updates (after a minibatch's last backward), the update runs as the engine's `_update_stage` /
`_apply_stage_update`: gradients moved to the master (× 1/m), the norm read, clipped, the config's
optimizer (Muon + Error Feedback for moe_10b) stepped into the next version's buffer, published. Step 0
fills the pipeline and makes the optimizer state; the steps after it are timed (`--steps`, default 2).
No communication is played: one GPU, dp 1 (the run's dp 4 would shard master, versions, gradients and
optimizer state 4 ways), and the update clips by the stage's own norm (the global norm's all-reduce
needs the other stages).

Measured, over the timed steps: forward and backward of every microbatch and each update, with CUDA events;
ms per microbatch = (Σ forward + Σ backward) / microbatches; MFU = model FLOPs / time / peak, with model
FLOPs per token = 6 × N + 12 × L × (n_heads × head_dim) × seq_len, N the stage's parameters a token touches
(attention projections, norms and router whole, the routed experts' top_k / E of theirs, the embedding
lookup none), L its decoder layers (PaLM's count: causal attention counted whole, no recomputation), and
peak 989 TFLOP/s (H100 and H200 SXM bf16 dense, picked by the device's name; `--peak-tflops` otherwise).
Peak memory is `torch.cuda.max_memory_allocated` over the whole run (the stage built, the steps, the
updates). Host syncs: `torch.cuda.set_sync_debug_mode("warn")` through the timed steps, warnings counted
per microbatch (forward and backward) and per update.

The prediction: the same loop played on fake tensors on the CPU (`--plan`: FakeTensorMode, shapes and
every allocation real, no memory) under `planning/memory_tracker.MemoryTracker`, its peak of live bytes
and what was live then, with host reads counted by `planning/host_reads.HostReads`. Stored in
`benchmarks/results/gpu_versioned_stage_plan.json`, which a GPU run prints beside its measurement (for
the same setup only). What a GPU adds and a plan does not see: the allocator's rounding, kernels'
workspaces (cuBLAS), and whatever a kernel allocates for itself.

    python benchmarks/gpu_versioned_stage.py [--out benchmarks/results/gpu_versioned_stage.json]
    python benchmarks/gpu_versioned_stage.py --plan     # the prediction, on fake tensors (CPU, ~1 min)
    python benchmarks/gpu_versioned_stage.py --device cpu --layers 1 --seq-len 128   # smoke (moe_10b's
        # widths: ~15 GB of memory); add --model-config tiny-moe --microbatches 4 for a seconds-long one
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before any HF import
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse
import json
import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "training_scripts/configs/moe_10b.yaml"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_versioned_stage.json"
DEFAULT_PLAN = ROOT / "benchmarks" / "results" / "gpu_versioned_stage_plan.json"
GiB = 2**30
# What the prediction must share with a measurement to stand beside it.
# moe_10b's stage 0 holds the embeddings and layers 0-2; with its first two layers the loop plans 48.4 GiB
# (benchmarks/results/gpu_versioned_stage_plan.json), with all three 69.3: more than an 80 GiB card's 90%
# less the CUDA context and workspaces (0.9 × 79.6 − 1.5 = 70.1 GiB on an H100), too close to fit for sure.
DEFAULT_LAYERS = 2
SETUP_KEYS = ("config", "model_config", "stage", "layers", "seq_len", "micro_batch_size", "microbatches",
              "pp_size", "steps", "schedule", "optimizer", "ef", "compute_dtype")


def _path(name: str) -> str:
    """A repository path as given, or from the repository root when run elsewhere."""
    return name if os.path.exists(name) or not (ROOT / name).exists() else str(ROOT / name)


def flops_per_token(stage, config, seq_len: int) -> float:
    """Model FLOPs per token of the stage (hf_asyncpp/utilization.py's count)."""
    from hf_asyncpp.utilization import active_parameters, attention_flops_per_token

    return 6 * active_parameters(stage.named_parameters(), config) + attention_flops_per_token(
        config, len(stage.model.layers), seq_len)


def _setup(args) -> tuple:
    """(the run's config, the model config, the stage plan, the stage's layers, the setup record)."""
    from hf_asyncpp.config import load_config
    from hf_asyncpp.models import StagePlan, build_config, plan_stages

    config = load_config(_path(args.config))
    model_config = build_config(_path(args.model_config or config.model_config))
    plan = plan_stages(model_config, config.pp_size, config.stage_balance, config.stage_boundaries)
    layers = plan[args.stage]
    if args.layers:  # the stage's first layers only (a smoke test)
        layers = range(layers.start, layers.start + min(args.layers, len(layers)))
        plan = StagePlan(layers if s == args.stage else r for s, r in enumerate(plan))
    setup = dict(config=args.config, model_config=args.model_config or config.model_config, stage=args.stage,
                 layers=[layers.start, layers.stop - 1], seq_len=args.seq_len or config.seq_len,
                 micro_batch_size=args.micro_batch_size or config.micro_batch_size,
                 microbatches=args.microbatches or config.n_microbatches, pp_size=config.pp_size, steps=args.steps,
                 schedule=config.schedule, optimizer=config.optimizer, ef=config.ef, compute_dtype="bf16")
    return config, model_config, plan, layers, setup


class _Clock:
    """Marks on the device's timeline: CUDA events (nothing waits), the wall clock on a CPU, none on
    fake tensors."""

    def __init__(self, kind: str):
        import torch

        self.kind, self.torch = kind, torch

    def mark(self):
        if self.kind == "cuda":
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter() if self.kind == "cpu" else None

    def ms(self, start, end) -> float | None:
        if self.kind == "cuda":
            return start.elapsed_time(end)
        return (end - start) * 1000 if self.kind == "cpu" else None


def _play(args, config, model_config, plan, device, clock: _Clock, tracker=None) -> dict:
    """Build the stage and play its actions for `args.steps` steps; what was timed and counted."""
    import dataclasses

    import torch
    from hf_asyncpp.torch_internals import FORWARD

    from hf_asyncpp.models.construct import build_stages
    from hf_asyncpp.models.compile import compile_layers
    from hf_asyncpp.models.recompute import apply_activation_checkpointing
    from hf_asyncpp.parallel.fsdp import reduce_dtype
    from hf_asyncpp.memory import held_tensors
    from hf_asyncpp.planning.plan import label_state
    from hf_asyncpp.schedules import get_schedule_spec
    from hf_asyncpp.update.gradients import GradientNorms
    from hf_asyncpp.update.held import HeldNorms
    from hf_asyncpp.update.report import StepReport
    from hf_asyncpp.update.rule import UpdateRule
    from hf_asyncpp.update.stage import StageUpdate
    from hf_asyncpp.update.updater import Updater
    from hf_asyncpp.update.versions import VersionedStage

    spec = get_schedule_spec(config.schedule)
    order, pp, stage_index = spec.order, config.pp_size, args.stage
    if order is None:
        raise SystemExit(f"schedule '{config.schedule}' is synchronous: this benchmark plays an asynchronous stage")
    m = args.microbatches or config.n_microbatches
    mbs, seq = args.micro_batch_size or config.micro_batch_size, args.seq_len or config.seq_len
    rank = next(r for r in range(pp) if stage_index in spec.stage_indices(pp, r))
    dtype = torch.bfloat16
    config = dataclasses.replace(config, n_microbatches=m)  # what the updater reads of it

    module = build_stages(model_config, plan, [stage_index], device, config.seed)[0]
    if config.compile_layers:  # first: the checkpoint wraps the compiled forward (engine.py)
        compile_layers(module, config.activation_checkpointing)
    apply_activation_checkpointing(module, config.activation_checkpointing)
    n_buffers = order.n_buffers(stage_index, pp, m)
    versioned = VersionedStage(module, n_buffers, dtype, reduce_dtype(config.grad_reduce_dtype, dtype))
    updater = Updater(config, [0], [stage_index], [module], order)
    layout = SimpleNamespace(pp_size=1, dp_size=1, device=device, dp_group=None)  # one stage: its update is applied at once
    report = StepReport()
    held = HeldNorms(GradientNorms(layout, [module], [stage_index], True, report), config.clips_by_global_norm)
    n_slots = order.n_slots(pp, m)
    receive: list[tuple[torch.Tensor, ...]] | None = None  # gradient receive buffers, one per slot
    generator = torch.Generator(device=device).manual_seed(config.seed)
    # The pipeline's own update of one stage (update/stage.py), applied at once: one stage's norm.
    stage_update = StageUpdate(0, stage_index, versioned, updater, module.routing_load, held,
                               UpdateRule(config.max_grad_norm, report), order, config, pp)

    def label(*_):
        if tracker is not None:
            label_state(tracker, held_tensors(list(module.parameters()), [updater], [versioned]))
            tracker.label([t for slot in receive or () for t in slot], "receive_buffer")

    updater.optimizer.register_step_pre_hook(label)
    updater.optimizer.register_step_post_hook(label)

    def update(version: int) -> None:
        stage_update.gradient_ready(version, version, 1 / m)

    pending: dict[int, tuple] = {}  # microbatch → (outputs, slot): forwarded, not yet backwarded
    timed = {"forward": [], "backward": [], "update": []}
    syncs = {"forward": 0, "backward": 0, "update": 0}
    held_most = 0
    for step in range(args.steps):
        tokens = torch.randint(model_config.vocab_size, (m * mbs, seq), device=device, generator=generator)
        counting = step > 0 and device.type == "cuda"
        marks = []  # (kind, start, end)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if counting:
                torch.cuda.set_sync_debug_mode("warn")
            for action in order.segment(rank, pp, m, step, args.steps + 1):  # + 1: no step here drains
                if action.stage_index != stage_index:
                    continue
                j, seen = action.microbatch_index, len(caught)
                label()
                start = clock.mark()
                if action.computation_type == FORWARD:
                    versioned.active = order.buffer(stage_index, pp, order.version(stage_index, pp, j, m), m)
                    if tracker is not None:
                        tracker.in_forward += 1
                    rows = tokens[(j % m) * mbs:(j % m + 1) * mbs]
                    outputs = versioned(rows)
                    if tracker is not None:
                        tracker.in_forward -= 1
                    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                    if receive is None:
                        receive = [tuple(torch.randn(o.shape, dtype=o.dtype, device=device, generator=generator)
                                         .mul_(1e-3) for o in outputs) for _ in range(n_slots)]
                    pending[j] = outputs
                    held_most = max(held_most, len(pending))
                    kind = "forward"
                else:
                    outputs = pending.pop(j)
                    grads = receive[j % n_slots]
                    torch.autograd.backward([o for o in outputs if o.requires_grad],
                                            [g for o, g in zip(outputs, grads) if o.requires_grad])
                    del outputs
                    kind = "backward"
                marks.append((kind, start, clock.mark()))
                syncs[kind] += _synchronizing(caught[seen:]) if counting else 0
                if order.updates_after(action, m):
                    seen, start = len(caught), clock.mark()
                    update(order.version(stage_index, pp, j, m))
                    marks.append(("update", start, clock.mark()))
                    syncs["update"] += _synchronizing(caught[seen:]) if counting else 0
            if counting:
                torch.cuda.set_sync_debug_mode(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:
            for kind, start, end in marks:
                timed[kind].append(clock.ms(start, end))
        if counting:  # where the synchronizing calls were made (the Python line that called the op)
            sites = timed.setdefault("sync_sites", {})
            for w in caught:
                if "synchroniz" in str(w.message):
                    site = f"{Path(w.filename).name}:{w.lineno}"
                    sites[site] = sites.get(site, 0) + 1
    label()
    return dict(module=module, timed=timed, syncs=syncs, n_buffers=n_buffers, n_slots=n_slots,
                held_most=held_most, updates_applied=versioned.master_version, model_config=model_config)


def _synchronizing(caught) -> int:
    """How many of the warnings caught are set_sync_debug_mode's."""
    return sum("synchroniz" in str(w.message) for w in caught)


def predict(args) -> dict:
    """The same loop on fake CPU tensors: the peak of live bytes and its parts, host reads."""
    import torch
    from hf_asyncpp.torch_internals import FakeTensorMode

    from hf_asyncpp.models.fake_kernels import register_fake_kernels
    from hf_asyncpp.planning.host_reads import HostReads
    from hf_asyncpp.planning.memory_tracker import MemoryTracker
    from hf_asyncpp.planning.plan import KINDS

    config, model_config, plan, _, setup = _setup(args)
    register_fake_kernels()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker, reads = MemoryTracker(fake_mode), HostReads()
    began = time.perf_counter()
    with fake_mode, tracker, reads:
        played = _play(args, config, model_config, plan, torch.device("cpu"), _Clock("fake"), tracker)
    parts = tracker.peak_parts()
    m = setup["microbatches"]
    sites = dict(Counter(r.site for r in reads.take()))
    return dict(setup=setup, predicted_peak_bytes=tracker.peak_bytes,
                predicted_peak_gib=tracker.peak_bytes / GiB,
                predicted_parts_gib={k: parts.get(k, 0) / GiB for k in KINDS if parts.get(k)},
                host_reads_per_step=sum(sites.values()) / args.steps, host_read_sites=sites,
                n_buffers=played["n_buffers"], receive_slots=played["n_slots"],
                microbatches_held_at_most=played["held_most"], updates_applied=played["updates_applied"],
                microbatches=m, torch=torch.__version__, seconds=time.perf_counter() - began)


def measure(args) -> dict:
    import torch
    import transformers

    config, model_config, plan, _, setup = _setup(args)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    played = _play(args, config, model_config, plan, device, _Clock(device.type))
    timed, m = played["timed"], setup["microbatches"]
    steps_timed = args.steps - 1
    forward, backward = sum(timed["forward"]), sum(timed["backward"])
    n_forward, n_backward = len(timed["forward"]), len(timed["backward"])
    ms_per_microbatch = (forward + backward) / max(steps_timed * m, 1)
    tokens = setup["micro_batch_size"] * setup["seq_len"]
    from hf_asyncpp import utilization

    per_token = flops_per_token(played["module"], model_config, setup["seq_len"])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_tflops = utilization.peak_tflops(device, args.peak_tflops)
    achieved = per_token * tokens / (ms_per_microbatch / 1000) if ms_per_microbatch else None
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    result = dict(
        setup=setup | dict(device=args.device, device_name=device_name, torch=torch.__version__,
                           transformers=transformers.__version__, n_buffers=played["n_buffers"],
                           receive_slots=played["n_slots"], microbatches_held_at_most=played["held_most"],
                           activation_checkpointing=config.activation_checkpointing,
                           compile_layers=config.compile_layers),
        flops_per_token=per_token,
        flops_formula="6 × parameters a token touches (experts × top_k/E, embedding lookup 0) + "
                      "12 × layers × n_heads × head_dim × seq_len",
        ms_per_microbatch=ms_per_microbatch,
        forward_ms=forward / n_forward if n_forward else None,
        backward_ms=backward / n_backward if n_backward else None,
        forward_ms_median=statistics.median(timed["forward"]) if n_forward else None,
        backward_ms_median=statistics.median(timed["backward"]) if n_backward else None,
        update_ms=statistics.mean(timed["update"]) if timed["update"] else None,
        tokens_per_s=tokens / (ms_per_microbatch / 1000) if ms_per_microbatch else None,
        tflops=achieved / 1e12 if achieved else None, peak_tflops=peak_tflops,
        mfu=achieved / (peak_tflops * 1e12) if achieved and peak_tflops and device.type == "cuda" else None,
        peak_memory_bytes=peak, peak_memory_gib=peak / GiB if peak is not None else None,
        host_syncs_per_microbatch=((played["syncs"]["forward"] + played["syncs"]["backward"]) / (steps_timed * m)
                                   if device.type == "cuda" and steps_timed else None),
        host_syncs_per_update=(played["syncs"]["update"] / len(timed["update"])
                               if device.type == "cuda" and timed["update"] else None),
        host_sync_sites=timed.get("sync_sites", {}),
        updates_applied=played["updates_applied"], timed_microbatches=steps_timed * m,
        seconds=time.perf_counter() - began,
    )
    result.update(_prediction_for(setup, args.plan_file))
    return result


def _prediction_for(setup: dict, plan_file: Path) -> dict:
    """The stored prediction of this setup, if there is one."""
    if not plan_file.is_file():
        return dict(predicted_peak_gib=None, prediction=f"none: {plan_file} is missing (run with --plan)")
    stored = json.loads(plan_file.read_text())
    differing = [k for k in SETUP_KEYS if stored["setup"].get(k) != setup.get(k)]
    if differing:
        return dict(predicted_peak_gib=None, prediction=f"none for this setup ({plan_file.name} differs in "
                                                        f"{', '.join(differing)})")
    return dict(predicted_peak_gib=stored["predicted_peak_gib"], predicted_parts_gib=stored["predicted_parts_gib"],
                predicted_host_reads_per_step=stored["host_reads_per_step"], prediction=str(plan_file.name))


def _table(r: dict) -> str:
    def cell(value, spec):
        return "—" if value is None else format(value, spec)

    s = r["setup"]
    rows = [
        ("stage", f"{s['stage']} of pp {s['pp_size']}, layers {s['layers'][0]}-{s['layers'][1]}, "
                  f"{s['micro_batch_size']} × {s['seq_len']} tokens, m {s['microbatches']}, {s['device_name']}"),
        ("ms per microbatch (forward + backward)", cell(r["ms_per_microbatch"], ".2f")),
        ("forward / backward ms (mean)", f"{cell(r['forward_ms'], '.2f')} / {cell(r['backward_ms'], '.2f')}"),
        ("update ms", cell(r["update_ms"], ".1f")),
        ("tokens/s", cell(r["tokens_per_s"], ",.0f")),
        ("model TFLOP/s (GFLOP per token)", f"{cell(r['tflops'], '.1f')} ({r['flops_per_token'] / 1e9:.3f})"),
        ("MFU", cell(r["mfu"], ".3f")),
        ("peak memory GiB: measured / predicted", f"{cell(r['peak_memory_gib'], '.2f')} / "
                                                  f"{cell(r['predicted_peak_gib'], '.2f')}"),
        ("host syncs per microbatch / per update", f"{cell(r['host_syncs_per_microbatch'], '.2f')} / "
                                                   f"{cell(r['host_syncs_per_update'], '.1f')}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:{width}}  {v}" for k, v in rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--model-config", "--model_config", dest="model_config",
                        help="another model (a preset or config.json) than the config's")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                        help=f"the stage's first N decoder layers only (default {DEFAULT_LAYERS}; 0: all of them)")
    parser.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, help="default: the config's")
    parser.add_argument("--micro-batch-size", "--micro_batch_size", dest="micro_batch_size", type=int)
    parser.add_argument("--microbatches", type=int, help="per step (default: the config's n_microbatches)")
    parser.add_argument("--steps", type=int, default=2, help="the first fills the pipeline; the rest are timed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", "--peak_tflops", dest="peak_tflops", type=float)
    parser.add_argument("--plan", action="store_true", help="predict on fake CPU tensors; write --plan-file")
    parser.add_argument("--plan-file", "--plan_file", dest="plan_file", type=Path, default=DEFAULT_PLAN)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps: at least 2 (one fills the pipeline, one is timed)")
    if args.plan:
        result = predict(args)
        args.plan_file.parent.mkdir(parents=True, exist_ok=True)
        args.plan_file.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(_table(result))


if __name__ == "__main__":
    main()
