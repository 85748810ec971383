"""Backends registered by name, like papermill's engines: ``local`` (default), ``azureml``, ``ray``.

Backends other than ``local`` load on first use, so their SDKs are optional extras.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import BackendError, did_you_mean
from .base import Backend, Compute, SubmitOptions

_BUILTIN = {
    "local": "nbbatch.backends.local:LocalBackend",
    "azureml": "nbbatch.backends.azureml:AzureMLBackend",
    "ray": "nbbatch.backends.ray:RayBackend",
}
_EXTRAS = {"azureml": "azure", "ray": "ray"}
_REGISTRY: dict[str, Any] = {}


def register_backend(name: str, factory: Any) -> None:
    """Register a backend class (or factory taking the spec's backend settings) under ``name``."""
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTRY})


def get_backend(name: str = "local", **settings: Any) -> Backend:
    """An instance of the backend called ``name``, configured with the spec's backend settings."""
    if name not in _REGISTRY:
        if name not in _BUILTIN:
            raise BackendError(f"unknown backend `{name}`{did_you_mean(name, backend_names())}; "
                               f"known backends: {', '.join(backend_names())}")
        module, _, attr = _BUILTIN[name].partition(":")
        try:
            _REGISTRY[name] = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            extra = _EXTRAS.get(name, name)
            raise BackendError(f"the `{name}` backend needs its extra: pip install 'nbbatch[{extra}]' ({exc})") from exc
    return _REGISTRY[name](**settings)


__all__ = ["Backend", "Compute", "SubmitOptions", "get_backend", "register_backend", "backend_names"]
