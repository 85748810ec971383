"""``nbbatch cluster create|status|scale|delete`` on the azureml backend's compute cluster (for Python callers and
tests: the command itself finds the backend through its capabilities, :mod:`nbbatch.backends.cluster`)."""

from __future__ import annotations

import argparse

from azure.ai.ml import MLClient

from nbbatch.backends.azureml.backend import AzureMLBackend
from nbbatch.backends.cluster import run_cluster_command


def cli_cluster(args: argparse.Namespace, ml_client: MLClient | None = None) -> int:
    """``nbbatch cluster …`` on the azureml backend, through ``ml_client`` when given (see
    :func:`~nbbatch.backends.cluster.run_cluster_command`)."""
    return run_cluster_command(args, AzureMLBackend, ml_client=ml_client)
