"""FSDP2 on the dp dimension: sharded training equals unsharded training, and holds 1/dp of the state.

"Unsharded" is the same run with `fsdp: false`: every dp replica holds whole parameters and
optimizer state and averages gradients with one all-reduce (tested equal to HF gradient
accumulation in tests/test_engine.py). "Sharded" is `fsdp: true`: synchronous stages under
`fully_shard` per decoder layer, asynchronous ones with Shard(0) DTensor master, versions and state.

Tolerances. With dp = 2 a sum of two values is the same in either order, and FSDP's averaging
(÷2) is exact, so elementwise optimizers (SGD, AdamW, Lion) see gradients that can differ only where
the two paths accumulate microbatch gradients in different buffers (fp32 rounding, ~1e-8 relative);
5 steps of AdamW stay within 1e-6. Muon and SOAP compute on the whole matrix gathered from shards
(bit-identical to the unsharded one when gradients are), but Muon's Newton–Schulz runs in bf16, where a
1-ulp input difference can flip a rounding: one flip moves an entry of the orthogonalised update by
up to 2^-8 relative to its size (~1), i.e. lr·2^-8 per step; the bound used is 5 steps × lr × 2^-8.
"""

from __future__ import annotations

import pytest

from tests.ranks import run_ranks
from tests.test_engine import small_model_config

SEQ, MBS, M, STEPS = 16, 2, 4, 5
LR = {"sgd": 0.5, "adamw": 3e-3, "muon": 2e-2, "soap": 3e-3, "lion": 3e-4}
TOLERANCE = {"sgd": 1e-6, "adamw": 1e-6, "lion": 1e-6, "soap": 1e-6, "muon": STEPS * LR["muon"] * 2 ** -8}


def _train(layout, preset, schedule, optimizer, fsdp, ef=False, mixed_precision="no", **config_keys):
    """Final whole parameters, per-step losses (then an evaluation loss for synchronous schedules)
    and the engine after STEPS steps (`config_keys`: any other TrainConfig keys)."""
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine

    model_config = small_model_config(preset)
    config = TrainConfig(model_config=preset, pp_size=layout.pp_size, schedule=schedule, optimizer=optimizer,
                         learning_rate=LR[optimizer], momentum=0.9, max_grad_norm=1.0, lr_scheduler_type="constant",
                         seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=4, max_steps=STEPS, fsdp=fsdp,
                         ef=ef, weight_decay=0.01, mixed_precision=mixed_precision, **config_keys)
    gen = torch.Generator().manual_seed(9)
    rows = [torch.randint(0, model_config.vocab_size, (layout.dp_size * MBS * M, SEQ), generator=gen)
            for _ in range(STEPS)]
    mine = [r.chunk(layout.dp_size)[layout.dp_rank] for r in rows]
    engine = PipelineEngine(config, model_config, layout)
    losses = [engine.train_step(mine[k], mine[k + 1] if k + 1 < STEPS else None).loss for k in range(STEPS)]
    engine.finish()
    if engine.spec.synchronous:  # evaluation runs on the sharded stages too
        losses.append(engine.eval_step(mine[0])[0])
    return engine.stage_state_dict(), losses, engine


def _sharded_vs_unsharded(rank, world_size, pp_size, preset, schedule, optimizers):
    from torch.distributed.tensor import DTensor

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    report = {}
    try:
        for optimizer in optimizers:
            reference, ref_losses, _ = _train(layout, preset, schedule, optimizer, fsdp=False)
            state, losses, engine = _train(layout, preset, schedule, optimizer, fsdp=True)
            # Per-element state; SOAP's factors and bases are per matrix, replicated by design.
            opt_state = [v for u in engine.executor.updaters for s in u.optimizer.state.values() for k, v in s.items()
                         if getattr(v, "ndim", 0) > 0 and not k.endswith(("_factor", "_basis"))]
            report[optimizer] = dict(
                param_diff=max((state[n] - reference[n]).abs().max().item() for n in reference),
                loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
                all_params_sharded=all(isinstance(p, DTensor) for p in engine.executor.params),
                all_state_sharded=bool(opt_state) and all(isinstance(v, DTensor) for v in opt_state),
            )
    finally:
        shutdown_parallel()
    return report


def _check(reports):
    for report in reports:
        for optimizer, row in report.items():
            assert row["all_params_sharded"] and row["all_state_sharded"], (optimizer, row)
            assert row["param_diff"] <= TOLERANCE[optimizer], (optimizer, row)
            assert row["loss_diff"] <= TOLERANCE[optimizer], (optimizer, row)


@pytest.mark.multirank
def test_each_optimizer_sharded_over_two_replicas_equals_unsharded():
    _check(run_ranks(2, _sharded_vs_unsharded, 1, "tiny-qwen3-moe", "gpipe", ["sgd", "adamw", "muon", "soap", "lion"]))


@pytest.mark.multirank
def test_pipedream_2bw_stage_sharded_over_two_replicas_equals_unsharded():
    _check(run_ranks(4, _sharded_vs_unsharded, 2, "tiny-mixtral", "pipedream-2bw", ["adamw", "muon"]))


def _started_from(rank, world_size, pp_size, preset, schedule, init_from):
    """This rank's stages as a sharded engine starting from `init_from` holds them (whole), and
    whether every parameter is a row shard."""
    from torch.distributed.tensor import DTensor

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        config = TrainConfig(model_config=preset, pp_size=pp_size, schedule=schedule, seq_len=SEQ, micro_batch_size=MBS,
                             n_microbatches=M, seed=4, init_from=init_from)
        engine = PipelineEngine(config, small_model_config(preset), layout)
        return engine.stage_state_dict(), all(isinstance(p, DTensor) for p in engine.executor.params)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,pp_size,schedule", [(2, 1, "gpipe"), (4, 2, "pipedream-2bw")])
def test_a_sharded_engine_starts_from_init_from_exactly(tmp_path, world_size, pp_size, schedule):
    """Each dp replica reads only its rows of init_from (tests/models/test_construct.py); the stages
    it then trains on — FSDP2's (the rows gathered once, then sharded by fully_shard) or the weight
    versions' row shards — hold from_pretrained's weights bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_asyncpp.models.construct import build_model

    build_model(small_model_config("tiny-mixtral"), seed=5).save_pretrained(tmp_path)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    for state, sharded in run_ranks(world_size, _started_from, pp_size, "tiny-mixtral", schedule, str(tmp_path)):
        assert sharded and state
        for name, tensor in state.items():
            assert torch.equal(tensor, expected[name]), name


def _bytes_after_training(rank, world_size, pp_size, schedule):
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        _, _, engine = _train(layout, "tiny-mixtral", schedule, "adamw", fsdp=True, ef=True)
        return dict(engine.state_bytes(), stage=engine.executor.stage_ids[0])
    finally:
        shutdown_parallel()


@pytest.mark.multirank
def test_optimizer_state_ef_buffers_and_weight_versions_shrink_as_one_over_dp():
    one_replica = run_ranks(2, _bytes_after_training, 2, "pipedream-2bw")  # pp 2 × dp 1
    two_replicas = run_ranks(4, _bytes_after_training, 2, "pipedream-2bw")  # pp 2 × dp 2
    for whole in one_replica:
        for shard in (r for r in two_replicas if r["stage"] == whole["stage"]):
            for kind in ("parameters", "weight_versions", "optimizer_state", "ef_buffers"):
                assert whole[kind] > 0, (kind, whole)
                # AdamW keeps a 4-byte step counter per tensor on every replica: allow for it.
                assert abs(shard[kind] - whole[kind] / 2) <= 0.005 * whole[kind], (kind, shard, whole)


def _bf16_vs_fp32(rank, world_size, pp_size, schedule):
    import torch

    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        reference, ref_losses, _ = _train(layout, "tiny-qwen3-moe", schedule, "adamw", fsdp=True)
        report = {}
        # A synchronous stage under FSDP2 would sum its microbatch gradients in bf16 with "compute" (refused).
        for reduce in ("fp32",) if schedule == "gpipe" else ("fp32", "compute"):
            state, losses, _ = _train(layout, "tiny-qwen3-moe", schedule, "adamw", fsdp=True, mixed_precision="bf16",
                                      grad_reduce_dtype=reduce)
            report[reduce] = dict(
                loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
                param_diff=max((state[n] - reference[n]).abs().max().item() for n in reference),
                master_dtypes={str(t.dtype) for t in state.values()}, state=state)
        states = {reduce: row.pop("state") for reduce, row in report.items()}
        if "compute" in report:
            report["compute"]["differs"] = any(not torch.equal(states["fp32"][n], states["compute"][n]) for n in states["fp32"])
        return report
    finally:
        shutdown_parallel()


@pytest.mark.parametrize("mixed_precision, device, fsdp, expected", [
    ("auto", "cuda", True, "bfloat16"), ("auto", "cuda", False, None), ("auto", "cpu", True, None),
    ("bf16", "cpu", True, "bfloat16"), ("no", "cuda", True, None),
])
def test_auto_precision_is_bf16_only_on_gpus_under_fsdp_for_every_kind_of_stage(mixed_precision, device, fsdp,
                                                                                  expected):
    """One decision for synchronous stages (FSDP2's policy) and versioned ones (their compute copies): with
    `fsdp: false` neither casts, so sync-vs-async comparisons measure the delay, not the precision."""
    import torch

    from hf_asyncpp.parallel.fsdp import compute_dtype

    dtype = compute_dtype(mixed_precision, torch.device(device), fsdp)
    assert dtype == (getattr(torch, expected) if expected else None)


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size, schedule", [(1, "gpipe"), (2, "pipedream-2bw")])
def test_bf16_compute_keeps_fp32_master_weights_and_tracks_the_fp32_run(pp_size, schedule):
    """bf16 forward/backward (fully_shard's MixedPrecisionPolicy, or bf16 compute copies of the weight
    versions) on 2 dp replicas: the master weights stay fp32, and 5 AdamW steps stay close to the fp32
    run. bf16 keeps 8 mantissa bits, so a loss of ~5 differs by a few 1e-2 and an AdamW step (~lr per
    entry, sign-like) can flip where a gradient entry is near 0: bounds 0.05 (loss) and 5·2·lr (weights).
    The same holds for the asynchronous stage with gradients averaged over dp in bf16 (grad_reduce_dtype:
    compute), which really changes the result (one more bf16 rounding of each replica's sum)."""
    for report in run_ranks(2 * pp_size, _bf16_vs_fp32, pp_size, schedule):
        for row in report.values():
            assert row["master_dtypes"] == {"torch.float32"}, row
            assert 0 < row["loss_diff"] < 0.05, row  # > 0: the compute really ran in bf16
            assert row["param_diff"] < STEPS * 2 * LR["adamw"], row
        assert schedule == "gpipe" or report["compute"]["differs"], report


def _dtypes_seen_in_forward(rank, world_size, pp_size, schedule):
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    try:
        preset = "tiny-deepseek-v3"
        model_config = small_model_config(preset)
        config = TrainConfig(model_config=preset, pp_size=pp_size, schedule=schedule, seq_len=SEQ, micro_batch_size=MBS,
                             n_microbatches=M, max_steps=2, mixed_precision="bf16")
        engine = PipelineEngine(config, model_config, layout)
        seen = {"router": set(), "attention": set()}
        for module in engine.executor.modules:
            for name, sub in module.named_modules():
                kind = "router" if hasattr(sub, "e_score_correction_bias") else "attention" if name.endswith(
                    "self_attn.o_proj") else None
                if kind:
                    sub.register_forward_pre_hook(lambda m, args, kind=kind: seen[kind].add(str(m.weight.dtype)))
        rows = torch.randint(0, model_config.vocab_size, (MBS * M, SEQ))
        engine.train_step(rows, rows)
        engine.train_step(rows, None)
        engine.finish()
        return seen
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size, schedule", [(1, "gpipe"), (2, "pipedream-2bw")])
def test_under_bf16_deepseek_v3_routers_still_compute_in_fp32(pp_size, schedule):
    """transformers keeps DeepSeek-V3's router weight in fp32 (`_keep_in_fp32_modules_strict`: 5.25
    does; 5.17 keeps only the routing bias); the bf16 policy must keep exactly what the class keeps, or
    expert choice would follow other scores than the model's own."""
    from transformers import DeepseekV3ForCausalLM

    router = "torch.float32" if "gate.weight" in (DeepseekV3ForCausalLM._keep_in_fp32_modules_strict or ()) else "torch.bfloat16"
    for seen in run_ranks(2 * pp_size, _dtypes_seen_in_forward, pp_size, schedule):
        assert seen == {"router": {router}, "attention": {"torch.bfloat16"}}, seen


def _router_stats_dtype_entering_stages(rank, world_size, schedule):
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), 2)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=2, schedule=schedule, seq_len=SEQ, micro_batch_size=MBS,
                             n_microbatches=M, max_steps=1, mixed_precision="bf16")
        engine = PipelineEngine(config, model_config, layout)
        seen = set()
        for module in engine.executor.modules:  # after FSDP2's own pre-forward hook, which casts the inputs it casts
            module.register_forward_pre_hook(
                lambda m, args: seen.update(str(a.dtype) for a in args[1:] if isinstance(a, torch.Tensor)))
        rows = torch.randint(0, model_config.vocab_size, (MBS * M, SEQ))
        engine.train_step(rows)
        engine.finish()
        return seen
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["1f1b", "pipedream-2bw"])
def test_under_bf16_the_router_statistics_cross_stages_in_fp32(schedule):
    """The expert counts and probabilities a stage hands to the next (for the exact load-balancing loss)
    stay fp32 under bf16 compute, in a synchronous stage under FSDP2 as in a versioned one: bf16 would
    round counts above 256, and sync and async runs would differ in more than the delay."""
    seen = run_ranks(4, _router_stats_dtype_entering_stages, schedule)
    assert set().union(*seen) == {"torch.float32"}, seen


def _gathered_vs_full_tensor(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hf_asyncpp.parallel import fsdp
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    init_parallel(read_launch(), 1)
    original = fsdp.all_gather_flat  # the release's flat all-gather (torch_internals)
    calls = []
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        gen = torch.Generator().manual_seed(0)
        # uneven rows (5 over 2), a rank without rows (1 over 2), 1-D, 3-D, 0-d (replicated), unsharded
        whole = {"uneven": torch.randn(5, 3, generator=gen), "one_row": torch.randn(1, 4, generator=gen),
                 "vector": torch.randn(6, generator=gen), "stack": torch.randn(3, 2, 4, generator=gen),
                 "keep_fp32": torch.randn(3, 2, generator=gen), "scalar": torch.randn((), generator=gen),
                 "plain": torch.randn(2, 2, generator=gen)}
        tensors = {n: t if n == "plain" else distribute_tensor(t, mesh, [Replicate() if t.ndim == 0 else Shard(0)])
                   for n, t in whole.items()}

        def counting(*args, **kwargs):
            calls.append(args[1].dtype)
            return original(*args, **kwargs)

        fsdp.all_gather_flat = counting
        dtype_of = lambda name, t: torch.float32 if name == "keep_fp32" else torch.bfloat16
        gathered = fsdp.gather_whole(tensors, dtype_of)
        return dict(equal={n: bool(torch.equal(gathered[n], whole[n].to(dtype_of(n, whole[n])))) for n in whole},
                    dtypes={n: str(g.dtype) for n, g in gathered.items()}, collectives=sorted(map(str, calls)))
    finally:
        fsdp.all_gather_flat = original
        shutdown_parallel()


@pytest.mark.multirank
def test_a_versions_compute_copy_is_gathered_in_its_dtype_with_one_collective_per_dtype():
    """gather_whole (the weight versions' compute copies) equals full_tensor() cast to the compute
    dtype bit for bit — the cast is elementwise, so casting before the gather changes nothing — for
    uneven and empty row shards, 1-D to 3-D tensors, replicated scalars and unsharded tensors, and
    needs one all-gather per dtype instead of one per parameter (bf16 moves half fp32's bytes)."""
    for report in run_ranks(2, _gathered_vs_full_tensor):
        assert all(report["equal"].values()), report["equal"]
        assert report["dtypes"]["keep_fp32"] == "torch.float32" and report["dtypes"]["uneven"] == "torch.bfloat16"
        assert report["collectives"] == ["torch.bfloat16", "torch.float32"]


def _reduced_vs_summed(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hf_asyncpp.parallel import fsdp
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    init_parallel(read_launch(), 1)
    original, original_cap = fsdp.reduce_scatter_flat, fsdp.BUCKET_BYTES
    calls = []
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        shapes = {"uneven": (5, 3), "one_row": (1, 4), "vector": (6,), "stack": (3, 2, 4), "scalar": ()}
        like = {n: distribute_tensor(torch.zeros(s), mesh, [Replicate() if not s else Shard(0)])
                for n, s in shapes.items()}
        # each replica's whole gradient sums differ; the reference adds all of them up in plain torch
        every_rank = [{n: torch.randn(s, generator=torch.Generator().manual_seed(10 * r + i))
                       for i, (n, s) in enumerate(shapes.items())} for r in range(world_size)]
        expected = {n: (sum(g[n] for g in every_rank) * (0.5 / world_size)) for n in shapes}

        def counting(*args, **kwargs):
            calls.append(args[1].numel())
            return original(*args, **kwargs)

        fsdp.reduce_scatter_flat = counting
        reports = {}
        for cap in (original_cap, 40):  # every tensor in one bucket; then buckets of ≤ 10 fp32 values
            fsdp.BUCKET_BYTES, calls[:] = cap, []
            reduced = fsdp.reduce_scatter_rows({n: t.clone() for n, t in every_rank[rank].items()}, like, 0.5)
            reports[cap] = dict(
                equal={n: bool(torch.equal(reduced[n].full_tensor(), expected[n])) for n in shapes},
                placed={n: reduced[n].placements == like[n].placements and reduced[n].shape == like[n].shape
                        and reduced[n].to_local().shape == like[n].to_local().shape for n in shapes},
                dtypes={str(t.dtype) for t in reduced.values()}, collectives=len(calls))
        # In bf16 (grad_reduce_dtype: compute), but "vector" in fp32 (as a parameter the model keeps in
        # fp32): each replica's sum rounded to bf16, added (exactly, in fp32, then rounded once to bf16 —
        # what a bf16 sum of two values is), then scaled in fp32.
        fsdp.BUCKET_BYTES, calls[:] = original_cap, []
        dtype_of = lambda n: torch.float32 if n == "vector" else torch.bfloat16
        in_bf16 = {n: (sum(g[n].to(dtype_of(n)).float() for g in every_rank).to(dtype_of(n)).float()
                       * (0.5 / world_size)) for n in shapes}
        reduced = fsdp.reduce_scatter_rows({n: t.clone() for n, t in every_rank[rank].items()}, like, 0.5, dtype_of)
        reports["bf16"] = dict(
            equal={n: bool(torch.equal(reduced[n].full_tensor(), in_bf16[n])) for n in shapes if n != "scalar"},
            placed={n: reduced[n].placements == like[n].placements for n in shapes},
            dtypes={str(t.dtype) for t in reduced.values()}, collectives=len(calls),
            differs_from_fp32=any(not torch.equal(in_bf16[n], expected[n]) for n in ("uneven", "stack")))
        return reports
    finally:
        fsdp.reduce_scatter_flat, fsdp.BUCKET_BYTES = original, original_cap
        shutdown_parallel()


@pytest.mark.multirank
def test_a_versions_gradients_are_averaged_over_dp_in_fp32_with_one_reduce_scatter_per_bucket():
    """reduce_scatter_rows (a sharded version's gradients on their way to the master) equals the sum
    of every replica's whole gradient, scaled and averaged, then cut into the parameter's row shards —
    bit for bit, since with dp = 2 a sum of two values does not depend on its order and ÷2 is exact —
    for uneven and empty row shards, 1-D to 3-D tensors and a replicated scalar (all-reduced). It
    needs one reduce-scatter per bucket of about BUCKET_BYTES, not one per parameter. Reduced in bf16
    (grad_reduce_dtype: compute) it equals the bf16 sum of the replicas' bf16-rounded sums, one
    reduce-scatter per dtype; the result is fp32 either way (the master's gradient)."""
    for report in run_ranks(2, _reduced_vs_summed):
        for cap, row in report.items():
            assert all(row["equal"].values()) and all(row["placed"].values()), (cap, row)
            assert row["dtypes"] == {"torch.float32"}, row
        whole_cap, small_cap, in_bf16 = report.values()
        assert whole_cap["collectives"] == 1
        # 15, 4, 6 and 24 fp32 values with buckets of 40 bytes: [uneven], [one_row, vector], [stack]
        assert small_cap["collectives"] == 3
        assert in_bf16["collectives"] == 2 and in_bf16["differs_from_fp32"]  # one per dtype; bf16 rounds
