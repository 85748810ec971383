"""The one rule for names that look like secrets (``AZURE_STORAGE_KEY``, ``HF_TOKEN``, ``DB_PASSWORD``…).

Variables and settings with such names never reach a kernel, a job definition, a stored setting or
a widget: a notebook, the Azure ML studio and ``.nbbatch/`` are all readable by others.
"""

from __future__ import annotations

SECRET_NAME_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CONNECTION_STRING", "SAS")


def is_secret_name(name: object) -> bool:
    """Whether a variable or setting called ``name`` may hold a secret (by its name, case-insensitively)."""
    upper = str(name).upper()
    return any(hint in upper for hint in SECRET_NAME_HINTS)
