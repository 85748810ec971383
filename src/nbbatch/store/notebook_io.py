"""Serialising notebooks quickly and writing them atomically."""

from __future__ import annotations

import json
import os
from typing import Any

from nbbatch.store.share import FILE_MODE, write_file_atomic


def notebook_bytes(nb: Any) -> bytes:
    """The ``.ipynb`` bytes of a notebook, as nbformat writes them, without re-validating on every save."""
    return (json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_notebook_atomic(nb: Any, path: str | os.PathLike[str]) -> None:
    """Write ``nb`` to ``path`` atomically (:func:`~nbbatch.artifacts.write_file_atomic`), readable as the umask allows."""
    write_file_atomic(path, notebook_bytes(nb), FILE_MODE)
