"""The README keeps its promises to a first-time reader:

- its first command trains what the project is for (PipeDream-2BW on two stages, Muon, Error Feedback, a
  held-out split), and the lines shown under it are the ones that run ends with;
- its Trainer example, extracted exactly as printed, runs with the command printed under it (two
  processes, one pipeline stage each), trains (the loss falls), evaluates, and leaves an HF model
  directory that `from_pretrained` loads; its metrics.jsonl holds the keys the README names;
- its test command is the one CI runs (.ci/run);
- its Results table is the committed study report's headline table, verbatim (docs/studies.md quotes its
  verdicts table likewise), and each loss difference its prose quotes is one the committed report or arms give;
- once the budget figure is committed, Results shows it and quotes its table, and says it is still to run before;
- every number of the reference study it (or docs/studies.md) quotes carries its source grade;
- every relative link in it and in docs/ points at a file (and heading) that exists.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.repo

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


@pytest.mark.multirank
def test_the_trainer_example_runs_as_printed(tmp_path):
    from transformers import AutoModelForCausalLM

    section = _section("With `transformers.Trainer`")
    [script], [command] = _blocks(section, "python"), _blocks(section, "bash")
    (tmp_path / "sonnets.py").write_text(script)
    argv = shlex.split(command.strip())
    assert argv[0] == "torchrun" and argv[-1] == "sonnets.py"
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]  # torchrun of this interpreter
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the example imports the package from anywhere
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    out = tmp_path / "outputs" / "sonnets"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [10, 20, 30] and [r["step"] for r in evals] == [10, 20, 30]
    # A 1.3M-parameter model from random init (ln 8192 ≈ 9.0) learns within 30 steps: at step 30 the
    # loss has fallen by far more than step-to-step noise; observed 7.92 → 5.68, eval 6.46 → 5.88.
    assert train[-1]["loss"] < train[0]["loss"] - 1.0 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(r["aux_loss"] > 0 for r in train)  # output_router_logits: the load-balancing loss is on
    named = re.search(r"hold the same keys \((.*?)\)", README.replace("\n", " ")).group(1)
    assert {key.strip("` ") for key in named.split(",") if key.strip("` ") != "…"} <= set(train[0])
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.3e6, rel=0.01)  # "a 1.3M-parameter MoE"
    assert (out / "final" / "README.md").is_file() and (out / "final" / "tokenizer.json").is_file()


def test_the_quickstart_trains_what_the_project_is_for_and_shows_its_closing_lines():
    """The first command runs tiny_moe.yaml on as many processes as it has pipeline stages: PipeDream-2BW,
    Muon, Error Feedback (λ = 1), a held-out split; the lines shown under it are that run's closing lines."""
    import yaml

    from hf_asyncpp.config import load_config

    section = _section("Quickstart")
    [train_command, _] = _blocks(section, "bash")
    launcher = yaml.safe_load((REPO / re.search(r"--config_file (\S+)", train_command).group(1)).read_text())
    config = load_config(str(REPO / re.search(r"train\.py --config (\S+)", train_command).group(1)))
    assert (config.schedule, config.optimizer, config.ef, config.ef_lambda) == ("pipedream-2bw", "muon", True, 1.0)
    assert config.pp_size == launcher["num_processes"] == 2 and config.eval_fraction > 0
    [shown] = _blocks(section, "text")
    idle, flush, validation, *_ = shown.splitlines()
    assert idle.startswith(f"[hf_asyncpp] idle share by pipeline rank over {config.max_steps} steps of pipedream-2bw ")
    p, m = config.pp_size, config.n_microbatches
    assert flush.startswith("[hf_asyncpp] 1f1b's flush would add ") and flush.endswith(
        f"; {(p - 1) / (m + p - 1):.2f} on equal stages)")
    assert validation.startswith("[hf_asyncpp] validation loss ")


def test_the_readme_test_command_is_the_one_ci_runs():
    [_, test_command] = _blocks(_section("Quickstart"), "bash")
    assert test_command.strip() in (REPO / ".ci" / "run").read_text()


def test_the_readme_stays_under_200_lines_what_is_reference_lives_in_docs():
    assert len(README.splitlines()) < 200


@pytest.mark.parametrize("page, text, table", [("README Results", _section("Results"), "headline.md"),
                                                ("docs/studies.md", (REPO / "docs" / "studies.md").read_text(),
                                                 "verdicts.md")])
def test_the_results_tables_are_the_committed_reports_headline_and_verdicts(page, text, table):
    """README Results quotes docs/results/<study>/headline.md, docs/studies.md its verdicts.md, between
    markers; the staleness test in test_shipped_configs.py keeps those files what the committed arms give,
    so neither page can drift."""
    quoted = re.findall(r"<!-- report: (\S+) -->\n(.*?)<!-- /report -->", text, flags=re.S)
    assert table in {Path(path).name for path, _ in quoted}, f"{page} quotes the report's {table}"
    for path, body in quoted:
        assert body == (REPO / path).read_text(), f"{page} is not {path}: copy it in"


def test_the_results_show_the_budget_figure_once_it_is_committed():
    """docs/results/cpu_budget holds the gap against the training budget (`--budget-figure`): Results embeds its
    figure, and docs/studies.md quotes its headline table (the test above holds the quote to the file); before
    it is drawn, Results says the budget studies are still to run, and nothing of theirs is shown."""
    results, figure = _section("Results"), "docs/results/cpu_budget/gap_vs_budget.png"
    if (REPO / "docs" / "results" / "cpu_budget" / "budget.json").is_file():
        studies = (REPO / "docs" / "studies.md").read_text()
        assert f"]({figure})" in results and "<!-- report: docs/results/cpu_budget/budget_headline.md -->" in studies
        assert "Still to run: the budget studies" not in results
    else:
        assert "Still to run: the budget studies" in results and figure not in results


def _seed_gaps(arms: dict[str, float]) -> set[str]:
    """Every grid arm's gap to the sync arm of its optimizer, momentum, learning rate and seed, as printed
    (arms are named optimizer-mode-m<momentum>-lr<rate>-s<seed>)."""
    gaps = set()
    for name, loss in arms.items():
        optimizer = name.partition("-")[0]
        sync = re.sub(r"^.*?(-m[\d.]+-lr.+-s\d+)$", rf"{optimizer}-sync\1", name)
        if sync != name and sync in arms:
            gaps.add(f"{loss - arms[sync]:+.3f}")
    return gaps


def test_the_results_prose_quotes_only_numbers_the_committed_report_gives():
    """A loss or gap the bullets print (a signed value to 3 decimals, with its spread if any) is in the
    tables of a report Results quotes (the study's, the budget figure's) or is one seed's gap from a quoted
    study's arms: prose left behind by later arms fails."""
    prose = re.sub(r"<!-- report: \S+ -->.*?<!-- /report -->", "", _section("Results"), flags=re.S)
    reports = {REPO / Path(path).parent for path in re.findall(r"<!-- report: (\S+) -->", _section("Results"))}
    tables = "".join(page.read_text() for report in reports for page in report.glob("*.md")).replace("-", "−")
    given = set().union(*(_seed_gaps(json.loads((report / "results.json").read_text())["arms"])  # a grid's arms
                          for report in reports if (report / "results.json").is_file()))
    stale = [value for value in re.findall(r"[+−-]\d\.\d{3}(?: ± \d\.\d{3})?", prose)
             if value.replace("-", "−") not in tables and value.replace("−", "-") not in given]
    folders = sorted(str(report.relative_to(REPO)) for report in reports)
    assert not stale, f"README Results quotes {stale}, which no report it quotes gives ({folders})"


def _hand_written(text: str) -> str:
    """A page without the blocks generated from the records (the report tables and the transcription, whose
    numbers the study tests hold to their grades)."""
    return re.sub(r"<!-- (report|reference): \S+ -->.*?<!-- /\1 -->", "", text, flags=re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/studies.md"])
def test_every_published_number_the_text_quotes_carries_its_source_grade(page):
    """Each value the reference's records print with a digit in it (a loss, gap, share, or a finding such as
    "16 stages") is followed by a grade, and every grade follows a value whose record has that grade: a
    published number quoted without its grade, or with another, fails."""
    from hf_asyncpp.study.reference import grade_legend, published_records

    text, records = re.sub(r"\s+", " ", _hand_written((REPO / page).read_text())), published_records()  # one line
    for record in (r for r in records if re.search(r"\d", r.shown)):
        for quoted in re.finditer(rf"(?<![\d.])[+−-]?{re.escape(record.shown.lstrip('+'))}(?![\d%])", text):
            assert text[quoted.end():].startswith((" [V2]", " [S1]")), \
                f"{page} quotes {quoted.group()} without its grade"
    rest = text.replace(grade_legend(), "")
    for citation in sorted({r.cited for r in records}, key=len, reverse=True):
        rest = rest.replace(citation, "")
    assert not re.findall(r"\S+ \[(?:V2|S1)\]", rest), f"{page}: a grade that is not its record's"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))])
def test_relative_links_point_at_files_and_headings_that_exist(page):
    path = REPO / page
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)]*))?\)", path.read_text()):
        if "://" in target:
            continue
        linked = (path.parent / target) if target else path
        assert linked.exists(), f"{page} links to {target}, which does not exist"
        assert not anchor or anchor in _anchors(linked), f"{page} links to {target}#{anchor}: no such heading"
