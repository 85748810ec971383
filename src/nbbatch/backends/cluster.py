"""A managed cluster: what a backend with :attr:`~nbbatch.backends.base.Capabilities.managed_cluster` gives as
``backend.cluster``, and ``nbbatch cluster create|status|scale|delete`` over it.

The command knows no backend: it takes the backend from ``--backend`` or the experiment file (else the one installed
backend that manages a cluster), and its options from the backend's settings that name one
(:func:`~nbbatch.backends.settings.setting`'s ``option``, e.g. ``--max-nodes``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, Protocol

from nbbatch.backends import backend_class, backend_names
from nbbatch.backends.base import Backend
from nbbatch.backends.settings import Setting
from nbbatch.errors import BackendError
from nbbatch.spec.experiment import load_experiment

ACTIONS = ("create", "status", "scale", "delete")


class ClusterState(Protocol):
    """What a managed cluster says about itself."""

    exists: bool

    def summary(self) -> str:
        """A few lines of text."""

    def to_dict(self) -> dict[str, Any]:
        """The same as JSON-able data."""


class ManagedCluster(Protocol):
    """A cluster nbbatch creates, inspects, resizes and deletes (a backend's ``cluster``)."""

    name: str

    def create(self, wait: bool = True) -> ClusterState:
        """Create it if it does not exist (an existing one is left as it is)."""

    def status(self) -> ClusterState:
        """Its size, nodes and errors."""

    def scale(self, min_nodes: int | None = None, max_nodes: int | None = None, wait: bool = True) -> ClusterState:
        """Change its node range."""

    def provision(self, wait: bool = True) -> str:
        """Create it, or resize an existing one to the settings; a note on what could not change (empty: nothing)."""

    def delete(self, wait: bool = True) -> bool:
        """Delete it; False when it did not exist."""


def cluster_options(backend: type[Backend]) -> dict[str, tuple[str, Setting]]:
    """The command-line options of a backend's cluster settings: option → (setting name, setting)."""
    return {s.option: (key, s) for key, s in backend.setting_table().items() if s.option}


def cluster_parser(backend: type[Backend], prog: str = "nbbatch cluster") -> argparse.ArgumentParser:
    """``nbbatch cluster``'s parser with ``backend``'s options."""
    parser = argparse.ArgumentParser(prog=prog, description=f"the {backend.name} backend's cluster")
    add_common_arguments(parser)
    for option, (key, setting) in cluster_options(backend).items():
        kind = int if setting.kinds == (int,) else float if float in setting.kinds else str
        parser.add_argument(option, dest=key, type=kind, choices=list(setting.choices) or None,
                            metavar=option.lstrip("-").replace("-", "_").upper(),
                            help=setting.label or key.replace("_", " "))
    return parser


def _chosen_backend(args: argparse.Namespace) -> str | None:
    """The backend ``args`` name (``--backend``, else the experiment's), wherever on the command line it was given."""
    rest: Sequence[str] | None = getattr(args, "options", None)
    if rest:
        common = argparse.ArgumentParser(add_help=False)  # only to find --backend and --experiment among the rest
        add_common_arguments(common)
        given, _unknown = common.parse_known_args([args.action, *rest])
        args = argparse.Namespace(**{**vars(args), **{k: v for k, v in vars(given).items() if v}})
    if getattr(args, "backend", None):
        return str(args.backend)
    return load_experiment(args.experiment).backend if getattr(args, "experiment", None) else None


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``nbbatch cluster`` takes for every backend."""
    parser.add_argument("action", choices=ACTIONS, help="what to do with the cluster")
    parser.add_argument("--backend", help="the backend whose cluster (default: the experiment's, else the one "
                                          "installed backend that manages a cluster)")
    parser.add_argument("--experiment", help="take the cluster's settings from this experiment file's backend:")
    parser.add_argument("--no-wait", action="store_true", help="return once the backend has the request")
    parser.add_argument("--json", action="store_true", help="the cluster's state as JSON (for scripts)")


def managing_backend(name: str | None = None) -> type[Backend]:
    """The backend ``name`` when it manages a cluster; without a name, the one installed backend that does."""
    if name:
        found = backend_class(name)
        if not found.capabilities.managed_cluster:
            raise BackendError(f"the `{name}` backend has no cluster that nbbatch manages")
        return found  # type: ignore[no-any-return]
    managing, missing = [], []
    for candidate in backend_names():
        try:
            cls = backend_class(candidate)
        except BackendError as exc:  # its extra is not installed
            missing.append(str(exc))
            continue
        if getattr(getattr(cls, "capabilities", None), "managed_cluster", False):
            managing.append(cls)
    if len(managing) == 1:
        return managing[0]  # type: ignore[no-any-return]
    if not managing:
        raise BackendError("no installed backend has a cluster that nbbatch manages"
                           + (f" ({'; '.join(missing)})" if missing else ""))
    raise BackendError(f"several backends manage a cluster ({', '.join(c.name for c in managing)}): name one with "
                       "--backend")


def cluster_settings(backend: type[Backend], args: argparse.Namespace) -> dict[str, Any]:
    """The backend settings of ``--experiment``'s ``backend:``, overridden by the command line's options."""
    settings: dict[str, Any] = {}
    if getattr(args, "experiment", None):
        spec = load_experiment(args.experiment)
        if spec.backend != backend.name:
            raise BackendError(f"{args.experiment} uses the `{spec.backend}` backend, not {backend.name}")
        settings.update({k: v for k, v in spec.backend_settings.items() if k in backend.setting_table()})
    for key, _setting in cluster_options(backend).values():
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    return settings


def parsed(backend: type[Backend], args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the backend's options parsed from what ``nbbatch cluster`` left unparsed (``args.options``)."""
    rest: Sequence[str] | None = getattr(args, "options", None)
    if rest is None:  # a namespace made by a caller, not the command line
        return args
    return cluster_parser(backend).parse_args([args.action, *rest], namespace=argparse.Namespace(**{
        k: v for k, v in vars(args).items() if k != "options" and v not in (None, False)}))


def run_cluster_command(args: argparse.Namespace, backend: type[Backend] | None = None, **python_settings: Any) -> int:
    """``nbbatch cluster create|status|scale|delete``: manage a backend's cluster.

    ``args`` holds ``action`` and the optional ``backend``, ``experiment``, ``no_wait``, ``json`` and the backend's
    cluster settings by name (or, from the command line, the unparsed rest in ``options``). ``python_settings``
    (a client, a credential) go to the backend as they are.
    """
    backend = backend or managing_backend(_chosen_backend(args))
    args = parsed(backend, args)
    if not backend.capabilities.managed_cluster:
        raise BackendError(f"the `{backend.name}` backend has no cluster that nbbatch manages")
    cluster: ManagedCluster = backend(**cluster_settings(backend, args), **python_settings).cluster  # type: ignore[attr-defined]
    wait = not getattr(args, "no_wait", False)
    if args.action == "create":
        status = cluster.create(wait=wait)
    elif args.action == "status":
        status = cluster.status()
    elif args.action == "scale":
        low, high = getattr(args, "min_nodes", None), getattr(args, "max_nodes", None)
        if low is None and high is None:
            raise BackendError("nbbatch cluster scale needs --min-nodes and/or --max-nodes")
        status = cluster.scale(low, high, wait=wait)
    elif args.action == "delete":
        deleted = cluster.delete(wait=wait)
        print(f"cluster {cluster.name}: {'deleted' if deleted else 'did not exist'}")
        return 0
    else:
        raise BackendError(f"unknown cluster action `{args.action}`: one of {', '.join(ACTIONS)}")
    print(json.dumps(status.to_dict(), indent=2) if getattr(args, "json", False) else status.summary())
    return 0


__all__ = ["ACTIONS", "ClusterState", "ManagedCluster", "add_common_arguments", "cluster_options", "cluster_parser",
           "cluster_settings", "managing_backend", "run_cluster_command"]
