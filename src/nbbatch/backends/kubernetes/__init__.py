"""The ``kubernetes`` backend: runs as Kubernetes Jobs, where most GPU fleets outside HPC centres live.

* one ``nbbatch submit`` makes one **Indexed Job** per run shape (image, GPUs, CPU, memory, retries): index ``i`` is
  run ``i``, at most ``max_parallel`` pods at once (``parallelism``); one Indexed Job of N pods and a headless Service
  per **distributed run** (its ranks meet at ``<job>-0.<job>``);
* every pod runs the framework's image (``nbbatch images push``) and ``nbbatch run-one`` — the executor every backend
  uses — on its index's launch, which lies on the share, a volume of the pods (a ReadWriteMany claim, NFS, Azure
  Files through its CSI driver);
* nothing is queued before the server says it would take it: a server-side dry run of every Job, its Service and one
  of its pods (quota, LimitRange, priority classes and admission webhooks judge pods);
* the run records on the share are the truth; the Jobs and pods explain waits (unschedulable: which resource), images
  that cannot be pulled, OOMKilled pods and deleted Jobs. A run's Job is kept next to its files
  (``<experiment>/<run id>/kubernetes.json``, :class:`~nbbatch.backends.kubernetes.states.KubernetesJob`).

Settings (the experiment's ``backend:`` mapping) are the fields of :class:`KubernetesSettings`. See
docs/kubernetes.md, which also says what was proven against a fake API server and what ran for real.
"""

from __future__ import annotations

import importlib
from typing import Any

# loaded on first use: run-one in a pod imports nbbatch.backends.kubernetes.node, without the Kubernetes client
_WHERE = {"KubernetesBackend": "backend", "KubernetesSettings": "settings", "JOB_FILE": "states",
          "KubernetesJob": "states", "kubernetes_stop_request": "node"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = sorted(_WHERE)
