"""The `hf-asyncpp` command: `hf-asyncpp train --config ...` (same as training_scripts/train.py)
and `hf-asyncpp schedules` (print each registered schedule's action lists)."""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = """usage: hf-asyncpp <command> [args]

commands:
  train [--config FILE] [--key value ...]   train (launch under torchrun / accelerate for pp > 1)
  schedules [--pp N] [--microbatches M]     show every registered schedule's per-rank action lists
"""


def _show_schedules(argv: list[str]) -> int:
    import argparse

    from torch.distributed.pipelining.schedules import _format_pipeline_order

    from .schedules import SCHEDULES, ScheduleError

    parser = argparse.ArgumentParser(prog="hf-asyncpp schedules")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    for spec in SCHEDULES.values():
        print(f"== {spec.name}: {spec.description}")
        try:
            print(_format_pipeline_order(spec.actions(args.pp, args.microbatches)))
        except (ValueError, ScheduleError) as err:
            print(f"   (cannot run: {str(err).splitlines()[0]})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .run import main as train_main

        return train_main(rest)
    if command == "schedules":
        return _show_schedules(rest)
    print(f"unknown command '{command}'\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
