"""Inputs: folders a run reads, bound to notebook parameters (``inputs: {DATA_DIR: ./data}``).

An input is a folder on this machine (the experiment file made it absolute) or a share URL
(``azfiles://account/share/data``). Each one is checked before anything runs; where it executes, the
run's parameter gets the folder's path as the run sees it (see :mod:`nbbatch.execute.folders`).
"""

from __future__ import annotations

from pathlib import Path

from nbbatch.errors import NbbatchError, ValidationError
from nbbatch.store.share import open_share


def is_share_url(location: str) -> bool:
    """Whether an input names a share (``scheme://…``) rather than a folder on this machine."""
    return "://" in location


def check_inputs(inputs: dict[str, str]) -> None:
    """Raise :class:`ValidationError` naming the first input that is not a folder (or not on its share)."""
    for name, location in inputs.items():
        if is_share_url(location):
            _check_share_input(name, location)
            continue
        folder = Path(location)
        if not folder.exists():
            raise ValidationError(f"input `{name}`: there is no folder {folder}; create it (`make data` fetches "
                                  "CIFAR-10 into ./data) or fix the path in `inputs:` (relative to the experiment file)")
        if not folder.is_dir():
            raise ValidationError(f"input `{name}`: {folder} is a file, not a folder; an input is the folder "
                                  "the notebook reads its files from")


def _check_share_input(name: str, url: str) -> None:
    try:
        share = open_share(url)
        present = share.exists("")
    except NbbatchError as exc:
        raise ValidationError(f"input `{name}`: cannot open {url}: {exc}") from exc
    if not present:
        raise ValidationError(f"input `{name}`: nothing at {url}; upload the folder first, e.g. "
                              f"`nbbatch data push ./data {url}`")


def input_identities(inputs: dict[str, str], project_root: Path) -> dict[str, str]:
    """What a run id hashes of its inputs: folders inside the project by their project-relative path
    (the same run on every clone of the project), others as given."""
    identities = {}
    for name, location in inputs.items():
        if not is_share_url(location):
            try:
                location = "project:" + Path(location).relative_to(project_root).as_posix()
            except ValueError:
                pass
        identities[name] = location
    return identities
