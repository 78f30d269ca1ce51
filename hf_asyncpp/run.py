"""A training run from a config: validate → process groups → data → engine steps → metrics → export.

`training_scripts/train.py` and `hf-asyncpp train` are this module's `main`. Validation happens
before any process group starts and before output_dir is touched; a bad config exits with status 2
and one message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

__all__ = ["main", "train"]


def _parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Pipeline-parallel pretraining of an HF causal LM. Any config key can be overridden "
        "as --key value.",
    )
    parser.add_argument("--config", help="YAML config file (keys: see README, 'Config reference')")
    return parser.parse_known_args(argv)


def _is_reporting_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _set_threads(config, launch) -> None:
    import torch

    if config.threads_per_rank:
        torch.set_num_threads(config.threads_per_rank)
    elif launch.launched and not torch.cuda.is_available():
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", launch.world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


@contextlib.contextmanager
def _main_process_first(layout):
    """Rank 0 fills the datasets cache first; the others then read it instead of racing to write it."""
    import torch.distributed as dist

    if not layout.is_main:
        dist.barrier()
    yield
    if layout.is_main:
        dist.barrier()


def _model_card(config, model_config, layout, record: dict, spec, final_eval: dict | None) -> str:
    from .hub import eval_results, model_card_facts, render_model_card

    facts = model_card_facts(config, model_config, (layout.pp_size, layout.dp_size), record, spec)
    name = config.hub_model_id.split("/")[-1] if config.hub_model_id else Path(config.output_dir).name
    results = eval_results(final_eval, facts["data"]["name"]) if final_eval else None
    return render_model_card(facts, name, repo_id=config.hub_model_id, eval_results=results).content


def _push(folder: Path, repo_id: str) -> str | None:
    """Upload the export; the error message (the local files are kept) or None."""
    from .hub import push_to_hub

    try:
        print(f"[hf_asyncpp] pushed to {repo_id}: {push_to_hub(folder, repo_id)}")
        return None
    except Exception as err:  # network, auth, server
        message = f"upload of {folder} to {repo_id} failed ({type(err).__name__}: {err}); the export is kept"
        print(f"error: {message}", file=sys.stderr)
        return message


def train(config, model_config, launch) -> dict:
    """Run training on this rank; returns the last logged record (main process; {} elsewhere)."""
    from tqdm.auto import tqdm

    from .checkpoint import export_hf_model
    from .checkpoint.checkpoints import find_checkpoint, load_checkpoint, save_checkpoint
    from .data import MinibatchSampler, build_token_blocks, load_tokenizer
    from .engine import PipelineEngine
    from .evaluation import evaluate, split_held_out
    from .metrics import MetricsWriter
    from .parallel.mesh import init_parallel, shutdown_parallel

    _set_threads(config, launch)
    layout = init_parallel(launch, config.pp_size)
    try:
        tokenizer = load_tokenizer(config.tokenizer)
        with _main_process_first(layout):
            blocks = build_token_blocks(config.dataset, tokenizer, config.seq_len, config.text_column)
        blocks, held_out = split_held_out(blocks, config.eval_fraction)
        sampler = MinibatchSampler(
            blocks, config.rows_per_step, layout.dp_rank, layout.dp_size, config.shuffle, config.seed
        )

        def run_evaluation(step: int) -> dict:
            results = {"step": step, **evaluate(engine, held_out, config.rows_per_step, layout.dp_rank,
                                                 layout.dp_size)}
            if writer:
                writer.write(results)
            return results

        engine = PipelineEngine(config, model_config, layout)
        start_step, tokens_seen = 0, 0
        if config.resume_from_checkpoint:
            path = find_checkpoint(config.resume_from_checkpoint, config.output_dir)
            resumed = load_checkpoint(engine, layout, path)
            start_step, tokens_seen = resumed["step"], resumed["tokens_seen"]
            engine.resume_after(start_step)
            if layout.is_main:
                print(f"[hf_asyncpp] resumed from {path} after step {start_step}")
        writer = MetricsWriter(config.output_dir, start_step if config.resume_from_checkpoint else None) \
            if layout.is_main else None
        if layout.is_main:
            print(f"[hf_asyncpp] {engine.spec.name}: pp={layout.pp_size} dp={layout.dp_size}; {engine.plan.describe()}")
        progress = tqdm(total=config.max_steps, initial=start_step, disable=not layout.is_main, desc="train",
                        unit="step")
        record = {}
        for step in range(start_step, config.max_steps):
            next_rows = sampler.rows(step + 1) if step + 1 < config.max_steps else None
            result = engine.train_step(sampler.rows(step), next_rows)
            tokens_seen += result.tokens
            progress.update(1)
            if layout.is_main and (result.step % config.logging_steps == 0 or result.step == config.max_steps):
                record = {
                    "step": result.step,
                    "loss": result.loss,
                    "aux_loss": result.aux_loss,
                    "lr": result.lr,
                    "grad_norm": result.grad_norm,
                    "tokens": tokens_seen,
                    "tokens_per_s": result.tokens / result.step_time_s,
                    "step_time_s": result.step_time_s,
                    "idle_fraction_per_rank": result.idle_fraction_per_rank,
                    "weight_version_age_per_stage": result.weight_version_age_per_stage,
                    "schedule": engine.spec.name,
                }
                progress.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                writer.write(record)
            if config.eval_steps and result.step % config.eval_steps == 0 and result.step < config.max_steps:
                run_evaluation(result.step)
            if config.save_steps and result.step % config.save_steps == 0:
                save_checkpoint(engine, layout, config.output_dir, result.step,
                                {"tokens_seen": tokens_seen, "config": dataclasses.asdict(config)},
                                config.save_total_limit)
        engine.finish()
        progress.close()
        final_eval = run_evaluation(config.max_steps) if held_out is not None else None
        if writer:
            writer.close()
        if layout.is_main and final_eval:
            print(f"[hf_asyncpp] validation loss {final_eval['eval_loss']:.4f}, "
                  f"perplexity {final_eval['eval_perplexity']:.2f}")
        if config.save_final:
            card = _model_card(config, model_config, layout, record, engine.spec, final_eval) \
                if layout.is_main else None
            out = export_hf_model(engine.stage_state_dict(), layout, model_config, tokenizer,
                                  Path(config.output_dir) / "final", config.max_shard_size, card)
            if layout.is_main:
                print(f"[hf_asyncpp] saved {out}")
                if config.push_to_hub:
                    record["push_error"] = _push(out, config.hub_model_id)
        return record
    finally:
        shutdown_parallel()


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse_args(argv)
    from .config import ConfigError, load_config, validate_config
    from .parallel.launch import LaunchError, read_launch

    try:
        config = load_config(args.config, overrides)
        launch = read_launch()
        if not launch.launched and config.pp_size > 1:
            from .schedules import SCHEDULES

            spec = SCHEDULES.get(config.schedule)
            if spec is not None and not spec.synchronous and not config.emulate_pp_size:
                config.emulate_pp_size = config.pp_size
                print(f"[hf_asyncpp] one process (no launcher): emulating {config.schedule} at depth {config.pp_size}")
            else:
                print(f"[hf_asyncpp] one process (no launcher): pp_size {config.pp_size} → 1")
            config.pp_size = 1
        model_config = validate_config(config, launch.world_size)
    except (ConfigError, LaunchError) as err:
        if _is_reporting_rank():
            print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.time()
    record = train(config, model_config, launch)
    if _is_reporting_rank():
        print(f"[hf_asyncpp] done in {time.time() - start:.1f}s")
    return 1 if record.get("push_error") else 0


if __name__ == "__main__":
    sys.exit(main())
