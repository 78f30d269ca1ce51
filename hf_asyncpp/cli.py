"""The `hf-asyncpp` command: `hf-asyncpp train --config ...` (same as training_scripts/train.py),
`hf-asyncpp push <dir> <repo_id>` (upload an export to the Hub), `hf-asyncpp export <checkpoint> <dir>`
(a training checkpoint as an HF model directory, one process), `hf-asyncpp prepare-data` (a corpus as
pre-tokenized Arrow shards), `hf-asyncpp plot <run_dir> ...`
(loss curves as PNG), `hf-asyncpp study <study.yaml>` (a grid of runs with a results table and
figures) and `hf-asyncpp schedules` (print each registered schedule's action lists)."""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["main"]

_USAGE = """usage: hf-asyncpp <command> [args]   (hf-asyncpp --version; options take dashes or underscores)

commands:
  train [CONFIG | --config FILE] [--key value ...]
                                            train (launch under torchrun / accelerate for pp > 1);
                                            train --help lists every config key
  export CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16]
                                            a training checkpoint (any pp × dp layout) as an HF model
                                            directory (weights, config, tokenizer, card), on one
                                            process; dtype: the run's export_dtype unless given
  push DIR REPO_ID [--private] [--revision BRANCH]
                                            upload an exported model directory (e.g. outputs/run/final)
                                            to the Hub (its branch BRANCH, created if missing); the
                                            token comes from HF_TOKEN or `hf auth login`
  plot RUN_DIR [RUN_DIR ...] [--out FILE] [--x step|tokens]
                                            loss curves from metrics.jsonl: one run to
                                            RUN_DIR/loss_curves.png, several to ./loss_comparison.png
  study STUDY.yaml [--report-only]           run (or continue) a study: optimizer × delay × EF × momentum ×
                                            depth × seed; writes results.md/.csv/.json and figures;
                                            says how many arms are left and about how long they take
  study STUDY.yaml --reproduce [ARM ...] [--steps N] [--tolerance T]
                                            rerun finished arms (all without names) at this code, each
                                            whole or its first N steps, and hold each to its record
                                            (reproductions.json/.md); exits 1 if one disagrees
  study --budget-figure OUT_DIR STUDY.yaml STUDY.yaml [...]
                                            the gap against tokens per parameter from studies of
                                            different model sizes on the same data (their results.json)
  schedules [--pp N] [--microbatches M]     show every registered schedule's per-rank action lists
  plan CONFIG | --config CONFIG [--key value ...] [--world-size N] [--gpu-memory-gib G] [--allowance-gib A] [--json FILE]
                                            each rank's peak device memory and its parts, played on
                                            fake tensors through start-up and three steps at the
                                            config's real size; exits 1 naming the rank that does
                                            not fit G GiB less A (default 6) for CUDA and NCCL
  prepare-data SOURCE OUT_DIR --seq_len N [--tokenizer T] [--text_column C] [--blocks_per_shard B]
               [--dataset_config_name X] [--dataset_split S] [--dataset_revision R]
               [--num_proc P] [--max_tokens T]
                                            tokenize and pack a corpus (files or a Hub id, streamed;
                                            its files P at a time; its first T tokens) into Arrow
                                            shards + manifest.json; train with `--dataset OUT_DIR`
                                            (no tokenizing, no network)
"""


def _parse(parser, argv: list[str], known: bool = False):
    """`parser`'s arguments from `argv`, each option taken spelled with dashes or underscores alike
    (`--world-size`, `--world_size`)."""
    spelled = {option.replace("_", "-"): option for action in parser._actions for option in action.option_strings}
    tokens = []
    for token in argv:
        key, eq, value = token.partition("=")
        if key.startswith("--"):
            key = spelled.get(key.replace("_", "-"), key)
        tokens.append(f"{key}{eq}{value}")
    return parser.parse_known_args(tokens) if known else parser.parse_args(tokens)


def _push(argv: list[str]) -> int:
    import argparse

    from .hub import push_to_hub

    parser = argparse.ArgumentParser(prog="hf-asyncpp push")
    parser.add_argument("folder")
    parser.add_argument("repo_id")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", help="the branch to upload to (created if missing; default: main)")
    args = _parse(parser, argv)
    try:
        url = push_to_hub(args.folder, args.repo_id, private=args.private, revision=args.revision)
    except Exception as err:  # network, auth, server: one line, local files untouched
        print(f"error: upload of {args.folder} to {args.repo_id} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"[hf_asyncpp] pushed {args.folder} to {args.repo_id}: {url}")
    return 0


def _export(argv: list[str]) -> int:
    import argparse

    from .checkpoint import CheckpointError, export_checkpoint
    from .hub import checkpoint_model_card
    from .resilience import NonFiniteError

    parser = argparse.ArgumentParser(prog="hf-asyncpp export")
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    parser.add_argument("out_dir", metavar="OUT_DIR")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "float32", "bfloat16"],
                        help="the weights' dtype (default: the run's export_dtype)")
    args = _parse(parser, argv)
    name = Path(args.out_dir).name
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype,
                                model_card=lambda state, model_config: checkpoint_model_card(state, model_config, name))
    except (CheckpointError, NonFiniteError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[hf_asyncpp] exported {args.checkpoint} to {out}")
    return 0


def _plot(argv: list[str]) -> int:
    import argparse

    from .plots import X_AXES, compare_runs, write_loss_curves

    parser = argparse.ArgumentParser(prog="hf-asyncpp plot")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default=None,
                        help="PNG to write (default: RUN_DIR/loss_curves.png, or ./loss_comparison.png for several)")
    parser.add_argument("--x", choices=X_AXES, default="step")
    args = _parse(parser, argv)
    try:
        if len(args.run_dirs) == 1:
            path = write_loss_curves(args.run_dirs[0], args.out, x=args.x)
        else:
            path = compare_runs(args.run_dirs, args.out or "loss_comparison.png", x=args.x)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _show_schedules(argv: list[str]) -> int:
    import argparse

    from .torch_internals import _format_pipeline_order

    from .schedules import SCHEDULES, ScheduleError

    parser = argparse.ArgumentParser(prog="hf-asyncpp schedules")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    args = _parse(parser, argv)
    for spec in SCHEDULES.values():
        print(f"== {spec.name}: {spec.description}")
        try:
            print(_format_pipeline_order(spec.actions(args.pp, args.microbatches)))
        except (ValueError, ScheduleError) as err:
            print(f"   (cannot run: {str(err).splitlines()[0]})")
    return 0


def _prepare_data(argv: list[str]) -> int:
    import argparse

    from .data.errors import DataError
    from .data.prepare import prepare_data

    parser = argparse.ArgumentParser(prog="hf-asyncpp prepare-data")
    parser.add_argument("source")
    parser.add_argument("out_dir")
    parser.add_argument("--seq_len", type=int, required=True)
    parser.add_argument("--tokenizer", default="builtin")
    parser.add_argument("--text_column", default="text")
    parser.add_argument("--blocks_per_shard", type=int, default=100_000)
    parser.add_argument("--dataset_config_name")
    parser.add_argument("--dataset_split", default="train")
    parser.add_argument("--dataset_revision")
    parser.add_argument("--num_proc", type=int, default=1, help="processes tokenizing the source's files in parallel")
    parser.add_argument("--max_tokens", type=lambda s: int(float(s)), help="keep only the first N tokens (e.g. 41e9)")
    args = _parse(parser, argv)
    try:
        manifest = prepare_data(args.source, args.out_dir, args.tokenizer, args.seq_len, args.text_column,
                                args.blocks_per_shard, args.dataset_config_name, args.dataset_split,
                                args.dataset_revision, args.num_proc, args.max_tokens)
    except (DataError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[hf_asyncpp] {args.out_dir}: {manifest['blocks']} blocks of {args.seq_len} tokens in "
          f"{len(manifest['shards'])} shard(s)")
    return 0


def _plan(argv: list[str]) -> int:
    import argparse
    import json
    from dataclasses import replace

    from .config import ConfigError, load_config
    from .planning.plan import named_temporaries, overshoot, plan_layout, table
    from .planning.step_time import Device, fastest_fitting, predict_steps, step_table

    parser = argparse.ArgumentParser(prog="hf-asyncpp plan", description="each rank's peak device memory, "
                                     "played on fake tensors at the config's real size, and each schedule's "
                                     "step predicted from its stages' FLOPs")
    parser.add_argument("config", nargs="?", help="the run's YAML config (or --config FILE)")
    parser.add_argument("--config", dest="config_option", metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help="ranks in all (pp_size × dp); default pp_size")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0)
    parser.add_argument("--allowance-gib", type=float, help="kept free on every rank for what the plan cannot see "
                        "(default: each rank's own: CUDA context, workspaces, NCCL per communicator, fragmentation)")
    parser.add_argument("--schedules", default="", help="other schedules whose memory to play too, comma-separated "
                        "(each takes as long as the config's)")
    assumed = Device()
    parser.add_argument("--peak-tflops", type=float, default=assumed.peak_tflops,
                        help="each GPU's dense bf16 peak for the predicted step (default: an H100 SXM's)")
    parser.add_argument("--mfu", type=float, default=assumed.mfu, help="the share of that peak the stages reach")
    parser.add_argument("--memory-tbs", type=float, default=assumed.memory_tbs,
                        help="each GPU's memory bandwidth, TB/s (the optimizer step)")
    parser.add_argument("--link-gbs", type=float, default=assumed.link_gbs,
                        help="GB/s of the link between pipeline ranks (default: 400 Gb/s InfiniBand)")
    parser.add_argument("--json", dest="json_path", help="write every rank's plan and the predicted steps here")
    args, overrides = _parse(parser, argv, known=True)
    args.config = args.config_option or args.config
    if args.config is None:
        parser.error("a config file is needed: hf-asyncpp plan CONFIG.yaml")
    try:
        config = load_config(args.config, overrides)
        world_size = args.world_size or config.pp_size
        if world_size % config.pp_size:
            raise ConfigError(f"--world-size {world_size} is not a multiple of pp_size {config.pp_size}")
        from .config_checks import build_model_config, fit_global_batch
        from .schedules import get_schedule_spec

        fit_global_batch(config, world_size)
        model_config = build_model_config(config)  # the model the run builds, init_from's and overrides included
        played = [get_schedule_spec(config.schedule).name]
        played += [get_schedule_spec(name).name for name in args.schedules.split(",") if name]
    except (ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = Device(args.peak_tflops, args.mfu, args.memory_tbs, args.link_gbs)
    steps = predict_steps(config, model_config, world_size, device)
    runs = {r["schedule"] for r in steps if "step_s" in r}
    plans, fits = {}, {}
    for name in dict.fromkeys(played):
        if name not in runs and name != played[0]:
            continue
        ranks = plan_layout(replace(config, schedule=name), model_config, world_size)
        plans[name], fits[name] = ranks, overshoot(ranks, args.gpu_memory_gib, args.allowance_gib) is None
        print(f"{name}:\n{table(ranks)}")
        for line in named_temporaries(ranks):
            print(line)
    print(f"\npredicted step per schedule ({device.peak_tflops:g} TFLOP/s × MFU {device.mfu:g}, "
          f"{device.memory_tbs:g} TB/s, links {device.link_gbs:g} GB/s; docs/scale.md):\n{step_table(steps, fits)}")
    best = fastest_fitting(steps, fits)
    fastest = fastest_fitting(steps, dict.fromkeys(runs, True))
    if best is not None:
        print(f"fastest that fits: {best['schedule']} ({1000 * best['step_s']:.0f} ms a step)")
    if fastest is not None and fastest["schedule"] not in fits:
        print(f"fastest predicted: {fastest['schedule']}, its memory not played (--schedules {fastest['schedule']})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "config": args.config, "overrides": overrides, "world_size": world_size,
            "gpu_memory_gib": args.gpu_memory_gib, "allowance_gib": args.allowance_gib,
            "ranks": plans.get(played[0], []), "other_schedules": {k: v for k, v in plans.items() if k != played[0]},
            "device": vars(device), "steps": steps}, indent=2) + "\n")
    own = plans.get(played[0])
    over = overshoot(own, args.gpu_memory_gib, args.allowance_gib) if own else None
    if over:
        print(over, file=sys.stderr)
        return 1
    print(f"every rank of {played[0]} fits a {args.gpu_memory_gib:g} GiB GPU with its allowance to spare")
    return 0


COMMANDS = ("train", "export", "push", "plot", "study", "schedules", "plan", "prepare-data")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"hf-asyncpp {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .run import main as train_main

        return train_main(rest, prog="hf-asyncpp train")
    if command == "schedules":
        return _show_schedules(rest)
    if command == "push":
        return _push(rest)
    if command == "export":
        return _export(rest)
    if command == "study":  # a front end of its own: the training core never imports the study tooling
        from .study.cli import main as study_main

        return study_main(rest)
    if command == "plot":
        return _plot(rest)
    if command == "prepare-data":
        return _prepare_data(rest)
    if command == "plan":
        return _plan(rest)
    import difflib

    close = difflib.get_close_matches(command, COMMANDS, n=1)
    print(f"error: unknown command '{command}'" + (f" (did you mean {close[0]}?)" if close else "")
          + f"; commands: {', '.join(COMMANDS)} (hf-asyncpp --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
