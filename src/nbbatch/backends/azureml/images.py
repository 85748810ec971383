"""What a job needs besides the cluster: its framework's image (an Azure ML environment), the datastore of
the results share, and a snapshot of the code (nbbatch's source, the frameworks' data, the runs' notebooks)."""

from __future__ import annotations

import re
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from azure.ai.ml import MLClient
from azure.ai.ml.entities import (
    AccountKeyConfiguration,
    AzureFileDatastore,
    BuildContext,
    Environment,
    SasTokenConfiguration,
)
from azure.core.exceptions import HttpResponseError, ResourceNotFoundError

import nbbatch
from nbbatch.backends.azureml.workspace import error_text
from nbbatch.containers.engines import find_engine
from nbbatch.containers.images import IGNORE, image_spec, stage_context
from nbbatch.containers.registry import ImageNotInRegistry, mirrored, registry_ref, require_remote_image
from nbbatch.errors import BackendError, ContainerError, ShareError
from nbbatch.plan.runs import Run
from nbbatch.spec.frameworks import list_frameworks
from nbbatch.spec.project import Project, find_project
from nbbatch.store.azfiles_client import account_key_env, check_account_key, storage_key, storage_suffix

KEY_ENV = "AZURE_STORAGE_KEY"
# The user Azure ML jobs run as: root, as in Azure ML's curated images, for which its job setup, the data runtime's
# mounts and MPI's ssh between nodes are made (the image template's default, uid 10001, is for Kubernetes).
IMAGE_USER = "root"


def framework_environment(framework: Any, dockerfiles_dir: Path, build_dir: Path | None = None,
                          registry: str | None = None, base_mirror: str | None = None) -> Environment:
    """The Azure ML environment of a framework: its GPU image (:mod:`nbbatch.containers.images`) running as
    :data:`IMAGE_USER`, versioned by the image's fingerprint (its pins, the filled-in Dockerfile, uv and nbbatch's
    requirements).

    With ``registry`` the environment is the image pushed there (``nbbatch images push``):
    ``image: REGISTRY/nbbatch-<framework>:<fingerprint>``, nothing built by Azure ML. Else, with ``build_dir``, the
    build context is staged there, the same context ``nbbatch images build`` builds from (the Dockerfile with the
    framework's values, and everything it copies), for the linux/x86_64 nodes Azure ML runs; with ``base_mirror``
    a Docker Hub base image is pulled from that registry's copy (``az acr import``), not from Docker Hub.
    """
    try:
        base = mirrored(framework.base_image, base_mirror) if registry is None else None
        spec = image_spec(framework, Path(dockerfiles_dir), base=base or None, run_as=IMAGE_USER)
        path = Path(dockerfiles_dir)
        if build_dir is not None and registry is None:
            path = stage_context(spec, build_dir, find_project(), arch="x86_64")
    except ContainerError as exc:
        raise BackendError(f"{exc} (the azureml backend builds each framework's image from there; or name an existing "
                           "Azure ML environment under `environments:`)") from exc
    tags = {"nbbatch": "1", "framework": framework.name, "kernel": framework.kernel_name}
    source: dict[str, Any] = {"build": BuildContext(path=str(path), dockerfile_path="Dockerfile")}
    if registry is not None:
        source = {"image": registry_ref(spec, registry)}
        tags["image"] = source["image"]
    return Environment(
        name=f"nbbatch-{framework.name}",
        version=spec.fingerprint,
        description=f"nbbatch {framework.title} environment (kernel {framework.kernel_name})",
        tags=tags,
        **source,
    )


def check_pushed(framework: Any, dockerfiles_dir: Path, registry: str) -> None:
    """Before submitting with ``registry:``: the framework's GPU image is in the registry (Azure ML would fail the job
    only when its node pulls). Refused when the registry says it has no such tag; where this machine cannot ask it
    (no container engine, no login, not reachable from here, where the workspace may still reach it), a warning."""
    try:
        spec = image_spec(framework, Path(dockerfiles_dir), run_as=IMAGE_USER)
    except ContainerError as exc:
        raise BackendError(str(exc)) from exc
    ref = registry_ref(spec, registry)
    try:
        require_remote_image(find_engine(), spec, registry)
    except ImageNotInRegistry as exc:
        raise BackendError(f"{exc}. Azure ML would fail the job when its node pulls the image; nothing was "
                           "submitted.") from exc
    except ContainerError as exc:
        warnings.warn(f"could not check that {ref} is in the registry ({exc}); Azure ML fails the job at its start "
                      "if its node cannot pull it", stacklevel=2)


def ensure_environment(ml_client: MLClient, framework: Any, dockerfiles_dir: Path,
                       registry: str | None = None, base_mirror: str | None = None) -> Environment:
    """The framework's environment: reused when its name and version (the pins) exist, else registered.

    Registering uploads the staged build context; Azure ML builds the image on first use (a job waits
    in Preparing meanwhile) and keeps it in the workspace's container registry. With ``registry`` it names the
    image pushed there instead, which the nodes pull (nothing is uploaded or built).
    """
    wanted = framework_environment(framework, dockerfiles_dir, registry=registry, base_mirror=base_mirror)
    try:
        return ml_client.environments.get(wanted.name, version=wanted.version)
    except ResourceNotFoundError:
        pass
    with tempfile.TemporaryDirectory(prefix="nbbatch-image-") as tmp:
        staged = framework_environment(framework, dockerfiles_dir, build_dir=Path(tmp) / "context", registry=registry,
                                       base_mirror=base_mirror)
        try:
            return ml_client.environments.create_or_update(staged)
        except HttpResponseError as exc:
            raise BackendError(f"cannot register environment {staged.name}:{staged.version}: "
                               f"{error_text(exc)}") from exc


# Where no storage key may be used: the job reaches the results share with its cluster's identity, no datastore.
KEYLESS_FIX = ("set `share_mode: direct` under `backend:`: the job then writes the results share with its cluster's "
               "managed identity (Storage File Data Privileged Contributor on the account; inputs are still mounted "
               "through datastores, so keep inputs on a share that has one)")


def datastore_name_for(account: str, share: str) -> str:
    """The default datastore name of a file share: ``nbbatch_<account>_<share>``."""
    return re.sub(r"[^a-z0-9_]", "_", f"nbbatch_{account}_{share}".lower())[:255]


def ensure_datastore(ml_client: MLClient, name: str, account: str, share: str) -> None:
    """Check the Azure ML datastore ``name`` points at the file share; register it when missing.

    Registering needs that account's key once (``AZURE_STORAGE_KEY_<ACCOUNT>``, or ``AZURE_STORAGE_KEY`` for the
    account in ``AZURE_STORAGE_ACCOUNT``: :func:`nbbatch.store.azfiles_client.storage_key`), checked against the
    service first so a datastore is never registered with another account's key. Azure ML keeps the key in the
    workspace's key vault, and workspace Readers can read it back through the datastore. Without a key, say how
    to register the datastore by hand or to go without one (``share_mode: direct``). An Azure File datastore takes an
    account key or a SAS token only, so one registered without credentials is refused: every job would fail to mount it.
    """
    try:
        found = ml_client.datastores.get(name)
    except ResourceNotFoundError:
        found = None
    if found is not None:
        if not isinstance(found, AzureFileDatastore):
            raise BackendError(f"datastore `{name}` exists but is a {type(found).__name__}, not an Azure File "
                               "datastore; name another with `datastore:`")
        if (found.account_name, found.file_share_name) != (account, share):
            raise BackendError(f"datastore `{name}` points at {found.account_name}/{found.file_share_name}, "
                               f"not the experiment's share {account}/{share}; name another with `datastore:`")
        if not isinstance(found.credentials, (AccountKeyConfiguration, SasTokenConfiguration)):
            raise BackendError(
                f"datastore `{name}` ({account}/{share}) has no account key or SAS token, and Azure ML mounts an Azure "
                "File datastore with one of those only (identity-based access is for blob and Data Lake datastores): "
                f"every job would fail to mount it. Register it again with credentials.account_key or "
                f"credentials.sas_token, or, to go without a key, {KEYLESS_FIX}")
        return
    key = storage_key(account)
    if not key:
        raise BackendError(
            f"the workspace has no datastore `{name}` for the file share {account}/{share}. Register it once "
            f"with `az ml datastore create --file <yaml>` (type: azure_file, name: {name}, account_name: {account}, "
            f"file_share_name: {share}, credentials.account_key or credentials.sas_token: Azure File datastores take "
            f"no other credentials; see docs/azure.md), or set {account_key_env(account)} to that account's key for "
            "this command and nbbatch registers it (Azure ML keeps the key in the workspace's key vault; workspace "
            f"Readers can read it). To go without a key, {KEYLESS_FIX}"
        )
    try:
        check_account_key(account, share, key)
    except ShareError as exc:
        raise BackendError(f"cannot register datastore `{name}`: {exc}") from exc
    ml_client.datastores.create_or_update(
        AzureFileDatastore(
            name=name, account_name=account, file_share_name=share, endpoint=storage_suffix(),
            description="nbbatch results share", credentials=AccountKeyConfiguration(account_key=key),
        )
    )


def project_root_of(run: Run) -> Path:
    """The project a run's notebook belongs to."""
    return run.project_root()


def build_code_snapshot(runs: Sequence[Run], dest: Path, project_root: Path | None = None) -> Path:
    """Copy what a job needs into ``dest``: nbbatch's source, the frameworks' data, the runs' notebooks.

    The layout mirrors the project (``src/nbbatch/``, ``frameworks/<name>/``, each notebook at its
    project-relative path), so ``run-one`` resolves notebooks the same way as on this machine.
    The content is deterministic, so Azure ML reuses an upload when nothing changed.
    """
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(Path(nbbatch.__file__).parent, dest / "src" / "nbbatch", ignore=IGNORE, dirs_exist_ok=True)
    frameworks = sorted({r.framework for r in runs if r.framework})
    for run in runs:
        rel = Path(run.notebook_rel)
        if rel.is_absolute() or ".." in rel.parts:
            raise BackendError(f"notebook {run.notebook_rel} of run {run.run_id} is outside the project; the "
                               "azureml backend ships the project's notebooks only: move it into the project")
        root = project_root or project_root_of(run)
        source = run.resolve_notebook(root)
        if not source.is_file():
            raise BackendError(f"notebook {run.notebook_rel} of run {run.run_id} is missing from {root}")
        target = dest / run.notebook_rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    if frameworks:
        root = project_root or project_root_of(runs[0])
        known = list_frameworks(Project(root))
        for name in frameworks:
            if name in known:
                shutil.copytree(known[name].folder, dest / "frameworks" / name, ignore=IGNORE, dirs_exist_ok=True)
    return dest
