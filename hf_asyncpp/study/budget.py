"""The gap against the training budget: several studies that train models of different sizes on the same data,
each one point at its tokens per parameter (`hf-asyncpp study --budget-figure OUT_DIR STUDY.yaml STUDY.yaml …`).

A study's points are the rows of its results.json (`report` writes it) whose learning rates were tuned per
mode (protocol `per_mode`: every optimizer, mode, EF λ and momentum at its own tuned rate); a row without a
protocol is one of the sync protocol (delayed arms at the rate tuned for sync) and is not read. Its budget is
its tokens per run (max_steps × micro_batch_size × n_microbatches × seq_len, one emulated rank) over all its
model's parameters, embeddings included, as the study headers count them. Its passes over the training
data are what a finished arm logged at its last step (`epoch`: steps over steps per pass of the training
blocks), not an estimate.

The studies must train on the same data — corpus, tokenizer, sequence length, held-out set and tokens per
run — so that the axis varies the model alone and every point has made the same passes over the data (more
tokens of a corpus that repeats would conflate the budget with repetition); no two may share a budget. Their
learning-rate schedules are listed beside the points, not checked; budget.md says when they differ.

Written to OUT_DIR: gap_vs_budget.png, a panel per EF λ (EF off first), a line per (optimizer, delayed mode,
momentum) that every study measured, the gap against tokens per parameter on a log axis ± its paired seed
spread; budget.json and budget.md, every per-mode row of every study beside its budget; budget_headline.md,
the gaps alone, a column per budget (what README Results quotes). budget.json names the study files, so that
the figure can be drawn again from them (each budget's `study_file`).
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .figures import pyplot, save_figure
from .grid import Study, StudyError
from .results import gap_cell, markdown_head, markdown_row, row_share_cell, spread

__all__ = ["PROTOCOL", "Budget", "budget_of", "budget_rows", "write_budget_figure"]

PROTOCOL = "per_mode"
ROW_KEYS = ("optimizer", "mode", "ef_lambda", "momentum", "learning_rate", "seeds", "val_loss", "val_loss_std", "gap",
            "gap_std", "ef_recovered")


@dataclass(frozen=True)
class Budget:
    """A study's training budget and the data it is spent on."""

    study: str
    study_file: str  # relative to the working directory where it lies below it, so the figure can be redrawn
    model_config: str
    parameters: int  # all of them, embeddings included
    tokens_per_run: int
    data: dict  # what every study of one figure must share: corpus, tokenizer, sequence length, held-out set
    lr_schedule: str  # listed beside the points
    passes: float | None  # over the training data, as a finished arm logged it; None before one finished

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens_per_run / self.parameters


def _study_file(study: Study) -> str:
    """The study's file as budget.json names it."""
    path = Path(study.path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def budget_of(study: Study) -> Budget:
    """The study's budget, from the config its arms run with (all of them share the model and the data)."""
    from ..hub import parameter_counts
    from ..models.presets import build_config
    from .runner import arm_config

    config = arm_config(study, study.arms(study.first_learning_rates())[0])
    total, _ = parameter_counts(build_config(config.model_config))
    data = {key: getattr(config, key) for key in ("dataset", "dataset_config_name", "dataset_split", "tokenizer",
                                                  "seq_len", "eval_dataset", "eval_fraction")}
    schedule = (f"{config.lr_scheduler_type} {json.dumps(config.lr_scheduler_kwargs or {})}, warm-up "
                f"{config.warmup_steps}/{config.max_steps} steps")
    return Budget(study.name, _study_file(study), config.model_config, total,
                  config.max_steps * config.rows_per_step * config.seq_len,
                  data, schedule, _passes(study))


def _passes(study: Study) -> float | None:
    """Passes over the training data of the study's first finished arm (all share the data and tokens), as
    its last training record logged them."""
    from ..plots import read_metrics
    from . import table_arms
    from .runner import arm_dir, finished_record

    for arm in table_arms(study):
        if finished_record(study, arm) is not None:
            train, _ = read_metrics(arm_dir(study, arm))
            return train[-1].get("epoch") if train else None
    return None


def _check_comparable(budgets: list[Budget]) -> None:
    """StudyError unless the studies share their data and tokens per run, and differ in their budgets."""
    first = budgets[0]
    for budget in budgets[1:]:
        differing = [key for key in first.data if budget.data[key] != first.data[key]]
        if budget.tokens_per_run != first.tokens_per_run:
            differing.append("tokens per run")
        if differing:
            raise StudyError(f"{budget.study} and {first.study} differ in {', '.join(differing)}: the budget axis "
                             "varies the model alone, on the same data and tokens (else the points differ in passes "
                             "over the data, or measure their losses on different text)")
    shared = [b.study for b in budgets if sum(c.parameters == b.parameters for c in budgets) > 1]
    if shared:
        raise StudyError(f"{' and '.join(shared)} have the same budget: each study is one point of the axis")


def _per_mode_rows(study: Study) -> list[dict]:
    path = study.output_dir / "results.json"
    if not path.is_file():
        raise StudyError(f"{path} does not exist: report the study first (hf-asyncpp study {study.path} --report-only)")
    rows = [row for row in json.loads(path.read_text())["rows"] if row.get("protocol", "sync") == PROTOCOL]
    if not rows:
        raise StudyError(f"{path} has no rows of learning rates tuned per mode (protocol {PROTOCOL}): "
                         "run the study with lr_protocol: per_mode")
    return rows


def budget_rows(studies: list[Study]) -> tuple[list[Budget], list[dict]]:
    """The studies' budgets, smallest first, and their per-mode rows, each with its study's budget."""
    budgets = [budget_of(study) for study in studies]
    _check_comparable(budgets)
    order = sorted(range(len(studies)), key=lambda i: budgets[i].tokens_per_parameter)
    rows = [dict(study=budgets[i].study, parameters=budgets[i].parameters,
                 tokens_per_parameter=budgets[i].tokens_per_parameter, **{key: row.get(key) for key in ROW_KEYS})
            for i in order for row in _per_mode_rows(studies[i])]
    return [budgets[i] for i in order], rows


def _lines(rows: list[dict]) -> dict[float, dict[tuple, list[tuple[float, float, float]]]]:
    """Per EF λ, per (optimizer, delayed mode, momentum) that every study measured: its (tokens per parameter,
    gap, gap spread) points. A line some study lacks is left out: its points would not span the same budgets."""
    budgets = {row["tokens_per_parameter"] for row in rows}  # one per study (_check_comparable)
    lines: dict[float, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["mode"] != "sync" and row["gap"] is not None:
            lines[row["ef_lambda"]][(row["optimizer"], row["mode"], row["momentum"])].append(
                (row["tokens_per_parameter"], row["gap"], row["gap_std"]))
    complete = {ef: {line: sorted(points) for line, points in by_line.items() if len(points) == len(budgets)}
                for ef, by_line in sorted(lines.items())}
    return {ef: by_line for ef, by_line in complete.items() if by_line}


def _figure(rows: list[dict], out: Path) -> Path:
    panels = _lines(rows)
    if not panels:
        raise StudyError("no delayed mode has a gap in every study: nothing to draw against the budget")
    plt = pyplot()
    colours = {line: f"C{i}" for i, line in enumerate(sorted({line for lines in panels.values() for line in lines}))}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (ef, lines) in zip(axes[0], panels.items()):
        for (optimizer, mode, momentum), points in sorted(lines.items()):
            budgets, gaps, spreads = zip(*points)
            ax.errorbar(budgets, gaps, yerr=spreads, marker="o", capsize=3, color=colours[(optimizer, mode, momentum)],
                        label=f"{optimizer}, {mode}, momentum {momentum:g}")
        ax.set_xscale("log")
        ticks = sorted({budget for points in lines.values() for budget, _, _ in points})
        ax.set_xticks(ticks, [f"{budget:.3g}" for budget in ticks])
        ax.minorticks_off()  # the log axis's own minor labels would crowd the few budgets
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(title=f"EF λ={ef:g}" if ef else "EF off", xlabel="tokens per parameter",
               ylabel="validation loss − sync")
        ax.legend(fontsize=7)
    fig.suptitle("Gap to synchronous training vs training budget (each mode at its own tuned rate; ± the seed spread)",
                 fontsize=9)
    return save_figure(plt, fig, out / "gap_vs_budget.png")


def _markdown(budgets: list[Budget], rows: list[dict]) -> str:
    lines = ["Budgets: the same data and tokens per run, the model's size varied (all parameters counted).", "",
             *markdown_head(["study", "model", "parameters", "tokens per run", "tokens per parameter",
                             "passes over the training data", "learning-rate schedule"])]
    lines += [markdown_row([b.study, b.model_config, f"{b.parameters:,}", f"{b.tokens_per_run:,}",
                            f"{b.tokens_per_parameter:.3g}", "–" if b.passes is None else f"{b.passes:.2f}",
                            b.lr_schedule]) for b in budgets]
    if len({b.lr_schedule for b in budgets}) > 1:
        lines += ["", "The learning-rate schedules differ: the gaps compare budgets and schedules at once."]
    lines += ["", "Each mode at its own tuned learning rate (protocol per_mode). Gap: validation loss − the sync",
              "arm's, mean ± standard deviation of the paired differences (seeds); '–': sync, or not finished.", "",
              *markdown_head(["tokens per parameter", "optimizer", "mode", "EF λ", "momentum", "learning rate",
                              "val_loss", "gap"])]
    for r in rows:
        learning_rate = "–" if r["learning_rate"] is None else f"{r['learning_rate']:g}"
        val_loss = spread(r["val_loss"], r["val_loss_std"], r["seeds"], signed=False, count=False)
        lines.append(markdown_row([f"{r['tokens_per_parameter']:.3g}", r["optimizer"], r["mode"],
                                   f"{r['ef_lambda']:g}", f"{r['momentum']:g}", learning_rate, val_loss, gap_cell(r)]))
    return "\n".join(lines) + "\n"


def _headline(budgets: list[Budget], rows: list[dict]) -> str:
    """The gaps side by side, a column per budget: per optimizer and momentum that every study ran, a row for
    its sync loss, one per delayed mode and EF λ for its gap, one for the share EF removes; the passes over
    the data last."""
    by_key = {(r["tokens_per_parameter"], r["optimizer"], r["momentum"], r["mode"], r["ef_lambda"]): r for r in rows}
    lines = ["Each mode at its own tuned learning rate (protocol per_mode); gap: validation loss − the sync arm's,",
             "mean ± standard deviation of the paired differences (seeds); '–': not finished.", "",
             *markdown_head(["optimizer", "momentum", "", *(f"{b.tokens_per_parameter:.3g} tokens per parameter "
                                                            f"({b.parameters / 1e6:.2g}M parameters)" for b in budgets)])]

    def cells(key: tuple, show) -> list[str]:
        return [show(by_key.get((b.tokens_per_parameter, *key))) for b in budgets]  # show(None): '–'

    measured = [{(r["optimizer"], r["momentum"]) for r in rows if r["tokens_per_parameter"] == b.tokens_per_parameter}
                for b in budgets]
    lanes = sorted(set.intersection(*measured))  # another study's optimizers and momenta are in budget.md
    delayed = sorted({(r["mode"], r["ef_lambda"]) for r in rows if r["mode"] != "sync"})
    for optimizer, momentum in lanes:
        head = [optimizer, f"{momentum:g}"]
        lines.append(markdown_row([*head, "sync: validation loss", *cells(
            (optimizer, momentum, "sync", 0.0),
            lambda r: "–" if r is None else spread(r["val_loss"], r["val_loss_std"], r["seeds"], signed=False))]))
        for mode, ef in delayed:
            label = f"{mode}" + (f" + EF λ {ef:g}" if ef else "")
            lines.append(markdown_row([*head, f"{label}: gap", *cells((optimizer, momentum, mode, ef), gap_cell)]))
            if ef:
                lines.append(markdown_row([*head, f"{label}: share of the gap EF removes", *cells(
                    (optimizer, momentum, mode, ef), row_share_cell)]))
    lines.append(markdown_row(["", "", "passes over the training data",
                               *("–" if b.passes is None else f"{b.passes:.2f}" for b in budgets)]))
    return "\n".join(lines) + "\n"


def write_budget_figure(out_dir: str | Path, studies: list[Study]) -> list[Path]:
    """gap_vs_budget.png, budget.json, budget.md and budget_headline.md in out_dir from the studies' results (see
    the module's docstring); StudyError for studies that cannot share the axis. Returns the files written."""
    if len(studies) < 2:
        raise StudyError("a budget figure needs at least two studies, one per budget")
    budgets, rows = budget_rows(studies)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figure = _figure(rows, out)
    table, markdown, headline = out / "budget.json", out / "budget.md", out / "budget_headline.md"
    table.write_text(json.dumps({"budgets": [{**dataclasses.asdict(b), "tokens_per_parameter": b.tokens_per_parameter}
                                             for b in budgets], "rows": rows}, indent=1))
    markdown.write_text(_markdown(budgets, rows))
    headline.write_text(_headline(budgets, rows))
    return [figure, table, markdown, headline]
