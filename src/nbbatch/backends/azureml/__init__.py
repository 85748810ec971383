"""The ``azureml`` backend: each run is an Azure ML command job on a GPU compute cluster.

This is deep_bait's Batch AI flow on today's service (Azure ML, SDK v2 ``azure-ai-ml``):

* a **cluster** (:class:`AzureMLCluster`, :mod:`.cluster`): an ``AmlCompute`` cluster that scales
  between ``min_nodes`` and ``max_nodes`` VMs of ``vm_size`` (dedicated or low-priority), sized by
  :class:`ClusterSettings` (which the backend's settings extend) and managed by ``nbbatch cluster``;
* an **environment** per framework (:mod:`.images`): an Azure ML ``Environment`` named
  ``nbbatch-<framework>``, built by Azure ML from the build context :mod:`nbbatch.containers.images`
  stages (``dockerfiles/Dockerfile`` filled from framework.yaml, and all it copies), versioned by the
  image's fingerprint and reused while it is unchanged;
* a **job** per run (:class:`AzureMLBackend`, :mod:`.backend`): a ``command`` job whose code is a
  snapshot of the run's notebooks, the frameworks' data and nbbatch's own source, and whose command
  is ``nbbatch run-one`` — the same executor every backend uses — writing ``output.ipynb``,
  ``run.json`` and ``log.txt`` to the experiment's Azure File share, mounted into the job through an
  Azure ML datastore.

The job name, its studio URL and the last job state seen are kept next to the run's files in
``<experiment>/<run id>/azureml.json`` (:class:`JobState`, :mod:`.jobs`); the backend's ``sync``
maps job states onto run records (:func:`map_job_status`), reading them in one paged list per poll, backing off
when throttled, and naming each job the same for a run's attempt (:mod:`.polling`). Settings (the ``backend:`` mapping of the
experiment file) are the fields of :class:`AzureMLSettings` (also :class:`AzureMLBackend`'s keyword arguments).

The workspace comes from the settings (``subscription_id``, ``resource_group``, ``workspace``),
else from ``AZURE_SUBSCRIPTION_ID`` / ``AZURE_RESOURCE_GROUP`` / ``AZUREML_WORKSPACE``, else from an
Azure ML ``config.json`` (searched from the working directory up, or ``config:``) (:func:`connect`,
:mod:`.workspace`). Credentials are :class:`azure.identity.DefaultAzureCredential`'s.
Importing this package imports nothing yet: each name below loads its module (and so the Azure SDK) on first use,
so that :mod:`.placement` loads on a job's node, whose image has nbbatch without the azure extra.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {  # name -> the module of this package that defines it
    "AzureMLBackend": "backend", "AzureMLSettings": "backend", "DEFAULT_LAUNCHER": "backend",
    "cli_cluster": "cli",
    "AzureMLCluster": "cluster", "ClusterSettings": "cluster", "ClusterStatus": "cluster",
    "build_code_snapshot": "images", "ensure_datastore": "images", "ensure_environment": "images",
    "framework_environment": "images",
    "JOB_FILE": "jobs", "JobState": "jobs", "job_yaml": "jobs", "map_job_status": "jobs",
    "azureml_placement": "placement",
    "connect": "workspace",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = sorted(_WHERE)
