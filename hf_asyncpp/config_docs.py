"""The config keys described for people, generated from the config sections' fields (config.py): their type,
default and help. `train.py --help` prints `keys_help()`; docs/config.md holds `keys_reference()`
between two markers, rewritten by

    python -m hf_asyncpp.config_docs docs/config.md

(tests/test_config_docs.py fails while the file is out of date).
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

from .config import ALIASES, SECTIONS, STRATEGIES, TRAINER_OPTIMIZERS

__all__ = ["BEGIN_MARKER", "END_MARKER", "keys_help", "keys_reference", "update_reference"]

BEGIN_MARKER = "<!-- keys: generated from TrainConfig by `python -m hf_asyncpp.config_docs docs/config.md` -->"
END_MARKER = "<!-- end of generated keys -->"


def _sections() -> list[tuple[str, list[dataclasses.Field]]]:
    """(section, its keys) in TrainConfig's order: the section dataclasses of config.py."""
    return [(name, list(dataclasses.fields(section))) for name, section in SECTIONS.items()]


def _default(field: dataclasses.Field) -> str:
    """The default as it is written in YAML or on the command line."""
    value = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _type(field: dataclasses.Field) -> str:
    return str(field.type).replace(" | None", " or none")


def keys_help(width: int = 100) -> str:
    """Every key with its type, default and meaning, as `train.py --help` lists them."""
    lines = []
    for section, fields in _sections():
        lines.append(f"{section}:")
        for field in fields:
            lines.append(f"  --{field.name} {_type(field)} (default: {_default(field)})")
            lines += textwrap.wrap(field.metadata["help"], width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                   break_on_hyphens=False)
    return "\n".join(lines)


def keys_reference() -> str:
    """The keys as Markdown tables, one per section (docs/config.md between the markers)."""
    parts = []
    for section, fields in _sections():
        rows = [f"| `{f.name}` | {_type(f)} | `{_default(f)}` | {f.metadata['help'].replace('|', chr(92) + '|')} |"
                for f in fields]
        parts.append("\n".join([f"### {section}", "", "| key | type | default | meaning |", "|---|---|---|---|", *rows]))
    aliases = [f"| `{name}` | `{key}` |" for name, (key, _) in ALIASES.items()]
    parts.append("\n".join(["### TrainingArguments' names", "",
                             "YAML files and `--key` overrides also take transformers' `TrainingArguments` names for "
                             "the settings both have. A setting given under both names must have one value; on "
                             "the command line, either name replaces the file's. `optim` takes "
                             + ", ".join(f"`{name}`" for name in TRAINER_OPTIMIZERS) + "; `bf16: true` is "
                             "`mixed_precision: bf16`; a `warmup_steps` below 1 is a `warmup_ratio`. "
                             "`num_train_epochs` and `warmup_ratio` are keys of their own (above). "
                             + ", ".join(f"`{name}`" for name in STRATEGIES) + " take `steps` (what the "
                             "`*_steps` key does) and, for evaluations and saves, `no` (`*_steps: 0`); events "
                             "timed in epochs are AsyncPPTrainer's.", "",
                             "| TrainingArguments | here |", "|---|---|", *aliases]))
    return "\n\n".join(parts)


def update_reference(path: str | Path) -> bool:
    """Rewrite the generated part of `path` (between the markers); True if it changed."""
    path = Path(path)
    text = path.read_text()
    head, begin, rest = text.partition(BEGIN_MARKER)
    _, end, tail = rest.partition(END_MARKER)
    if not begin or not end:
        raise ValueError(f"{path} lacks the markers {BEGIN_MARKER} … {END_MARKER}")
    new = f"{head}{BEGIN_MARKER}\n\n{keys_reference()}\n\n{END_MARKER}{tail}"
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    for target in sys.argv[1:] or ["docs/config.md"]:
        print(f"{target}: {'updated' if update_reference(target) else 'up to date'}")
