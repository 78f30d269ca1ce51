"""The study tooling sits on top of the training core: it imports the core, and no module of the core
imports it. Only the command-line front end (hf_asyncpp/cli.py) hands the `study` command to it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_asyncpp"


def _imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Every module `path` (or `source` as if it were there) imports, as absolute names (relative imports
    resolved against its package)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
    return names


def test_no_module_of_the_training_core_imports_the_study():
    core = [p for p in PACKAGE.rglob("*.py") if "study" not in p.relative_to(PACKAGE).parts and p != PACKAGE / "cli.py"]
    importers = sorted(str(p.relative_to(PACKAGE)) for p in core
                       if any(name == "hf_asyncpp.study" or name.startswith("hf_asyncpp.study.")
                              for name in _imported_modules(p)))
    assert importers == []


def test_the_command_line_front_end_is_the_only_way_in():
    front_end = _imported_modules(PACKAGE / "cli.py")
    assert {name for name in front_end if name.startswith("hf_asyncpp.study")} == {"hf_asyncpp.study.cli",
                                                                                  "hf_asyncpp.study.cli.main"}


def test_the_resolver_sees_a_relative_import_of_the_study():
    """The first check can fail: a core module's relative import of the study resolves to its name."""
    source = "from ..study import grid\nfrom .. import study\n"
    assert {"hf_asyncpp.study", "hf_asyncpp.study.grid"} <= _imported_modules(PACKAGE / "models" / "any.py", source)
