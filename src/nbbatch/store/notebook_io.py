"""Serialising notebooks quickly and writing them atomically."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from nbbatch.errors import ValidationError
from nbbatch.store.share import FILE_MODE, write_file_atomic


def notebook_bytes(nb: Any) -> bytes:
    """The ``.ipynb`` bytes of a notebook, as nbformat writes them, without re-validating on every save."""
    return (json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_notebook_atomic(nb: Any, path: str | os.PathLike[str]) -> None:
    """Write ``nb`` to ``path`` atomically (:func:`~nbbatch.artifacts.write_file_atomic`), readable as the umask allows."""
    write_file_atomic(path, notebook_bytes(nb), FILE_MODE)


def check_notebook_target(path: str | os.PathLike[str]) -> None:
    """Refuse, before a notebook runs, an output path it could not be written to: a folder, a path under a missing
    folder or under a file, a folder this user cannot write (permissions, a read-only mount).

    A missing folder is not created (as papermill does not): a mistyped path should not pass silently.
    """
    target = Path(path)
    folder = target.parent
    try:
        if target.is_dir():
            raise ValidationError(f"the output notebook {target} is a folder; name a file, e.g. {target / 'out.ipynb'}")
        existing = next(p for p in (folder, *folder.parents) if p.exists())  # the root exists
        if not existing.is_dir():
            raise ValidationError(f"cannot write the output notebook {target}: {existing} is a file, not a folder")
        if existing != folder:
            raise ValidationError(f"cannot write the output notebook {target}: its folder {folder} does not exist; "
                                  f"create it first (mkdir -p {folder}) or choose another output path")
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".probe")  # as the saves will
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:  # e.g. a parent folder this user may not enter, a full disk
        if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
            raise ValidationError(f"cannot write the output notebook {target}: its folder {folder} is not writable "
                                  "(permissions or a read-only file system); choose another output path") from exc
        raise ValidationError(f"cannot write the output notebook {target}: {exc.strerror or exc}") from exc


# papermill's tags: the parameters cell it injects, and the error markers it (and nbbatch) adds to an output notebook
INJECTED_TAG, MARKER_TAG = "injected-parameters", "papermill-error-cell-tag"


def users_cell(cell: Any) -> bool:
    """Whether an executed notebook's cell is one of the user's own (not papermill's injected parameters, nor a marker)."""
    tags = cell.get("metadata", {}).get("tags", [])
    return INJECTED_TAG not in tags and MARKER_TAG not in tags


def user_cells(cells: list[Any], end: int | None = None) -> int:
    """How many of the user's own cells are in ``cells[:end]``: an executed notebook's cells counted as the user's
    notebook has them (every command's cell numbers and progress count so)."""
    return sum(1 for cell in cells[:end] if users_cell(cell))


def cell_number(cells: list[Any], index: int | None) -> int | None:
    """The number, in the user's own notebook (1-based, papermill's injected cell not counted), of the executed
    notebook's cell ``index`` (0-based, as papermill and nbclient give it); None for a cell not the user's."""
    if index is None or not 0 <= index < len(cells) or not users_cell(cells[index]):
        return None
    return user_cells(cells, index) + 1


def stopped_cell(nb: Any) -> tuple[int | None, str | None]:
    """The number (:func:`cell_number`) and first lines of the cell a stopped notebook stopped in: the last one
    papermill started (None, None: none had started)."""
    cells = list(nb.cells if nb is not None else [])
    started = [i for i, c in enumerate(cells) if c.get("metadata", {}).get("papermill", {}).get("start_time")]
    if not started:
        return None, None
    number = cell_number(cells, started[-1])
    if number is None:
        return None, None
    return number, "\n".join(str(cells[started[-1]].get("source", "")).splitlines()[:5]) or None
