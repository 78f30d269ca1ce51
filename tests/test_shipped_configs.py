"""The configs in training_scripts/configs/ validate at the world size they are written for, the 2B and 10B
MoE configs describe the models their headers, docs/scale.md and training_scripts/models/README.md advertise,
the dense 135M and 360M model configs have the parameter counts that training_scripts/models/README.md's table
states, and every study in training_scripts/studies/ loads and every one of its arms validates as the study
runner would run it (at world size = depth for launch: pipeline), so a study cannot fail on a config error
after hours of earlier arms. A study whose arms are committed (docs/results/<study>/) has its committed report
equal to the one those arms give.

The scale configs name files their header tells the user to prepare with Hub access (the SmolLM2 tokenizer,
prepared training shards, a held-out parquet file): stand-ins replace them here — the shipped tokenizer, a
one-block prepared directory, a one-row file. A training set that is a Hub dataset id is only parsed by
validation (`check_dataset_source` never contacts the Hub), so it is checked as written with HF_HUB_OFFLINE
lifted for validation alone; huggingface_hub itself stays offline (it read the variable at import), so
nothing can reach the network. The studies built on those
configs get the same stand-ins through their `base` keys.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hf_asyncpp.config import load_config
from hf_asyncpp.config_checks import validate_config
from hf_asyncpp.hub import parameter_counts
from hf_asyncpp.models.presets import build_config
from hf_asyncpp.study import load_study
from hf_asyncpp.study.runner import check_arms

pytestmark = pytest.mark.repo

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "training_scripts" / "configs").glob("*.yaml"))
STUDIES = sorted((REPO / "training_scripts" / "studies").glob("*.yaml"))
MODELS = REPO / "training_scripts" / "models"
DENSE = ("dense_135m", "dense_360m")


@dataclass(frozen=True)
class Advertised:
    world_size: int  # the launch the config is written for (its accelerate config's process count)
    total: str  # parameters, as the docs print them
    active: str  # parameters active per token


SCALE = {"moe_2b.yaml": Advertised(8, "2.04B", "0.45B"), "moe_10b.yaml": Advertised(32, "10.12B", "1.66B")}
TOKENS_PER_PARAMETER = 20  # the study's budget, which max_steps is sized to
TOLERANCE = 0.03


def _billions(text: str) -> float:
    return float(text.removesuffix("B")) * 1e9


def _count(text: str) -> float:
    """A parameter count as the docs print it: 162.8M, 2.04B."""
    return float(text[:-1]) * {"M": 1e6, "B": 1e9}[text[-1]]


def _prepared_stand_in(tmp_path, seq_len: int) -> str:
    """A prepared directory of one block at seq_len, as `hf-asyncpp prepare-data` writes it."""
    from hf_asyncpp.data.prepare import prepare_data

    out = tmp_path / f"prepared_{seq_len}"
    if not out.exists():
        corpus = tmp_path / "stand_in_corpus.jsonl"
        corpus.write_text('{"text": "%s"}\n' % " ".join(f"word{i % 97}" for i in range(seq_len)))
        prepare_data(str(corpus), str(out), "builtin", seq_len)
    return str(out)


def _with_stand_ins(config, tmp_path):
    """The config with the files a user prepares replaced by stand-ins when they are not there."""
    if config.tokenizer not in (None, "builtin") and not os.path.isdir(config.tokenizer):
        config.tokenizer = "builtin"
    if config.dataset.startswith("data/") and not os.path.exists(config.dataset):  # shards the header prepares
        config.dataset = _prepared_stand_in(tmp_path, config.seq_len)
    if config.eval_dataset is not None and not os.path.exists(config.eval_dataset):
        held_out = tmp_path / "held_out.jsonl"
        held_out.write_text('{"text": "a held-out document"}\n')
        config.eval_dataset = str(held_out)
    return config


def _validate_from_repo_root(monkeypatch) -> None:
    """Paths resolve as a run from the repository root resolves them, and hf_asyncpp's dataset check accepts
    Hub ids (it only parses them) while the Hub client itself stays offline."""
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE  # read at import, before the variable is lifted below: the client stays offline
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # for hf_asyncpp's own check, which reads it at call time


def _validated(path: Path, tmp_path, monkeypatch):
    """(config, HF model config) for a shipped YAML, validated at its world size from the repository root."""
    _validate_from_repo_root(monkeypatch)
    config = _with_stand_ins(load_config(str(path)), tmp_path)
    advertised = SCALE.get(path.name)
    return config, validate_config(config, advertised.world_size if advertised else 2)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path, tmp_path, monkeypatch):
    config, _ = _validated(path, tmp_path, monkeypatch)
    assert config.model_config and config.output_dir.startswith("outputs/")


@pytest.mark.parametrize("name", sorted(SCALE))
def test_a_scale_config_builds_the_model_it_advertises(name, tmp_path, monkeypatch):
    path = REPO / "training_scripts" / "configs" / name
    advertised = SCALE[name]
    config, model_config = _validated(path, tmp_path, monkeypatch)
    total, active = parameter_counts(model_config)  # a meta-device build: nothing is allocated
    assert total == pytest.approx(_billions(advertised.total), rel=TOLERANCE)
    assert active == pytest.approx(_billions(advertised.active), rel=TOLERANCE)

    assert model_config.model_type == "qwen3_moe" and not model_config.tie_word_embeddings
    assert (config.schedule, config.optimizer, config.ef, config.seq_len) == ("pipedream-2bw", "muon", True, 2048)
    dp_size = advertised.world_size // config.pp_size
    tokens = config.max_steps * config.rows_per_step * dp_size * config.seq_len
    assert tokens == pytest.approx(TOKENS_PER_PARAMETER * total, rel=TOLERANCE)

    docs = {"its header": path.read_text(), "docs/scale.md": (REPO / "docs" / "scale.md").read_text(),
            "training_scripts/models/README.md": (REPO / "training_scripts" / "models" / "README.md").read_text()}
    for where, text in docs.items():
        assert advertised.total in text and advertised.active in text, f"{name}: counts not stated in {where}"


def _study_with_stand_ins(path: Path, tmp_path):
    """The study with the files a user prepares (tokenizer, held-out file) replaced by stand-ins in its base
    keys, which every arm sets on top of its base_config."""
    study = load_study(path)
    config = load_config(str(study.base_config))
    for key in ("tokenizer", "eval_dataset", "dataset", "seq_len"):
        if key in study.base:
            setattr(config, key, study.base[key])
    config = _with_stand_ins(config, tmp_path)
    study.base["tokenizer"], study.base["dataset"] = config.tokenizer, config.dataset
    if config.eval_dataset is not None:
        study.base["eval_dataset"] = config.eval_dataset
    return study


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_every_arm_of_every_shipped_study_validates(path, tmp_path, monkeypatch):
    _validate_from_repo_root(monkeypatch)
    study = _study_with_stand_ins(path, tmp_path)
    # Every arm it may run before a tuning adds candidates: the sync tuning; each protocol's arms at the first
    # candidates; under per_mode each delayed group's candidates, and its seeds at a pick other than the sync
    # protocol's (the smallest factor).
    first = study.first_learning_rates()
    per_mode = {group: study.per_mode_candidates(study.learning_rate(first, group[0], group[3]))
                for group in study.delayed_groups} if "per_mode" in study.protocols else {}
    arms = [*study.tuning_arms(), *(study.arms(first) if "sync" in study.protocols else []),
            *(study.tuning_arm(group, lr) for group, lrs in per_mode.items() for lr in lrs),
            *(study.arms(first, {group: lrs[0] for group, lrs in per_mode.items()}) if per_mode else [])]
    check_arms(study, arms)  # as `hf-asyncpp study` does before any arm runs; pipeline arms at world size = depth

    # Scratch output under outputs/ (ignored by git), or a study whose finished arms are kept in the
    # repository (docs/results/<study>/) so that it can be run in parts on different machines.
    assert study.output_dir.parts[0] == "outputs" or study.output_dir.parts[:2] == ("docs", "results")
    if study.launch == "pipeline":
        # Every torchrun of the runner takes GPUs from cuda:0 and the default rendezvous port: one at a time.
        assert study.parallel == 1
    # A header that counts the study's runs (its cost estimate rests on the count) counts them right: the
    # tuning arms of the chosen learning rate are the grid's own sync arms, so each distinct name runs once.
    names = {arm.name for arm in arms}
    stated = re.search(r"^# Arms: (at most )?(\d+)", path.read_text(), re.MULTILINE)
    if stated:
        assert int(stated.group(2)) == len(names)


def _table(text: str, columns: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """{row label: {column: cell}} of the Markdown table whose header row names `columns`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("|") and [c.strip() for c in line.strip("|").split("|")][1:] == list(columns))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        label, *cells = (c.strip() for c in line.strip().strip("|").split("|"))
        rows[label] = dict(zip(columns, cells))
    return rows


@pytest.mark.parametrize("name", DENSE)
def test_a_dense_model_config_has_the_parameter_count_its_readme_row_states(name, monkeypatch):
    monkeypatch.chdir(REPO)
    table = _table((MODELS / "README.md").read_text(), DENSE)
    model_config = build_config(str(MODELS / name / "config.json"))
    total, active = parameter_counts(model_config)  # a meta-device build: nothing is allocated
    assert total == active  # dense: every parameter is active
    assert total == pytest.approx(_count(table["parameters, total"][name]), rel=TOLERANCE)
    lm_head = model_config.vocab_size * model_config.hidden_size
    assert lm_head == pytest.approx(_count(table["of which the untied lm_head"][name]), rel=TOLERANCE)
    # Untied: the pipeline and the emulator at depth > 1 cannot split a shared embedding.
    assert model_config.model_type == "llama" and not model_config.tie_word_embeddings
    assert model_config.vocab_size == 49152 and model_config.max_position_embeddings >= 2048


def test_the_cpu_study_model_has_the_size_its_readme_states_and_its_own_reproducible_tokenizer(tmp_path, monkeypatch):
    import subprocess
    import sys

    from transformers import AutoTokenizer

    monkeypatch.chdir(REPO)
    directory = MODELS / "moe_cpu_1m"
    model_config = build_config(str(directory / "config.json"))
    total, _ = parameter_counts(model_config)
    embeddings = 2 * model_config.vocab_size * model_config.hidden_size  # untied
    assert (round(total / 1e6, 2), round((total - embeddings) / 1e6, 2)) == (1.14, 0.94)  # as its README says
    assert len(AutoTokenizer.from_pretrained(str(directory))) == model_config.vocab_size == 2048
    # The README's command rebuilds the checked-in tokenizer byte for byte (BPE training is deterministic).
    subprocess.run([sys.executable, "training_scripts/build_tokenizer.py", "--vocab-size", "2048", "--out",
                    str(tmp_path)], check=True, capture_output=True)
    assert (tmp_path / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()


CPU_MODELS = ("moe_cpu_250k", "moe_cpu_1m", "moe_cpu_4m")
CPU_STUDY_TOKENS = 1000 * 4096  # cpu_scale's and the budget studies' tokens per run


def test_the_cpu_study_models_have_the_counts_their_readme_table_states_and_one_layout_family():
    table = _table((MODELS / "README.md").read_text(), CPU_MODELS)
    first = build_config(str(MODELS / "moe_cpu_1m" / "config.json"))
    for name in CPU_MODELS:
        model_config = build_config(str(MODELS / name / "config.json"))
        total, _ = parameter_counts(model_config)  # a meta-device build: nothing is allocated
        embeddings = 2 * model_config.vocab_size * model_config.hidden_size  # untied
        assert total == int(table["parameters, total"][name].replace(",", ""))
        assert total - embeddings == int(table["outside the embeddings"][name].replace(",", ""))
        assert f"{CPU_STUDY_TOKENS / total:.3g}" == table["tokens per parameter at 4,096,000 tokens"][name]
        # One family: the same architecture, routing and vocabulary (the budget studies read moe_cpu_1m's
        # tokenizer), heads of one size in one grouping, experts twice the hidden size.
        for key in ("model_type", "num_local_experts", "num_experts_per_tok", "vocab_size", "head_dim",
                    "tie_word_embeddings", "router_aux_loss_coef", "max_position_embeddings"):
            assert getattr(model_config, key) == getattr(first, key), (name, key)
        assert model_config.num_attention_heads * model_config.head_dim == model_config.hidden_size
        assert model_config.num_attention_heads == 2 * model_config.num_key_value_heads
        assert model_config.moe_intermediate_size == 2 * model_config.hidden_size
    counts = [parameter_counts(build_config(str(MODELS / name / "config.json")))[0] for name in CPU_MODELS]
    assert counts[-1] / counts[0] >= 16  # the budgets, at one token count, span at least 16× in tokens per parameter


COMMITTED_STUDIES = [p for p in STUDIES
                     if str(yaml.safe_load(p.read_text()).get("output_dir", "")).startswith("docs/results/")]


@pytest.mark.parametrize("path", COMMITTED_STUDIES, ids=lambda p: p.name)
def test_a_committed_study_report_is_the_one_its_committed_arms_give(path, tmp_path, monkeypatch):
    """The tables and claims in docs/results/<study>/ (which the README and docs/studies.md quote) are what
    `--report-only` writes from the arms committed beside them: a report left stale by later arms fails."""
    import dataclasses
    import shutil

    from hf_asyncpp.study import report

    monkeypatch.chdir(REPO)
    study = load_study(path)
    committed = REPO / study.output_dir
    if not (committed / "arms").is_dir():  # nothing run yet: nothing reported either
        assert not any((committed / name).exists() for name in ("claims.md", "headline.md", "verdicts.md"))
        return
    shutil.copytree(committed / "arms", tmp_path / "arms", ignore=shutil.ignore_patterns("*.log", "*.txt"))
    report(dataclasses.replace(study, output_dir=tmp_path))
    for name in ("summary.md", "claims.md", "headline.md", "verdicts.md", "results.md", "results.csv", "tuning.json"):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), f"{committed / name} is stale"


COMMITTED_BUDGET_FIGURES = sorted((REPO / "docs" / "results").glob("*/budget.json"))


@pytest.mark.parametrize("table", COMMITTED_BUDGET_FIGURES, ids=lambda p: p.parent.name)
def test_a_committed_budget_figure_is_the_one_its_studies_committed_reports_give(table, tmp_path, monkeypatch):
    """budget.md, budget_headline.md (which README Results quotes) and budget.json are what `--budget-figure`
    draws from the studies budget.json names, as their committed reports stand: a budget table left stale by
    a study's later arms fails."""
    import json

    from hf_asyncpp.study.budget import write_budget_figure

    monkeypatch.chdir(REPO)
    files = [budget["study_file"] for budget in json.loads(table.read_text())["budgets"]]
    write_budget_figure(tmp_path, [load_study(REPO / file) for file in files])
    for name in ("budget.json", "budget.md", "budget_headline.md"):
        assert (tmp_path / name).read_text() == (table.parent / name).read_text(), f"{table.parent / name} is stale"
