"""JSON Lines, the format of the files a run streams to the share (``metrics.jsonl``, ``telemetry.jsonl``).

A writer appends one object per line; a reader may look while the writer is mid-line, so
:func:`parse_jsonl` keeps only complete lines that hold a JSON object and skips the rest.
"""

from __future__ import annotations

import json
from typing import Any


def jsonl_line(obj: dict[str, Any]) -> bytes:
    """One line of JSON Lines: compact JSON (non-finite numbers as strings) and a newline."""
    return (json.dumps(obj, separators=(",", ":"), default=str, allow_nan=False) + "\n").encode()


def parse_jsonl(data: bytes | str) -> list[dict[str, Any]]:
    """The objects of complete lines in ``data``; a partial last line and unreadable lines are skipped."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if not text.endswith("\n"):
        text = text.rpartition("\n")[0]  # the writer is mid-line: that line is not there yet
    objects = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            objects.append(obj)
    return objects
