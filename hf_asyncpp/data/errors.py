"""What is wrong with a run's data, said once: the file, the row or byte where known, and the fix.

`datasets` and pyarrow report a bad file as a chained exception that names neither the file nor the
place (a JSON parse error "in row 7" of a batch, a UnicodeDecodeError at a position in some file), so
a failed load is diagnosed afterwards by reading the files the way the loader does, and only then:
the successful path costs nothing. Empty files are refused before loading.
"""

from __future__ import annotations

import json
import os

__all__ = ["DataError", "check_not_empty", "diagnose_load_failure"]

_TEXT_HINT = "give UTF-8 text files (.txt, .md), .jsonl/.json or .parquet"


class DataError(ValueError):
    """A dataset that cannot train this run, with what to do about it."""


def check_not_empty(files: list[str], name: str) -> None:
    for path in files:
        if os.path.getsize(path) == 0:
            raise DataError(f"{name}: file {path} is empty; remove it from the dataset or fill it")


def diagnose_load_failure(loader: str, files: list[str], name: str, err: BaseException) -> DataError:
    """A DataError for a local dataset whose loading raised `err`: the first place found that the
    loader cannot read, else `err` itself with its innermost cause."""
    for path in files:
        place = _first_unreadable_place(loader, path)
        if place:
            return DataError(f"{name}: {path}: {place}")
    return DataError(f"{name} could not be loaded ({_innermost(err)}); {_TEXT_HINT}")


def _first_unreadable_place(loader: str, path: str) -> str | None:
    if loader == "json" and path.endswith(".jsonl"):
        offset = 0
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                problem = _line_problem(line)
                if problem:
                    return f"line {number} (byte {offset}) is not {problem}"
                offset += len(line)
        return None
    if loader in ("json", "text"):
        decoded = _undecodable_byte(path)
        if decoded is not None:
            return f"byte {decoded} is not UTF-8 text (a binary file?); {_TEXT_HINT}"
        if loader == "json":
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except json.JSONDecodeError as err:
                return f"is not valid JSON at line {err.lineno}, column {err.colno} (byte {err.pos}): {err.msg}"
    return None


def _line_problem(line: bytes) -> str | None:
    """What is wrong with one jsonl line, and what to do (None: nothing)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"UTF-8 text (byte {err.start} of the line; a binary file?); {_TEXT_HINT}"
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return (f"valid JSON ({err.msg} at column {err.colno}); the file may have been cut short while written: "
                "write it again or drop that line")
    return None if isinstance(row, dict) else "a JSON object (one row per line: {\"input_ids\": [...]} or {\"text\": ...})"


def _undecodable_byte(path: str, chunk: int = 1 << 20) -> int | None:
    """The offset of the first byte that is not UTF-8 text, or None."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            pending = len(decoder.getstate()[0])  # bytes of the previous chunk the decoder still holds
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:
                return offset - pending + err.start
            if not data:
                return None
            offset += len(data)


def _innermost(err: BaseException) -> str:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {err}"
