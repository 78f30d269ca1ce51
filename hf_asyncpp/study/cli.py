"""The `hf-asyncpp study` command: run or continue a study, rewrite its report, or draw the budget figure."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """`hf-asyncpp study ...` (hf_asyncpp/cli.py dispatches it here)."""
    import argparse

    from . import StudyError, StudyStopped, known_arms, load_study, report, run_study
    from .budget import write_budget_figure
    from .runner import progress

    parser = argparse.ArgumentParser(prog="hf-asyncpp study")
    parser.add_argument("study", nargs="+")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the table and figures and say how far the grid is, run nothing")
    parser.add_argument("--budget-figure", metavar="OUT_DIR",
                        help="draw the gap against tokens per parameter from the studies' results, run nothing")
    args = parser.parse_args(argv)
    if args.budget_figure is None and len(args.study) > 1:
        parser.error("one study at a time, or several with --budget-figure")
    if args.budget_figure is not None and args.report_only:
        parser.error("--budget-figure reads the studies' reports: write them first with --report-only")
    try:
        if args.budget_figure is not None:
            paths = write_budget_figure(args.budget_figure, [load_study(path) for path in args.study])
        elif args.report_only:
            study = load_study(args.study[0])
            paths = report(study)
            print(f"{study.name}: {progress(study, known_arms(study))}", file=sys.stderr)
        else:
            paths = run_study(args.study[0])
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StudyStopped as stopped:
        # As a run stopped by SIGTERM after its checkpoint: a clean end, not a failure.
        print(f"study stopped ({stopped}): run the same command to continue; finished arms are kept and "
              "stopped ones resume from their checkpoints", file=sys.stderr)
        return 0
    for path in paths:
        print(path)
    return 0
