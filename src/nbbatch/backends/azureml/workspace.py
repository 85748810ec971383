"""The Azure ML workspace: which one, connected with which credential; and Azure errors as short text."""

from __future__ import annotations

import json
import os
from typing import Any

from azure.ai.ml import MLClient

from nbbatch.errors import BackendError
from nbbatch.store.azfiles_client import CLOUD_ENV


def connect(
    *,
    subscription_id: str | None = None,
    resource_group: str | None = None,
    workspace: str | None = None,
    config: str | os.PathLike[str] | None = None,
    credential: Any = None,
    **client_kwargs: Any,
) -> MLClient:
    """An :class:`MLClient` for the workspace the settings, the environment or ``config.json`` name."""
    subscription_id = subscription_id or os.environ.get("AZURE_SUBSCRIPTION_ID")
    resource_group = resource_group or os.environ.get("AZURE_RESOURCE_GROUP")
    workspace = workspace or os.environ.get("AZUREML_WORKSPACE")
    if credential is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    if subscription_id and resource_group and workspace and config is None:
        return MLClient(credential, subscription_id, resource_group, workspace, **client_kwargs)
    try:
        return MLClient.from_config(credential, path=str(config) if config else None, **client_kwargs)
    except Exception as exc:  # the SDK raises its own ValidationException when no config.json is found
        raise BackendError(
            "the azureml backend needs a workspace: set `subscription_id`, `resource_group` and `workspace` "
            "under `backend:` in the experiment file, or AZURE_SUBSCRIPTION_ID, AZURE_RESOURCE_GROUP and "
            "AZUREML_WORKSPACE, or download the workspace's config.json (Azure ML studio → workspace → "
            f"Download config file) into the project ({exc})"
        ) from exc


def job_environment(identity_client_id: str | None) -> dict[str, str]:
    """The variables a job gets besides its run's: the user-assigned identity ``DefaultAzureCredential`` must pick
    (``AZURE_CLIENT_ID``: without it a managed-identity token names no identity, and a cluster with only a
    user-assigned one answers none), and the sovereign cloud this driver uses (``AZUREML_CURRENT_CLOUD``, set by
    ``MLClient(cloud=…)`` or by hand), so the job reaches the same cloud's Azure Files endpoint as the driver."""
    environment = {"AZURE_CLIENT_ID": identity_client_id} if identity_client_id else {}
    if cloud := os.environ.get(CLOUD_ENV):
        environment[CLOUD_ENV] = cloud
    return environment


def error_text(exc: BaseException) -> str:
    """An Azure error on one line, at most 2000 characters: the service's own answer when the response carries one.

    Azure ML's answers (``{"error": {"code", "message", "details", "innerError"}}``) reach the SDK's newer
    operations as a bare "Operation returned an invalid status": their code, message, details and inner codes
    are read from the response body instead.
    """
    text = _service_answer(exc) or getattr(exc, "message", None) or str(exc)
    return " ".join(str(text).split())[:2000]


def error_codes(exc: BaseException) -> list[str]:
    """The codes of the service's answer that ``exc`` carries: its error's, its details', its inner errors'
    (and azure-core's ``error_code``, e.g. from ``x-ms-error-code``)."""
    codes = [str(exc.error_code)] if getattr(exc, "error_code", None) else []  # type: ignore[attr-defined]
    try:
        error = json.loads(exc.response.text())["error"]  # type: ignore[attr-defined]
    except (AttributeError, TypeError, KeyError, ValueError):
        return codes
    if not isinstance(error, dict):
        return codes
    codes += [str(error["code"])] if error.get("code") else []
    codes += [str(d["code"]) for d in error.get("details") or [] if isinstance(d, dict) and d.get("code")]
    inner = error.get("innerError")
    while isinstance(inner, dict) and inner.get("code"):
        codes.append(str(inner["code"]))
        inner = inner.get("innerError")
    return codes


def _service_answer(exc: BaseException) -> str | None:
    """``(code) message`` with the details and inner error codes of the body of the response that ``exc`` carries."""
    try:
        error = json.loads(exc.response.text())["error"]  # type: ignore[attr-defined]
        message = str(error["message"])
    except (AttributeError, TypeError, KeyError, ValueError):
        return None
    parts = [f"({error.get('code') or 'Error'}) {message}"]
    details = [str(d.get("message")) for d in error.get("details") or [] if isinstance(d, dict) and d.get("message")]
    parts += [f"detail: {d}" for d in details if d != message]
    inner, codes = error.get("innerError"), []
    while isinstance(inner, dict) and inner.get("code"):
        codes.append(str(inner["code"]))
        inner = inner.get("innerError")
    if codes:
        parts.append(f"inner error: {'/'.join(codes)}")
    return "; ".join(parts)
