"""model_cards/example.md is the card the README quickstart's export writes
(outputs/tiny_moe/final/README.md).

The test renders it as the export does (hub.run_model_card) from what the quickstart runs with, read
now: training_scripts/configs/tiny_moe.yaml through train.py's config steps, on the processes of
training_scripts/accelerate/cpu_2proc.yaml. What only a run knows (throughput, idle fractions,
weight-version ages, the validation loss, the library versions) comes from a quickstart run, recorded
in model_cards/example_run.json with the config it ran: a changed config needs a new run.

Regenerate (model_cards/README.md):
    python -m tests.test_model_cards --update                          # after a template change
    python -m tests.test_model_cards --update --run outputs/tiny_moe   # after a quickstart run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "training_scripts" / "configs" / "tiny_moe.yaml"
LAUNCHER = ROOT / "training_scripts" / "accelerate" / "cpu_2proc.yaml"
TEMPLATE = ROOT / "model_cards" / "template.md"
GUIDE = ROOT / "model_cards" / "README.md"
EXAMPLE = ROOT / "model_cards" / "example.md"
RECORD = ROOT / "model_cards" / "example_run.json"
REGENERATE = "python -m tests.test_model_cards --update"


def _quickstart_launch() -> dict:
    """What the quickstart runs with now: the config file's keys and the launcher's processes."""
    launcher = yaml.safe_load(LAUNCHER.read_text())
    return {"config": yaml.safe_load(CONFIG.read_text()), "processes": launcher["num_processes"],
            "mixed_precision": launcher["mixed_precision"]}


def quickstart_card(record: dict) -> str:
    """The card the quickstart's export writes, given what its run measured (`record`)."""
    from hf_asyncpp.config import load_config
    from hf_asyncpp.config_checks import apply_launch_settings, validate_config
    from hf_asyncpp.hub import run_model_card
    from hf_asyncpp.parallel.launch import LaunchInfo
    from hf_asyncpp.schedules import get_schedule_spec

    launch = _quickstart_launch()
    world_size = launch["processes"]
    # As run.main does on rank 0 of the launched processes.
    config = load_config(str(CONFIG))
    apply_launch_settings(config, LaunchInfo(world_size, 0, 0, True, launch["mixed_precision"]))
    model_config = validate_config(config, world_size)
    with mock.patch("hf_asyncpp.hub.software_versions", return_value=record["versions"]):
        return run_model_card(config, model_config, (config.pp_size, world_size // config.pp_size),
                              get_schedule_spec(config.schedule), record["last_record"], record["final_eval"],
                              repo_id=config.hub_model_id)


def record_of_run(run_dir: Path) -> dict:
    """What `quickstart_card` needs from a finished quickstart run in `run_dir`: its last logged
    record and final evaluation (metrics.jsonl), the versions its card states, and what it ran with."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "train_tokens_per_second" in r][-1]
    final_eval = [r for r in records if "eval_loss" in r and r["step"] == last["step"]]
    card = (run_dir / "final" / "README.md").read_text()
    listed = card.split("## Framework versions", 1)[1].strip().splitlines()
    versions = dict(line.removeprefix("- ").split(" ", 1) for line in listed)
    return {**_quickstart_launch(), "last_record": last, "final_eval": final_eval[-1] if final_eval else None,
            "versions": versions}


def test_the_recorded_run_ran_the_quickstart_as_it_is_now():
    recorded = json.loads(RECORD.read_text())
    assert {k: recorded[k] for k in ("config", "processes", "mixed_precision")} == _quickstart_launch(), (
        f"{RECORD.name} was measured under another quickstart: run the quickstart (README.md), then "
        f"{REGENERATE} --run outputs/tiny_moe")


def test_the_example_card_is_the_one_the_quickstart_writes():
    expected = quickstart_card(json.loads(RECORD.read_text()))
    assert EXAMPLE.read_text() == expected, f"model_cards/example.md is stale: {REGENERATE}"


def test_the_guide_names_every_variable_the_template_uses():
    import jinja2
    from jinja2 import meta

    template = TEMPLATE.read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", GUIDE.read_text(), re.M))
    assert set(rows) == meta.find_undeclared_variables(jinja2.Environment().parse(template))
    fields = {(name, field) for name, field in re.findall(r"\b(\w+)\.(\w+)\b(?!\()", template) if name in rows}
    assert fields and not {f"{name}.{field}" for name, field in fields if f"`{field}`" not in rows[name]}


def test_the_package_reads_the_template_here_from_a_checkout():
    from hf_asyncpp.hub import TEMPLATE as read

    assert read == TEMPLATE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.test_model_cards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="rewrite model_cards/example.md")
    parser.add_argument("--run", type=Path, help="a finished quickstart run: record its measurements first")
    args = parser.parse_args(argv)
    if not args.update:
        parser.error("nothing to do without --update")
    if args.run is not None:
        record = record_of_run(args.run)
        card = quickstart_card(record)
        if card != (args.run / "final" / "README.md").read_text():
            print(f"error: {args.run}/final/README.md is not the card rendered from its record: was it the "
                  "quickstart's command, unchanged, on this checkout?", file=sys.stderr)
            return 1
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
    EXAMPLE.write_text(quickstart_card(json.loads(RECORD.read_text())))
    print(f"wrote {EXAMPLE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
