"""Where a node launcher is in its gang on Azure ML: the variables of Azure ML's distributions.

``nbbatch run-one`` reads them on the node, where the Azure SDK may be missing (Azure ML's job images carry nbbatch
without its extras): so this module imports no SDK, and the registry names it (``nbbatch.backends``) instead of
:meth:`AzureMLBackend.node_placement <nbbatch.backends.azureml.backend.AzureMLBackend.node_placement>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from nbbatch.execute.placement import DEFAULT_PORT, NodePlacement
from nbbatch.plan.runs import Run
from nbbatch.store.share import Share


def azureml_placement(run: Run, environ: Mapping[str, str], share: Share | None = None) -> NodePlacement | None:
    """Azure ML's distributions: MPI (``OMPI_COMM_WORLD_*``, one launcher per rank), TensorFlow (``TF_CONFIG``)
    and PyTorch (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); None when none of them is set."""
    assert run.distribution is not None
    per_node = run.distribution.processes_per_node
    if "OMPI_COMM_WORLD_RANK" in environ:  # MPI started one process per rank: this launcher is that rank's
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        local = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank % per_node))
        # Azure ML names the master "addr:port" (AZ_BATCH_MASTER_NODE), or only its address on one node
        master, _, port = (environ.get("AZ_BATCH_MASTER_NODE") or "").partition(":")
        master = master or environ.get("AZ_BATCHAI_MPI_MASTER_NODE") or environ.get("MASTER_ADDR") or "127.0.0.1"
        port = port or environ.get("MASTER_PORT") or str(DEFAULT_PORT)
        return NodePlacement(rank // per_node, (f"{master}:{port}",), (local,))
    if environ.get("TF_CONFIG") and run.distribution.type == "tensorflow":
        config = json.loads(environ["TF_CONFIG"])
        return NodePlacement(int(config["task"]["index"]), tuple(config["cluster"]["worker"]))
    if "MASTER_ADDR" in environ:
        node = environ.get("NODE_RANK") or environ.get("GROUP_RANK") or environ.get("RANK") or "0"
        return NodePlacement(int(node), (f"{environ['MASTER_ADDR']}:{environ.get('MASTER_PORT') or DEFAULT_PORT}",))
    return None


__all__ = ["azureml_placement"]
