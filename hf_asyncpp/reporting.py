"""Experiment trackers (`report_to`): TensorBoard, Weights & Biases and Trackio, fed with the same
records that go to metrics.jsonl.

`check_report_to` runs with the rest of the validation, so a misspelt tracker or a missing package
fails before training starts; `Reporters` then sends every numeric scalar of a record to each tracker.
Tracker packages are imported only when a tracker is opened. The W&B and Trackio project is
$WANDB_PROJECT / $TRACKIO_PROJECT, default "hf_asyncpp".
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from .metrics import numeric_scalars

__all__ = ["REPORTERS", "Reporters", "check_report_to"]

REPORTERS = ("tensorboard", "wandb", "trackio")

_PACKAGE_BY_REPORTER = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
_DEFAULT_PROJECT = "hf_asyncpp"


def check_report_to(report_to: list[str]) -> None:
    """Raise ValueError unless `report_to` is empty, ["none"], or known trackers whose packages import."""
    if "none" in report_to and len(report_to) > 1:
        raise ValueError(f"report_to 'none' cannot be combined with trackers (got {', '.join(report_to)})")
    for name in report_to:
        if name == "none":
            continue
        if name not in REPORTERS:
            raise ValueError(f"report_to: unknown tracker {name!r}; choose from {', '.join(REPORTERS)} or none")
        package = _PACKAGE_BY_REPORTER[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"report_to {name} needs the {package} package: pip install {package}")


class Reporters:
    """The trackers named in `report_to`, opened at construction; `log` sends one record to all of them."""

    def __init__(self, report_to: list[str], log_dir: str | Path, run_name: str, config: dict):
        check_report_to(report_to)
        opener_by_name = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}
        # dict.fromkeys: a tracker named twice is opened once, in the order given.
        self._trackers = [opener_by_name[name](Path(log_dir), run_name, config)
                          for name in dict.fromkeys(report_to) if name != "none"]

    def log(self, values: dict, step: int) -> None:
        """Every numeric scalar of `values` at `step`; lists, strings, booleans and None are skipped."""
        scalars = numeric_scalars(values)
        if scalars:
            for tracker in self._trackers:
                tracker.log(scalars, step)

    def close(self) -> None:
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()


def _tensorboard_tag(key: str) -> str:
    """`eval_loss` → `eval/loss`, `loss` → `train/loss`: the tags transformers' TensorBoardCallback writes."""
    return f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"


class _TensorBoard:
    def __init__(self, log_dir: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._writer.add_text("config", json.dumps(config, indent=2, default=str))

    def log(self, scalars: dict, step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(_tensorboard_tag(key), value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, log_dir: Path, run_name: str, config: dict):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)  # wandb.init does not create `dir`
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", _DEFAULT_PROJECT), name=run_name,
                               config=config, dir=str(log_dir))

    def log(self, scalars: dict, step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _Trackio:
    def __init__(self, log_dir: Path, run_name: str, config: dict):
        import trackio

        self._trackio = trackio
        # Trackio keeps its runs in its own local store (or a Space), not under log_dir.
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", _DEFAULT_PROJECT), name=run_name, config=config)

    def log(self, scalars: dict, step: int) -> None:
        self._trackio.log(scalars, step=step)

    def close(self) -> None:
        self._trackio.finish()
