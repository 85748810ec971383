"""The kubernetes backend's settings, declared once (see :mod:`nbbatch.backends.settings`), and the share volume."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbbatch.backends.kubernetes.manifests import PodSettings, is_quantity
from nbbatch.backends.settings import setting
from nbbatch.errors import ValidationError
from nbbatch.redact import is_secret

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def share_volume(share: Mapping[str, Any]) -> dict[str, Any]:
    """The pod volume of the backend's ``share:`` setting (one key: pvc, nfs, azfiles or host_path)."""
    kinds = {"pvc", "nfs", "azfiles", "host_path"}
    if not isinstance(share, Mapping) or len(share) != 1 or next(iter(share)) not in kinds:
        raise ValidationError("backend setting `share:` says how pods mount the share: exactly one of `pvc: CLAIM` (a "
                              "ReadWriteMany PersistentVolumeClaim), `nfs: SERVER:/PATH`, `azfiles: {share_name: …, "
                              "secret_name: …}` (the Azure Files CSI driver) or `host_path: /PATH` (a one-node cluster)")
    (kind, value), = share.items()
    if kind == "pvc" and isinstance(value, str) and value:
        return {"persistentVolumeClaim": {"claimName": value}}
    if kind == "nfs" and isinstance(value, str) and ":/" in value:
        server, path = value.split(":", 1)
        return {"nfs": {"server": server, "path": path}}
    if kind == "azfiles" and isinstance(value, Mapping) and value.get("share_name") and value.get("secret_name"):
        return {"csi": {"driver": "file.csi.azure.com", "volumeAttributes": {
            "shareName": str(value["share_name"]), "secretName": str(value["secret_name"])}}}
    if kind == "host_path" and isinstance(value, str) and value.startswith("/"):
        return {"hostPath": {"path": value, "type": "Directory"}}
    forms = {"pvc": "`pvc: CLAIM`", "nfs": "`nfs: SERVER:/PATH`", "host_path": "`host_path: /PATH`",
             "azfiles": "`azfiles: {share_name: SHARE, secret_name: SECRET}` (the Secret holds the account's name and "
                        "key, as the Azure Files CSI driver reads them)"}
    raise ValidationError(f"backend setting `share: {{{kind}: {value!r}}}` is not a volume: write {forms[kind]}")


@dataclass(frozen=True)
class KubernetesSettings:
    """The kubernetes backend's settings (the experiment's ``backend:`` mapping; see docs/kubernetes.md)."""

    share: dict[str, Any] | None = None  # how pods mount the experiment's share (required; see share_volume)
    share_path: str = ""  # the share's folder inside that volume (the volume mount's subPath)
    namespace: str = field(default="default", metadata=setting(label="namespace"))
    context: str | None = field(default=None, metadata=setting(label="kubeconfig context"))
    kubeconfig: str | None = None  # default: $KUBECONFIG or ~/.kube/config (in a pod: its service account)
    registry: str | None = field(default=None, metadata=setting(label="registry"))  # REGISTRY/nbbatch-<fw>:<fp>
    images: dict[str, str] | None = None  # framework (or "*") → image, instead of the registry's tags
    cpu_image: bool = False  # the frameworks' CPU images (as `nbbatch images push --cpu`)
    base_image: str | None = None  # the images built on this base (as `nbbatch images push --base`)
    cpu: str | None = None  # each run's CPU request (default: resources.cpus, the LimitRange's default, or 1)
    memory: str | None = None  # each run's memory request and limit (default: the LimitRange's, or 4Gi)
    max_parallel: int | None = field(default=None, metadata=setting(minimum=1, label="max parallel"))
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None
    priority_class: str | None = None
    service_account: str | None = None
    image_pull_secrets: list[str] | None = None
    run_as_user: int | None = None  # the image's own user (uid 10001) unless set
    fs_group: int | None = 10001  # the image's group owns the share volume's files (volumes that support it)
    env: dict[str, str] | None = None  # variables for run-one (and so the kernel) in every pod; no secrets
    python: str = "python"  # nbbatch's Python in the images
    termination_grace_s: int = field(default=30, metadata=setting(minimum=1))  # SIGTERM to SIGKILL of a pod
    cancel_grace_s: float = field(default=15.0, metadata=setting(minimum=0))  # before a running run's Job is deleted
    poll_s: float | None = field(default=None, metadata=setting(minimum=0))
    client: Any = field(default=None, metadata=setting(python_only=True))  # a kubernetes.client.ApiClient (tests)

    def __post_init__(self) -> None:
        if self.share is None:
            raise ValidationError("the kubernetes backend needs `share:`, how its pods mount the experiment's share: "
                                  "`share: {pvc: CLAIM}` (a ReadWriteMany claim), `{nfs: SERVER:/PATH}`, `{azfiles: "
                                  "{share_name: …, secret_name: …}}` or `{host_path: /PATH}`")
        share_volume(self.share)
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ValidationError(f"backend setting `namespace: {self.namespace}` is not a Kubernetes namespace name: "
                                  "lowercase letters, digits and '-', at most 63, starting and ending alphanumeric")
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if value is not None and not is_quantity(value):
                example = "500m or 2" if name == "cpu" else "4Gi or 512Mi"
                raise ValidationError(f"backend setting `{name}: {value}` is not a Kubernetes quantity: write e.g. "
                                      f"{example}")
        secret = sorted(k for k, v in (self.env or {}).items() if is_secret(k, v))
        if secret:
            raise ValidationError(f"backend setting `env` holds `{secret[0]}`, which looks like a secret; it would be "
                                  "written into every pod's spec. Put it in a Kubernetes Secret and read it from the "
                                  "notebook (or the image)")

    def pod_settings(self) -> PodSettings:
        return PodSettings(
            namespace=self.namespace, share_volume=share_volume(self.share or {}), share_sub_path=self.share_path,
            node_selector=self.node_selector or {}, tolerations=self.tolerations or (),
            priority_class=self.priority_class, service_account=self.service_account,
            image_pull_secrets=self.image_pull_secrets or (), run_as_user=self.run_as_user, fs_group=self.fs_group,
            termination_grace_s=self.termination_grace_s, env=self.env or {}, python=self.python)


__all__ = ["KubernetesSettings", "share_volume"]
