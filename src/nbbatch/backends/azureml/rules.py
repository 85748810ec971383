"""The Azure ML service's rules (``rules.yaml``), checked offline before anything is created in a workspace.

Each name the backend sends (experiment, job, compute, datastore, storage account, file share, input, environment),
``shm_size``, every datastore path (parsed by the SDK's own parser) and the job's time limit are checked here, so
``nbbatch plan``/``submit`` refuse what the service would refuse, naming the rule and what to write instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from azure.ai.ml._utils._storage_utils import AzureMLDatastorePathUri
from azure.ai.ml.exceptions import ValidationException

from nbbatch.backends.azureml.images import datastore_name_for
from nbbatch.errors import ValidationError
from nbbatch.plan.runs import Run
from nbbatch.spec.yaml_loader import load_yaml
from nbbatch.store.azfiles import AzureFilesLocation, parse_azfiles_url

RULES_FILE = Path(__file__).with_name("rules.yaml")
# What a job spends besides its attempts' own `timeout.run`: once, the node's setup (image pull, mounts) before the
# runner starts; per attempt, starting the kernel and saving the notebook and record after the deadline stopped it.
SETUP_SLACK_S = 600
ATTEMPT_SLACK_S = 120
# Whether the job's `limits.timeout` also counts its time queued for nodes and its image's first build (which can
# take longer than SETUP_SLACK_S) is not documented; until `make azure-smoke` measures it, the limit leaves this
# much more (docs/azure.md, "Job time limits"). Only a backstop: the runner inside stops each attempt at timeout.run.
QUEUE_AND_BUILD_SLACK_S = 7200


@dataclass(frozen=True)
class NameRule:
    """One kind of name the service checks: its pattern, the rule in the service's words, and the fix."""

    key: str
    what: str
    pattern: re.Pattern[str]
    chars: str
    replace: str
    says: str
    fix: str
    source: str
    lowercase: bool = False
    max_length: int | None = None  # an example is cut to this length

    def allows(self, value: str) -> bool:
        """Whether the service takes ``value``."""
        return isinstance(value, str) and self.pattern.fullmatch(value) is not None

    def example(self, value: str) -> str | None:
        """``value`` made valid (other characters replaced, ends trimmed), or None when that does not give one."""
        text = value.lower() if self.lowercase else value
        text = re.sub(f"[^{self.chars}]+", self.replace, text)
        if self.replace:
            text = re.sub(f"{re.escape(self.replace)}+", self.replace, text).strip(self.replace)
        text = text.lstrip("0123456789") if self.key == "compute" else text
        if self.max_length:
            text = text[:self.max_length].rstrip(self.replace or "")
        return text if text != value and self.allows(text) else None

    def refusal(self, value: str, where: str) -> ValidationError:
        """The error refusing ``value`` (one paragraph: what, the service's rule, what to write instead)."""
        suggestion = self.example(value)
        fix = self.fix.format(example=f" (e.g. `{suggestion}`)" if suggestion else "")
        return ValidationError(
            f"{where} `{value}` is not a valid {self.what}, which the service refuses: \"{self.says}\" ({self.source}). "
            f"To fix it, {fix}. Nothing was created in Azure ML")


@cache
def _data() -> Mapping[str, object]:
    return load_yaml(RULES_FILE.read_text()) or {}


@cache
def name_rules() -> dict[str, NameRule]:
    """The name rules of ``rules.yaml`` by kind (``experiment``, ``compute``, ``datastore`` …)."""
    rules = {}
    for key, entry in dict(_data()["names"]).items():  # type: ignore[call-overload]
        rules[key] = NameRule(key=key, what=entry["what"], pattern=re.compile(entry["pattern"]), chars=entry["chars"],
                              replace=entry.get("replace", ""), says=" ".join(entry["says"].split()),
                              fix=" ".join(entry["fix"].split()), source=entry["source"],
                              lowercase=bool(entry.get("lowercase", False)), max_length=entry.get("max_length"))
    return rules


def check_name(kind: str, value: str, where: str) -> None:
    """Raise :class:`ValidationError` when the service refuses ``value`` as a name of ``kind`` (said to be ``where``)."""
    rule = name_rules()[kind]
    if not rule.allows(value):
        raise rule.refusal(value, where)


def job_name(run_id: str, suffix: str) -> str:
    """A job name for ``run_id`` the service accepts: other characters become ``-``, cut to fit with ``-<suffix>``.

    Deterministic in ``run_id`` (nbbatch's own run ids, ``<label>-<10 hex>``, are kept as they are)."""
    rule = name_rules()["job"]
    stem = re.sub(f"[^{rule.chars}]", "-", run_id)
    if not stem[:1].isascii() or not stem[:1].isalnum():
        stem = "r" + stem
    longest = 255 - len(suffix) - 1
    return f"{stem[:longest]}-{suffix}"


def datastore_path(datastore: str, prefix: str) -> str:
    """A folder of a datastore as Azure ML names it (``azureml://datastores/<name>/paths/<folder>/``).

    The root of the datastore is ``paths/./``: the SDK's parser refuses an empty path after ``paths/``."""
    folder = prefix.strip("/")
    path = f"{folder}/" if folder else str(_data()["datastore_root"])
    return f"azureml://datastores/{datastore}/paths/{path}"


@cache
def _refused_path_chars() -> tuple[tuple[str, bool, str], ...]:
    """``(chars, whitespace, why)`` of each entry of ``datastore_path_refused`` in ``rules.yaml``."""
    return tuple((str(entry.get("chars", "")), bool(entry.get("whitespace", False)), " ".join(entry["why"].split()))
                 for entry in _data()["datastore_path_refused"])  # type: ignore[attr-defined]


def _refused_char(char: str) -> str | None:
    """Why ``char`` may not be in a datastore path; None when the SDK and the data runtime read it alike."""
    for chars, whitespace, why in _refused_path_chars():
        if char in chars or (whitespace and char != " " and (char.isspace() or not char.isprintable())):
            return why
    return None


def _visible(text: str) -> str:
    """``text`` with each whitespace or control character but the plain space written as its escape (``\\t``)."""
    return "".join(c if c == " " or (c.isprintable() and not c.isspace()) else ascii(c)[1:-1] for c in text)


def check_datastore_folder(location: AzureFilesLocation, where: str) -> None:
    """Raise :class:`ValidationError` when a folder of ``location`` holds a character that the SDK and the data
    runtime read differently in ``azureml://datastores/<name>/paths/<folder>/`` (``rules.yaml``,
    ``datastore_path_refused``): the job would mount another folder than the one the driver reads."""
    for char in dict.fromkeys(location.prefix):
        why = _refused_char(char)
        if why is None:
            continue
        folder = next(part for part in location.prefix.split("/") if char in part)
        renamed = "".join("-" if _refused_char(c) else c for c in folder)
        raise ValidationError(
            f"the folder `{_visible(folder)}` of {where} ({_visible(location.url)}) holds `{_visible(char)}`, which "
            f"Azure ML cannot carry in a datastore path: {why}. Rename the folder (e.g. to `{renamed}`) and write the "
            "new name in the azfiles:// URL. Nothing was created in Azure ML")


def check_datastore_path(uri: str, where: str) -> None:
    """Raise :class:`ValidationError` unless the SDK's own parser (``AzureMLDatastorePathUri``) reads ``uri`` back whole."""
    try:
        parsed = AzureMLDatastorePathUri(uri)
    except ValidationException as exc:
        raise ValidationError(f"{where} would be mounted from {uri}, which the Azure ML SDK refuses ({exc}); this is a "
                              "bug in nbbatch, please report it. Nothing was created in Azure ML") from exc
    if parsed.to_short_uri() != uri:  # its pattern stops at a line break: the job would mount another folder
        raise ValidationError(f"{where} would be mounted from {uri!r}, which the Azure ML SDK reads as "
                              f"{parsed.to_short_uri()!r}: a folder name holds a line break or another control "
                              "character; rename that folder. Nothing was created in Azure ML")


def job_timeout_s(run: Run) -> int | None:
    """The job's time limit: every attempt the runner inside makes (``retries + 1``, each with its own ``timeout.run``
    and no pause between them), plus the node's setup and room for queueing and an image build; None when the run has
    no time limit."""
    if not run.timeout_s:
        return None
    attempts = run.retries + 1
    return int(attempts * (float(run.timeout_s) + ATTEMPT_SLACK_S) + SETUP_SLACK_S + QUEUE_AND_BUILD_SLACK_S)


def cluster_create_hint(codes: list[str]) -> str | None:
    """The advice of ``rules.yaml``'s ``cluster_create_hints`` for a refusal carrying ``codes``; None: none fits."""
    hints = dict(_data().get("cluster_create_hints") or {})  # type: ignore[call-overload]
    lowered = [code.lower() for code in codes]
    for word, hint in hints.items():
        if any(word in code for code in lowered):
            return " ".join(str(hint).split())
    return None


def job_lifetime_s(tier: str) -> int:
    """The longest a job may run on a cluster of ``tier`` (``dedicated`` or ``low_priority``)."""
    lifetimes = dict(_data()["job_lifetime_s"])  # type: ignore[call-overload]
    return int(lifetimes.get(tier, lifetimes["dedicated"]))


def check_job_timeout(run: Run, tier: str) -> None:
    """Raise :class:`ValidationError` when the run's attempts cannot all fit in one job's lifetime on ``tier``."""
    needed, lifetime = job_timeout_s(run), job_lifetime_s(tier)
    if needed is None or needed <= lifetime:
        return
    attempts = run.retries + 1
    raise ValidationError(
        f"run {run.run_id} may run {attempts} attempt(s) of up to {run.timeout_s:g} s each (timeout.run: "
        f"{run.timeout_s:g}, retries: {run.retries}), {needed} s with the node's setup, but an Azure ML job on a "
        f"{tier.replace('_', '-')} cluster lives at most {lifetime} s ({lifetime // 86400} days; Microsoft Learn, "
        "Azure Machine Learning quotas and limits, \"Job lifetime\"). Lower timeout.run or retries (checkpoint and "
        "resume in a later submission instead). Nothing was created in Azure ML")


def check_settings(*, datastore: str | None, shm_size: str | None, identity_client_id: str | None = None) -> None:
    """Refuse a ``datastore:``, ``shm_size:`` or ``identity_client_id:`` setting the service would refuse (the
    cluster's name is checked by :class:`~nbbatch.backends.azureml.cluster.ClusterSettings`)."""
    if datastore is not None:
        check_name("datastore", datastore, "`datastore:` under `backend:`")
    if shm_size is not None:
        check_name("shm_size", str(shm_size), "`shm_size:` under `backend:`")
    if identity_client_id is not None:
        check_name("client_id", str(identity_client_id), "`identity_client_id:` under `backend:`")


def normal_shm_size(value: str | None) -> str | None:
    """``shm_size`` as the service documents it: ``16G`` is sent as ``16g`` (Docker reads both alike)."""
    return None if value is None else str(value).lower()


def check_location(location: AzureFilesLocation, datastore: str, where: str, mounted: bool = True) -> None:
    """Refuse a share (or a folder of one) whose account or share name the service refuses, or, when it is
    ``mounted`` through ``datastore``, whose datastore name or path would be refused (unmounted, as the results
    share in ``share_mode: direct``, the job opens it by its azfiles:// URL: no datastore path is written)."""
    check_name("storage_account", location.account, f"the storage account of {where} ({location.url})")
    check_name("file_share", location.share, f"the file share of {where} ({location.url})")
    if not mounted:
        return
    check_name("datastore", datastore, f"the datastore of {where}")
    check_datastore_folder(location, where)
    check_datastore_path(datastore_path(datastore, location.prefix), where)


def check_run(run: Run, environment: str, tier: str) -> None:
    """Refuse a run whose job the service would refuse: its experiment's name, its job name, its environment's name,
    its inputs (names, shares, datastores, paths) or a time limit longer than a job may live on ``tier``."""
    check_name("experiment", run.experiment, f"the experiment name of run {run.run_id}")
    check_name("job", job_name(run.run_id, "0" * 8), f"the job name of run {run.run_id}")
    found = re.fullmatch(r"azureml:([^:@/]+)[:@].+", environment)
    if found:
        check_name("environment", found.group(1), f"the environment of run {run.run_id}")
    for name, url in sorted(run.inputs.items()):
        check_name("input", name, f"input `{name}` of run {run.run_id}")
        if url.startswith("azfiles://"):
            place = parse_azfiles_url(url)
            check_location(place, datastore_name_for(place.account, place.share), f"input `{name}`")
    check_job_timeout(run, tier)
