"""The `hf_asyncpp` logger: what a run tells its user, on stderr, once per launch.

Every rank runs the same program, so, as transformers' Trainer does by default (`log_level_replica`
"warning"), rank 0 says everything from INFO up and the other ranks only warnings and errors. Lines
read `[hf_asyncpp] message` (`[hf_asyncpp] warning: message`). The logger does not propagate to the
root logger; set its level like any other:

    logging.getLogger("hf_asyncpp").setLevel(logging.WARNING)   # only warnings and errors

Commands' own output (the `error:` line of a bad config, a table asked for) stays on stdout/stderr.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger"]

_ROOT = "hf_asyncpp"


class _CurrentStderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (redirected or captured), not as it was at import."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


class _RankZeroOrWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or os.environ.get("RANK", "0") == "0"


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"[{_ROOT}] {level}{record.getMessage()}"


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = _CurrentStderr()
        handler.addFilter(_RankZeroOrWarning())
        handler.setFormatter(_Format())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (a child of `hf_asyncpp`, which carries the handler)."""
    _configure_root()
    return logging.getLogger(name)
