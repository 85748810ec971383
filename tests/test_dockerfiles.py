"""The framework images, checked without building them (``test_containers_real.py`` builds one for real).

One template, ``dockerfiles/Dockerfile``, filled from each ``framework.yaml``: a base pinned by tag (the
framework's ``base_image``), the pins installed by ``nbbatch envs create`` (GPU builds only as listed in
``gpu_packages``, each the same package at the same version), a non-root final user (root for Azure ML's builds), and a build
context, as the azureml backend stages it, that holds every path the Dockerfile copies.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nbbatch.containers.images import (
    LABEL_WHEELHOUSE,
    TEMPLATE,
    copy_sources,
    image_spec,
    instructions,
    render,
    stage_context,
    with_wheelhouse,
)
from nbbatch.errors import ContainerError
from nbbatch.spec.frameworks import Framework, list_frameworks
from nbbatch.spec.project import Project

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ROOT / "dockerfiles"


@pytest.fixture(scope="module")
def frameworks() -> dict[str, Framework]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
        return list_frameworks(Project(ROOT))


@pytest.fixture(params=sorted(p.parent.name for p in (ROOT / "frameworks").glob("*/framework.yaml")))
def spec(request, frameworks):
    return image_spec(frameworks[request.param], DOCKERFILES)


def package(spec: str) -> str:
    """The distribution name of ``name[extra]==version`` (normalized)."""
    return re.split(r"[\[=<>~! ]", spec, maxsplit=1)[0].strip().lower().replace("_", "-")


def gpu_variant_ok(original: str, variant: str) -> bool:
    """A GPU build of the same package: the same name with an extra or a CUDA suffix, or without -cpu."""
    base, var = package(original), package(variant)
    return var == base or var.startswith(base + "-cu") or base.endswith("-cpu") and var == base[:-4]


def test_one_template_and_no_per_framework_copies():
    assert (DOCKERFILES / TEMPLATE).is_file()
    assert not list(DOCKERFILES.glob("*/Dockerfile")), "frameworks' images come from the one template"


def test_the_base_is_framework_yamls_and_pinned_by_tag(spec):
    steps = instructions(spec.text)
    froms = [args for kw, args in steps if kw == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert spec.args["BASE_IMAGE"] == spec.framework.base_image
    name, _, tag = spec.framework.base_image.rpartition(":")
    assert name and tag and "/" not in tag and tag != "latest", f"{spec.framework.base_image} is not pinned by a tag"
    assert f'ARG BASE_IMAGE="{spec.framework.base_image}"' in spec.text
    if spec.framework.gpu:
        assert "cuda" in spec.framework.base_image, "a GPU framework builds on a CUDA base image"


def test_the_environment_is_built_by_nbbatch_envs_create(spec):
    run = " ".join(args for kw, args in instructions(spec.text) if kw == "RUN")
    assert re.search(r"python -m nbbatch envs create \"\$\{FRAMEWORK\}\" \$\( \[ \"\$\{GPU\}\" = 1 \] && echo --gpu \)",
                     run), "the framework's env must come from `nbbatch envs create` (the venvs' own code)"
    assert spec.args["GPU"] == ("1" if spec.framework.gpu else "0")
    # The only packages installed outside it are nbbatch's own requirements, from the staged file.
    runs = [args for kw, args in instructions(spec.text) if kw == "RUN"]
    others = [cmd.strip() for args in runs for cmd in args.split("&&") if "pip install" in cmd]
    assert others == ["uv pip install --python /opt/nbbatch/venv/bin/python -r /opt/nbbatch/requirements.txt"]


def test_gpu_builds_are_the_same_packages_at_the_same_versions(frameworks):
    for fw in frameworks.values():
        pinned = {package(line): line for line in fw.pinned()}
        for original, variant in fw.gpu_packages.items():
            assert original in pinned, f"{fw.name}: gpu_packages names {original}, which is not pinned"
            assert gpu_variant_ok(original, variant), f"{fw.name}: {original} → {variant} is not a GPU build of it"
        swapped = fw.requirement_lines(gpu=True)
        assert [line.split("==")[1] for line in swapped] == [line.split("==")[1] for line in fw.pinned()]
        if fw.gpu_packages or fw.gpu_pip_options:
            assert fw.fingerprint(gpu=True) != fw.fingerprint()


def final_user(text: str) -> str:
    """The user a filled-in Dockerfile's last ``USER`` names, its ARGs' defaults substituted; after its last RUN."""
    steps = instructions(text)
    defaults = {name.strip(): json.loads(value) if value.startswith('"') else value
                for name, _, value in (args.partition("=") for kw, args in steps if kw == "ARG")}
    users = [(i, args) for i, (kw, args) in enumerate(steps) if kw == "USER"]
    assert users and users[-1][0] > max(i for i, (kw, _) in enumerate(steps) if kw == "RUN")
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], users[-1][1]).split(":")[0]


def test_runs_as_a_non_root_user(spec):
    assert final_user(spec.text) == "nbbatch", "the image would run as root"


def test_azure_ml_images_run_as_root_and_say_so(spec, tmp_path):
    """Issue 50 item 3: Azure ML's curated images run as root (job setup, data mounts, MPI's ssh): the azureml
    backend's images (built there, or pushed with `--run-as root` for `registry:`) are another build of the template."""
    pytest.importorskip("azure.ai.ml")
    from nbbatch.backends.azureml.images import IMAGE_USER, framework_environment

    root = image_spec(spec.framework, DOCKERFILES, run_as="root")
    assert IMAGE_USER == "root" and final_user(root.text) == "root" and root.user == "root"
    assert root.fingerprint != spec.fingerprint and root.variant == f"{spec.variant} as root"
    assert root.build_command == f"{spec.build_command} --run-as root"
    env = framework_environment(spec.framework, DOCKERFILES, registry="myacr.azurecr.io/nbbatch")
    assert env.version == root.fingerprint and env.image.endswith(f":{root.fingerprint}")


def test_an_own_dockerfile_without_the_user_arg_cannot_run_as_another_user(frameworks, tmp_path):
    own = tmp_path / "dockerfiles" / "chainer"
    own.mkdir(parents=True)
    (own / "Dockerfile").write_text("ARG BASE_IMAGE=ubuntu:24.04\nFROM ${BASE_IMAGE}\nUSER 1000\n")
    image_spec(frameworks["chainer"], own.parent)  # its own user, as it says
    with pytest.raises(ContainerError, match=r"cannot run as `root`: it has no `ARG RUN_AS`.*`USER \$\{RUN_AS\}` last"):
        image_spec(frameworks["chainer"], own.parent, run_as="root")
    with pytest.raises(ContainerError, match="is not a user an image can run as"):
        image_spec(frameworks["chainer"], DOCKERFILES, run_as="root; rm -rf /")


def test_the_staged_context_holds_everything_the_dockerfile_copies(spec, tmp_path):
    """What the azureml backend uploads for Azure ML's image build: every COPY source must be in it."""
    pytest.importorskip("azure.ai.ml")
    from nbbatch.backends.azureml.images import IMAGE_USER, framework_environment  # the azure extra: only when installed

    env = framework_environment(spec.framework, DOCKERFILES, build_dir=tmp_path / "ctx")
    spec = image_spec(spec.framework, DOCKERFILES, run_as=IMAGE_USER)  # what Azure ML builds: its jobs run as root
    assert final_user((Path(env.build.path) / "Dockerfile").read_text()) == "root"
    context = Path(env.build.path)
    sources = copy_sources((context / "Dockerfile").read_text())
    assert {"context/uv", "context/nbbatch-requirements.txt", "src/nbbatch", f"frameworks/{spec.framework.name}"} <= set(sources)
    assert [s for s in sources if not (context / s).exists()] == []
    assert env.version == spec.fingerprint
    uv = (context / "context" / "uv").read_bytes()
    assert uv[:4] == b"\x7fELF" and uv[18] == 0x3E, "Azure ML's nodes need uv's linux/x86_64 binary"


def test_copy_sources_reads_args_and_skips_other_stages():
    text = render('ARG NAME\nFROM x\nCOPY --from=other /a /b\nCOPY dir/${NAME} one.txt /dst/\nADD $NAME/f /g\n',
                  {"NAME": "fw"})
    assert copy_sources(text) == ["dir/fw", "one.txt", "fw/f"]


def test_a_missing_copy_source_is_refused_before_any_build(frameworks, tmp_path, monkeypatch):
    dockerfiles = tmp_path / "dockerfiles"
    dockerfiles.mkdir()
    (dockerfiles / TEMPLATE).write_text((DOCKERFILES / TEMPLATE).read_text() + "COPY notes/extra.txt /opt/\n")
    spec = image_spec(frameworks["chainer"], dockerfiles)
    monkeypatch.setenv("NBBATCH_CACHE_DIR", str(tmp_path / "cache"))
    fake_uv = tmp_path / "cache" / "uv-0.13.8-x86_64" / "uv"
    fake_uv.parent.mkdir(parents=True)
    fake_uv.write_bytes(b"\x7fELF")
    with pytest.raises(ContainerError, match="notes/extra.txt"):
        stage_context(spec, tmp_path / "ctx", Project(ROOT), arch="x86_64")


def test_the_fingerprint_follows_pins_base_and_template(frameworks, tmp_path):
    fw = frameworks["pytorch"]
    gpu, cpu = image_spec(fw, DOCKERFILES), image_spec(fw, DOCKERFILES, gpu=False)
    assert gpu.fingerprint != cpu.fingerprint and cpu.args == {**gpu.args, "GPU": "0", "BASE_IMAGE": "ubuntu:24.04"}
    assert image_spec(fw, DOCKERFILES, base="debian:12").fingerprint != gpu.fingerprint
    assert gpu.ref == f"nbbatch/pytorch:{gpu.fingerprint}" and gpu.build_command == "nbbatch images build pytorch"
    assert cpu.build_command == "nbbatch images build pytorch --cpu"
    dockerfiles = tmp_path / "dockerfiles"
    dockerfiles.mkdir()
    (dockerfiles / TEMPLATE).write_text((DOCKERFILES / TEMPLATE).read_text() + "# changed\n")
    assert image_spec(fw, dockerfiles).fingerprint != gpu.fingerprint


# --- a wheelhouse (--find-links) ---------------------------------------------------------------------


def wheel_folder(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"PK fake wheel " + name.encode())
    return folder


def test_a_wheelhouse_reaches_the_framework_step_alone_and_keeps_the_tag(frameworks, tmp_path):
    fw = frameworks["pytorch"]
    plain = image_spec(fw, DOCKERFILES, gpu=False)
    wheels = wheel_folder(tmp_path / "wheels", "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    housed = image_spec(fw, DOCKERFILES, gpu=False, find_links=[wheels])
    # Without one, the Dockerfile is the template's, byte for byte; with one, the tag is the same (same pins).
    assert plain.text == render((DOCKERFILES / TEMPLATE).read_text(), plain.args) and plain.wheels == ()
    assert housed.ref == plain.ref and housed.wheels == (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",)
    assert LABEL_WHEELHOUSE not in plain.labels
    assert housed.labels == {**plain.labels, LABEL_WHEELHOUSE: "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"}
    before, after = instructions(plain.text), instructions(housed.text)
    changed = [(old, new) for old, new in zip(before, after, strict=True) if old != new]
    assert len(changed) == 1 and "nbbatch envs create" in changed[0][0][1]
    step, original = (" ".join(args.split()) for (_, args) in changed[0][::-1])
    assert step.startswith("--mount=type=bind,source=context/wheelhouse,target=/run/nbbatch/wheelhouse ")
    assert "export UV_FIND_LINKS=/run/nbbatch/wheelhouse && if [ -f /run/nbbatch/ca.crt ]" in step
    assert step.endswith(original), "the step's own commands follow unchanged"
    assert copy_sources(housed.text) == copy_sources(plain.text), "the wheels are mounted, never copied into a layer"


def test_a_wheelhouse_must_be_a_folder_holding_wheels(frameworks, tmp_path):
    fw = frameworks["chainer"]
    with pytest.raises(ContainerError, match=r"--find-links .*nowhere: no such folder"):
        image_spec(fw, DOCKERFILES, find_links=[tmp_path / "nowhere"])
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "README.txt").write_text("no wheels here")
    (notes / "sub" / "deep-1.0-py3-none-any.whl").write_text("not looked for below the folder")
    with pytest.raises(ContainerError, match=r"holds no wheel file \(\*\.whl\)"):
        image_spec(fw, DOCKERFILES, find_links=[notes])
    first = wheel_folder(tmp_path / "first", "a-1.0-py3-none-any.whl")
    second = wheel_folder(tmp_path / "second", "a-1.0-py3-none-any.whl", "b-2.0-py3-none-any.whl")
    spec = image_spec(fw, DOCKERFILES, find_links=[first, second])
    assert spec.wheels == (first / "a-1.0-py3-none-any.whl", second / "b-2.0-py3-none-any.whl")


def test_a_wheelhouse_needs_a_step_running_nbbatch_envs_create(tmp_path):
    with pytest.raises(ContainerError, match="no RUN step running `nbbatch envs create`"):
        with_wheelhouse("FROM x\nRUN pip install torch\n", tmp_path / "Dockerfile")
    text = with_wheelhouse("FROM x\nRUN --network=host \\\n    python -m nbbatch envs create fw\nRUN true\n",
                           tmp_path / "Dockerfile")
    assert " ".join(instructions(text)[1][1].split()) == (
        "--network=host --mount=type=bind,source=context/wheelhouse,target=/run/nbbatch/wheelhouse "
        "export UV_FIND_LINKS=/run/nbbatch/wheelhouse && python -m nbbatch envs create fw")
    assert instructions(text)[2] == ("RUN", "true")



def test_a_base_mirror_replaces_docker_hub_bases_only():
    """Issue 50 item 11: ACR builds pull Docker Hub bases anonymously (rate limits); `base_mirror:` names a
    registry holding copies (`az acr import --source docker.io/<base> --image <base>`)."""
    from nbbatch.containers.registry import mirrored

    mirror = "myacr.azurecr.io"
    assert mirrored("nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04", mirror) == (
        "myacr.azurecr.io/nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04")
    assert mirrored("ubuntu:24.04", mirror) == "myacr.azurecr.io/ubuntu:24.04"
    assert mirrored("docker.io/library/ubuntu:24.04", mirror) == "myacr.azurecr.io/library/ubuntu:24.04"
    for other in ("nvcr.io/nvidia/pytorch:24.01-py3", "mcr.microsoft.com/azureml/openmpi4.1.0-ubuntu22.04",
                  "localhost/base:1", "registry:5000/base:1"):
        assert mirrored(other, mirror) == other  # not Docker Hub's: pulled where it is
    assert mirrored("ubuntu:24.04", None) == "ubuntu:24.04"


def test_azure_ml_builds_pull_the_base_from_the_mirror(frameworks):
    pytest.importorskip("azure.ai.ml")
    from nbbatch.backends.azureml.images import framework_environment

    fw = frameworks["pytorch"]
    plain = framework_environment(fw, DOCKERFILES)
    mirrored_env = framework_environment(fw, DOCKERFILES, base_mirror="myacr.azurecr.io")
    spec = image_spec(fw, DOCKERFILES, base=f"myacr.azurecr.io/{fw.base_image}", run_as="root")
    assert mirrored_env.version == spec.fingerprint != plain.version  # another base: another environment version
    assert f'ARG BASE_IMAGE="myacr.azurecr.io/{fw.base_image}"' in spec.text
    pushed = framework_environment(fw, DOCKERFILES, registry="myacr.azurecr.io/nbbatch", base_mirror="myacr.azurecr.io")
    assert pushed.version == plain.version  # `registry:` images were built here, on their own base


def test_a_push_of_another_variant_names_the_run_as_option(frameworks):
    """`images push` of the default build, when only the root build is here, says to push with `--run-as root`."""
    import types

    from nbbatch.ui.images_commands import _other_builds

    root = image_spec(frameworks["chainer"], DOCKERFILES, run_as="root")
    engine = types.SimpleNamespace(images_labelled=lambda labels: [(root.ref, "sha256:1")],
                                   query=lambda *args: types.SimpleNamespace(stdout=root.variant + "\n"))
    said = _other_builds(engine, image_spec(frameworks["chainer"], DOCKERFILES))
    assert "built here with other options (`--run-as root`)" in said
