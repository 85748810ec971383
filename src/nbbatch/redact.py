"""The one rule for what looks like a secret: by a variable's or setting's name, and by its value.

Names: ``AZURE_STORAGE_KEY``, ``HF_TOKEN``, ``DB_PASSWORD``, ``MYSQL_PWD``, ``IDENTITY_HEADER``…
Values: a URL with credentials (``postgres://user:pw@host/db``, ``https://__token__:abc@host/simple``),
a connection string or query with a secret part (``AccountKey=…``, ``Pwd=…``, ``sig=…``), an
``Authorization`` header value (``Bearer …``), a PEM private key.

Variables and settings that look secret never reach a kernel, a job definition, a Ray task, a stored
setting or a widget: a notebook, the Azure ML studio, Ray's state API and ``.nbbatch/`` are all
readable by others. :func:`without_secrets` applies the rule at any depth of a settings tree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

# A name holding one of these (in upper case) is a secret's name: AZURE_STORAGE_KEY, GITHUB_TOKEN, db_password…
SECRET_NAME_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CONNECTION_STRING", "SAS",
                     "AUTHORIZATION", "IDENTITY_HEADER")
# A name with one of these as a whole word (split at `_`, `-`, `.`…) is too: MYSQL_PWD, SMTP_PASS, NPM_CONFIG__AUTH.
SECRET_NAME_WORDS = frozenset({"PWD", "PASS", "AUTH"})
NOT_SECRET_NAMES = frozenset({"PWD"})  # the shell's working directory

# `scheme://userinfo@`: the userinfo of a URL (no `/`, `?`, `#` or space before the `@`)
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://([^/?#@\s]+)@")
# `name=value` inside a connection string, a query or a list of options (`a=1;AccountKey=…`, `?sv=…&sig=…`)
_PAIR = re.compile(r"(?:^|[;&?,\s])([A-Za-z][A-Za-z0-9_.\-]*)\s*=\s*[^;&,\s]")
_HEADER = re.compile(r"\s*(?:bearer|basic|sharedkey)\s+\S{8,}", re.IGNORECASE)
_PRIVATE_KEY = "PRIVATE KEY-----"
_PAIR_WORDS = frozenset({"PWD", "PASS", "SIG"})  # ODBC's Pwd=, a SAS URL's sig=
TOKEN_AS_USER_MIN = 20  # `https://<token>@host`: a user name this long is taken for a token


def is_secret_name(name: object) -> bool:
    """Whether a variable or setting called ``name`` may hold a secret (by its name, case-insensitively)."""
    upper = str(name).upper()
    if upper in NOT_SECRET_NAMES:
        return False
    if any(hint in upper for hint in SECRET_NAME_HINTS):
        return True
    return any(word in SECRET_NAME_WORDS for word in re.split(r"[^A-Z0-9]+", upper))


def is_secret_value(value: object) -> bool:
    """Whether ``value`` (text; anything else is not) holds a credential whatever its name.

    A URL with a password (``scheme://user:password@host``) or with a long token as its user name,
    a ``name=value`` part whose name is a secret's (``AccountKey=``, ``Password=``, ``Pwd=``, ``sig=``),
    an ``Authorization`` header value (``Bearer …``), a PEM private key.
    """
    if not isinstance(value, str) or not value:
        return False
    for userinfo in _URL_USERINFO.findall(value):
        user, colon, password = userinfo.partition(":")
        if (colon and password) or len(user) >= TOKEN_AS_USER_MIN:
            return True
    for key in _PAIR.findall(value):
        if key.upper() in _PAIR_WORDS or is_secret_name(key):
            return True
    return bool(_HEADER.match(value)) or _PRIVATE_KEY in value


def is_secret(name: object, value: object = None) -> bool:
    """Whether a variable or setting ``name`` = ``value`` may hold a secret: by its name, or by its value."""
    return is_secret_name(name) or is_secret_value(value)


# What a kernel needs to log to MLflow when MLFLOW_TRACKING_URI reaches it: a server's credentials, and
# inside an Azure ML job the job's own run token (azureml-mlflow authenticates with it). The user (or
# Azure ML) asked for tracking by setting the URI; without these nbbatch.record could not log.
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                        "AZUREML_RUN_TOKEN", "AZUREML_RUN_TOKEN_EXPIRY")


def tracking_credentials(env: Mapping[str, str]) -> dict[str, str]:
    """The :data:`TRACKING_CREDENTIALS` in ``env``, when ``env`` names an MLflow tracking URI (else none)."""
    uri = env.get("MLFLOW_TRACKING_URI")
    if not uri or is_secret_value(uri):
        return {}
    return {name: env[name] for name in TRACKING_CREDENTIALS if name in env}


def without_secrets(value: Any) -> Any:
    """A copy of ``value`` without what looks secret, at any depth (mappings in mappings, mappings in lists…).

    A mapping loses its entries that :func:`is_secret` flags; a list or tuple loses its secret-looking
    strings and its ``{name: SECRET_NAME, value: …}`` entries (Kubernetes-style variable lists).
    """
    if isinstance(value, Mapping):
        return {k: without_secrets(v) for k, v in value.items() if not is_secret(k, v)}
    if isinstance(value, (list, tuple)):
        kept = [without_secrets(v) for v in value if not is_secret_value(v) and not _named_secret(v)]
        return kept if isinstance(value, list) else tuple(kept)
    return value


def has_secret(value: Any) -> bool:
    """Whether :func:`without_secrets` would remove anything from ``value`` (or ``value`` itself looks secret)."""
    return is_secret_value(value) or without_secrets(value) != value


def _named_secret(entry: Any) -> bool:
    """``{name: AZURE_STORAGE_KEY, value: …}``: an entry of a variable list that names a secret."""
    return isinstance(entry, Mapping) and any(
        str(k).lower() in ("name", "key") and isinstance(v, str) and is_secret_name(v) for k, v in entry.items())


def redacted_url(url: str) -> str:
    """``url`` as a message may show it: its scheme, host and port, without a user, password, path, query or fragment
    (a Slack webhook's path is its secret; a SAS URL's query is)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "(a URL that cannot be read)"
    if not parts.scheme or not host:
        return "(a URL that cannot be read)"
    hidden = parts.path.strip("/") or parts.query or parts.fragment
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}{'/…' if hidden else ''}"
