"""``nbbatch cluster create|status|scale|delete``: the azureml backend's compute cluster from the command line."""

from __future__ import annotations

import argparse
import json
from typing import Any

from azure.ai.ml import MLClient

from nbbatch.backends.azureml.backend import AzureMLBackend
from nbbatch.errors import BackendError, did_you_mean
from nbbatch.spec.experiment import load_experiment

_ARGS = ("subscription_id", "resource_group", "workspace", "config", "vm_size", "min_nodes", "max_nodes", "tier",
         "idle_time_before_scale_down")


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The backend settings of ``--experiment``'s ``backend:``, overridden by the command line's options."""
    settings: dict[str, Any] = {}
    if getattr(args, "experiment", None):
        spec = load_experiment(args.experiment)
        if spec.backend != "azureml":
            raise BackendError(f"{args.experiment} uses the `{spec.backend}` backend, not azureml")
        settings.update(spec.backend_settings)
    for key in _ARGS:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if getattr(args, "name", None):
        settings["compute"] = args.name
    return settings


def cli_cluster(args: argparse.Namespace, ml_client: MLClient | None = None) -> int:
    """``nbbatch cluster create|status|scale|delete``: manage the azureml backend's compute cluster.

    Reads ``args.action`` and the optional ``experiment``, ``name``, ``vm_size``, ``min_nodes``,
    ``max_nodes``, ``tier``, ``idle_time_before_scale_down``, ``subscription_id``,
    ``resource_group``, ``workspace``, ``config``, ``no_wait`` and ``json`` attributes.
    """
    settings = settings_from_args(args)
    known = {k: v for k, v in settings.items() if k in AzureMLBackend.setting_table()}
    cluster = AzureMLBackend(ml_client=ml_client, **known).cluster
    wait = not getattr(args, "no_wait", False)
    action = args.action
    if action == "create":
        status = cluster.create(wait=wait)
    elif action == "status":
        status = cluster.status()
    elif action == "scale":
        if getattr(args, "min_nodes", None) is None and getattr(args, "max_nodes", None) is None:
            raise BackendError("nbbatch cluster scale needs --min-nodes and/or --max-nodes")
        status = cluster.scale(getattr(args, "min_nodes", None), getattr(args, "max_nodes", None), wait=wait)
    elif action == "delete":
        deleted = cluster.delete(wait=wait)
        print(f"cluster {cluster.name}: {'deleted' if deleted else 'did not exist'}")
        return 0
    else:
        raise BackendError(f"unknown cluster action `{action}`{did_you_mean(action, ['create', 'status', 'scale', 'delete'])}")
    if getattr(args, "json", False):
        print(json.dumps(status.to_dict(), indent=2))
    else:
        print(status.summary())
    return 0
