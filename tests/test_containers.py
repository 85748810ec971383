"""Containers without a container engine: fake ``docker`` and ``podman`` scripts stand in for the real ones.

Engine discovery (``auto``: Docker when its daemon answers, else Podman), how each engine hands GPUs to a
container and keeps bind-mounted files the user's, the ``run`` command of a run's container (mounts,
passed variables by name only, GPUs renumbered from 0), image states by fingerprint, the local backend
refusing ``container: true`` runs it cannot start, the frameworks' GPU builds and ``nbbatch images``.
``test_containers_real.py`` builds and runs an image for real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.shares import ShareDouble

import nbbatch
from nbbatch.backends import SubmitOptions, get_backend
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.containers import engines
from nbbatch.containers.engines import CA_MOUNT, Docker, Podman, build_ca_bundle, find_engine
from nbbatch.containers.images import (
    UV_VERSION,
    build_image,
    image_spec,
    image_status,
    machine_arch,
    require_image,
)
from nbbatch.containers.runner import HOST_NBBATCH, container_command, container_launch
from nbbatch.errors import BackendError, ContainerError, ValidationError
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.envs import MARKER, env_status
from nbbatch.execute.launch import LaunchSpec
from nbbatch.plan.runs import Run
from nbbatch.spec.frameworks import Framework, get_framework, list_frameworks
from nbbatch.spec.project import Project
from nbbatch.store.runjson import ContainerInfo
from nbbatch.ui.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHAINER_NOTEBOOK = "notebooks/Chainer_CIFAR.ipynb"
BROKEN_DOCKER = """\
case "$1" in
  info) echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
        exit 1;;
esac
exit 0
"""
WORKING_DOCKER = """\
case "$1" in
  info) echo "27.3.1"; exit 0;;
esac
exit 0
"""
WORKING_PODMAN = """\
case "$1" in
  info) echo "runc"; exit 0;;
esac
exit 0
"""


@pytest.fixture(autouse=True)
def _fresh_engines():
    """find_engine caches usable engines: no test sees another's fakes."""
    engines._usable.cache_clear()
    yield
    engines._usable.cache_clear()


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """An empty folder as the whole PATH (no real docker or podman reachable); ``write(name, body)`` adds a script."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))

    def write(name: str, body: str) -> Path:
        script = folder / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(0o755)
        return script

    write.folder = folder  # type: ignore[attr-defined]
    return write


@pytest.fixture(scope="module")
def chainer() -> Framework:
    """The repository's `chainer` framework (a CPU image on ubuntu:24.04)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
        return list_frameworks(Project(ROOT))["chainer"]


@pytest.fixture
def repo_frameworks(monkeypatch):
    """The repository's frameworks/ as the frameworks of any Project(ROOT) a test builds."""
    monkeypatch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
    monkeypatch.delenv("NBBATCH_PROJECT", raising=False)


def fake_podman_with_images(write, state: Path) -> Path:
    """A podman whose images are files in ``state``: ``ready`` holds the one reference `image inspect` knows,
    ``images`` the lines `images --filter label=nbbatch.framework=chainer` prints, ``labels`` each
    reference's labels (``REF<TAB>JSON``)."""
    state.mkdir(exist_ok=True)
    return write("podman", f"""\
STATE="{state}"
case "$1" in
  info) echo "runc"; exit 0;;
  image)
    if [ "$2" = inspect ] && [ "$4" = "{{{{json .Config.Labels}}}}" ] && [ -f "$STATE/labels" ]; then
      while IFS="$(printf '\t')" read -r ref json; do
        if [ "$ref" = "$5" ]; then echo "$json"; exit 0; fi
      done < "$STATE/labels"
    fi
    if [ "$2" = inspect ] && [ "$4" = "{{{{.Id}}}}" ] && [ -f "$STATE/ready" ]; then
      read -r want < "$STATE/ready"
      if [ "$5" = "$want" ]; then echo "sha256:feedface0123"; exit 0; fi
    fi
    echo "Error: $5: image not known" >&2; exit 125;;
  images)
    if [ "$3" = "label=nbbatch.framework=chainer" ] && [ -f "$STATE/images" ]; then
      while IFS= read -r line; do printf '%s\\n' "$line"; done < "$STATE/images"
    fi
    exit 0;;
esac
exit 0
""")


def pairs(cmd: list[str]) -> set[tuple[str, str]]:
    return set(zip(cmd, cmd[1:], strict=False))


def values_of(cmd: list[str], option: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd[:-1]) if arg == option]


# --- engine discovery --------------------------------------------------------------------------------


def test_no_engine_on_path_says_what_to_install(fake_bin):
    with pytest.raises(ContainerError, match="no container engine") as info:
        find_engine("auto")
    assert "podman" in str(info.value).lower()


def test_docker_without_its_daemon_is_refused_and_podman_suggested(fake_bin):
    docker = fake_bin("docker", BROKEN_DOCKER)
    for name in ("auto", "docker"):
        with pytest.raises(ContainerError, match="daemon is not reachable") as info:
            find_engine(name)
        message = str(info.value)
        assert str(docker) in message and "Cannot connect to the Docker daemon" in message
        assert "engine: podman" in message


def test_auto_falls_back_to_podman_when_dockers_daemon_is_down(fake_bin):
    fake_bin("docker", BROKEN_DOCKER)
    podman = fake_bin("podman", WORKING_PODMAN)
    engine = find_engine("auto")
    assert isinstance(engine, Podman) and engine.binary == str(podman)


def test_auto_takes_docker_when_its_daemon_answers(fake_bin):
    docker = fake_bin("docker", WORKING_DOCKER)
    fake_bin("podman", WORKING_PODMAN)
    engine = find_engine("auto")
    assert isinstance(engine, Docker) and engine.binary == str(docker)
    assert find_engine("podman").binary == str(fake_bin.folder / "podman")


def test_an_unknown_or_missing_engine_is_named(fake_bin):
    with pytest.raises(ContainerError, match="did you mean `podman`"):
        find_engine("podmn")
    with pytest.raises(ContainerError, match="`podman` is not installed") as info:
        find_engine("podman")
    assert "engine: docker" in str(info.value)


def test_podman_that_cannot_run_containers_is_refused(fake_bin):
    fake_bin("podman", 'echo "cannot set up namespace using newuidmap" >&2\nexit 125\n')
    with pytest.raises(ContainerError, match="podman cannot run containers here: cannot set up namespace"):
        find_engine("podman")


# --- GPUs, users, CA bundles ------------------------------------------------------------------------


def test_gpu_arguments_of_each_engine():
    assert Docker("/x/docker").gpu_args([0, 2]) == ["--gpus", '"device=0,2"']
    assert Docker("/x/docker").gpu_args([]) == []
    assert Podman("/x/podman").gpu_args([0, 2]) == ["--device", "nvidia.com/gpu=0", "--device", "nvidia.com/gpu=2"]
    assert Podman("/x/podman").gpu_args([]) == []


def test_podman_gpus_need_nvidias_cdi_spec(tmp_path, monkeypatch):
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    monkeypatch.setattr(engines, "CDI_DIRS", (etc, run))
    (etc / "other.yaml").write_text("kind: example.com/fpga\n")
    with pytest.raises(ContainerError, match="nvidia-ctk cdi generate") as info:
        Podman("/x/podman").check_gpus()
    assert str(etc) in str(info.value) and "resources.gpus: 0" in str(info.value)
    run.mkdir()
    (run / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")
    Podman("/x/podman").check_gpus()


def test_docker_gpus_need_the_nvidia_container_toolkit(fake_bin):
    docker = fake_bin("docker", """\
if [ "$1" = info ] && [ "$3" = "{{json .Runtimes}}" ]; then echo '{"runc":{}}'; exit 0; fi
exit 1
""")
    with pytest.raises(ContainerError, match="NVIDIA Container Toolkit"):
        Docker(str(docker)).check_gpus()
    fake_bin("docker", """\
if [ "$1" = info ] && [ "$3" = "{{json .Runtimes}}" ]; then
  echo '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}'; exit 0
fi
exit 1
""")
    Docker(str(docker)).check_gpus()


def test_docker_gpus_pass_with_the_toolkits_cli_on_path(fake_bin):
    docker = fake_bin("docker", "echo '{\"runc\":{}}'\n")
    fake_bin("nvidia-container-cli", "exit 0\n")
    Docker(str(docker)).check_gpus()


def test_podman_maps_the_invoking_user_into_the_container(monkeypatch):
    uid, gid = os.getuid(), os.getgid()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert Podman("/x/podman").user_args() == ["--user", f"{uid}:{gid}"]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    args = Podman("/x/podman").user_args()
    assert args[0] == "--userns=keep-id" and args[1:] == ["--user", f"{uid}:{gid}"]
    assert Docker("/x/docker").user_args() == ["--user", f"{uid}:{gid}"]


def test_build_mounts_show_the_ca_bundle_to_podman_builds(tmp_path):
    bundle = tmp_path / "ca.crt"
    assert Podman("/x/podman").build_mounts(bundle) == ["--volume", f"{bundle}:{CA_MOUNT}:ro"]
    assert Podman("/x/podman").build_mounts(None) == []
    assert Docker("/x/docker").build_mounts(bundle) == []


def test_build_ca_bundle_comes_from_the_usual_variables(tmp_path, monkeypatch):
    for variable in ("NBBATCH_BUILD_CA", "PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        monkeypatch.delenv(variable, raising=False)
    assert build_ca_bundle() is None
    bundle = tmp_path / "proxy-ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    assert build_ca_bundle() == bundle
    own = tmp_path / "own-ca.pem"
    own.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("NBBATCH_BUILD_CA", str(own))
    assert build_ca_bundle() == own  # nbbatch's own variable first
    monkeypatch.setenv("NBBATCH_BUILD_CA", str(tmp_path / "nowhere.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path))  # a folder, not a bundle file
    assert build_ca_bundle() is None


# --- a run's container --------------------------------------------------------------------------------


@pytest.fixture
def layout(tmp_path):
    """A project, a share, a notebook outside the project, a data folder outside both."""
    base = tmp_path.resolve()
    folders = {name: base / name for name in ("proj", "share", "elsewhere", "data", "private")}
    for folder in folders.values():
        folder.mkdir()
    (folders["proj"] / "inputs").mkdir()
    (folders["elsewhere"] / "nb.ipynb").write_text("{}")
    return folders


def container_run(layout: dict[str, Path], **extra) -> Run:
    return Run(run_id="toy-0123456789", experiment="exp", notebook=str(layout["elsewhere"] / "nb.ipynb"),
               notebook_rel="nb.ipynb", kernel="nbbatch-toy", framework="toy",
               parameters={"DATA": str(layout["data"]), "INPUTS": str(layout["proj"] / "inputs"),
                           "MISSING": str(layout["data"] / "nope"), "N": 3, "REL": "inputs"}, **extra)


def command_for(layout, gpu_ids=(), **extra) -> list[str]:
    return container_command(Podman("/fake/podman"), "localhost/nbbatch/toy:abc", "nbbatch-toy-1",
                             container_run(layout, **extra), layout["share"], layout["proj"],
                             layout["private"] / "launch.json", list(gpu_ids),
                             {"nbbatch.experiment": "exp", "nbbatch.run": "toy-0123456789"})


def launch_for(layout, gpu_ids=(), shared_gpu=False) -> LaunchSpec:
    """What run-one inside the container is told (its launch file, read back)."""
    context = AttemptContext(gpu_ids=list(gpu_ids), shared_gpu=shared_gpu)
    launch = container_launch(container_run(layout), layout["share"], layout["proj"], context,
                              ContainerInfo("podman", "localhost/nbbatch/toy:abc", "sha256:1", "nbbatch-toy-1"), None)
    return LaunchSpec.from_json(launch.to_json())


def test_container_mounts_the_share_rw_and_what_the_run_reads_ro(layout):
    cmd = command_for(layout)
    assert cmd[:2] == ["/fake/podman", "run"]
    volumes = values_of(cmd, "--volume")
    share, proj = layout["share"], layout["proj"]
    assert f"{share}:{share}:rw" in volumes
    assert f"{proj}:{proj}:ro" in volumes
    assert f"{layout['elsewhere']}:{layout['elsewhere']}:ro" in volumes  # the notebook's folder
    assert f"{layout['data']}:{layout['data']}:ro" in volumes  # a folder a parameter names
    assert f"{layout['private']}:{layout['private']}:ro" in volumes
    assert f"{Path(nbbatch.__file__).resolve().parent}:{HOST_NBBATCH}/nbbatch:ro" in volumes
    assert not [v for v in volumes if "inputs" in v or "nope" in v], "inside the project: mounted with it"
    assert len(volumes) == len(set(volumes)) == 6
    assert ("--workdir", str(proj)) in pairs(cmd)


def test_a_parameter_inside_the_share_is_not_mounted_read_only(layout):
    (layout["share"] / "prepared").mkdir()
    cmd = command_for(layout, cwd=str(layout["share"] / "prepared"))
    volumes = values_of(cmd, "--volume")
    assert not [v for v in volumes if v.endswith(":ro") and v.startswith(str(layout["share"]))]


def test_a_parameter_naming_a_system_folder_never_hides_the_images_own(layout):
    run = container_run(layout)
    run = Run(**{**run.to_dict(), "parameters": {"ROOT": "/", "TMP": "/tmp", "USR": "/usr/share", "ETC": "/etc",
                                                 "DATA": str(layout["data"])}})
    cmd = container_command(Podman("/fake/podman"), "img", "n", run, layout["share"], layout["proj"],
                            layout["private"] / "launch.json", [], {})
    volumes = values_of(cmd, "--volume")
    assert not [v for v in volumes if v.split(":")[0] in ("/", "/tmp", "/usr/share", "/etc")]
    assert f"{layout['proj']}:{layout['proj']}:ro" in volumes and f"{layout['data']}:{layout['data']}:ro" in volumes


def test_container_shares_the_hosts_namespaces_and_carries_labels(layout):
    cmd = command_for(layout)
    got = pairs(cmd)
    assert {("--network", "host"), ("--pid", "host"), ("--ipc", "host"), ("--name", "nbbatch-toy-1"),
            ("--label", "nbbatch.experiment=exp"), ("--label", "nbbatch.run=toy-0123456789")} <= got
    assert "--rm" in cmd
    image = cmd.index("localhost/nbbatch/toy:abc")
    assert cmd[image + 1:] == ["python", "-m", "nbbatch", "run-one", str(layout["private"] / "launch.json")]
    launch = launch_for(layout)
    assert (launch.share, launch.project) == (str(layout["share"].resolve()), str(layout["proj"]))
    assert launch.backend == "local" and not launch.shared_gpu and launch.run == container_run(layout)
    assert launch.gpus == () and not values_of(cmd[:image], "--device")
    assert launch.container.name == "nbbatch-toy-1" and launch.node is None  # run.json's container, as the host knows it


def test_container_gets_its_gpus_numbered_from_zero(layout):
    cmd = command_for(layout, gpu_ids=[3, 5])
    image = cmd.index("localhost/nbbatch/toy:abc")
    assert values_of(cmd[:image], "--device") == ["nvidia.com/gpu=3", "nvidia.com/gpu=5"]
    launch = launch_for(layout, gpu_ids=[3, 5], shared_gpu=True)
    assert launch.gpus == (0, 1) and launch.host_gpu_ids == (3, 5) and launch.shared_gpu


def test_container_gets_variables_by_name_and_never_secrets(layout, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cret-token")
    monkeypatch.setenv("AZURE_STORAGE_KEY", "azure-key-value-abc")
    monkeypatch.setenv("HF_TOKEN", "hf-token-value")
    monkeypatch.setenv("NBBATCH_ENVS_DIR", "/x/envs")
    monkeypatch.setenv("NBBATCH_PROJECT", "/x/project")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = command_for(layout)
    joined = " ".join(cmd)
    env = values_of(cmd, "--env")
    assert {"MLFLOW_TRACKING_URI", "TF_CPP_MIN_LOG_LEVEL", "HOME=/tmp", f"PYTHONPATH={HOST_NBBATCH}"} <= set(env)
    assert "MLFLOW_TRACKING_TOKEN" in env  # by name: MLflow needs it where the URI goes
    assert not [e for e in env if e.startswith(("MLFLOW_", "TF_")) and "=" in e], "values never on the command line"
    for secret in ("s3cret-token", "azure-key-value-abc", "hf-token-value", "127.0.0.1:5000"):
        assert secret not in joined
    for hidden in ("AZURE_STORAGE_KEY", "HF_TOKEN", "NBBATCH_ENVS_DIR", "NBBATCH_PROJECT"):
        assert hidden not in env and hidden not in joined


def test_tracking_credentials_stay_home_without_a_tracking_uri(layout, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cret-token")
    env = values_of(command_for(layout), "--env")
    assert "MLFLOW_TRACKING_TOKEN" not in env


# --- image states ---------------------------------------------------------------------------------------


def test_image_status_missing_stale_ready(chainer, fake_bin, tmp_path):
    state = tmp_path / "podman-state"
    engine = Podman(str(fake_podman_with_images(fake_bin, state)))
    spec = image_spec(chainer, ROOT / "dockerfiles")
    assert spec.ref == f"nbbatch/chainer:{spec.fingerprint}" and not spec.gpu

    missing = image_status(engine, spec)
    assert (missing.state, missing.ref, missing.image_id, missing.older) == ("missing", spec.ref, None, ())

    older, other_base = "localhost/nbbatch/chainer:0123456789abcdef", "localhost/nbbatch/chainer:fedcba9876543210"
    (state / "images").write_text(f"{older}\tdeadbeef\n{other_base}\tbeefdead\n")
    (state / "labels").write_text(
        f"{older}\t{json.dumps({'nbbatch.framework': 'chainer', 'nbbatch.variant': spec.variant})}\n"
        f"{other_base}\t{json.dumps({'nbbatch.framework': 'chainer', 'nbbatch.variant': 'cpu:debian:12'})}\n")
    stale = image_status(engine, spec)  # a build on another base is another variant, not an older build
    assert stale.state == "stale" and stale.older == ("localhost/nbbatch/chainer:0123456789abcdef",)
    with pytest.raises(ContainerError, match="only older builds exist"):
        require_image(engine, spec)

    (state / "images").write_text(f"localhost/nbbatch/chainer:0123456789abcdef\tdeadbeef\n"
                                  f"localhost/{spec.ref}\tfeedface0123\n")
    (state / "ready").write_text(spec.ref + "\n")
    ready = image_status(engine, spec)
    assert ready.state == "ready" and ready.image_id == "sha256:feedface0123"
    assert ready.older == ("localhost/nbbatch/chainer:0123456789abcdef",)  # the current build is not an older one
    assert require_image(engine, spec) == ready


def test_require_image_names_the_build_command(chainer, fake_bin, tmp_path):
    engine = Podman(str(fake_podman_with_images(fake_bin, tmp_path / "podman-state")))
    with pytest.raises(ContainerError, match="never built") as info:
        require_image(engine, image_spec(chainer, ROOT / "dockerfiles"))
    message = str(info.value)
    assert "`nbbatch images build chainer`" in message and "--build-envs" in message and "podman" in message
    with pytest.raises(ContainerError) as info:
        require_image(engine, image_spec(chainer, ROOT / "dockerfiles", base="localhost/x:1"))
    assert "`nbbatch images build chainer --base localhost/x:1`" in str(info.value)


# --- the local backend with container: true -----------------------------------------------------------


def chainer_run(**extra) -> Run:
    return Run(run_id="chainer-0123456789", experiment="exp", notebook=str(ROOT / CHAINER_NOTEBOOK),
               notebook_rel=CHAINER_NOTEBOOK, kernel="nbbatch-chainer", framework="chainer", **extra)


def test_container_runs_need_a_share_on_this_machine(tmp_path):
    backend = LocalBackend(gpus=[], container=True, engine="podman")
    remote = ShareDouble(tmp_path / "share", remote=True, url="azfiles://acct/share")
    with pytest.raises(ContainerError, match="folder on this machine") as info:
        backend.check_share(remote)
    assert "azfiles://acct/share" in str(info.value)
    LocalBackend(gpus=[]).check_share(remote)  # venv runs: not this check's business


def test_container_runs_refuse_mps(fake_bin):
    fake_bin("podman", WORKING_PODMAN)
    backend = LocalBackend(gpus=[], container=True, engine="podman")
    with pytest.raises(ValidationError, match="mps"):
        backend.check([chainer_run()], SubmitOptions(mps=True))


def test_container_runs_refuse_a_notebook_of_no_framework(fake_bin):
    fake_bin("podman", WORKING_PODMAN)
    loose = Run(run_id="toy-1", experiment="exp", notebook=str(ROOT / "notebooks/Toy.ipynb"),
                notebook_rel="notebooks/Toy.ipynb", kernel="python3", framework=None)
    with pytest.raises(ValidationError, match="frameworks:") as info:
        LocalBackend(gpus=[], container=True, engine="podman").check([chainer_run(), loose], SubmitOptions())
    assert "notebooks/Toy.ipynb" in str(info.value) and "python3" in str(info.value)


def test_container_runs_refuse_a_framework_without_its_image(fake_bin, tmp_path, repo_frameworks):
    fake_podman_with_images(fake_bin, tmp_path / "podman-state")
    backend = LocalBackend(gpus=[], container=True, engine="podman")
    with pytest.raises(ContainerError, match="nbbatch images build chainer"):
        backend.check([chainer_run()], SubmitOptions())


def test_container_runs_start_once_the_image_is_ready(chainer, fake_bin, tmp_path, repo_frameworks):
    state = tmp_path / "podman-state"
    fake_podman_with_images(fake_bin, state)
    (state / "ready").write_text(image_spec(chainer, ROOT / "dockerfiles").ref + "\n")
    backend = LocalBackend(gpus=[], container=True, engine="podman")
    backend.check([chainer_run()], SubmitOptions())
    assert backend._images["chainer"] == (image_spec(chainer, ROOT / "dockerfiles").ref, "sha256:feedface0123")


def test_container_runs_without_an_engine_are_refused(fake_bin, repo_frameworks):
    with pytest.raises(ContainerError, match="`podman` is not installed"):
        LocalBackend(gpus=[], container=True, engine="podman").check([chainer_run()], SubmitOptions())


def test_container_capabilities_and_settings():
    contained = LocalBackend(gpus=[], container=True)
    assert contained.capabilities.local_kernels is False and contained.capabilities.containers is True
    plain = LocalBackend(gpus=[])
    assert plain.capabilities.local_kernels is True and plain.capabilities.containers is False
    assert LocalBackend.capabilities.local_kernels is True, "the class's capabilities are left alone"
    with pytest.raises(BackendError, match="engine"):
        LocalBackend(engine="dockr")
    with pytest.raises(BackendError, match="container"):
        LocalBackend(container="yes")


# --- frameworks' GPU builds and env status ----------------------------------------------------------------


def write_framework(project: Path, name: str = "tfx", gpu_packages: str = "{TensorFlow-CPU: 'tensorflow[and-cuda]'}") -> Path:
    folder = project / "frameworks" / name
    folder.mkdir(parents=True)
    (folder / "framework.yaml").write_text(f"title: TFX\nnotebook: notebooks/{name}.ipynb\ngpu: true\n"
                                           f"gpu_packages: {gpu_packages}\n")
    (folder / "requirements.txt").write_text("# pins\nnumpy==1.26.4\ntensorflow-cpu==2.16.1  # the CPU build\n"
                                             "tensorflow-cpu-extra==1.0\n")
    return folder


def test_gpu_builds_swap_only_the_listed_packages(project):
    write_framework(project)
    fw = get_framework("tfx", Project(project))
    assert fw.gpu_packages == {"tensorflow-cpu": "tensorflow[and-cuda]"}
    assert fw.requirement_lines() == fw.pinned() == ["numpy==1.26.4", "tensorflow-cpu==2.16.1",
                                                      "tensorflow-cpu-extra==1.0"]
    assert fw.requirement_lines(gpu=True) == ["numpy==1.26.4", "tensorflow[and-cuda]==2.16.1", "tensorflow-cpu-extra==1.0"]
    assert fw.fingerprint(gpu=True) != fw.fingerprint()
    assert fw.fingerprint(gpu=True) == get_framework("tfx", Project(project)).fingerprint(gpu=True)


def test_gpu_builds_match_names_as_package_indexes_do(project):
    folder = write_framework(project)
    (folder / "requirements.txt").write_text("Tensorflow_CPU==2.16.1\nnumpy==1.26.4\n")
    fw = get_framework("tfx", Project(project))
    assert fw.requirement_lines(gpu=True) == ["tensorflow[and-cuda]==2.16.1", "numpy==1.26.4"]


def test_system_packages_must_be_package_names(project):
    folder = write_framework(project)
    (folder / "framework.yaml").write_text((folder / "framework.yaml").read_text() + "system_packages: [libquadmath0]\n")
    assert get_framework("tfx", Project(project)).system_packages == ("libquadmath0",)
    (folder / "framework.yaml").write_text((folder / "framework.yaml").read_text() + "system_packages: ['x; rm -rf /']\n")
    with pytest.raises(ValidationError, match="system_packages"):
        get_framework("tfx", Project(project))


def test_gpu_packages_must_be_a_mapping(project):
    write_framework(project, gpu_packages="[a]")
    with pytest.raises(ValidationError, match="gpu_packages"):
        get_framework("tfx", Project(project))


def write_built_env(project: Path, fw: Framework, fingerprint: str, gpu: bool) -> None:
    env = project / ".nbbatch" / "envs" / fw.name
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    (env / MARKER).write_text(json.dumps({"framework": fw.name, "fingerprint": fingerprint, "gpu": gpu,
                                          "built_at": "2025-01-01T00:00:00Z"}))
    kernel = project / ".nbbatch" / "jupyter" / "kernels" / fw.kernel_name
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text("{}")


@pytest.fixture
def own_envs(monkeypatch):
    for variable in ("NBBATCH_ENVS_DIR", "NBBATCH_JUPYTER_DIR", "NBBATCH_FRAMEWORKS_DIR"):
        monkeypatch.delenv(variable, raising=False)


def test_an_env_built_with_gpu_builds_is_ready_as_one(project, own_envs):
    write_framework(project)
    fw = get_framework("tfx", Project(project))
    write_built_env(project, fw, fw.fingerprint(gpu=True), gpu=True)
    status = env_status(fw, Project(project))
    assert (status.state, status.gpu, status.fingerprint) == ("ready", True, fw.fingerprint(gpu=True))


def test_an_env_marked_cpu_with_the_gpu_fingerprint_is_stale(project, own_envs):
    write_framework(project)
    fw = get_framework("tfx", Project(project))
    write_built_env(project, fw, fw.fingerprint(gpu=True), gpu=False)
    status = env_status(fw, Project(project))
    assert (status.state, status.gpu, status.fingerprint) == ("stale", False, fw.fingerprint())


# --- nbbatch images ---------------------------------------------------------------------------------------


@pytest.fixture
def in_repo(monkeypatch, repo_frameworks):
    monkeypatch.chdir(ROOT)


def test_images_context_writes_the_build_context(in_repo, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"  # a stand-in for uv's binary: no download
    fake_uv = cache / f"uv-{UV_VERSION}-{machine_arch()}" / "uv"
    fake_uv.parent.mkdir(parents=True)
    fake_uv.write_bytes(b"\x7fELF fake uv")
    monkeypatch.setenv("NBBATCH_CACHE_DIR", str(cache))
    dest = tmp_path / "ctx"
    assert main(["images", "context", "chainer", str(dest)]) == 0
    assert 'ARG FRAMEWORK="chainer"' in (dest / "Dockerfile").read_text()
    assert (dest / "frameworks" / "chainer" / "requirements.txt").is_file()
    assert (dest / "frameworks" / "chainer" / "framework.yaml").is_file()
    assert (dest / "context" / "nbbatch-requirements.txt").is_file()
    assert (dest / "context" / "uv").read_bytes() == b"\x7fELF fake uv"
    assert (dest / "src" / "nbbatch" / "containers" / "runner.py").is_file()
    assert not list(dest.rglob("__pycache__"))
    assert str(dest) in capsys.readouterr().out


def test_images_context_needs_a_framework_and_a_folder(in_repo, capsys):
    assert main(["images", "context", "chainer"]) != 0
    assert "usage: nbbatch images context FRAMEWORK DIR" in capsys.readouterr().err


def fake_uv_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for uv's binary in the cache: no download."""
    fake_uv = tmp_path / "cache" / f"uv-{UV_VERSION}-{machine_arch()}" / "uv"
    fake_uv.parent.mkdir(parents=True)
    fake_uv.write_bytes(b"\x7fELF fake uv")
    monkeypatch.setenv("NBBATCH_CACHE_DIR", str(tmp_path / "cache"))


def wheels_in(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(f"wheel {name} of {folder.name}".encode())
    return folder


def test_images_context_stages_only_the_wheels_of_find_links(in_repo, tmp_path, monkeypatch):
    fake_uv_cache(tmp_path, monkeypatch)
    first = wheels_in(tmp_path / "first", "x-1.0-py3-none-any.whl", "notes.txt")
    wheels_in(first / "sub", "inner-1.0-py3-none-any.whl")  # only the folder's own wheels, not its tree
    second = wheels_in(tmp_path / "second", "x-1.0-py3-none-any.whl", "y-2.0-py3-none-any.whl")
    dest = tmp_path / "ctx"
    assert main(["images", "context", "chainer", str(dest), "--find-links", str(first), "--find-links", str(second)]) == 0
    house = dest / "context" / "wheelhouse"
    assert sorted(p.name for p in house.iterdir()) == ["x-1.0-py3-none-any.whl", "y-2.0-py3-none-any.whl"]
    assert (house / "x-1.0-py3-none-any.whl").read_text() == "wheel x-1.0-py3-none-any.whl of first"  # first wins
    assert (house / "y-2.0-py3-none-any.whl").stat().st_ino == (second / "y-2.0-py3-none-any.whl").stat().st_ino
    assert "UV_FIND_LINKS=/run/nbbatch/wheelhouse" in (dest / "Dockerfile").read_text()
    plain = tmp_path / "plain"
    assert main(["images", "context", "chainer", str(plain)]) == 0
    assert not (plain / "context" / "wheelhouse").exists()
    assert "wheelhouse" not in (plain / "Dockerfile").read_text()


def test_images_build_refuses_a_find_links_folder_without_wheels(in_repo, fake_bin, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["images", "build", "chainer", "--engine", "podman", "--find-links", str(empty)]) != 0
    err = capsys.readouterr().err
    assert f"--find-links {empty} holds no wheel file" in err and "Traceback" not in err  # before any engine is sought


def test_a_build_with_a_wheelhouse_labels_the_image_with_its_wheels(repo_frameworks, fake_bin, tmp_path, monkeypatch):
    fake_uv_cache(tmp_path, monkeypatch)
    state = tmp_path / "podman-state"
    state.mkdir()
    podman = fake_bin("podman", f"""\
case "$1" in
  image) echo "Error: image not known" >&2; exit 125;;  # no image yet: build it
  build) printf '%s\\n' "$@" > "{state}/args"; for last; do :; done
         for wheel in "$last"/context/wheelhouse/*; do echo "${{wheel##*/}}"; done > "{state}/wheels";;
esac
exit 0
""")
    wheels = wheels_in(tmp_path / "wheels", "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    spec = image_spec(get_framework("pytorch", Project(ROOT)), ROOT / "dockerfiles", gpu=False, find_links=[wheels])
    build_image(Podman(str(podman)), spec, Project(tmp_path / "proj"))
    args = (state / "args").read_text().splitlines()
    assert "nbbatch.wheelhouse=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl" in values_of(args, "--label")
    assert (state / "wheels").read_text().split() == ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    assert values_of(args, "--tag") == [image_spec(spec.framework, ROOT / "dockerfiles", gpu=False).ref]


def test_images_list_with_an_unknown_engine_fails(in_repo, fake_bin, capsys):
    assert main(["images", "list", "--engine", "podmn"]) != 0
    assert "did you mean `podman`" in capsys.readouterr().err


def test_images_list_shows_each_frameworks_state(in_repo, fake_bin, tmp_path, capsys):
    fake_podman_with_images(fake_bin, tmp_path / "podman-state")
    assert main(["images", "list", "chainer", "--engine", "podman"]) == 0
    out = capsys.readouterr().out
    assert "chainer" in out and "missing" in out and "(podman)" in out
    assert main(["images", "list", "--engine", "podman", "--cpu", "chainer"]) == 0  # names after the options
    assert "chainer" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's own error for an unknown option
        main(["images", "list", "--engine", "podman", "--bogus"])


@pytest.mark.parametrize("given", [{"registry": "127.0.0.1:5000"}, {"cpu_image": True},
                                   {"base_image": "debian:12", "registry": "reg.example.com/team"}])
@pytest.mark.parametrize("backend", ["local", "slurm", "ray"])
def test_image_settings_without_container_are_refused_not_ignored(backend, given):
    with pytest.raises(ValidationError, match=r"`(registry|cpu_image|base_image)`.*add `container: true`"):
        get_backend(backend, **given)
    get_backend(backend, container=True, **given)  # with container: true they are taken
