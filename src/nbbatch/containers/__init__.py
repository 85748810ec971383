"""Containers: the framework images (built from ``dockerfiles/Dockerfile`` and ``frameworks/<name>/``) and
runs executed inside them.

* :mod:`~nbbatch.containers.engines`: Docker and Podman behind one short protocol, found by name or by
  what is installed and running;
* :mod:`~nbbatch.containers.images`: the template filled from ``framework.yaml``, the build context
  (the same one Azure ML builds from), tags by fingerprint, ``ready | stale | missing``;
* :mod:`~nbbatch.containers.runner`: ``nbbatch run-one`` of one run inside its framework's image, for
  the local backend's ``container: true``;
* :mod:`~nbbatch.containers.checks`: what ``container: true`` refuses and the images it needs, for any backend;
* :mod:`~nbbatch.containers.registry`: images pushed to and pulled from a registry (``REGISTRY/nbbatch-<fw>:<fp>``);
* :mod:`~nbbatch.containers.node`: the slurm backend's ``container: true`` on a node (a launch naming ``container_images``).
"""
