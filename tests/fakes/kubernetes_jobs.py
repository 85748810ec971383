"""What the Kubernetes Job controller makes of an Indexed Job: the Pod of one index, and the index ranges it reports.

Pure functions on plain dicts (the JSON shape of the API objects), shared by the fake API server's Job controller
(:mod:`fakes.kubernetes_cluster`) and by tests that turn a Job the backend made into the Pod YAML that
``podman kube play`` runs. The derivation follows the real controller (pkg/controller/job, v1.28+):

- name ``<job>-<index>-<5 random characters>`` (``generateName`` ``<job>-<index>-``, cut to 58 characters as the API
  server cuts generated names);
- the template's labels plus ``batch.kubernetes.io/job-name`` / ``job-name`` and, when the Job has a uid,
  ``batch.kubernetes.io/controller-uid`` / ``controller-uid`` (the API server puts these on the template of a stored
  Job; a Job that was never stored has no uid), and ``batch.kubernetes.io/job-completion-index``;
- the annotation ``batch.kubernetes.io/job-completion-index`` (and, with ``backoffLimitPerIndex``,
  ``batch.kubernetes.io/job-index-failure-count``);
- ``spec.hostname`` ``<job>-<index>`` (the template's ``subdomain`` is kept, so ``<job>-<index>.<subdomain>`` resolves
  through a headless Service of that name);
- ``JOB_COMPLETION_INDEX`` in every container and init container that does not define it, read from the index label;
- an ``ownerReferences`` entry to the Job (controller, blockOwnerDeletion) when the Job has a uid.

The controller's ``batch.kubernetes.io/job-tracking`` finalizer is not part of the derivation (the fake cluster adds
it); nor is anything the API server adds when it stores the Pod (defaults, status).
"""

from __future__ import annotations

import copy
import random
from typing import Any

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
LEGACY_JOB_NAME_LABEL = "job-name"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
LEGACY_CONTROLLER_UID_LABEL = "controller-uid"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # a label and an annotation
INDEX_FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
INDEX_IGNORED_FAILURE_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"
TRACKING_FINALIZER = "batch.kubernetes.io/job-tracking"
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"

# The API server's generated-name alphabet (k8s.io/apiserver names.SimpleNameGenerator: no vowels, no 0/1/3).
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
GENERATED_SUFFIX_LENGTH = 5
MAX_GENERATE_NAME = 63 - GENERATED_SUFFIX_LENGTH


def random_suffix(rng: random.Random | None = None) -> str:
    """Five characters as the API server appends to a ``generateName``."""
    pick = (rng or random).choice
    return "".join(pick(NAME_ALPHABET) for _ in range(GENERATED_SUFFIX_LENGTH))


def generate_name(prefix: str, suffix: str | None = None) -> str:
    """The name the API server gives an object created with ``generateName: prefix``."""
    return prefix[:MAX_GENERATE_NAME] + (suffix if suffix is not None else random_suffix())


def index_generate_name(job_name: str, index: int) -> str:
    """``<job>-<index>-``, the job part cut so that the whole fits a generated name (as the controller does)."""
    tail = f"-{index}-"
    prefix = job_name + tail
    if len(prefix) > MAX_GENERATE_NAME:
        prefix = prefix[:MAX_GENERATE_NAME - len(tail)] + tail
    return prefix


def pod_for_index(job: dict[str, Any], index: int, suffix: str | None = None, *, failures: int = 0,
                  ignored_failures: int = 0, index_label: bool = True) -> dict[str, Any]:
    """The Pod the Job controller creates for ``index`` of the Indexed Job ``job`` (a dict as the API returns it).

    ``suffix`` fixes the five random characters of the name (random when ``None``). ``failures`` /
    ``ignored_failures`` are the index's earlier failures, written as annotations when the Job uses
    ``backoffLimitPerIndex`` (the controller counts them). ``index_label=False`` derives as servers before v1.28 did
    (no index label; ``JOB_COMPLETION_INDEX`` read from the annotation). The Job is not modified.
    """
    meta = job.get("metadata") or {}
    spec = job.get("spec") or {}
    name = meta["name"]
    uid = meta.get("uid")
    template = copy.deepcopy(spec.get("template") or {})
    template_meta = template.get("metadata") or {}
    pod_spec = template.get("spec") or {}

    labels = dict(template_meta.get("labels") or {})
    labels.setdefault(JOB_NAME_LABEL, name)
    labels.setdefault(LEGACY_JOB_NAME_LABEL, name)
    if uid:
        labels.setdefault(CONTROLLER_UID_LABEL, uid)
        labels.setdefault(LEGACY_CONTROLLER_UID_LABEL, uid)
    if index_label:
        labels[COMPLETION_INDEX] = str(index)
    annotations = dict(template_meta.get("annotations") or {})
    annotations[COMPLETION_INDEX] = str(index)
    if spec.get("backoffLimitPerIndex") is not None:
        annotations[INDEX_FAILURE_COUNT] = str(failures)
        if ignored_failures:
            annotations[INDEX_IGNORED_FAILURE_COUNT] = str(ignored_failures)

    pod_spec["hostname"] = f"{name}-{index}"
    source = "labels" if index_label else "annotations"
    index_env = {"name": COMPLETION_INDEX_ENV,
                 "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": f"metadata.{source}['{COMPLETION_INDEX}']"}}}
    for container in [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]:
        env = container.setdefault("env", [])
        if not any(var.get("name") == COMPLETION_INDEX_ENV for var in env):
            env.append(copy.deepcopy(index_env))

    prefix = index_generate_name(name, index)
    metadata: dict[str, Any] = {"name": generate_name(prefix, suffix), "generateName": prefix,
                                "namespace": meta.get("namespace", "default"), "labels": labels,
                                "annotations": annotations}
    if uid:
        metadata["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
                                        "controller": True, "blockOwnerDeletion": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def format_indexes(indexes: set[int] | list[int]) -> str:
    """Indexes as the Job status writes them: ``"0-2,5,7,8"`` (runs of three or more as ranges, two as a pair)."""
    ordered = sorted(set(indexes))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first},{last}" if last == first + 1 else f"{first}-{last}")
        start = end + 1
    return ",".join(parts)


def parse_indexes(text: str | None) -> set[int]:
    """The set of indexes in a ``completedIndexes`` / ``failedIndexes`` string."""
    indexes: set[int] = set()
    for part in filter(None, (text or "").split(",")):
        first, _, last = part.partition("-")
        indexes.update(range(int(first), int(last or first) + 1))
    return indexes
