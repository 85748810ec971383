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
maps job states onto run records (:func:`map_job_status`). Settings (the ``backend:`` mapping of the
experiment file) are the fields of :class:`AzureMLSettings` (also :class:`AzureMLBackend`'s keyword arguments).

The workspace comes from the settings (``subscription_id``, ``resource_group``, ``workspace``),
else from ``AZURE_SUBSCRIPTION_ID`` / ``AZURE_RESOURCE_GROUP`` / ``AZUREML_WORKSPACE``, else from an
Azure ML ``config.json`` (searched from the working directory up, or ``config:``) (:func:`connect`,
:mod:`.workspace`). Credentials are :class:`azure.identity.DefaultAzureCredential`'s.
Importing this package imports the Azure SDK; ``import nbbatch`` does not.
"""

from __future__ import annotations

from nbbatch.backends.azureml.backend import DEFAULT_LAUNCHER, AzureMLBackend, AzureMLSettings
from nbbatch.backends.azureml.cli import cli_cluster
from nbbatch.backends.azureml.cluster import AzureMLCluster, ClusterSettings, ClusterStatus
from nbbatch.backends.azureml.images import build_code_snapshot, ensure_datastore, ensure_environment, framework_environment
from nbbatch.backends.azureml.jobs import JOB_FILE, JobState, job_yaml, map_job_status
from nbbatch.backends.azureml.workspace import connect

__all__ = [
    "AzureMLBackend",
    "AzureMLSettings",
    "AzureMLCluster",
    "ClusterSettings",
    "ClusterStatus",
    "JobState",
    "map_job_status",
    "connect",
    "framework_environment",
    "ensure_environment",
    "ensure_datastore",
    "build_code_snapshot",
    "job_yaml",
    "cli_cluster",
    "JOB_FILE",
    "DEFAULT_LAUNCHER",
]
