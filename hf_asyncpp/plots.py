"""Loss curves of finished or running trainings as PNG files, read from their metrics.jsonl.

`write_loss_curves` draws one run (training and validation loss, and the MoE load-balancing loss
when the model has one); `compare_runs` overlays several runs, against steps or tokens seen.
matplotlib is imported inside the functions, so importing hf_asyncpp does not pay for it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["X_AXES", "compare_runs", "read_metrics", "write_loss_curves"]

X_AXES = ("step", "tokens")


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of `<run_dir>/metrics.jsonl`, each sorted by step.

    A resumed run rewrites the steps after its checkpoint, so the last record of a (kind, step) wins.
    Records of neither kind (no `step`, or neither `loss` nor `eval_loss`) are left out.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir} (looked for {path})")
    train_by_step: dict[int, dict] = {}
    eval_by_step: dict[int, dict] = {}
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line_number} is not JSON: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{line_number} is not a metrics record (a JSON object)")
        if "step" not in record:
            continue
        if "loss" in record:
            train_by_step[record["step"]] = record
        elif "eval_loss" in record:
            eval_by_step[record["step"]] = record
    return ([train_by_step[step] for step in sorted(train_by_step)],
            [eval_by_step[step] for step in sorted(eval_by_step)])


def write_loss_curves(run_dir: str | Path, out_path: str | Path | None = None, x: str = "step") -> Path:
    """Training and validation loss of one run against `x` ("step" or "tokens"), with a second panel
    for the auxiliary (load-balancing) loss if it is ever non-zero; written to `out_path`
    (default `<run_dir>/loss_curves.png`). Returns the path written."""
    run_dir = Path(run_dir)
    train, evals = read_metrics(run_dir)
    series = _loss_series(train, evals, x, run_dir)
    aux_losses = [record.get("aux_loss") or 0.0 for record in train]
    has_aux = any(aux_losses)

    figure = _new_figure(height=6.0 if has_aux else 4.5)
    if has_aux:
        loss_axes, aux_axes = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    else:
        loss_axes, aux_axes = figure.subplots(), None
    _draw_losses(loss_axes, series, color="C0", label_prefix="")
    loss_axes.set_ylabel("loss")
    loss_axes.legend()
    loss_axes.set_title(run_dir.resolve().name)
    if aux_axes is not None:
        aux_axes.plot(series["train_x"], aux_losses, color="C2")
        aux_axes.set_ylabel("aux loss")
    (loss_axes if aux_axes is None else aux_axes).set_xlabel(x)
    return _save(figure, run_dir / "loss_curves.png" if out_path is None else out_path)


def compare_runs(run_dirs: list[str | Path], out_path: str | Path, x: str = "step") -> Path:
    """Every run's training loss (solid) and validation loss (dashed, same colour) on one axes against
    `x` ("step" or "tokens"), labelled by run directory name. Returns the path written."""
    run_dirs = [Path(run_dir) for run_dir in run_dirs]
    # Read every run before drawing, so a missing one fails before anything is written.
    all_series = [_loss_series(*read_metrics(run_dir), x, run_dir) for run_dir in run_dirs]

    figure = _new_figure(height=5.0)
    axes = figure.subplots()
    for index, (label, series) in enumerate(zip(_run_labels(run_dirs), all_series)):
        _draw_losses(axes, series, color=f"C{index % 10}", label_prefix=f"{label} ")
    axes.set_xlabel(x)
    axes.set_ylabel("loss")
    axes.set_title("loss by run")
    axes.legend(fontsize="small")
    return _save(figure, out_path)


def _loss_series(train: list[dict], evals: list[dict], x: str, run_dir: Path) -> dict:
    """The x and loss values of one run's training and evaluation records."""
    if x not in X_AXES:
        raise ValueError(f"x must be one of {', '.join(X_AXES)}, not {x!r}")
    if not train and not evals:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no loss records")
    train_steps = [record["step"] for record in train]
    eval_steps = [record["step"] for record in evals]
    if x == "step":
        train_x, eval_x = train_steps, eval_steps
    else:
        import numpy as np

        if not train or any("num_input_tokens_seen" not in record for record in train):
            raise ValueError(f"{run_dir / 'metrics.jsonl'} has training records without 'num_input_tokens_seen'")
        train_x = [record["num_input_tokens_seen"] for record in train]
        # Evaluation records count held-out tokens, not training progress: place them at the tokens
        # seen by their step, interpolated between the logged training steps.
        eval_x = np.interp(eval_steps, train_steps, train_x).tolist()
    return {"train_x": train_x, "train_loss": [record["loss"] for record in train],
            "eval_x": eval_x, "eval_loss": [record["eval_loss"] for record in evals]}


def _draw_losses(axes, series: dict, color: str, label_prefix: str) -> None:
    if series["train_x"]:
        axes.plot(series["train_x"], series["train_loss"], color=color, label=f"{label_prefix}train")
    if series["eval_x"]:
        axes.plot(series["eval_x"], series["eval_loss"], color=color, linestyle="--", marker="o",
                  markersize=4, label=f"{label_prefix}eval")


def _run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's directory name; names shared by several runs get their parent directory too."""
    names = [run_dir.resolve().name for run_dir in run_dirs]
    return [f"{run_dir.resolve().parent.name}/{name}" if names.count(name) > 1 else name
            for run_dir, name in zip(run_dirs, names)]


def _new_figure(height: float):
    # A bare Figure on an Agg canvas: no pyplot state, no display backend, safe in any process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8.0, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save(figure, out_path: str | Path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=120)
    return out_path
