"""Framework environments: one virtual environment and one Jupyter kernel per framework.

``<envs>/<name>/`` is a venv built from ``frameworks/<name>/`` pins; its kernel ``nbbatch-<name>``
lives in the project's own Jupyter data dir (never the user's home unless asked: :func:`register_user_kernel`,
as ``ipykernel install --user`` does) and carries the framework's variables. A marker file holds the pins
fingerprint: an env is ``ready``, ``stale`` or ``missing``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

import nbbatch
from nbbatch.errors import NbbatchError
from nbbatch.spec.environments import MARKER, EnvStatus, env_path, env_python, env_status, kernel_dir
from nbbatch.spec.frameworks import Framework, get_framework
from nbbatch.spec.project import Project, find_project
from nbbatch.store.share import FILE_MODE, write_file_atomic

KERNEL_REQUIREMENTS = ("ipykernel>=6.25",)
INSTALL_ATTEMPTS = 2  # an install fails now and then on a network or mirror hiccup; a second try is cheap


def _last_lines(log_path: Path, start: int, count: int = 8) -> str:
    """The last lines the failed step wrote (pip's own error), indented under the message."""
    try:
        with open(log_path, "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return "".join(f"\n    {line}" for line in lines[-count:])


def installer() -> str:
    """``uv`` when installed (unless NBBATCH_INSTALLER says otherwise), else ``pip``."""
    chosen = os.environ.get("NBBATCH_INSTALLER")
    if chosen:
        return chosen
    return "uv" if shutil.which("uv") else "pip"


def _install_cmd(python: Path, args: list[str]) -> list[str]:
    if installer() == "uv":
        return ["uv", "pip", "install", "--python", str(python), *args]
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *args]


def _nbbatch_source() -> Path:
    return Path(nbbatch.__file__).resolve().parent


def _link_nbbatch(python: Path, log) -> None:
    """Make this nbbatch importable in the env (its kernel calls nbbatch.record and nbbatch.data)."""
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    package = _nbbatch_source()
    target = Path(site)
    if package.parent.name == "src":  # a source checkout: follow it live
        (target / "nbbatch.pth").write_text(str(package.parent) + "\n")
    else:  # an installed nbbatch: copy the (pure-Python) package
        shutil.rmtree(target / "nbbatch", ignore_errors=True)
        shutil.copytree(package, target / "nbbatch", ignore=shutil.ignore_patterns("__pycache__"))
    log.write(f"linked nbbatch from {package}\n")


def _write_kernel(framework: Framework, project: Project, python: Path, gpu: bool = False) -> Path:
    folder = kernel_dir(framework, project)
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [str(python), "-Xfrozen_modules=off", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"nbbatch {framework.title}",
        "language": "python",
        "env": dict(framework.kernel_env),
        "metadata": {"nbbatch": {"framework": framework.name, "fingerprint": framework.fingerprint(gpu=gpu)}},
    }
    write_file_atomic(folder / "kernel.json", json.dumps(spec, indent=2).encode(), FILE_MODE)
    return folder


def user_kernel_dir(framework: Framework) -> Path:
    """Where :func:`register_user_kernel` puts ``framework``'s kernel: the user's Jupyter data dir
    (``JUPYTER_DATA_DIR``, else ``~/.local/share/jupyter``), where a plain ``jupyter lab`` finds it."""
    return Path(jupyter_data_dir()) / "kernels" / framework.kernel_name


def registered_user_kernel(framework: Framework, project: Project | None = None) -> Path | None:
    """The user's kernelspec of ``framework`` when it starts this project's env (another project's is not ours)."""
    project = project or find_project()
    folder = user_kernel_dir(framework)
    try:
        argv = json.loads((folder / "kernel.json").read_text()).get("argv") or [""]
    except (OSError, ValueError, AttributeError):
        return None
    return folder if Path(argv[0]) == env_python(env_path(framework, project)) else None


def register_user_kernel(framework: Framework, project: Project | None = None) -> Path:
    """Copy ``framework``'s built kernelspec into the user's Jupyter data dir, so a plain ``jupyter lab`` lists it;
    replaces an earlier registration of the same name. Returns its folder.

    What ``ipykernel install --user`` does through jupyter_client's ``install_kernel_spec(user=True)`` (replace the
    folder with a copy), done here with jupyter_core alone: jupyter_client takes a second to import, and the
    command line starts without it."""
    project = project or find_project()
    source = kernel_dir(framework, project)
    if not (source / "kernel.json").exists():
        raise NbbatchError(f"the environment for framework `{framework.name}` is not built, so it has no kernel "
                           f"to register; build it with `nbbatch envs create {framework.name}`")
    target = user_kernel_dir(framework)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return target


def unregister_user_kernel(framework: Framework, project: Project | None = None) -> Path | None:
    """Remove the user's kernelspec of ``framework`` if it starts this project's env; return what was removed."""
    folder = registered_user_kernel(framework, project)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    return folder


def _package_versions(python: Path) -> dict[str, str]:
    code = (
        "import json, importlib.metadata as m;"
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions() if d.metadata['Name']}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return dict(sorted(json.loads(out).items()))


def build_env(framework: Framework, project: Project | None = None, force: bool = False,
              on_step: Callable[[str], None] | None = None, gpu: bool | None = None) -> EnvStatus:
    """Create (or rebuild) the env and kernel of ``framework``; idempotent while pins are unchanged.

    ``gpu=True`` installs the framework's GPU builds (``gpu_packages``, ``gpu_pip_options``) instead of
    the packages they replace, as its image does; ``False`` the pins as they are; ``None`` keeps what
    the env was built with (the pins, for a new one)."""
    project = project or find_project()
    status = env_status(framework, project)
    gpu = status.gpu if gpu is None else gpu
    if status.state == "ready" and not force and status.gpu == gpu:
        return status
    path = status.path
    project.envs_dir.mkdir(parents=True, exist_ok=True)
    log_path = project.envs_dir / f"{framework.name}.log"
    step = on_step or (lambda _msg: None)
    with open(log_path, "w") as log:
        def run(cmd: list[str], what: str, attempts: int = 1) -> None:
            step(what)
            for attempt in range(1, attempts + 1):
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                start = log.tell()
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PIP_PROGRESS_BAR": "off"})
                if done.returncode == 0:
                    return
                if attempt < attempts:  # a download cut short or a busy mirror: pip resumes from its cache
                    log.write(f"# exit {done.returncode}; trying again ({attempt + 1} of {attempts})\n")
                    step(f"{what} (try {attempt + 1})")
            raise NbbatchError(
                f"building the environment for `{framework.name}` failed while {what} "
                f"(exit {done.returncode}{', ' + str(attempts) + ' tries' if attempts > 1 else ''}); "
                f"see the build log {log_path}{_last_lines(log_path, start)}"
            )

        try:
            (path / MARKER).unlink(missing_ok=True)
            if path.exists() and (force or status.state != "ready" or status.gpu != gpu):
                shutil.rmtree(path)
            python = env_python(path)
            if not python.exists():
                if installer() == "uv":
                    run(["uv", "venv", "--python", sys.executable, str(path)], "creating the venv")
                else:
                    run([sys.executable, "-m", "venv", str(path)], "creating the venv")
            if framework.setup_requirements:
                run(_install_cmd(python, list(framework.setup_requirements)), "installing setup requirements",
                INSTALL_ATTEMPTS)
            requirements = framework.requirements
            if gpu:
                requirements = path / "requirements-gpu.txt"
                requirements.write_text("\n".join(framework.requirement_lines(gpu=True)) + "\n")
            options = [*framework.pip_options, *(framework.gpu_pip_options if gpu else ())]
            run(_install_cmd(python, [*options, *KERNEL_REQUIREMENTS, "-r", str(requirements)]),
                "installing pinned requirements" + (" (GPU builds)" if gpu else ""), INSTALL_ATTEMPTS)
            step("registering the kernel")
            _link_nbbatch(python, log)
            _write_kernel(framework, project, python, gpu)
            if registered_user_kernel(framework, project):  # the user's copy follows the rebuilt kernel
                register_user_kernel(framework, project)
            marker = {
                "framework": framework.name,
                "fingerprint": framework.fingerprint(gpu=gpu),
                "gpu": gpu,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "installer": installer(),
                "packages": _package_versions(python),
            }
            (path / MARKER).write_text(json.dumps(marker, indent=2))
        except OSError as exc:
            raise NbbatchError(f"building the environment for `{framework.name}` failed: {exc}; see {log_path}") from exc
    return env_status(framework, project)


def build_envs(names: Iterable[str], project: Project | None = None, force: bool = False,
               parallel: int | None = None, progress: bool = True, gpu: bool | None = None) -> list[EnvStatus]:
    """Build several envs in parallel, saying how they go on stderr (``progress``); raise if any failed, naming
    their logs."""
    project = project or find_project()
    frameworks = [get_framework(n, project) for n in dict.fromkeys(names)]
    todo = [fw for fw in frameworks
            if force or (state := env_status(fw, project)).state != "ready" or gpu is not None and state.gpu != gpu]
    failures: list[str] = []
    if todo:
        console = Console(stderr=True)
        # On a terminal a live display that leaves nothing behind (the caller prints the summary); piped (`make demo
        # | tee`), a line as each build starts and ends, so a 10-minute build is never silent.
        live = progress and console.is_terminal
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      disable=not live, transient=True) as bar:
            tasks = {fw.name: bar.add_task(f"{fw.name}: queued", total=1) for fw in todo}

            def say(line: str) -> None:
                if progress and not live:
                    console.print(line, markup=False, highlight=False)

            def one(fw: Framework) -> None:
                task, began = tasks[fw.name], time.monotonic()
                say(f"{fw.name}: building its environment")
                try:
                    build_env(fw, project, force=force, gpu=gpu,
                              on_step=lambda msg: bar.update(task, description=f"{fw.name}: {msg}"))
                    bar.update(task, description=f"{fw.name}: ready", completed=1)
                    say(f"{fw.name}: built in {time.monotonic() - began:.0f} s")
                except NbbatchError as exc:
                    failures.append(str(exc))
                    bar.update(task, description=f"[red]{fw.name}: failed", completed=1)
                    say(f"{fw.name}: failed after {time.monotonic() - began:.0f} s")

            workers = parallel or min(len(todo), max(2, os.cpu_count() or 2))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(one, todo))
    if failures:
        raise NbbatchError("\n".join(failures))
    return [env_status(fw, project) for fw in frameworks]


def env_packages(framework: Framework, project: Project | None = None) -> dict[str, str]:
    """The package versions recorded when the env was built (empty when unknown)."""
    project = project or find_project()
    marker = env_path(framework, project) / MARKER
    try:
        return dict(json.loads(marker.read_text()).get("packages", {}))
    except (OSError, ValueError):
        return {}


def remove_env(framework: Framework, project: Project | None = None) -> None:
    """Delete a framework's env and its kernel (also the user's copy of the kernel, when it starts this env)."""
    project = project or find_project()
    unregister_user_kernel(framework, project)
    shutil.rmtree(env_path(framework, project), ignore_errors=True)
    shutil.rmtree(kernel_dir(framework, project), ignore_errors=True)
    (project.envs_dir / f"{framework.name}.log").unlink(missing_ok=True)
