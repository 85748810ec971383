"""JSON Lines, the format of the files a run streams to the share (``metrics.jsonl``, ``telemetry.jsonl``).

A writer appends one object per line; a reader may look while the writer is mid-line, so
:func:`parse_jsonl` keeps only complete lines that hold a JSON object and skips the rest.
"""

from __future__ import annotations

import json
from typing import Any

from nbbatch.errors import ShareError
from nbbatch.store.share import RangeStore, Share


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


class JsonlTail:
    """The complete objects a JSON Lines file on a share gains between reads (``metrics.jsonl`` while its run goes).

    Only the new bytes are read where the share can (:class:`~nbbatch.store.share.RangeStore`); a line the writer is
    still writing is read next time. A file that shrank (its run submitted again) is read again from its start.
    """

    def __init__(self, share: Share, path: str) -> None:
        self.share, self.path, self.offset = share, path, 0

    def read(self) -> list[dict[str, Any]]:
        """The objects of the lines completed since the last read (none while the file is not there)."""
        try:
            if isinstance(self.share, RangeStore):
                chunk = self.share.read_range(self.path, self.offset)
            else:
                whole = self.share.read_bytes(self.path)
                if len(whole) < self.offset:
                    self.offset = 0
                chunk = whole[self.offset:]
        except (ShareError, OSError):  # not there yet, or the share failed: read again next time
            return []
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        return parse_jsonl(complete)
