"""Static checks of the per-framework images (Docker cannot build on the test machines).

Each ``dockerfiles/<name>/Dockerfile`` must build from a base pinned by tag, install exactly the pins
of ``frameworks/<name>/requirements.txt`` (a GPU variant of the same package at the same version is
allowed, e.g. ``tensorflow-cpu==X`` → ``tensorflow[and-cuda]==X``), register the kernel
``nbbatch-<name>`` with the framework's kernel variables, and run as a non-root user.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from nbbatch.spec.frameworks import Framework, list_frameworks
from nbbatch.spec.project import Project

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ROOT / "dockerfiles"


@pytest.fixture(scope="module")
def frameworks() -> dict[str, Framework]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
        return list_frameworks(Project(ROOT))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def images_used(steps: list[tuple[str, str]]) -> list[str]:
    used = [args.split()[0] for kw, args in steps if kw == "FROM"]
    used += re.findall(r"--from=(\S+)", " ".join(args for kw, args in steps if kw == "COPY"))
    return used


def package(spec: str) -> str:
    """The distribution name of ``name[extra]==version`` (normalized)."""
    return re.split(r"[\[=<>~! ]", spec, maxsplit=1)[0].strip().lower().replace("_", "-")


def gpu_variant_ok(original: str, variant: str) -> bool:
    """A GPU variant of the same package: the same name with an extra or a CUDA suffix."""
    base, var = package(original), package(variant)
    return var == base or var.startswith(base + "-cu") or base.endswith("-cpu") and var == base[:-4]


def test_every_framework_has_a_dockerfile_and_no_dockerfile_is_orphaned(frameworks):
    assert frameworks, "no frameworks found"
    have = {p.parent.name for p in DOCKERFILES.glob("*/Dockerfile")}
    assert set(frameworks) == have, f"without a Dockerfile: {sorted(set(frameworks) - have)}; " \
                                    f"without a framework: {sorted(have - set(frameworks))}"


@pytest.fixture(params=sorted(p.parent.name for p in DOCKERFILES.glob("*/Dockerfile")))
def case(request, frameworks):
    name = request.param
    if name not in frameworks:
        pytest.fail(f"dockerfiles/{name} has no frameworks/{name}/framework.yaml")
    return frameworks[name], instructions(DOCKERFILES / name / "Dockerfile")


def test_images_are_pinned_by_tag(case):
    fw, steps = case
    used = images_used(steps)
    assert used, "no FROM"
    for image in used:
        name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
        assert name and tag and "/" not in tag, f"{image} is not pinned by a tag"
        assert tag != "latest", f"{image} uses the moving tag `latest`"


def test_base_image_is_the_one_framework_yaml_names(case):
    fw, steps = case
    froms = [args.split()[0] for kw, args in steps if kw == "FROM"]
    assert froms[-1] == fw.base_image, f"framework.yaml says base_image {fw.base_image}, the Dockerfile uses {froms[-1]}"


def test_installs_exactly_the_frameworks_requirements(case):
    fw, steps = case
    name = fw.name
    copies = [args.split() for kw, args in steps if kw == "COPY" and f"frameworks/{name}/" in args]
    assert copies, f"the Dockerfile must COPY frameworks/{name}/{fw.requirements.name}"
    sources = [a for c in copies for a in c[:-1] if not a.startswith("--")]
    assert sources == [f"frameworks/{name}/{fw.requirements.name}"], f"copies {sources}, not the pins file alone"
    copied_to = copies[0][-1]
    run = " && ".join(args for kw, args in steps if kw == "RUN")
    # The files pip/uv install from: the copied pins, or a copy rewritten by sed to GPU variants.
    rewrites = re.findall(r"sed\s+(?:-E\s+)?-e\s+'s/\^([^/]+)==/([^/]+)==/'\s+(\S+)\s*>\s*(\S+)", run)
    installed_files = {copied_to}
    for original, variant, source, target in rewrites:
        assert source == copied_to, f"sed rewrites {source}, not the copied pins"
        assert original.replace("\\", "") in {p.split("==")[0] for p in fw.pinned()}, f"{original} is not pinned"
        assert gpu_variant_ok(original, variant), f"{original} → {variant} is not a GPU variant of the same package"
        installed_files.add(target)
    installs = [cmd for cmd in re.split(r"&&|;", run) if re.search(r"\bpip\b.*\binstall\b", cmd)]
    assert installs, "nothing is installed"
    requirement_files = set()
    for cmd in installs:
        tokens = shlex.split(cmd)
        requirement_files |= {tok for flag, tok in zip(tokens, tokens[1:], strict=False) if flag == "-r"}
    assert requirement_files, "the pins are not installed with -r"
    assert requirement_files <= installed_files, f"installs {requirement_files - installed_files}, not the pins"
    # No other pinned package sneaks in beside the file: only the setup requirements and ipykernel.
    allowed = {package(r) for r in fw.setup_requirements} | {"ipykernel"}
    for cmd in installs:
        for token in shlex.split(cmd):
            if re.match(r"^[A-Za-z0-9_.\-\[\]]+\s*(==|>=|<=|~=)", token):
                assert package(token) in allowed, f"`{token}` is installed beside the pins file"
    for requirement in fw.setup_requirements:
        assert requirement in run, f"setup requirement {requirement} is not installed first"
    for option in fw.pip_options:
        assert option in run, f"pip option {option} from framework.yaml is not used"


def test_registers_the_kernel_with_the_frameworks_variables(case):
    fw, steps = case
    run = " ".join(args for kw, args in steps if kw == "RUN")
    match = re.search(r"ipykernel install (.*?)(?:&&|$)", run)
    assert match, "no `python -m ipykernel install`"
    args = shlex.split(match.group(1))
    assert args[args.index("--name") + 1] == fw.kernel_name
    env = {args[i + 1]: args[i + 2] for i, a in enumerate(args) if a == "--env"}
    assert env == fw.kernel_env, f"kernel variables {env} differ from framework.yaml's {fw.kernel_env}"


def test_runs_as_a_non_root_user(case):
    fw, steps = case
    users = [(i, args.split(":")[0]) for i, (kw, args) in enumerate(steps) if kw == "USER"]
    assert users, "no USER: the image would run as root"
    last_index, last_user = users[-1]
    assert last_user not in {"root", "0"}, "the last USER is root"
    last_run = max(i for i, (kw, _) in enumerate(steps) if kw == "RUN")
    assert last_index > last_run, "the final USER must come after the install steps"


def test_gpu_claims_are_explained(case):
    fw, steps = case
    text = (DOCKERFILES / fw.name / "Dockerfile").read_text()
    if fw.gpu:
        assert "GPU" in text and "cuda" in fw.base_image.lower(), "a GPU framework builds from a CUDA base image"
    else:
        assert "NO GPU" in text, "a CPU-only framework's Dockerfile says so"
