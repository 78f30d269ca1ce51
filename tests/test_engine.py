"""The pipelined step equals the unsplit HF model trained with gradient accumulation.

For every supported family, pp = 2 and pp = 4 (and pp = 2 × dp = 2), every synchronous schedule:
  - the minibatch's LM loss and aux loss equal HF's (`model(input_ids, labels=input_ids)`),
  - after one SGD step with lr = 1 every parameter equals the reference's, so the comparison is a
    comparison of gradients; fp32 sums in a different order differ by ~1e-7, hence 1e-5;
  - DeepSeek-V3's routing biases moved by ±rate toward the mean expert load of the whole step.
"""

from __future__ import annotations

import pytest

from tests.ranks import run_ranks
from tests import p2p_tags

TOL = 1e-5
FAMILIES = [
    "tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-olmoe", "tiny-deepseek-v3", "tiny-gpt-oss",
    "tiny-llama", "tiny-qwen3",
]
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zbv"]
SEQ, MBS, M = 16, 2, 4
BIAS_RATE = 0.01


def small_model_config(preset: str):
    from hf_asyncpp.models.presets import build_config

    overrides = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, vocab_size=128, router_aux_loss_coef=0.1)
    if preset == "tiny-deepseek-v3":
        overrides.update(num_key_value_heads=2, head_dim=8, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16, moe_intermediate_size=32)
    if preset in ("tiny-mixtral", "tiny-gpt-oss", "tiny-qwen3"):
        overrides["sliding_window"] = 6  # shorter than SEQ so the window matters
    if preset == "tiny-qwen3":
        overrides.update(use_sliding_window=True, max_window_layers=4)  # layers 4.. slide
    if "moe" in preset or preset in ("tiny-mixtral", "tiny-gpt-oss", "tiny-olmoe", "tiny-deepseek-v3"):
        overrides.setdefault("moe_intermediate_size", 32)
    return build_config(preset, **overrides)


def save_model_dir(config_or_model, path):
    """A model directory as the Hub ships one: its config (and weights) beside its tokenizer, here the
    built-in BPE, whose 8192 ids the config's vocabulary is sized to. A run reads the tokenizer there."""
    from hf_asyncpp.data import load_tokenizer

    config_or_model.save_pretrained(path)
    load_tokenizer("builtin").save_pretrained(path)
    return path


def routed_token_counts(model, rows, n_microbatches) -> dict:
    """Tokens per expert of every bias-balanced (DeepSeek-V3) router of the HF model on `rows`."""
    import torch

    counts, hooks = {}, []
    for name, module in model.named_modules():
        if hasattr(module, "e_score_correction_bias"):
            def hook(mod, args, out, name=name):
                counts[name] = counts.get(name, 0) + torch.bincount(out[2].reshape(-1), minlength=mod.num_experts)
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        for mb in rows.chunk(n_microbatches):
            model(input_ids=mb)
    for h in hooks:
        h.remove()
    return counts


def reference_step(model, rows, n_microbatches, aux_coef):
    """HF model, gradient accumulation over microbatches, one SGD(lr=1) step."""
    import torch

    model.zero_grad()
    lm_total = aux_total = 0.0
    for mb in rows.chunk(n_microbatches):
        out = model(input_ids=mb, labels=mb)
        (out.loss / n_microbatches).backward()
        aux = out.aux_loss.item() if getattr(out, "aux_loss", None) is not None and aux_coef else 0.0
        lm_total += out.loss.item() - aux_coef * aux
        aux_total += aux
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= p.grad
    return lm_total / n_microbatches, aux_total / n_microbatches


def _worker(rank, world_size, pp_size, families, schedules):
    import copy

    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine, build_full_model
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), pp_size)
    report = []
    try:
        for preset in families:
            model_config = small_model_config(preset)
            aux_coef = model_config.router_aux_loss_coef if preset not in ("tiny-llama", "tiny-qwen3", "tiny-deepseek-v3") else 0.0
            for schedule in schedules:
                config = TrainConfig(model_config=preset, pp_size=pp_size, schedule=schedule, optimizer="sgd",
                                     learning_rate=1.0, momentum=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                                     seq_len=SEQ, micro_batch_size=MBS, n_microbatches=M, seed=3,
                                     router_bias_update_rate=BIAS_RATE)
                full = build_full_model(config, model_config)
                reference = copy.deepcopy(full)
                gen = torch.Generator().manual_seed(11)
                all_rows = torch.randint(0, model_config.vocab_size, (layout.dp_size * MBS * M, SEQ), generator=gen)
                if layout.dp_rank > 0:  # a script that seeds nothing: the replicas start from replica 0's weights
                    with torch.no_grad():
                        for p in full.parameters():
                            p.add_(torch.randn_like(p))
                engine = PipelineEngine(config, model_config, layout, model=full)
                # The caller's model keeps only this rank's stages (the rest moved to the meta device).
                held = {id(p) for module in engine.executor.modules for p in module.parameters()}
                foreign_allocated = [n for n, p in full.named_parameters() if id(p) not in held and not p.is_meta]
                mine = all_rows.view(layout.dp_size, MBS * M, SEQ)[layout.dp_rank]
                loads = routed_token_counts(reference, all_rows, M * layout.dp_size)
                with p2p_tags.recording() as messages:
                    result = engine.train_step(mine)
                # The reference sees each dp rank's minibatch as its own accumulation group and
                # averages them, as the dp all-reduce does.
                ref_lm = ref_aux = 0.0
                ref_params = {}
                grads = {}
                for d in range(layout.dp_size):
                    replica = copy.deepcopy(reference)
                    lm, aux = reference_step(replica, all_rows.view(layout.dp_size, MBS * M, SEQ)[d], M, aux_coef)
                    ref_lm, ref_aux = ref_lm + lm / layout.dp_size, ref_aux + aux / layout.dp_size
                    for name, p in replica.named_parameters():
                        grads[name] = grads.get(name, 0) + (reference.get_parameter(name) - p) / layout.dp_size
                for name, p in reference.named_parameters():
                    ref_params[name] = p - grads[name]
                # DeepSeek-V3 routing biases: one step of ±rate toward the mean load over all replicas.
                for name, load in loads.items():
                    bias = reference.get_buffer(name + ".e_score_correction_bias")
                    ref_params[name + ".e_score_correction_bias"] = bias + BIAS_RATE * torch.sign(
                        load.double().mean() - load.double()).float()
                mine_state = engine.stage_state_dict()
                compared = [n for n in mine_state if n in ref_params]
                param_diff = max((mine_state[n] - ref_params[n]).abs().max().item() for n in compared)
                init = dict(reference.named_parameters())
                moved = max((mine_state[n] - init[n]).abs().max().item() for n in compared if n in init)
                bias_moved = sum(float(ref_params[n + ".e_score_correction_bias"].abs().sum()) for n in loads)
                report.append(dict(preset=preset, schedule=schedule, param_diff=param_diff, bias_moved=bias_moved,
                                   loss_diff=abs(result.loss - ref_lm), aux_diff=abs(result.aux_loss - ref_aux),
                                   compared=compared, n_model_params=len(ref_params), moved=moved,
                                   aux=result.aux_loss, messages=messages, foreign_allocated=foreign_allocated))
    finally:
        shutdown_parallel()
    return report


def _check(reports):
    for rank_report in reports:
        for row in rank_report:
            p2p_tags.assert_untagged(row["messages"])  # matched by posting order, as under NCCL
            p2p_tags.assert_each_pair_on_its_own_group(row["messages"])
            assert row["param_diff"] < TOL, row
            assert row["loss_diff"] < TOL, row
            assert row["aux_diff"] < TOL, row
            assert not row["foreign_allocated"], row["foreign_allocated"]


@pytest.mark.multirank
@pytest.mark.parametrize("pp_size", [2, 4])
def test_every_family_and_schedule_matches_hf_gradient_accumulation(pp_size):
    """Every family at pp 2; at pp 4 (where the schedules' orders differ most) one of each kind of
    block: routed MoE with an aux loss, DeepSeek-V3's biased routing and MLA, a dense sliding-window model."""
    families = FAMILIES if pp_size == 2 else ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen3"]
    reports = run_ranks(pp_size, _worker, pp_size, families, SCHEDULES)
    _check(reports)
    for i, row in enumerate(reports[0]):
        # Every parameter of the model was compared on some rank, and the step really moved it.
        compared = set().union(*(report[i]["compared"] for report in reports))
        assert len(compared) == row["n_model_params"], row["preset"]
        assert min(report[i]["moved"] for report in reports) > 1e-3, row
        if row["preset"] == "tiny-deepseek-v3":
            assert row["bias_moved"] > 0  # the routing-bias update really happened and was compared
    # MoE families really exercise the aux loss.
    assert any(row["aux"] > 0 for row in reports[0])


@pytest.mark.multirank
def test_pp2_dp2_averages_gradients_over_data_parallel_replicas():
    """Also: replica 1 is handed other weights than replica 0 (its script seeded nothing); it starts
    from replica 0's, or its parameters would not match the reference."""
    _check(run_ranks(4, _worker, 2, ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"], ["1f1b", "zbv"]))


def _eval_with_and_without_logits(rank, world_size, schedule, emulate):
    import torch

    from hf_asyncpp.config import TrainConfig
    from hf_asyncpp.engine import PipelineEngine
    from hf_asyncpp.parallel.launch import read_launch
    from hf_asyncpp.parallel.mesh import init_parallel, shutdown_parallel

    layout = init_parallel(read_launch(), world_size)
    try:
        model_config = small_model_config("tiny-qwen3-moe")
        config = TrainConfig(model_config="tiny-qwen3-moe", pp_size=world_size, schedule=schedule, seq_len=SEQ,
                             micro_batch_size=MBS, n_microbatches=M, max_steps=2, emulate_pp_size=emulate)
        engine = PipelineEngine(config, model_config, layout)
        rows = torch.randint(0, model_config.vocab_size, (MBS * M, SEQ), generator=torch.Generator().manual_seed(3))
        engine.train_step(rows, rows)  # an asynchronous pipeline starts the next step's minibatch too
        loss, aux, dropped = engine.eval_step(rows)
        kept_chunks = sum(len(stage.output_chunks) for stage in engine.executor.torch_stages())
        with_logits = engine.eval_step(rows, return_logits=True)
        engine.train_step(rows, None)
        engine.finish()
        return dict(loss=(loss, aux), dropped=dropped, kept_chunks=kept_chunks, with_logits=with_logits[:2],
                    logits_shape=None if with_logits[2] is None else tuple(with_logits[2].shape),
                    last=engine.executor.holds_last_stage)
    finally:
        shutdown_parallel()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, schedule, emulate", [(2, "1f1b", 0), (2, "pipedream-2bw", 0),
                                                             (1, "pipedream-2bw", 2)])
def test_an_evaluation_keeps_no_logits_unless_asked_and_its_loss_is_the_same(world_size, schedule, emulate):
    """An evaluation frees each microbatch's logits after its loss (a minibatch's rows × seq × vocab on the
    last stage's device would sit beside the model); asked for, the logits come back from the last stage,
    and the loss is the same either way."""
    for report in run_ranks(world_size, _eval_with_and_without_logits, schedule, emulate):
        assert report["dropped"] is None and report["kept_chunks"] == 0, report
        assert report["loss"] == report["with_logits"], report
        expected = (MBS * M, SEQ, small_model_config("tiny-qwen3-moe").vocab_size) if report["last"] else None
        assert report["logits_shape"] == expected, report
