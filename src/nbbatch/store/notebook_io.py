"""Serialising notebooks quickly and writing them atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def notebook_bytes(nb: Any) -> bytes:
    """The ``.ipynb`` bytes of a notebook, as nbformat writes them, without re-validating on every save."""
    return (json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_notebook_atomic(nb: Any, path: str | os.PathLike[str]) -> None:
    """Write ``nb`` to ``path`` through a temporary file and a rename."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        from nbbatch.store.share import FILE_MODE

        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as handle:
            handle.write(notebook_bytes(nb))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
