"""What Azure Files accepts as a file or folder name, checked before a request is sent.

The rules are Microsoft's "Naming and referencing shares, directories, files, and metadata"
(learn.microsoft.com/rest/api/storageservices/naming-and-referencing-shares--directories--files--and-metadata):
names are case-preserving but case-insensitive (``Cifar/x`` and ``cifar/x`` are one file); a name part
is at most 255 characters, a path at most 2,048; ``" \\ / : | < > * ?`` and the control characters 0x00-0x1F are refused (the
service answers 400 ``InvalidResourceName``); the service trims a trailing dot unless asked not to
(``x-ms-allow-trailing-dot``, which SMB clients cannot read back), and refuses the device names of
Windows (``CON``, ``LPT1``…). nbbatch refuses all of these itself, naming the file, the rule and a name
that works: the service's own answer names neither, and the SDK's rename cuts a name at ``?``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from nbbatch.errors import ShareError

FORBIDDEN = '"\\:|<>*?'  # and "/", which separates the parts of a path
MAX_PART = 255
MAX_PATH = 2048
RESERVED = frozenset({"CON", "PRN", "AUX", "NUL", "CLOCK$", *(f"COM{i}" for i in range(1, 10)),
                      *(f"LPT{i}" for i in range(1, 10))})
_BAD_CHARS = re.compile(r'["\\:|<>*?\x00-\x1f]')

SHARE_NAME = re.compile(r"(?=.{3,63}$)[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9]))*")  # 3-63 of a-z 0-9, single inner hyphens

__all__ = ["FORBIDDEN", "name_problem", "refused_names", "check_name", "check_share_name", "suggest"]


def _part_problem(part: str) -> str | None:
    """Why Azure Files refuses the name part ``part``; None when it takes it as it is."""
    bad = sorted(set(_BAD_CHARS.findall(part)))
    if bad:
        shown = " ".join(repr(c)[1:-1] if c < " " else c for c in bad)
        return (f"it holds {shown}, which Azure Files refuses in names (none of {' '.join(FORBIDDEN)} "
                "nor control characters)")
    if part.endswith("."):
        return "it ends with a dot, which Azure Files drops: the file would be written under another name"
    if part.upper() in RESERVED:
        return f"`{part}` is a device name Azure Files refuses"
    if len(part) > MAX_PART:
        return f"a part of it is {len(part)} characters long; Azure Files takes at most {MAX_PART}"
    return None


def name_problem(path: str) -> str | None:
    """Why Azure Files would refuse (or rename) the ``/``-separated ``path``; None when it is fine."""
    for part in str(path).split("/"):
        if part not in ("", ".", "..") and (why := _part_problem(part)):  # `.`/`..`: path steps, not names
            return why
    if len(str(path)) > MAX_PATH:
        return f"it is {len(str(path))} characters long; Azure Files takes paths of at most {MAX_PATH}"
    return None


def suggest(path: str) -> str:
    """A name Azure Files takes for ``path``: forbidden characters replaced by ``-``, trailing dots dropped."""
    parts = []
    for part in str(path).split("/"):
        fixed = _BAD_CHARS.sub("-", part).rstrip(".") or "_"
        if fixed.upper() in RESERVED:
            fixed = f"{fixed}_"
        parts.append(fixed[:MAX_PART] if part else part)
    return "/".join(parts)


def refused_names(paths: Iterable[str]) -> dict[str, str]:
    """``{path: why}`` for the paths Azure Files would refuse, or would fold into another of ``paths``.

    Two paths that differ only in case are one file on Azure Files: the second would overwrite the first.
    """
    refused: dict[str, str] = {}
    seen: dict[str, str] = {}
    for path in paths:
        if why := name_problem(path):
            refused[path] = why
            continue
        other = seen.setdefault(path.casefold(), path)
        if other != path:
            refused[path] = f"it differs from `{other}` only in case, and Azure Files ignores case: one would overwrite the other"
    return refused


def check_name(path: str, where: str) -> None:
    """Raise :class:`ShareError` naming ``path``, the rule and the fix when Azure Files would refuse it."""
    why = name_problem(path)
    if why:
        raise ShareError(f"cannot write `{path}` to {where}: {why}. Rename it, e.g. to `{suggest(path)}`")


def check_share_name(share: str, url: str) -> None:
    """Raise :class:`ShareError` naming the rule and a name that works when Azure Files refuses file share ``share``
    (3-63 lowercase letters, digits and hyphens, starting and ending with a letter or digit, no two hyphens in a row):
    the service's own answer (400 InvalidResourceName or OutOfRangeInput) names neither the share nor the rule."""
    if SHARE_NAME.fullmatch(share):
        return
    fixed = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", share.lower())).strip("-")[:63].rstrip("-")
    fixed = fixed if len(fixed) >= 3 else (fixed + "-share").lstrip("-")
    raise ShareError(f"`{url}` names file share `{share}`, which Azure Files refuses: a share name is 3-63 lowercase "
                     f"letters, digits and hyphens, starts and ends with a letter or digit and has no two hyphens in a "
                     f"row. Use e.g. `{fixed}`")
