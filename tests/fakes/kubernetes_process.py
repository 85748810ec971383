"""A kubelet for the fake cluster that really runs each pod's container as a local process.

What it does with a pod's (single) container, as a container runtime would:

- the command is ``command`` + ``args`` after Kubernetes' ``$(VAR)`` expansion (``$$(VAR)`` stays literal, unknown
  variables stay as written) from the container's environment; ``env`` values may refer to earlier ones;
- the environment: ``env`` (``value``, ``valueFrom.fieldRef`` of ``metadata.name`` / ``namespace`` / ``uid`` /
  ``labels['…']`` / ``annotations['…']``, ``spec.nodeName``, ``spec.serviceAccountName``, ``status.podIP``
  (127.0.0.1), ``status.hostIP``; ``configMapKeyRef``; ``resourceFieldRef``), ``envFrom`` ConfigMaps, ``HOSTNAME``,
  and ``PATH`` with the test's interpreter folder first (the pod's ``python`` is the test's venv); ``HOME``,
  ``LANG``, ``PYTHONPATH``, ``TMPDIR`` pass through from the test (``passthrough``);
- ``workingDir``; stdout and stderr together are the pod's log;
- each ``volumeMount`` is a host folder, bound at ``mountPath`` inside a private mount namespace (``unshare --mount
  --propagation private``, so nothing outside the pod's process sees it). The host folder of a volume is looked up in
  ``volumes`` by, in order: the volume's name, its ``persistentVolumeClaim.claimName``, its NFS ``server:path``, its
  NFS ``path``, its ``hostPath.path``, its ``azureFile.shareName``; else an ``emptyDir`` is a fresh folder, a
  ``hostPath`` is that host folder itself, a ``configMap`` is a folder of its keys, and any other volume fails the
  pod (``FailedMount``). A ``mountPath`` that does not exist on the host gets a tmpfs over its deepest existing
  folder (e.g. ``/mnt`` for ``/mnt/nbbatch/share``, inside the namespace only), then the folders, then the bind; a
  mount that would have to create a folder in ``/`` or hide a host folder the pod uses is refused;
- a pod with a ``subdomain`` (a rank of a gang behind a headless Service) gets an ``/etc/hosts`` in which its Job's
  pod hostnames are 127.0.0.1 (all pods run here), bound in its namespace.

Without volume mounts and ``subdomain`` no namespace (and no root) is needed.

Deleting the pod sends SIGTERM to the process group, and SIGKILL when ``terminationGracePeriodSeconds`` (or the
delete's grace period) ends; exit 0 → ``Completed``, else ``Error`` (143 on SIGTERM, 137 on SIGKILL). The image and
the resources are not enforced (they stay in the pod spec).
"""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fakes.kubernetes_kubelets import PodReporter
from fakes.kubernetes_rules import Quantity

if TYPE_CHECKING:
    from fakes.kubernetes_cluster import Cluster

POD_IP = "127.0.0.1"
NODE_ALLOCATABLE = {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"}


class PodSetupError(Exception):
    """The container cannot be started: a waiting reason (``CreateContainerConfigError``…) and the message."""

    def __init__(self, reason: str, message: str, event: str = "Failed"):
        super().__init__(message)
        self.reason, self.event = reason, event


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


@dataclass
class _Running:
    proc: subprocess.Popen | None = None
    stopped: bool = False
    grace: float = 30.0
    killed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    woken: threading.Event = field(default_factory=threading.Event)


class ProcessKubelet:
    """Runs each pod's container as a local process (see the module's docstring). ``volumes`` maps a volume (by the
    keys listed there) to a host folder."""

    def __init__(self, volumes: dict[str, str | os.PathLike] | None = None, *, python_bin: str | os.PathLike | None = None,
                 passthrough: tuple[str, ...] = ("HOME", "LANG", "LC_ALL", "PYTHONPATH", "TMPDIR")):
        self.volumes = {key: Path(folder) for key, folder in (volumes or {}).items()}
        self.python_bin = Path(python_bin) if python_bin else Path(sys.executable).parent
        self.passthrough = passthrough
        self.cluster: Cluster | None = None
        self._pods: dict[str, _Running] = {}
        self._threads: list[threading.Thread] = []
        self._scratch = Path(tempfile.mkdtemp(prefix="fake-kubelet-"))

    @staticmethod
    def unavailable() -> str | None:
        """Why pods with volume mounts cannot run here (``None`` when they can): they need root and ``unshare``."""
        if os.geteuid() != 0:
            return "ProcessKubelet mounts volumes in a mount namespace: needs root"
        if not shutil.which("unshare"):
            return "ProcessKubelet needs unshare (util-linux)"
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
        return None if probe.returncode == 0 else f"unshare --mount is not allowed here: {probe.stderr.decode().strip()}"

    def attach(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def start_pod(self, pod: dict[str, Any]) -> None:
        running = self._pods.setdefault(pod["metadata"]["uid"], _Running())
        thread = threading.Thread(target=self._run, args=(pod, running), daemon=True,
                                  name=f"process-kubelet-{pod['metadata']['name']}")
        self._threads.append(thread)
        thread.start()

    def stop_pod(self, pod: dict[str, Any], grace_seconds: float) -> None:
        running = self._pods.get(pod["metadata"]["uid"])
        if running is None:
            return
        with running.lock:
            running.stopped, running.grace = True, grace_seconds
            self._terminate(running)
        running.woken.set()

    def close(self) -> None:
        for running in self._pods.values():
            with running.lock:
                running.stopped, running.grace = True, 0
                self._terminate(running)
            running.woken.set()
        for thread in self._threads:
            thread.join(timeout=10)
        shutil.rmtree(self._scratch, ignore_errors=True)

    @staticmethod
    def _terminate(running: _Running) -> None:
        """SIGTERM the process group now and SIGKILL it when the grace period ends (the caller holds the lock)."""
        proc = running.proc
        if proc is None or proc.poll() is not None:
            return

        def kill() -> None:
            if proc.poll() is None:
                running.killed = True
                _signal(proc, signal.SIGKILL)

        _signal(proc, signal.SIGTERM)
        timer = threading.Timer(running.grace, kill)
        timer.daemon = True
        timer.start()

    def _run(self, pod: dict[str, Any], running: _Running) -> None:
        assert self.cluster is not None
        report = PodReporter(self.cluster, pod, POD_IP, POD_IP)
        report.schedule()
        try:
            argv = self.command_line(report.pod)
        except PodSetupError as error:
            report.waiting(error.reason, str(error))
            report.event("Warning", error.event, str(error))
            running.woken.wait()
            if not report.gone():
                report.never_ran()
            return
        with running.lock:
            if running.stopped:
                report.never_ran()
                return
            running.proc = subprocess.Popen(argv[0], env=argv[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        report.running()
        proc = running.proc
        assert proc.stdout is not None
        reader = threading.Thread(target=self._read_log, args=(proc, report), daemon=True)
        reader.start()
        code = proc.wait()
        _signal(proc, signal.SIGKILL)  # the container ends with its main process: what it left behind goes too
        reader.join()
        proc.stdout.close()
        report.terminated(128 - code if code < 0 else code)

    def _read_log(self, proc: subprocess.Popen, report: PodReporter) -> None:
        assert self.cluster is not None and proc.stdout is not None
        for chunk in iter(lambda: os.read(proc.stdout.fileno(), 65536), b""):
            self.cluster.store.append_log(report.namespace, report.name, chunk.decode(errors="replace"))

    # ---------------------------------------------------------------------------------------------- the command
    def command_line(self, pod: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that run the pod's container (mounts first, in a namespace, when it has some)."""
        spec = pod["spec"]
        containers = spec.get("containers") or []
        if len(containers) != 1 or spec.get("initContainers"):
            raise PodSetupError("CreateContainerError", "ProcessKubelet runs pods of exactly one container")
        container = containers[0]
        env = self.environment(pod, container)
        command = [expand(part, env) for part in [*(container.get("command") or []), *(container.get("args") or [])]]
        if not container.get("command"):
            raise PodSetupError("CreateContainerError", "ProcessKubelet runs the container's command: this one has "
                                "none (the image's entrypoint is not known here)")
        mounts = self.mounts(pod, container)
        hosts = self.hosts_file(pod)
        if hosts is not None:
            mounts.append((Path("/etc/hosts"), hosts, True))
        lines = ["set -e", *self.mount_lines(mounts, env)]
        workdir = container.get("workingDir")
        if workdir:
            inside = any(Path(workdir) == path or path in Path(workdir).parents for path, _h, _r in mounts)
            if inside:
                lines.append(f"mkdir -p {shlex.quote(workdir)}")
            lines.append(f'cd {shlex.quote(workdir)} || {{ echo "chdir to cwd ({workdir}) set in config.json failed: '
                         f'no such file or directory" >&2; exit 128; }}')
        lines.append('exec "$@"')
        script = "\n".join(lines)
        prefix = ["unshare", "--mount", "--propagation", "private"] if mounts else []
        return [*prefix, "sh", "-c", script, "pod", *command], env

    def environment(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        meta = pod["metadata"]
        env = {key: os.environ[key] for key in self.passthrough if key in os.environ}
        env["PATH"] = f"{self.python_bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
        env["HOSTNAME"] = pod["spec"].get("hostname") or meta["name"]
        for source in container.get("envFrom") or []:
            for kind in ("configMapRef", "secretRef"):
                if ref := source.get(kind):
                    data = self._data(kind, meta["namespace"], ref["name"], ref.get("optional", False))
                    env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        own: dict[str, str] = {}
        for var in container.get("env") or []:
            if "valueFrom" in var:
                own[var["name"]] = self._value_from(pod, container, var["valueFrom"])
            else:
                own[var["name"]] = expand(var.get("value", ""), {**env, **own})
        env.update(own)
        return env

    def _value_from(self, pod: dict[str, Any], container: dict[str, Any], source: dict[str, Any]) -> str:
        meta = pod["metadata"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            for section in ("labels", "annotations"):
                prefix = f"metadata.{section}['"
                if path.startswith(prefix):
                    return (meta.get(section) or {}).get(path[len(prefix):-2], "")
            fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                      "metadata.uid": meta.get("uid", ""), "spec.nodeName": pod["spec"].get("nodeName", ""),
                      "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
                      "status.podIP": POD_IP, "status.podIPs": POD_IP, "status.hostIP": POD_IP,
                      "status.hostIPs": POD_IP}
            return fields.get(path, "")
        for kind in ("configMapKeyRef", "secretKeyRef"):
            if ref := source.get(kind):
                data = self._data(kind, meta["namespace"], ref["name"], ref.get("optional", False))
                if ref["key"] not in data and not ref.get("optional"):
                    what = "ConfigMap" if kind == "configMapKeyRef" else "Secret"
                    raise PodSetupError("CreateContainerConfigError",
                                        f"couldn't find key {ref['key']} in {what} {meta['namespace']}/{ref['name']}")
                return data.get(ref["key"], "")
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            section, _, name = ref["resource"].partition(".")
            text = ((container.get("resources") or {}).get(section) or {}).get(name) or NODE_ALLOCATABLE.get(name, "0")
            value = Quantity.parse(text).value / Quantity.parse(ref.get("divisor", "1")).value
            return str(-(-value.numerator // value.denominator))
        raise PodSetupError("CreateContainerConfigError", f"ProcessKubelet cannot resolve env source {sorted(source)}")

    def _data(self, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str]:
        """The keys of a ConfigMap (``kind`` configMap…) or of a Secret (decoded)."""
        assert self.cluster is not None
        secret = kind.startswith("secret")
        found = self.cluster.store.get("secrets" if secret else "configmaps", namespace, name)
        if found is None and not optional:
            raise PodSetupError("CreateContainerConfigError", f'{"secret" if secret else "configmap"} "{name}" not '
                                "found")
        data = dict((found or {}).get("data") or {})
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()} if secret else data

    # ------------------------------------------------------------------------------------------------ volumes
    def host_folder(self, pod: dict[str, Any], volume: dict[str, Any]) -> Path:
        nfs, claim = volume.get("nfs") or {}, volume.get("persistentVolumeClaim") or {}
        keys = [volume["name"], claim.get("claimName"), f"{nfs.get('server')}:{nfs.get('path')}" if nfs else None,
                nfs.get("path"), (volume.get("hostPath") or {}).get("path"), (volume.get("azureFile") or {}).get(
                    "shareName")]
        for key in keys:
            if key and key in self.volumes:
                return self.volumes[key]
        own = self._scratch / pod["metadata"]["uid"] / volume["name"]
        if "emptyDir" in volume:
            own.mkdir(parents=True, exist_ok=True)
            return own
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        for kind, name_key in (("configMap", "name"), ("secret", "secretName")):
            if kind in volume:
                own.mkdir(parents=True, exist_ok=True)
                source = volume[kind]
                for key, value in self._data(kind, pod["metadata"]["namespace"], source[name_key],
                                             source.get("optional", False)).items():
                    (own / key).write_text(value)
                return own
        raise PodSetupError("ContainerCreating", f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                            f"ProcessKubelet has no host folder for it: map it, e.g. "
                            f"ProcessKubelet(volumes={{{volume['name']!r}: folder}})", event="FailedMount")

    def mounts(self, pod: dict[str, Any], container: dict[str, Any]) -> list[tuple[Path, Path, bool]]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts = []
        for mount in container.get("volumeMounts") or []:
            host = self.host_folder(pod, volumes[mount["name"]])
            if mount.get("subPath"):
                host = host / mount["subPath"]
                host.mkdir(parents=True, exist_ok=True)
            mounts.append((Path(mount["mountPath"]), host, bool(mount.get("readOnly"))))
        return sorted(mounts, key=lambda m: len(m[0].parts))

    def hosts_file(self, pod: dict[str, Any]) -> Path | None:
        """For a pod with a ``subdomain`` (a rank of a gang), an /etc/hosts in which the hostnames of its Job's pods
        (``<job>-<index>.<subdomain>[.<namespace>.svc[.cluster.local]]``) are 127.0.0.1, where they all run: what
        the headless Service's DNS gives a real pod."""
        spec, meta = pod["spec"], pod["metadata"]
        subdomain = spec.get("subdomain")
        if not subdomain:
            return None
        assert self.cluster is not None
        owner = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == "Job"), None)
        job = self.cluster.store.get("jobs", meta["namespace"], owner["name"]) if owner else None
        hostnames = [spec.get("hostname") or meta["name"]]
        if job is not None and job["spec"].get("completionMode") == "Indexed":
            hostnames = [f"{job['metadata']['name']}-{i}" for i in range(job["spec"]["completions"])]
        domain = f"{subdomain}.{meta['namespace']}.svc"
        lines = [Path("/etc/hosts").read_text()]
        lines += [f"{POD_IP}\t{name}.{domain}.cluster.local {name}.{domain} {name}.{subdomain} {name}"
                  for name in hostnames]
        lines.append(f"{POD_IP}\t{domain}.cluster.local {domain} {subdomain}")
        path = self._scratch / meta["uid"] / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return path

    def mount_lines(self, mounts: list[tuple[Path, Path, bool]], env: dict[str, str]) -> list[str]:
        """Shell lines that make the mounts inside the namespace, touching nothing outside it."""
        kept = [host for _p, host, _r in mounts] + [self.python_bin, Path(sys.prefix), self._scratch]
        kept += [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        lines, covered = [], []
        for path, host, read_only in mounts:
            if not path.exists():
                base = next(p for p in path.parents if p.is_dir())
                if base == Path("/"):
                    raise PodSetupError("CreateContainerError", f"ProcessKubelet cannot mount at {path}: it would have "
                                        "to create a folder in / of this machine", event="FailedMount")
                hidden = [k for k in kept if k == base or base in k.parents]
                if hidden:
                    raise PodSetupError("CreateContainerError", f"ProcessKubelet cannot mount at {path}: a tmpfs over "
                                        f"{base} would hide {hidden[0]}", event="FailedMount")
                if base not in covered:
                    lines.append(f"mount -t tmpfs fake-kubelet {shlex.quote(str(base))}")
                    covered.append(base)
                lines.append(f"mkdir -p {shlex.quote(str(path))}")
            lines.append(f"mount --bind {shlex.quote(str(host))} {shlex.quote(str(path))}")
            if read_only:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(str(path))}")
        return lines


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
