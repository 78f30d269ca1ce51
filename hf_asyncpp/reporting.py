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
    """The trackers named in `report_to`, opened at construction; `log` sends one record to all of them.
    `run_ids`: the runs to continue ({tracker: id}, what `run_ids()` gave the run a checkpoint resumes),
    so a job requeued from its checkpoint logs on in the same W&B run."""

    def __init__(self, report_to: list[str], log_dir: str | Path, run_name: str, config: dict,
                 run_ids: dict | None = None):
        check_report_to(report_to)
        opener_by_name = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}
        # dict.fromkeys: a tracker named twice is opened once, in the order given.
        self._trackers = {name: opener_by_name[name](Path(log_dir), run_name, config, (run_ids or {}).get(name))
                          for name in dict.fromkeys(report_to) if name != "none"}

    def run_ids(self) -> dict:
        """{tracker: its run's id}, for the trackers whose runs a resumed job continues."""
        return {name: tracker.run_id for name, tracker in self._trackers.items() if tracker.run_id is not None}

    def log(self, values: dict, step: int) -> None:
        """Every numeric scalar of `values` at `step`; lists, strings, booleans and None are skipped."""
        scalars = numeric_scalars(values)
        if scalars:
            for tracker in self._trackers.values():
                tracker.log(scalars, step)

    def close(self) -> None:
        trackers, self._trackers = self._trackers, {}
        for tracker in trackers.values():
            tracker.close()


def _tensorboard_tag(key: str) -> str:
    """`eval_loss` → `eval/loss`, `loss` → `train/loss`: the tags transformers' TensorBoardCallback writes;
    a key already named for training is not doubled (`train_tokens_per_second` → `train/tokens_per_second`)."""
    if key.startswith("eval_"):
        return f"eval/{key[len('eval_'):]}"
    return f"train/{key.removeprefix('train_')}"


class _TensorBoard:
    run_id = None  # a resumed run appends to the same log directory

    def __init__(self, log_dir: Path, run_name: str, config: dict, run_id: str | None = None):
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
    def __init__(self, log_dir: Path, run_name: str, config: dict, run_id: str | None = None):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)  # wandb.init does not create `dir`
        # resume="allow": the run of that id continues where it exists, and is made where it does not.
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", _DEFAULT_PROJECT), name=run_name,
                               config=config, dir=str(log_dir), id=run_id, resume="allow" if run_id else None)
        self.run_id = self._run.id

    def log(self, scalars: dict, step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _Trackio:
    run_id = None  # trackio continues a run by its name

    def __init__(self, log_dir: Path, run_name: str, config: dict, run_id: str | None = None):
        import trackio

        self._trackio = trackio
        # Trackio keeps its runs in its own local store (or a Space), not under log_dir.
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", _DEFAULT_PROJECT), name=run_name, config=config)

    def log(self, scalars: dict, step: int) -> None:
        self._trackio.log(scalars, step=step)

    def close(self) -> None:
        self._trackio.finish()
