"""The `hf-asyncpp study` command: run or continue a study, rewrite its report, rerun finished arms to check
they reproduce, or draw the budget figure."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """`hf-asyncpp study ...` (hf_asyncpp/cli.py dispatches it here)."""
    import argparse

    from . import StudyError, StudyStopped, known_arms, load_study, report, run_study
    from .budget import write_budget_figure
    from .reproduce import TOLERANCE, reproduce_arms
    from .runner import progress

    parser = argparse.ArgumentParser(prog="hf-asyncpp study")
    parser.add_argument("study", nargs="+")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the table and figures and say how far the grid is, run nothing")
    parser.add_argument("--reproduce", nargs="*", metavar="ARM",
                        help="rerun these finished arms at this code and compare each with its record (none named: "
                             "every finished arm not yet reproduced so under these numerics); exits 1 if one "
                             "does not agree")
    parser.add_argument("--steps", type=int, help="with --reproduce: stop each rerun after this step and compare "
                                                  "the records up to there")
    parser.add_argument("--tables-only", action="store_true",
                        help="with --reproduce and no arm named: only the arms the report's tables read")
    parser.add_argument("--tolerance", type=float, help="with --reproduce: how far a whole rerun's final "
                                                        f"validation loss may lie from the record (default {TOLERANCE})")
    parser.add_argument("--budget-figure", metavar="OUT_DIR",
                        help="draw the gap against tokens per parameter from the studies' results, run nothing")
    args = parser.parse_args(argv)
    if args.budget_figure is None and len(args.study) > 1:
        parser.error("one study at a time, or several with --budget-figure")
    if args.report_only + (args.reproduce is not None) + (args.budget_figure is not None) > 1:
        parser.error("one of --report-only, --reproduce and --budget-figure at a time")
    if args.reproduce is None and (args.steps is not None or args.tolerance is not None or args.tables_only):
        parser.error("--steps, --tolerance and --tables-only go with --reproduce")
    if args.tables_only and args.reproduce:
        parser.error("--tables-only chooses the arms itself: name none")
    try:
        if args.reproduce is not None:
            compared = reproduce_arms(load_study(args.study[0]), args.reproduce, args.steps,
                                      TOLERANCE if args.tolerance is None else args.tolerance,
                                      tables_only=args.tables_only)
            return 0 if all(c["agrees"] for c in compared) else 1
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
