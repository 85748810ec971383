"""What ``nbbatch run-one`` needs to know in a pod, without the Kubernetes client (the images carry nbbatch alone).

A pod is stopped with SIGTERM when nbbatch cancels its run (the run's cancel marker is on the share first, and says
so) and when the cluster takes the pod away: an eviction, a preemption, a node drain. The second is not the run's
end: its Job's pod failure policy replaces the pod (``DisruptionTarget``: not counted), and the new pod resumes the
run from its checkpoint. So a stop signal without a marker puts the run back in the queue, its notebook so far kept.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

from nbbatch.execute.placement import NodePlacement
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import StopRequest
from nbbatch.store.runjson import Status
from nbbatch.store.share import Share


def kubernetes_stop_request(signum: int) -> StopRequest:
    """Why this pod's launcher got ``signum`` when no cancel marker says (the node stop hook): the cluster took the
    pod away, and the run goes back in the queue."""
    pod = os.environ.get("HOSTNAME", "?")
    return StopRequest(Status.QUEUED, "interrupted: Kubernetes stopped its pod (an eviction, a preemption or a node "
                                      "drain); a new pod resumes it from its last checkpoint", "PodInterrupted",
                       f"{signal.Signals(signum).name} to pod {pod} without a cancel from nbbatch")


def kubernetes_placement(run: Run, environ: Mapping[str, str], share: Share | None = None) -> NodePlacement | None:
    """The node placement hook: none beyond nbbatch's own variables (a gang's pod sets ``NBBATCH_NODE_RANK`` from its
    completion index, its Job ``NBBATCH_ENDPOINTS``); here so that run-one in a pod loads no Kubernetes client."""
    return None


__all__ = ["kubernetes_placement", "kubernetes_stop_request"]
