"""The Ray backend: each run is a Ray task that executes ``nbbatch run-one`` on whichever node Ray picks.

A run asks Ray for ``num_gpus`` = its GPUs (``1/runs_per_gpu`` when several runs share one GPU) and
``num_cpus`` (setting, default 1). On the node, the task starts ``python -m nbbatch run-one`` as a
subprocess with ``CUDA_VISIBLE_DEVICES`` set from :func:`ray.get_gpu_ids` (empty for CPU runs); the
notebook runs in that node's framework kernel, found through the project's Jupyter path, so the
framework environments need no Ray. Outputs go to the share, which every node must see.

The tasks are owned by one small detached actor per experiment and share (the *supervisor*), so
they outlive the submitting process (``submit --no-wait``, a closed notebook), and ``status`` and
``cancel`` from another process can reach them. The supervisor records a final status for any task
that ended without one (node lost, task cancelled before it started, ``nbbatch`` missing on a node)
and leaves by itself once it has been idle for ``linger_s``.

Secrets never travel with an experiment: a secret-looking variable in ``env``, ``runtime_env.env_vars``
or a run's ``env:`` is refused before anything starts (:meth:`RayBackend.check_secrets`). Share
credentials (``AZURE_STORAGE_KEY``) come from the nodes' own environment. On the node, the run's launch
reaches ``run-one`` through a file in a private temporary folder of the task (not its command line),
next to the notebook's copy when the node has none.

Settings (the experiment's ``backend:`` mapping)::

    backend:
      name: ray
      address: auto            # or host:6379, or ray://head:10001
      num_cpus: 1              # CPUs each run asks for
      max_retries: null        # Ray retries after a node/worker death (default: the experiment's retries)
      shared_folder: false     # true: a folder share is mounted at the same path on every node
      project: null            # the project's path on the nodes (default: the submitting project's path)
      resources: {}            # extra Ray resources each run asks for, e.g. {"accelerator_type:A100": 0.01}
      env: {}                  # environment variables for run-one (and so the kernel) on the nodes; no secrets
      runtime_env: null        # a Ray runtime_env for the run tasks (its env_vars: no secrets either)
      autoscaling: false       # true: do not refuse runs that no current node can hold
      cancel_grace_s: 15       # how long a cancelled run may take to stop itself before its task is killed
      linger_s: 60             # how long an idle supervisor waits for more runs before it leaves
      gang_timeout_s: 300      # how long a distributed run's nodes may take to be placed together
      container: false         # true: each run in its framework's image on its node (docs/ray.md)
      engine: podman           # with container: the engine on the nodes (podman or docker)
      cpu_image: false         # with container: the frameworks' CPU images (`nbbatch images build --cpu`)
      base_image: null         # with container: the images built on this base (`nbbatch images build --base`)
      registry: null           # with container: the nodes pull REGISTRY/nbbatch-<fw>:<fingerprint> (`images push`)

With ``container: true`` the task's ``run-one`` starts the run's container on its node, as the slurm backend's does
(:mod:`nbbatch.containers.node`); the images are looked for here before anything starts, and again on the node.

The package, by where its code runs:

* :mod:`~nbbatch.backends.ray.backend`: :class:`RayBackend`, the driver side (settings, the cluster,
  the share check, handing runs to the supervisor, refresh, cancel);
* :mod:`~nbbatch.backends.ray.supervisor`: the :class:`RunSupervisor` actor and how a task's end is recorded;
* :mod:`~nbbatch.backends.ray.node`: the body of a run's task on a node (:func:`execute_on_node`);
* :mod:`~nbbatch.backends.ray.task`: what travels between them (:class:`RayTaskSpec`, :func:`gpu_request`).

``import nbbatch`` never imports Ray: these modules import it only when a function needs the cluster.
"""

from nbbatch.backends.ray.backend import FRESH_S, RayBackend
from nbbatch.backends.ray.node import NODE_ID_ENV, execute_on_node
from nbbatch.backends.ray.supervisor import NAMESPACE, RunSupervisor, supervisor_name
from nbbatch.backends.ray.task import RayTaskSpec, gpu_request
from nbbatch.backends.sharedfs import filesystem_type

__all__ = ["FRESH_S", "NAMESPACE", "NODE_ID_ENV", "RayBackend", "RayTaskSpec", "RunSupervisor", "execute_on_node",
           "filesystem_type", "gpu_request", "supervisor_name"]
