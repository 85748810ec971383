"""Backends registered by name, like papermill's engines: ``local`` (default), ``azureml``, ``ray``, ``slurm``,
``kubernetes``.

A backend is a :class:`~nbbatch.backends.base.Backend` subclass in one module (or small package),
registered with :func:`register_backend` or through the ``nbbatch.backends`` entry-point group
(``name = "package.module:Class"``). Backends other than ``local`` load on first use, so their SDKs
are optional extras.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from nbbatch.backends.base import Backend, Capabilities, Compute, Setting, SubmitOptions, SubmitOutcome
from nbbatch.errors import BackendError, did_you_mean
from nbbatch.execute.placement import PlacementReader
from nbbatch.execute.stopsignals import StopExplainer

ENTRY_POINT_GROUP = "nbbatch.backends"
_BUILTIN = {
    "local": "nbbatch.backends.local.backend:LocalBackend",
    "azureml": "nbbatch.backends.azureml:AzureMLBackend",
    "ray": "nbbatch.backends.ray:RayBackend",
    "slurm": "nbbatch.backends.slurm:SlurmBackend",
    "kubernetes": "nbbatch.backends.kubernetes:KubernetesBackend",
}
_EXTRAS = {"azureml": "azure", "ray": "ray"}
# A built-in backend's node placement hook, where its class cannot load on the node (Azure ML's job images carry
# nbbatch without the azure extra, the framework images without the kubernetes one) or in a module of its own (Slurm's
# address exchange); the others' is their class's.
_NODE_PLACEMENT = {
    "azureml": "nbbatch.backends.azureml.placement:azureml_placement",
    "slurm": "nbbatch.backends.slurm.gang:slurm_placement",
    "kubernetes": "nbbatch.backends.kubernetes.node:kubernetes_placement",
}
# Why a built-in backend's cluster stopped a node launcher (``(signum) -> StopRequest | None``, asked after the
# signal; nbbatch.execute.stopsignals): Slurm's says scancel or time limit, Kubernetes' an evicted pod (the run goes back
# in the queue). The others' signal is named as it is.
_NODE_STOP = {"slurm": "nbbatch.backends.slurm.jobs:slurm_stop_request",
              "kubernetes": "nbbatch.backends.kubernetes.node:kubernetes_stop_request"}
_REGISTRY: dict[str, Any] = {}
_REGISTERED: set[str] = set()  # registered by register_backend (not loaded from _BUILTIN)


def register_backend(name: str, factory: Any) -> None:
    """Register a backend class (or a factory taking the spec's backend settings) under ``name``."""
    _REGISTRY[name] = factory
    _REGISTERED.add(name)


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    """Every backend that can be named in an experiment's ``backend:``."""
    return sorted({*_BUILTIN, *_REGISTRY, *_entry_points()})


def backend_class(name: str) -> Any:
    """The class (or factory) registered as ``name``, loaded on first use."""
    if name not in _REGISTRY:
        plugins = _entry_points()
        if name in plugins:
            _REGISTRY[name] = plugins[name].load()
        elif name in _BUILTIN:
            module, _, attr = _BUILTIN[name].partition(":")
            try:
                _REGISTRY[name] = getattr(importlib.import_module(module), attr)
            except ImportError as exc:
                extra = _EXTRAS.get(name, name)
                raise BackendError(f"the `{name}` backend needs its extra: pip install 'nbbatch[{extra}]' ({exc})") from exc
        else:
            raise BackendError(f"unknown backend `{name}`{did_you_mean(name, backend_names())}; "
                               f"known backends: {', '.join(backend_names())}")
    return _REGISTRY[name]


def node_placement_hook(name: str) -> PlacementReader | None:
    """Where a node of backend ``name``'s gang is (``(run, environ, share=None) -> NodePlacement | None``, see
    :meth:`Backend.node_placement`); None when the backend has no hook beyond nbbatch's own variables."""
    if name in _NODE_PLACEMENT and name not in _REGISTERED and name not in _entry_points():
        module, _, attr = _NODE_PLACEMENT[name].partition(":")
        return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
    hook = getattr(backend_class(name), "node_placement", None)
    if hook is None or getattr(hook, "__func__", None) is Backend.node_placement.__func__:  # the base's: none
        return None
    return hook  # type: ignore[no-any-return]


def node_stop_hook(name: str) -> StopExplainer | None:
    """Why backend ``name``'s cluster sent its node launcher a stop signal (None: the signal says it all)."""
    if name not in _NODE_STOP or name in _REGISTERED or name in _entry_points():
        return None
    module, _, attr = _NODE_STOP[name].partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def get_backend(name: str = "local", **settings: Any) -> Backend:
    """An instance of the backend called ``name``, configured with the spec's backend settings."""
    return backend_class(name)(**settings)


__all__ = ["Backend", "Capabilities", "Compute", "Setting", "SubmitOptions", "SubmitOutcome", "backend_class",
           "backend_names", "get_backend", "node_placement_hook", "node_stop_hook", "register_backend"]
