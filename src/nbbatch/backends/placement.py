"""Where a node launcher is in its gang, by the variables each backend's cluster sets: the backends' placement hooks.

``nbbatch run-one`` reads them on the node, where a backend's SDK may be missing (Azure ML's job images carry
nbbatch without its extras): so the built-in backends' readers live here, importable without their SDK, and
:func:`placement_reader` finds a plug-in backend's in its class (:meth:`~nbbatch.backends.base.Backend.node_placement`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

from nbbatch.backends import backend_class
from nbbatch.backends.slurm.gang import slurm_placement
from nbbatch.execute.placement import DEFAULT_PORT, NodePlacement, PlacementReader
from nbbatch.plan.runs import Run
from nbbatch.store.share import Share


def azureml_placement(run: Run, environ: Mapping[str, str]) -> NodePlacement | None:
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


_BUILT_IN: dict[str, PlacementReader | None] = {"local": None, "ray": None, "azureml": azureml_placement}


def placement_reader(backend: str, share: Share | None = None) -> PlacementReader | None:
    """The placement hook of the backend called ``backend`` (None: it has none beyond nbbatch's own variables).

    Slurm's nodes exchange their addresses through ``share`` (see :mod:`nbbatch.backends.slurm.gang`)."""
    if backend == "slurm":
        return functools.partial(slurm_placement, share=share)
    if backend in _BUILT_IN:
        return _BUILT_IN[backend]
    return backend_class(backend).node_placement  # type: ignore[no-any-return]
