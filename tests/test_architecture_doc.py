"""docs/ARCHITECTURE.md cites code by file (`models/split.py`) and by file and name
(`models/split.py: plan_stages`): every cited file exists in the repository (a path as written, or as the
tail of one), and every cited name is defined in it (def, class or a module-level assignment)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.repo

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ARCHITECTURE.md"
CITED = re.compile(r"`([\w/.]+\.py)(?::\s*([\w.]+))?`")
FILES = [p for top in ("hf_asyncpp", "tests", "benchmarks", "training_scripts") for p in (REPO / top).rglob("*.py")]


def _files(cited: str) -> list[Path]:
    return [p for p in FILES if p.relative_to(REPO).as_posix().endswith(cited) and
            ("/" + p.relative_to(REPO).as_posix()).endswith("/" + cited)]


def _defines(path: Path, name: str) -> bool:
    head = name.split(".")[0]  # `Class.method`: the class, and the method in it
    text = path.read_text()
    found = re.search(rf"^(class|def|async def) {head}\b|^{head}\s*[:=]", text, re.MULTILINE)
    return bool(found) and all(re.search(rf"def {part}\b|{part}\s*[:=]", text) for part in name.split(".")[1:])


def test_every_file_and_name_the_architecture_doc_cites_exists():
    citations = CITED.findall(DOC.read_text())
    assert len(citations) > 30  # the doc cites code throughout; an empty match would test nothing
    missing = [f"`{cited}`" for cited, _ in citations if not _files(cited)]
    undefined = [f"`{cited}: {name}`" for cited, name in citations if name and _files(cited)
                 and not any(_defines(p, name) for p in _files(cited))]
    assert not missing, f"ARCHITECTURE.md cites files that do not exist: {missing}"
    assert not undefined, f"ARCHITECTURE.md cites names its files do not define: {undefined}"
