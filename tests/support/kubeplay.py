"""Kubernetes Pods run for real with ``podman kube play``: how the kubernetes backend's tests prove that every pod spec
nbbatch generates works (image, command, environment, user, volumes, the node launcher) where no cluster can run.

:class:`KubeNode` is one node of a pretend cluster: it plays Pod manifests (dicts, as the API server holds them) with
``podman kube play``, doing first what a kubelet and the cluster would do and podman 4.3 does not
(:func:`playable`), and removes every pod, volume, network and folder it made when it closes. Everything it makes
carries the label ``nbbatch.io/kubeplay=<its token>`` (:func:`leftovers` finds what is left).

What ``podman kube play`` 4.3.1 does with a Pod, as tried on this machine (runc, root), and what is done here instead:

* honoured: image, command/args, env ``value``, env ``fieldRef`` of ``metadata.name``, ``metadata.labels['…']`` and
  ``metadata.annotations['…']``, workingDir, ``runAsUser``/``runAsGroup``/``supplementalGroups``, resources (the
  memory limit), ``restartPolicy: Never``, ``hostname``, labels (on the pod and its containers), a
  ``persistentVolumeClaim`` (as the podman named volume of that name), ``hostPath``; ``hostAliases`` only on a
  bridge network (with ``--network host`` they are left out of /etc/hosts; kube play 4.3 has no ``--add-host``);
* refused: ``fieldRef`` of ``metadata.namespace`` ("fieldPath metadata.namespace is either not valid or not
  supported"): every fieldRef is resolved here, as the kubelet does;
* ignored, and done here: ``$(VAR)`` in command, args and env values (Kubernetes' expansion, :func:`expand`; podman
  passes it on, where a shell takes it for a command substitution); a mount's ``subPath`` (podman mounts the whole
  volume: the mount becomes a hostPath of the sub-folder, made as the kubelet makes it); ``fsGroup`` (the kubelet
  adds it to the container's groups, here ``supplementalGroups``, and before the pod starts gives the files of a
  volume that supports ownership, a claim's, to the group: :func:`give_to_group`; hostPath and NFS volumes it
  leaves alone); ``emptyDir`` (podman makes it a named volume called after the pod's volume, so two pods' ``dshm``
  are one volume, on disk; ``medium: Memory`` ignored): here a folder of the pod's own, under the host's /dev/shm (a
  tmpfs) for ``medium: Memory``; ``terminationGracePeriodSeconds`` (podman stops after 10 s):
  :meth:`PlayedPod.terminate` uses it; ``subdomain``: the cluster DNS of a headless Service, see below;
* different: a ``containerPort`` without ``hostPort`` is published on the host's port of that number (so a second
  pod with the same port cannot start: "cannot listen on the TCP port: listen tcp4 :29500: bind: address already in
  use"); Kubernetes publishes nothing, so such ports are dropped here (pods reach each other by address anyway);
* a claim's named volume is ``podman volume create --opt type=none --opt o=bind,uid=U,gid=G --opt device=DIR``:
  without ``uid``/``gid`` (the folder's own owner) podman chowns DIR to the container's user the first time a
  container mounts the new volume, which no cluster does.

Networking: each node has a podman bridge network of its own; every pod gets its own address and network namespace,
as on a cluster. A pod whose ``subdomain`` names a headless Service the node serves (:meth:`KubeNode.serve`) and whose
labels that Service selects is reachable as ``<hostname>.<subdomain>`` (the pod's alias on the network, resolved by
podman's DNS), as the cluster DNS resolves a headless Service's pods, ready or not: a gang's ranks meet at
``<job>-0.<job>:29500`` across pods.

``podman kube play`` 4.3 takes Pods, Deployments and PersistentVolumeClaims only: a Job is turned into its pods by the
caller (the Job controller's derivation, ``fakes.kubernetes_jobs.pod_for_index``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from fakes.kubernetes_process import expand  # Kubernetes' $(VAR) expansion, as the fake kubelet does it

from support.containers import podman
from support.waiting import wait_until

LABEL = "nbbatch.io/kubeplay"  # on every pod (and so its containers), volume and network a node makes
NODE_NAME = "kubeplay"  # spec.nodeName as the pods see it
DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds when a pod does not say
SERVICE_WAIT_S = 30  # how long PodmanKubelet waits for the headless Service a pod's subdomain names
MEMORY_ROOT = Path("/dev/shm")  # a tmpfs on the host: where emptyDir {medium: Memory} folders go
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


class PlayFailed(AssertionError):
    """``podman kube play`` refused the pod, or its container could not start (the kubelet's RunContainerError)."""


# --- what the kubelet resolves ----------------------------------------------------------------------------------------


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """The value of a downward-API ``fieldRef`` for ``pod`` (what the kubelet puts in the variable)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {"metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", "default"),
              "metadata.uid": meta.get("uid", ""), "spec.nodeName": NODE_NAME,
              "spec.serviceAccountName": spec.get("serviceAccountName", "default")}
    if path in simple:
        return str(simple[path])
    found = _FIELD.match(path)
    if found:
        return str((meta.get(found[1]) or {}).get(found[2], ""))
    raise ValueError(f"kubeplay: fieldRef {path!r} is not resolved here (add it to field_value)")


def resolved_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[dict[str, str]]:
    """The container's env as plain values: fieldRefs resolved, ``$(VAR)`` of earlier variables expanded."""
    values: dict[str, str] = {}
    for var in container.get("env") or []:
        if "valueFrom" in var:
            source = var["valueFrom"]
            if set(source) != {"fieldRef"}:
                raise ValueError(f"kubeplay: env {var['name']} comes from {sorted(source)}; only fieldRef is resolved here")
            values[var["name"]] = field_value(pod, source["fieldRef"]["fieldPath"])
        else:
            values[var["name"]] = expand(str(var.get("value", "")), values)
    return [{"name": k, "value": v} for k, v in values.items()]


# --- volumes ---------------------------------------------------------------------------------------------------------


def give_to_group(folder: Path, gid: int) -> None:
    """What the kubelet does before a pod with ``fsGroup`` starts to a volume that supports ownership management
    (pkg/volume/volume_linux.go, SetVolumeOwnership): each file's group becomes ``gid``, read-write for owner and
    group; directories also searchable and setgid, so what the pod makes there is the group's too."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chown(path, -1, gid)
        mode = path.stat().st_mode
        os.chmod(path, stat.S_IMODE(mode) | 0o660 | (0o110 | stat.S_ISGID if stat.S_ISDIR(mode) else 0))


@dataclass
class Playable:
    """A Pod as ``podman kube play`` 4.3 takes it, and what the node does first."""

    manifest: dict[str, Any]
    folders: list[Path] = field(default_factory=list)  # made before the pod starts (subPaths, emptyDirs)
    owned: list[Path] = field(default_factory=list)  # claims' folders, given to the fsGroup (when there is one)
    fs_group: int | None = None
    grace_s: int = DEFAULT_GRACE_S


def _volume_source(volume: Mapping[str, Any], claims: Mapping[str, tuple[str, Path]],
                   nfs: Mapping[str, Path]) -> tuple[Path | None, dict[str, Any] | None]:
    """A pod volume's host folder (None for an emptyDir) and what kube play mounts instead (None: as it is)."""
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]["claimName"]
        if claim not in claims:
            raise ValueError(f"kubeplay: the pod mounts claim {claim!r}, which the node does not have (claims=)")
        name, folder = claims[claim]
        return folder, {"persistentVolumeClaim": {"claimName": name}}
    if "hostPath" in volume:
        return Path(volume["hostPath"]["path"]), None
    if "nfs" in volume:
        export = f"{volume['nfs']['server']}:{volume['nfs']['path']}"
        if export not in nfs:
            raise ValueError(f"kubeplay: the pod mounts NFS export {export!r}, which the node does not have (nfs=)")
        return nfs[export], {"hostPath": {"path": str(nfs[export]), "type": "Directory"}}
    if "emptyDir" in volume:
        return None, None
    raise ValueError(f"kubeplay: volume {volume.get('name')!r} is of a kind not played here: {sorted(volume)}")


def playable(pod: Mapping[str, Any], claims: Mapping[str, tuple[str, Path]], scratch: Path, memory: Path,
             nfs: Mapping[str, Path] | None = None, mounts: Mapping[str, Path] | None = None,
             labels: Mapping[str, str] | None = None) -> Playable:
    """``pod`` as kube play 4.3 takes it (see the module's docstring): ``claims`` maps a claim to (the podman volume
    standing for it, its host folder); ``nfs`` an export ``server:/path`` to a host folder; emptyDirs go under
    ``scratch``, those of ``medium: Memory`` under ``memory`` (on a tmpfs); ``mounts`` (container path → host path)
    are added read-only to every container; ``labels`` to the pod's."""
    out = copy.deepcopy(dict(pod))
    out.setdefault("apiVersion", "v1")
    out.setdefault("kind", "Pod")
    meta, spec = out.setdefault("metadata", {}), out["spec"]
    meta["labels"] = {**(meta.get("labels") or {}), **(labels or {})}
    result = Playable(out, grace_s=int(spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)))
    hosts: dict[str, Path] = {}
    volumes = []
    for volume in spec.get("volumes") or []:
        folder, instead = _volume_source(volume, claims, nfs or {})
        if "emptyDir" in volume:
            in_memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
            folder = (memory if in_memory else scratch) / volume["name"]
            result.folders.append(folder)
            instead = {"hostPath": {"path": str(folder), "type": "Directory"}}
        elif "persistentVolumeClaim" in volume:
            result.owned.append(folder)
        hosts[volume["name"]] = folder
        volumes.append({"name": volume["name"], **(instead or {k: v for k, v in volume.items() if k != "name"})})
    security = dict(spec.get("securityContext") or {})
    if "fsGroup" in security:  # the kubelet adds it to every container's groups
        result.fs_group = int(security.pop("fsGroup"))
        security["supplementalGroups"] = [*security.get("supplementalGroups", []), result.fs_group]
    if security:
        spec["securityContext"] = security
    for number, (_inside, host) in enumerate(sorted((mounts or {}).items())):
        volumes.append({"name": f"kubeplay-mount-{number}", "hostPath": {"path": str(host)}})
    for container in spec.get("containers") or []:
        _playable_container(out, container, hosts, volumes, result, sorted((mounts or {}).items()))
    spec["volumes"] = volumes
    return result


def _playable_container(pod: Mapping[str, Any], container: dict[str, Any], hosts: Mapping[str, Path | None],
                        volumes: list[dict[str, Any]], result: Playable, mounts: list[tuple[str, Path]]) -> None:
    # a containerPort without hostPort only documents the port on Kubernetes; podman 4.3 publishes it on the host
    container["ports"] = [port for port in container.get("ports") or [] if "hostPort" in port]
    if not container["ports"]:
        del container["ports"]
    env = resolved_env(pod, container)
    container["env"] = env
    variables = {v["name"]: v["value"] for v in env}
    for key in ("command", "args"):
        if key in container:
            container[key] = [expand(str(word), variables) for word in container[key]]
    kept = []
    for mount in container.get("volumeMounts") or []:
        mount = dict(mount)
        sub = mount.pop("subPath", "")
        if sub:  # the sub-folder as a volume of its own, made as the kubelet makes it
            folder = hosts[mount["name"]]
            assert folder is not None, "a subPath of an emptyDir"
            name = f"{mount['name']}-sub-{len(volumes)}"
            result.folders.append(folder / sub)
            volumes.append({"name": name, "hostPath": {"path": str(folder / sub), "type": "Directory"}})
            mount["name"] = name
        kept.append(mount)
    kept += [{"name": f"kubeplay-mount-{n}", "mountPath": inside, "readOnly": True}
             for n, (inside, _host) in enumerate(mounts)]
    container["volumeMounts"] = kept


# --- pods on a node ------------------------------------------------------------------------------------------------


@dataclass
class PlayedPod:
    """A pod that ``podman kube play`` started. A context manager: the pod and its containers go at the end."""

    name: str
    container: str  # podman's name of the pod's (first) container: ``<pod>-<container>``
    grace_s: int
    on_remove: Callable[[], None] = lambda: None

    def state(self) -> dict[str, Any]:
        """The container's state as podman has it (``Status``, ``ExitCode``, ``OOMKilled``…); {} once removed."""
        done = podman("container", "inspect", "--format", "{{json .State}}", self.container, check=False)
        return json.loads(done.stdout) if done.returncode == 0 else {}

    def wait(self, timeout: float) -> int:
        """The container's exit code, once it has exited; TimeoutError (with its log's end) after ``timeout``."""
        try:
            done = podman("wait", self.container, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"pod {self.name} still runs after {timeout} s; its log ends:\n{self.logs()[-3000:]}") \
                from None
        return int(done.stdout.strip().splitlines()[-1])

    def address(self, network: str) -> str:
        """The pod's address on ``network`` (its infra container's)."""
        done = podman("pod", "inspect", "--format", "{{.InfraContainerID}}", self.name)
        infra = done.stdout.strip()
        found = podman("container", "inspect", "--format",
                       f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}', infra)
        return found.stdout.strip()

    def logs(self) -> str:
        """What the container wrote (stdout and stderr), as ``kubectl logs`` shows it."""
        done = subprocess.run(["podman", "logs", self.container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=60)
        return done.stdout

    def terminate(self, grace_s: int | None = None) -> None:
        """Stop the pod as a kubelet deleting it does: SIGTERM to the container, SIGKILL after the grace period (the
        pod's ``terminationGracePeriodSeconds`` unless ``grace_s``)."""
        grace = self.grace_s if grace_s is None else grace_s
        done = podman("pod", "stop", "-t", str(grace), self.name, check=False, timeout=grace + 60)
        if done.returncode != 0 and podman("pod", "exists", self.name, check=False).returncode == 0:
            raise AssertionError(f"podman pod stop {self.name} failed: {done.stderr[-2000:]}")

    def remove(self) -> None:
        """Remove the pod and its containers (stopped at once if running), and its folders."""
        podman("pod", "rm", "-f", self.name, check=False, timeout=120)
        self.on_remove()

    def __enter__(self) -> PlayedPod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class KubeNode:
    """One node of a pretend cluster, on this machine: plays Pods with ``podman kube play`` (see the module's
    docstring), their claims bound to host folders, the cluster DNS of headless Services on a bridge network of its
    own. A context manager: every pod, volume, network and folder it made goes at the end.

    ``claims``: claim name → host folder (its PersistentVolume); ``nfs``: ``server:/path`` → host folder;
    ``mounts``: container path → host path, mounted read-only into every container (e.g. this checkout's nbbatch over
    the image's)."""

    def __init__(self, claims: Mapping[str, Path] | None = None, nfs: Mapping[str, Path] | None = None,
                 mounts: Mapping[str, Path] | None = None) -> None:
        self.token = uuid.uuid4().hex[:8]
        self.network = f"kubeplay-{self.token}"
        self.nfs, self.mounts = dict(nfs or {}), dict(mounts or {})
        self.scratch = Path(tempfile.mkdtemp(prefix=f"kubeplay-{self.token}-"))
        self.claims: dict[str, tuple[str, Path]] = {}
        self.services: dict[str, dict[str, str]] = {}  # headless Service name → its selector
        self.pods: list[PlayedPod] = []
        self._network_made = False
        for claim, folder in (claims or {}).items():
            self.add_claim(claim, folder)

    @property
    def label(self) -> str:
        return f"{LABEL}={self.token}"

    def add_claim(self, claim: str, folder: Path) -> None:
        """Bind ``claim`` to ``folder``: a podman named volume of the folder, as its PersistentVolume."""
        volume = f"kubeplay-{self.token}-{claim}"
        owner = folder.stat()
        podman("volume", "create", "--label", self.label, "--opt", "type=none", "--opt",
               f"o=bind,uid={owner.st_uid},gid={owner.st_gid}", "--opt", f"device={folder}", volume)
        self.claims[claim] = (volume, folder)

    def serve(self, service: Mapping[str, Any]) -> None:
        """Serve a headless Service's DNS: pods it selects whose ``subdomain`` is its name resolve as
        ``<hostname>.<service>``. Only headless Services (``clusterIP: None``) are served."""
        spec = service["spec"]
        assert spec.get("clusterIP") == "None", f"Service {service['metadata']['name']} is not headless"
        self.services[service["metadata"]["name"]] = dict(spec.get("selector") or {})

    def dns_name(self, pod: Mapping[str, Any]) -> str | None:
        """The pod's name in the cluster DNS: ``<hostname>.<subdomain>`` when a served Service gives it one."""
        spec, labels = pod["spec"], (pod.get("metadata") or {}).get("labels") or {}
        subdomain, hostname = spec.get("subdomain"), spec.get("hostname") or pod["metadata"]["name"]
        if subdomain and subdomain in self.services and _selects(self.services[subdomain], labels):
            return f"{hostname}.{subdomain}"
        return None

    def _ensure_network(self) -> None:
        if not self._network_made:
            podman("network", "create", "--label", self.label, self.network)
            self._network_made = True

    def play(self, pod: Mapping[str, Any]) -> PlayedPod:
        """Start ``pod`` (a Pod manifest); PlayFailed with podman's words when it cannot start (the pod is still
        removed when the node closes)."""
        name = pod["metadata"]["name"]
        scratch, memory = self.scratch / name, MEMORY_ROOT / f"kubeplay-{self.token}-{name}"
        ready = playable(pod, self.claims, scratch / "empty", memory, self.nfs, self.mounts, {LABEL: self.token})
        for folder in ready.folders:
            folder.mkdir(parents=True, exist_ok=True)
        if ready.fs_group is not None:
            for folder in ready.owned:
                give_to_group(folder, ready.fs_group)
        path = scratch / "pod.yaml"
        scratch.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(ready.manifest, sort_keys=False))
        self._ensure_network()
        alias = self.dns_name(pod)
        network = f"{self.network}:alias={alias}" if alias else self.network
        container = f"{name}-{ready.manifest['spec']['containers'][0]['name']}"
        played = PlayedPod(name, container, ready.grace_s,
                           on_remove=lambda: shutil.rmtree(memory, ignore_errors=True))
        self.pods.append(played)
        done = podman("kube", "play", "--network", network, str(path), check=False)
        if done.returncode != 0:
            raise PlayFailed(f"podman kube play of pod {name} failed ({done.returncode}): "
                             f"{(done.stderr or done.stdout)[-2000:]}")
        return played

    def close(self) -> None:
        """Remove every pod, volume and network the node made (by its label, so also pods whose play failed) and
        its folders."""
        for pod in self.pods:
            pod.remove()
        if self.pods or self.claims or self._network_made:  # a node that made nothing needs no podman
            for kind, listing in (("pod", ("pod", "ps", "-q")), ("volume", ("volume", "ls", "-q")),
                                  ("network", ("network", "ls", "-q"))):
                for item in podman(*listing, "--filter", f"label={self.label}", check=False).stdout.split():
                    podman(kind, "rm", "-f", item, check=False, timeout=120)
        for folder in [self.scratch, *MEMORY_ROOT.glob(f"kubeplay-{self.token}-*")]:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> KubeNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PodmanKubelet:
    """The fake API server's kubelet (``fakes.kubernetes_cluster.Kubelet``) that runs each pod for real on ``node``
    with ``podman kube play``, so ``nbbatch.submit`` against the fake server runs its pods' notebooks.

    ``reporter`` is the fake cluster's ``PodReporter`` class (``fakes.kubernetes_kubelets``): it writes a pod's status
    and events as the kubelet does. A pod is scheduled, played (its DNS name from the headless Service its
    ``subdomain`` names, as the cluster has it), reported running with its address, its output appended to the
    pod's log, and reported terminated with its container's exit code (``OOMKilled`` when the kernel killed it for
    its memory limit); then its podman pod goes (the log is kept by the cluster). One that cannot start waits with
    ``RunContainerError`` until it is deleted. Deleting a pod stops it with its grace period."""

    def __init__(self, node: KubeNode, reporter: Any) -> None:
        self.node, self.reporter = node, reporter
        self.cluster: Any = None
        self._played: dict[str, PlayedPod] = {}
        self._stops: dict[str, threading.Event] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def attach(self, cluster: Any) -> None:
        self.cluster = cluster

    def start_pod(self, pod: dict[str, Any]) -> None:
        self._stops[pod["metadata"]["uid"]] = threading.Event()
        self._spawn(self._run, pod)

    def stop_pod(self, pod: dict[str, Any], grace_seconds: float) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            self._stops.setdefault(uid, threading.Event()).set()
            played = self._played.get(uid)
        if played is not None:
            self._spawn(played.terminate, int(grace_seconds))

    def close(self) -> None:
        for uid, stop in list(self._stops.items()):
            stop.set()
            if (played := self._played.get(uid)) is not None:
                played.terminate(0)
        for thread in self._threads:
            thread.join(timeout=120)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name="podman-kubelet")
        self._threads.append(thread)
        thread.start()

    def _run(self, pod: dict[str, Any]) -> None:
        uid, meta = pod["metadata"]["uid"], pod["metadata"]
        report = self.reporter(self.cluster, pod, "", "10.0.0.2")
        report.schedule()
        subdomain = pod["spec"].get("subdomain")
        if subdomain:  # names are given at play time: a pod made before its Service waits for it a little
            service = wait_until(lambda: self.cluster.store.get("services", meta["namespace"], subdomain),
                                 timeout=SERVICE_WAIT_S, message=f"Service {subdomain}", interval=0.2)
            if (service.get("spec") or {}).get("clusterIP") == "None":
                self.node.serve(service)
        with self._lock:
            if self._stops[uid].is_set():
                report.never_ran()
                return
            try:
                played = self.node.play(report.pod)
            except PlayFailed as failed:
                played = None
                report.waiting("RunContainerError", str(failed))
                report.event("Warning", "Failed", f"Error: {failed}")
            else:
                self._played[uid] = played
        if played is None:
            self._stops[uid].wait()
            if not report.gone():
                report.never_ran()
            return
        report.pod_ip = played.address(self.node.network)
        report.running()
        with subprocess.Popen(["podman", "logs", "-f", played.container], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) as follow:
            assert follow.stdout is not None
            for chunk in iter(lambda: os.read(follow.stdout.fileno(), 65536), b""):
                self.cluster.store.append_log(meta["namespace"], meta["name"], chunk.decode(errors="replace"))
        code = played.wait(timeout=24 * 3600)
        oom = played.state().get("OOMKilled")
        played.remove()
        report.terminated(code, "OOMKilled" if oom else None)


def leftovers(token: str | None = None) -> list[str]:
    """What a node left behind (pods, containers, volumes, networks labelled :data:`LABEL`, of ``token`` or any)."""
    label = f"label={LABEL}={token}" if token else f"label={LABEL}"
    found = []
    for what, listing in (("pod", ("pod", "ps", "--format", "{{.Name}}")),
                          ("container", ("ps", "--all", "--format", "{{.Names}}")),
                          ("volume", ("volume", "ls", "--format", "{{.Name}}")),
                          ("network", ("network", "ls", "--format", "{{.Name}}"))):
        found += [f"{what} {name}" for name in podman(*listing, "--filter", label, check=False).stdout.split()]
    return found


__all__ = ["LABEL", "KubeNode", "PlayFailed", "PlayedPod", "PodmanKubelet", "expand", "field_value", "give_to_group", "leftovers",
           "playable", "resolved_env"]
