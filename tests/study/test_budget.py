"""The gap against the training budget: each study one point at its tokens per parameter (its tokens per run
over all its model's parameters), read from the rows of its results.json tuned per mode; studies that do not
share their data and tokens per run cannot share the axis. Synthetic results; nothing trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_asyncpp.study import StudyError, load_study
from hf_asyncpp.study.budget import _lines, budget_rows, write_budget_figure

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "training_scripts" / "models"
BASE_TEXT = (REPO / "training_scripts" / "configs" / "tiny_moe.yaml").read_text()
PARAMETERS = {"moe_cpu_250k": 246_528, "moe_cpu_1m": 1_140_720, "moe_cpu_4m": 4_161_312}  # as their README states
TOKENS = 1000 * 4 * 8 * 128  # max_steps × micro_batch_size × n_microbatches × seq_len, cpu_scale's


def _row(optimizer, mode, ef, gap, protocol="per_mode", momentum=0.95):
    row = dict(optimizer=optimizer, mode=mode, ef_lambda=ef, momentum=momentum, learning_rate=1e-2, seeds=3,
               val_loss=4.0 + (gap or 0), val_loss_std=0.01, gap=gap, gap_std=None if gap is None else 0.02,
               ef_recovered=None)
    return row if protocol is None else {**row, "protocol": protocol}


def _study(tmp_path: Path, model: str, rows: list[dict], **base):
    """A study of `model` on cpu_scale's data whose report holds `rows`."""
    directory = tmp_path / model
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "base.yaml").write_text(BASE_TEXT)
    keys = dict(model_config=str(MODELS / model / "config.json"), tokenizer=str(MODELS / "moe_cpu_1m"), seq_len=128,
                micro_batch_size=4, n_microbatches=8, max_steps=1000, warmup_steps=100, eval_fraction=0.02)
    raw = dict(name=f"budget_{model}", base_config="base.yaml", base={**keys, **base},
               optimizers={"adamw": [1e-2], "muon": [2e-2]}, modes=["sync", "pipedream-2bw@2"], ef=[0, 1.0],
               momentum=[0.95], seeds=[0, 1, 2], output_dir=str(directory / "out"))
    (directory / "study.yaml").write_text(json.dumps(raw))  # JSON is YAML
    (directory / "out").mkdir(exist_ok=True)
    (directory / "out" / "results.json").write_text(json.dumps({"rows": rows}))
    return load_study(directory / "study.yaml")


def _grid(gap_off: float, gap_ef: float, optimizers=("adamw", "muon")) -> list[dict]:
    """A per-mode report of sync and 2BW@2 with and without EF, and the same grid at the sync protocol's rates
    (with and without the key, as reports written before protocols were recorded have none)."""
    per_mode = [row for optimizer in optimizers for row in (
        _row(optimizer, "sync", 0.0, None), _row(optimizer, "pipedream-2bw@2", 0.0, gap_off),
        {**_row(optimizer, "pipedream-2bw@2", 1.0, gap_ef), "ef_recovered": 1 - gap_ef / gap_off})]
    return [*per_mode, _row("adamw", "pipedream-2bw@2", 0.0, 9.0, protocol="sync"),
            _row("adamw", "pipedream-2bw@2", 1.0, 9.0, protocol=None)]


def test_each_study_is_a_point_at_its_tokens_per_parameter_with_its_per_mode_gaps(tmp_path):
    studies = [_study(tmp_path, "moe_cpu_4m", _grid(0.30, 0.05)),
               _study(tmp_path, "moe_cpu_250k", _grid(0.10, 0.01)),
               _study(tmp_path, "moe_cpu_1m", _grid(0.20, 0.02, optimizers=("adamw", "muon", "soap")))]
    budgets, rows = budget_rows(studies)
    assert [b.parameters for b in budgets] == [4_161_312, 1_140_720, 246_528]  # by budget: the largest model first
    assert [round(b.tokens_per_parameter, 2) for b in budgets] == [0.98, 3.59, 16.61]
    assert all(b.tokens_per_run == TOKENS for b in budgets)
    # The rows of the sync protocol (gap 9.0, with the key or without it) are not read.
    assert {row.get("gap") for row in rows} == {None, 0.01, 0.02, 0.05, 0.10, 0.20, 0.30}

    lines = _lines(rows)
    assert list(lines) == [0.0, 1.0]  # EF off, then EF on
    # A line per optimizer that every study measured (soap is in one study only), its points by budget.
    assert sorted(lines[0.0]) == [("adamw", "pipedream-2bw@2", 0.95), ("muon", "pipedream-2bw@2", 0.95)]
    adamw_off = lines[0.0][("adamw", "pipedream-2bw@2", 0.95)]
    assert [(round(x, 2), gap, spread) for x, gap, spread in adamw_off] == [
        (0.98, 0.30, 0.02), (3.59, 0.20, 0.02), (16.61, 0.10, 0.02)]
    assert [gap for _, gap, _ in lines[1.0][("muon", "pipedream-2bw@2", 0.95)]] == [0.05, 0.02, 0.01]

    # The passes over the training data are what a finished arm logged at its last step; "–" before one finished.
    from tests.study.test_tuning import finish

    arm = studies[1].arms(studies[1].first_learning_rates())[0]
    finish(studies[1], arm, 4.0)
    (studies[1].output_dir / "arms" / arm.name / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "epoch": step / 453.5, "loss": 5.0}) + "\n" for step in (500, 1000)))
    written = write_budget_figure(tmp_path / "figure", studies)
    assert [p.name for p in written] == ["gap_vs_budget.png", "budget.json", "budget.md", "budget_headline.md"]
    table = json.loads((tmp_path / "figure" / "budget.json").read_text())
    assert [b["study"] for b in table["budgets"]] == ["budget_moe_cpu_4m", "budget_moe_cpu_1m", "budget_moe_cpu_250k"]
    assert len(table["rows"]) == 6 + 9 + 6  # the per-mode rows of each study, soap's included
    markdown = (tmp_path / "figure" / "budget.md").read_text()
    row = "| 16.6 | adamw | pipedream-2bw@2 | 0 | 0.95 | 0.01 | 4.100 ± 0.010 | +0.100 ± 0.020 (3 seeds) |"
    assert row in markdown
    assert "| budget_moe_cpu_250k | " in markdown and "| 246,528 | 4,096,000 | 16.6 | 2.21 | cosine {}" in markdown
    assert "| 4,161,312 | 4,096,000 | 0.984 | – | cosine {}" in markdown
    assert table["budgets"][1]["passes"] is None and table["budgets"][2]["passes"] == pytest.approx(1000 / 453.5)
    assert "cosine {}, warm-up 100/1000 steps" in markdown  # each study's schedule, shown beside its budget
    assert "schedules differ" not in markdown
    # The study files, so that the figure can be drawn again from them.
    assert [b["study_file"] for b in table["budgets"]] == [str(s.path.resolve()) for s in (studies[0], studies[2],
                                                                                            studies[1])]

    # The headline: a column per budget, smallest first; per optimizer its sync loss, each delayed mode's gap.
    headline = (tmp_path / "figure" / "budget_headline.md").read_text().splitlines()
    assert headline[3] == ("| optimizer | momentum |  | 0.984 tokens per parameter (4.2M parameters) | 3.59 tokens "
                           "per parameter (1.1M parameters) | 16.6 tokens per parameter (0.25M parameters) |")
    assert headline[5:9] == [
        "| adamw | 0.95 | sync: validation loss | 4.000 ± 0.010 (3 seeds) | 4.000 ± 0.010 (3 seeds) | "
        "4.000 ± 0.010 (3 seeds) |",
        "| adamw | 0.95 | pipedream-2bw@2: gap | +0.300 ± 0.020 (3 seeds) | +0.200 ± 0.020 (3 seeds) | "
        "+0.100 ± 0.020 (3 seeds) |",
        "| adamw | 0.95 | pipedream-2bw@2 + EF λ 1: gap | +0.050 ± 0.020 (3 seeds) | +0.020 ± 0.020 (3 seeds) | "
        "+0.010 ± 0.020 (3 seeds) |",
        "| adamw | 0.95 | pipedream-2bw@2 + EF λ 1: share of the gap EF removes | 83% | 90% | 90% |"]
    assert headline[-1] == "|  |  | passes over the training data | – | – | 2.21 |"
    assert len(headline) == 5 + 2 * 4 + 1  # soap, which one study ran, is in budget.md alone


def test_a_delayed_mode_without_a_paired_sync_seed_shows_no_gap_in_the_headline(tmp_path):
    """A delayed arm can finish before its seed's sync arm: its row has no gap yet, and no share."""
    unpaired = [{**row, "gap": None, "gap_std": None, "ef_recovered": None} if row["optimizer"] == "muon"
                and row["mode"] != "sync" else row for row in _grid(0.3, 0.05)]
    studies = [_study(tmp_path, "moe_cpu_1m", _grid(0.2, 0.02)), _study(tmp_path, "moe_cpu_4m", unpaired)]
    write_budget_figure(tmp_path / "figure", studies)
    headline = (tmp_path / "figure" / "budget_headline.md").read_text()
    assert "| muon | 0.95 | pipedream-2bw@2: gap | – | +0.200 ± 0.020 (3 seeds) |" in headline
    assert "| muon | 0.95 | pipedream-2bw@2 + EF λ 1: share of the gap EF removes | – | 90% |" in headline


def test_budgets_run_with_different_learning_rate_schedules_are_drawn_and_the_table_says_so(tmp_path):
    floor = dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1})
    studies = [_study(tmp_path, "moe_cpu_1m", _grid(0.2, 0.02)),
               _study(tmp_path, "moe_cpu_4m", _grid(0.3, 0.05), **floor)]
    write_budget_figure(tmp_path / "figure", studies)
    markdown = (tmp_path / "figure" / "budget.md").read_text()
    assert 'cosine_with_min_lr {"min_lr_rate": 0.1}, warm-up 100/1000 steps' in markdown
    assert "The learning-rate schedules differ: the gaps compare budgets and schedules at once." in markdown


@pytest.mark.parametrize("different, named", [
    (dict(max_steps=2000), "tokens per run"),  # more passes over the same corpus: repetition, not only budget
    (dict(seq_len=256, micro_batch_size=2), "seq_len"),  # the same tokens per run in other sequences
    (dict(dataset="other.txt"), "dataset"),
    (dict(eval_fraction=0.05), "eval_fraction"),  # losses measured on another held-out set
])
def test_studies_that_do_not_share_their_data_and_tokens_cannot_share_the_axis(tmp_path, different, named):
    studies = [_study(tmp_path, "moe_cpu_1m", _grid(0.2, 0.02)),
               _study(tmp_path, "moe_cpu_4m", _grid(0.3, 0.05), **different)]
    with pytest.raises(StudyError, match=rf"budget_moe_cpu_4m and budget_moe_cpu_1m differ in {named}"):
        write_budget_figure(tmp_path / "figure", studies)
    assert not (tmp_path / "figure").exists()


def test_two_studies_of_one_budget_and_a_report_without_per_mode_rows_are_refused(tmp_path):
    one = _study(tmp_path / "a", "moe_cpu_1m", _grid(0.2, 0.02))
    with pytest.raises(StudyError, match="have the same budget"):
        write_budget_figure(tmp_path / "figure", [one, _study(tmp_path / "b", "moe_cpu_1m", _grid(0.2, 0.02))])
    sync_only = [row for row in _grid(0.3, 0.05) if row.get("protocol") != "per_mode"]
    with pytest.raises(StudyError, match="no rows of learning rates tuned per mode"):
        write_budget_figure(tmp_path / "figure", [one, _study(tmp_path, "moe_cpu_4m", sync_only)])
    with pytest.raises(StudyError, match="at least two studies"):
        write_budget_figure(tmp_path / "figure", [one])


def test_the_study_command_draws_the_budget_figure_from_several_study_files(tmp_path, capsys):
    from hf_asyncpp.cli import main

    paths = [str(_study(tmp_path, model, _grid(0.2, 0.02)).path) for model in ("moe_cpu_1m", "moe_cpu_4m")]
    assert main(["study", "--budget-figure", str(tmp_path / "figure"), *paths]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "figure" / name)
                                               for name in ("gap_vs_budget.png", "budget.json", "budget.md",
                                                                         "budget_headline.md")]
    with pytest.raises(SystemExit):  # several studies are a budget figure's, not a run's
        main(["study", *paths])
    assert "one study at a time" in capsys.readouterr().err
