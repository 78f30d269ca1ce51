"""A training run from a config: validate → process groups → data → engine steps → metrics → export.

`training_scripts/train.py` and `hf-asyncpp train` are this module's `main`. Validation happens
before any process group starts and before output_dir is touched; a bad config exits with status 2
and one message. A run that fails on every rank together (resilience.py: a full disk, non-finite
values under the stop policy, a lost peer) exits with status 1 and one message; a run stopped by
SIGTERM after saving its checkpoint exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .log import get_logger

__all__ = ["main", "train"]

logger = get_logger(__name__)


def _parse_args(argv: list[str] | None, prog: str = "train.py"):
    from .config_docs import keys_help

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):  # `hf-asyncpp train CONFIG.yaml`: the config file, positional
        argv = ["--config", *argv]
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Pipeline-parallel pretraining of an HF causal LM.\nEvery config key below can be set in the "
        "YAML file or as --key value (lists as --stage_boundaries 3,6);\ndocs/config.md has the same list.",
        epilog=f"config keys:\n{keys_help()}", formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config file")
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


def _push(folder: Path, config) -> str | None:
    """Upload the export to config.hub_model_id (its branch hub_revision); the error message (the
    local files are kept) or None."""
    from .hub import push_to_hub

    repo_id = config.hub_model_id
    try:
        url = push_to_hub(folder, repo_id, private=config.hub_private_repo, revision=config.hub_revision)
        logger.info(f"pushed to {repo_id}: {url}")
        return None
    except Exception as err:  # network, auth, server
        message = f"upload of {folder} to {repo_id} failed ({type(err).__name__}: {err}); the export is kept"
        print(f"error: {message}", file=sys.stderr)
        return message


def train(config, model_config, launch) -> dict:
    """Run training on this rank; returns the last logged record."""
    import torch.distributed as dist

    from .config_checks import check_settings, resolve_schedule
    from .data import load_tokenizer, token_free_data, training_data
    from .engine import PipelineEngine
    from .loop import TrainingLoop, load_main_process_first
    from .parallel.mesh import init_parallel, shutdown_parallel
    from .resilience import LocalFailure, PeerLostError, RunFailure, lost_peers_reported
    from .schedules import get_schedule_spec

    _set_threads(config, launch)
    layout = init_parallel(launch, config.pp_size, config.comm_timeout_s)
    peers_alive = True
    try:
        with lost_peers_reported(layout.rank, config.comm_timeout_s):
            tokenizer = load_tokenizer(config.tokenizer)
            # Only the ranks of the first and the last stage read the data (inputs, labels).
            reads = get_schedule_spec(config.schedule).reads_tokens(layout.pp_size, layout.pp_rank)
            data = load_main_process_first(layout, lambda: training_data(
                config, tokenizer, layout.dp_rank, layout.dp_size, model_config.vocab_size) if reads else None)
            # Rank 0 reads tokens: the held-out size and the epoch's length for the ranks that hold none.
            shapes = [None if data is None or data.held_out is None else data.held_out.shape[0],
                      None if data is None else data.steps_per_epoch]
            dist.broadcast_object_list(shapes, group=layout.io_group, group_src=0)
            data = data or token_free_data(config, shapes[0])
            if config.num_train_epochs is not None:  # max_steps from the data's length, as every rank sees it
                resolve_schedule(config, shapes[1])
                check_settings(config, layout.world_size)
            engine = PipelineEngine(config, model_config, layout)
            loop = TrainingLoop(config, model_config, layout, engine, data, tokenizer)
            if config.resume_from_checkpoint:
                loop.resume(config.resume_from_checkpoint)
            record = loop.run()
            if loop.terminated_at is not None:
                return dict(record, terminated_at=loop.terminated_at)
            if config.save_final:
                out = loop.export(Path(config.output_dir) / "final", config.hub_model_id)
                if layout.is_main and config.push_to_hub:
                    record["push_error"] = _push(out, config)
            return record
    except Exception as err:
        # Raised by every rank at the same point: they can still meet at the final barrier.
        peers_alive = isinstance(err, RunFailure) and not isinstance(err, (LocalFailure, PeerLostError))
        raise
    finally:
        shutdown_parallel(peers_alive)


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    args, overrides = _parse_args(argv, prog)
    from .config import ConfigError, load_config
    from .config_checks import apply_launch_settings, fit_to_one_process, validate_config
    from .parallel.launch import LaunchError, read_launch

    try:
        config = load_config(args.config, overrides)
        launch = read_launch()
        apply_launch_settings(config, launch)
        if not launch.launched:
            fit_to_one_process(config)
        model_config = validate_config(config, launch.world_size)
    except (ConfigError, LaunchError) as err:
        if _is_reporting_rank():
            print(f"error: {err}", file=sys.stderr)
        return 2
    from .resilience import LocalFailure, PeerLostError, RunFailure

    start = time.time()
    try:
        record = train(config, model_config, launch)
    except RunFailure as err:  # every rank raised it together (a full disk, NaN), or lost its peers
        if _is_reporting_rank() or isinstance(err, (PeerLostError, LocalFailure)):  # said by the rank concerned
            print(f"error: {err}", file=sys.stderr)
        return 1
    except ConfigError as err:  # found once the data was read (its length for num_train_epochs), on every rank
        if _is_reporting_rank():
            print(f"error: {err}", file=sys.stderr)
        return 2
    if "terminated_at" in record:
        return 0
    logger.info(f"done in {time.time() - start:.1f}s")
    return 1 if record.get("push_error") else 0


if __name__ == "__main__":
    sys.exit(main())
