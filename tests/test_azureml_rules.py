"""The Azure ML service's rules (backends/azureml/rules.yaml), checked offline before anything is created: each refusal
names the rule and the fix; and every job the backend can build satisfies them and the SDK's own datastore URI parser
(property-based, over names, share URLs, inputs and distributions)."""

from __future__ import annotations

import dataclasses
import io
import re
import types

import pytest

pytest.importorskip("azure.ai.ml")

from azure.ai.ml import load_job  # noqa: E402
from azure.ai.ml._utils._storage_utils import AzureMLDatastorePathUri  # noqa: E402
from fakes.azureml_transport import FakeAzureML  # noqa: E402
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from support.notebooks import make_notebook  # noqa: E402

from nbbatch.backends.azureml import AzureMLBackend, ClusterSettings, cli_cluster, job_yaml  # noqa: E402
from nbbatch.backends.azureml.images import datastore_name_for  # noqa: E402
from nbbatch.backends.azureml.rules import job_lifetime_s, name_rules  # noqa: E402
from nbbatch.errors import NbbatchError, ValidationError  # noqa: E402
from nbbatch.plan.runs import Run, run_id_for  # noqa: E402
from nbbatch.spec.resources import Distribution  # noqa: E402

pytestmark = [pytest.mark.azure, pytest.mark.timeout(300)]

ACCOUNT = "devstoreaccount1"
SHARE_URL = f"azfiles://{ACCOUNT}/results/nbbatch"
ENVIRONMENTS = {"*": "azureml:nbbatch-toy:1"}  # an existing environment: no framework folder needed
RULES = name_rules()


def _run(run_id: str = "toy-0123456789", experiment: str = "cifar", **changes) -> Run:
    base = Run(run_id=run_id, experiment=experiment, notebook="/p/notebooks/Toy.ipynb",
               notebook_rel="notebooks/Toy.ipynb", kernel="nbbatch-toy", parameters={"LR": 0.1}, framework="toy",
               gpus=1, timeout_s=900)
    return dataclasses.replace(base, **changes)


def _backend(aml: FakeAzureML, **settings) -> AzureMLBackend:
    values = {"compute": "gpu-a100", "vm_size": "Standard_ND96asr_v4", "max_nodes": 8, "environments": ENVIRONMENTS,
              **settings}
    return AzureMLBackend(ml_client=aml.ml_client(), **values)


def _share(url: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(url=url)  # what check_share reads of a share (its azfiles:// URL)


def _paths(job) -> list[str]:
    return [str(io.path) for io in [*job.inputs.values(), *job.outputs.values()] if getattr(io, "path", None)]


# --- fix 1: names the service refuses are refused before anything is created ------------------------------------


def test_an_experiment_name_with_a_dot_is_refused_before_anything_is_created(write_experiment, monkeypatch):
    import nbbatch.backends as backends
    from nbbatch.api import submit

    aml = FakeAzureML()
    monkeypatch.setitem(backends._REGISTRY, "azureml",
                        lambda **settings: AzureMLBackend(ml_client=aml.ml_client(), **settings))
    exp = write_experiment("experiment: cifar.v2\nnotebooks: [nb.ipynb]\n"
                           "backend: {name: azureml, compute: gpu-t4, environments: {'*': 'azureml:e:1'}}\n"
                           f"share: {SHARE_URL}\n")
    make_notebook(exp.parent / "nb.ipynb", ["print(1)"])
    with pytest.raises(ValidationError) as refused:
        submit(exp, progress=False, wait=False)
    text = str(refused.value)
    assert "`cifar.v2` is not a valid Azure ML experiment name" in text
    assert "letters, numbers, underscores, and dashes" in text and "e.g. `cifar-v2`" in text
    assert "rename the experiment" in text and "\n" not in text  # one paragraph: rule, bad value, fix
    assert not aml.transport.calls and not aml.computes and not aml.datastores and not aml.jobs


@pytest.mark.parametrize("name", ["ab", "gpu-", "gpu-1", "1gpu", "gpu_a100", "g" * 33, "g" * 25,
                                  "nbbatch-a100-lowpriority-x"])
def test_compute_names_the_service_refuses(name):
    """Issue 50 item 11: 25 to 32 characters are refused too (the REST API's pattern caps names at 24)."""
    with pytest.raises(ValidationError, match=rf"cluster name `{re.escape(name)}` is not a valid Azure ML compute "
                                              r"cluster name.*3 to 24 characters.*at most 24 characters"):
        ClusterSettings(name)
    aml = FakeAzureML()
    from nbbatch.ui.cli import build_parser

    with pytest.raises(NbbatchError, match="not a valid Azure ML compute cluster name"):
        cli_cluster(build_parser().parse_args(["cluster", "create", "--name", name]), ml_client=aml.ml_client())
    with pytest.raises(NbbatchError, match="not a valid Azure ML compute cluster name"):
        AzureMLBackend(ml_client=aml.ml_client(), compute=name)
    assert not aml.transport.calls and not aml.computes
    for good in ("gpu-t4", "nbbatch-gpu", "abc", "g" * 24, "nbbatch-probe2"):
        assert ClusterSettings(good).name == good


def test_a_long_cluster_name_is_refused_with_a_shortened_example():
    with pytest.raises(ValidationError, match=r"\(e.g. `nbbatch-a100-lowpriority`\)"):
        ClusterSettings("nbbatch-a100-lowpriority-x")
    with pytest.raises(ValidationError, match=r"\(e.g. `g{24}`\)"):
        ClusterSettings("g" * 30)


@pytest.mark.parametrize(("setting", "value", "rule"), [
    ("shm_size", "16 GB", "`<number><unit>`"), ("shm_size", "0g", "greater than 0"), ("shm_size", "16gb", "`g`"),
    ("datastore", "my-store", "lowercase letters, digits, and underscore"),
    ("datastore", "Results_DS", "lowercase letters, digits, and underscore"),
])
def test_settings_the_service_refuses(setting, value, rule):
    aml = FakeAzureML()
    backend = _backend(aml, **{setting: value})
    with pytest.raises(ValidationError, match=rf"`{setting}:` under `backend:` `{re.escape(value)}` is not a valid"
                                              rf".*{re.escape(rule)}.*Nothing was created"):
        backend.check([_run()])
    assert not aml.transport.calls
    _backend(aml, shm_size="16g", datastore="my_store").check([_run()])


def test_an_upper_case_shm_size_unit_is_sent_lower_case(tmp_path):
    """Docker reads `16G` as `16g`; the service documents the lower-case units, so nbbatch sends those."""
    aml = FakeAzureML()
    backend = _backend(aml, shm_size="16G")
    backend.check([_run()])
    job = backend.build_job(_run(), "azureml:env:1", tmp_path, datastore="ds", share_url="azfiles://acct/results")
    assert job.resources.shm_size == "16g"


@pytest.mark.parametrize(("url", "what"), [
    ("azfiles://MyAccount/results", "storage account"), ("azfiles://ab/results", "storage account"),
    ("azfiles://my-account/results", "storage account"), (f"azfiles://{ACCOUNT}/Results", "file share"),
    (f"azfiles://{ACCOUNT}/re--sults", "file share"), (f"azfiles://{ACCOUNT}/re", "file share"),
    (f"azfiles://{ACCOUNT}/results-", "file share"),
])
def test_share_and_input_names_the_service_refuses(url, what):
    aml = FakeAzureML()
    backend = _backend(aml)
    with pytest.raises(ValidationError, match=rf"the {what} of the experiment's share \({re.escape(url)}\) `"):
        backend.check_share(_share(url))
    with pytest.raises(ValidationError, match=rf"the {what} of input `DATA_DIR` \({re.escape(url)}/data\) `"):
        backend.check([_run(inputs={"DATA_DIR": f"{url}/data"})])
    assert not aml.transport.calls


# --- fix 2: the job's time limit covers every attempt ------------------------------------------------------------


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_the_job_time_limit_covers_every_attempt(retries, tmp_path):
    run = _run(retries=retries, timeout_s=900)
    job = _backend(FakeAzureML()).build_job(run, "azureml:e:1", tmp_path, datastore="ds", share_url=SHARE_URL)
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    assert loaded.limits.timeout >= (retries + 1) * 900 + 600  # each attempt gets its own timeout.run, plus setup
    # and room for the queue and a first image build, which the limit may count (until `make azure-smoke` says)
    assert loaded.limits.timeout >= (retries + 1) * 900 + 600 + 3600
    assert _backend(FakeAzureML()).build_job(_run(timeout_s=None), "azureml:e:1", tmp_path, datastore="ds",
                                             share_url=SHARE_URL).limits is None


def test_a_time_limit_longer_than_a_job_may_live_is_refused():
    four_days = 4 * 86400.0
    aml = FakeAzureML()
    low = _backend(aml, tier="low_priority")
    with pytest.raises(ValidationError, match=r"run toy-0123456789 may run 2 attempt\(s\).*low-priority cluster lives "
                                              r"at most 604800 s \(7 days.*Lower timeout.run or retries"):
        low.check([_run(timeout_s=four_days, retries=1)])
    low.check([_run(timeout_s=four_days, retries=0)])
    _backend(aml).check([_run(timeout_s=four_days, retries=3)])  # 16 days fit a dedicated node's 21
    with pytest.raises(ValidationError, match="dedicated cluster lives at most 1814400 s"):
        _backend(aml).check([_run(timeout_s=four_days, retries=5)])
    assert not aml.transport.calls
    assert job_lifetime_s("dedicated") == 21 * 86400


# --- fix 6: the root of a file share is a path the SDK's parser takes -------------------------------------------


def test_the_root_of_a_share_is_a_path_the_sdk_parses(tmp_path):
    backend = _backend(FakeAzureML())
    run = _run(inputs={"DATA_DIR": f"azfiles://{ACCOUNT}/datasets", "MORE": f"azfiles://{ACCOUNT}/datasets/"})
    job = backend.build_job(run, "azureml:e:1", tmp_path, datastore="ds", share_url=f"azfiles://{ACCOUNT}/results")
    paths = _paths(job)
    assert f"azureml://datastores/nbbatch_{ACCOUNT}_datasets/paths/./" in paths
    assert "azureml://datastores/ds/paths/./" in paths
    for path in paths:
        assert AzureMLDatastorePathUri(path).datastore in ("ds", f"nbbatch_{ACCOUNT}_datasets"), path
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    assert loaded.outputs["share"].path == "azureml://datastores/ds/paths/./"


# --- issue 50 item 1: folder names the datastore path cannot carry are refused, the others sent as they are --------


@pytest.mark.parametrize(("folder", "char", "shown"), [
    ("run#1", "#", "#"), ("50%off", "%", "%"), ("my%20data", "%", "%"), ("a+b", "+", "+"), ("me@home", "@", "@"),
    ("tab\there", "\t", "\\t"),
    ("no\u00a0break", "\u00a0", "\\xa0"), ("ideo\u3000space", "\u3000", "\\u3000"),
])
def test_a_folder_the_datastore_path_cannot_carry_is_refused_with_the_rename(folder, char, shown):
    aml = FakeAzureML()
    backend = _backend(aml)
    renamed = folder.replace(char, "-")
    visible = folder.replace(char, shown)
    expected = (rf"the folder `{re.escape(visible)}` of (the experiment's share|input `DATA_DIR`) \(azfiles://.*\) holds "
                rf"`{re.escape(shown)}`, which Azure ML cannot carry in a datastore path: .*Rename the folder \(e.g. to "
                rf"`{re.escape(renamed)}`\)")
    with pytest.raises(ValidationError, match=expected) as refused:
        backend.check_share(_share(f"{SHARE_URL}/{folder}/sub"))
    assert "\n" not in str(refused.value) and "Nothing was created in Azure ML" in str(refused.value)
    with pytest.raises(ValidationError, match=expected):
        backend.check([_run(inputs={"DATA_DIR": f"azfiles://{ACCOUNT}/datasets/{folder}"})])
    assert not aml.transport.calls
    direct = _backend(aml, share_mode="direct")  # the job opens the share by its URL: no datastore path to carry
    direct.check_share(_share(f"{SHARE_URL}/{folder}/sub"))
    with pytest.raises(ValidationError, match=expected):  # inputs are mounted all the same
        direct.check([_run(inputs={"DATA_DIR": f"azfiles://{ACCOUNT}/datasets/{folder}"})])


@pytest.mark.parametrize("folder", ["my data", "données", "数据集", "a&b", "cifar-10_v2 (copy)", "x=1,y=2;z~!$'[]{}^`"])
def test_a_folder_both_parsers_read_alike_is_sent_as_it_is(folder, tmp_path):
    """A space inside a name, non-ASCII letters and `&` are sent unescaped: the SDK reads the path as plain text."""
    backend = _backend(FakeAzureML())
    share_url = f"{SHARE_URL}/{folder}"
    backend.check_share(_share(share_url))
    run = _run(inputs={"DATA_DIR": f"azfiles://{ACCOUNT}/datasets/{folder}"})
    backend.check([run])
    job = backend.build_job(run, "azureml:e:1", tmp_path, datastore="ds", share_url=share_url,
                            share_prefix=f"nbbatch/{folder}")
    loaded = load_job(source=io.StringIO(job_yaml(job)))
    assert AzureMLDatastorePathUri(loaded.outputs["share"].path).path == f"nbbatch/{folder}/"
    assert AzureMLDatastorePathUri(loaded.inputs["DATA_DIR"].path).path == f"{folder}/"


# --- every job the backend can build satisfies the rules (property-based) ---------------------------------------

IDENTIFIER = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True).filter(
    lambda name: name not in ("if", "in", "is", "or", "as", "def", "for", "and", "not", "del", "try"))
ACCOUNTS = st.from_regex(r"[a-z0-9]{3,24}", fullmatch=True)
SHARES = st.from_regex(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,20}", fullmatch=True)
# folder names Azure Files takes: no control characters, none of " \ / : | < > * ? (Azure Files naming rules)
SEGMENT = st.text(st.characters(codec="utf-8", categories=["L", "M", "N", "P", "S", "Zs"],
                                exclude_characters='"\\/:|<>*?'), min_size=1, max_size=8).filter(
    lambda s: s not in (".", ".."))
PREFIXES = st.lists(SEGMENT, max_size=3).map("/".join)
SHARE_URLS = st.builds(lambda a, s, p, slash: f"azfiles://{a}/{s}" + (f"/{p}" if p else "") + slash,
                       ACCOUNTS, SHARES, PREFIXES, st.sampled_from(["", "/"]))
DISTRIBUTIONS = st.one_of(st.none(), st.builds(
    lambda kind, nodes, gpus: Distribution(kind, nodes, gpus if kind in ("torch", "mpi") else 1, gpus),
    st.sampled_from(["torch", "jax", "tensorflow", "mpi"]), st.integers(1, 8), st.integers(1, 8)))
VALUES = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=10), st.booleans())
# what nbbatch's experiment schema accepts (spec/experiment.schema.json), and run ids as plan makes them
EXPERIMENTS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", fullmatch=True)
LABELS = st.text(max_size=40)
COMPUTES = st.one_of(st.sampled_from(["gpu-a100", "nbbatch-gpu"]), st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,33}",
                                                                                  fullmatch=True))
SHM_SIZES = st.one_of(st.none(), st.sampled_from(["16g", "512m", "0g", "8G", "2 g", "1024k"]))
RUNS = st.fixed_dictionaries({
    "experiment": EXPERIMENTS, "label": LABELS, "parameters": st.dictionaries(IDENTIFIER, VALUES, max_size=3),
    "inputs": st.dictionaries(IDENTIFIER, SHARE_URLS, max_size=2), "distribution": DISTRIBUTIONS,
    "retries": st.integers(0, 3), "timeout_s": st.one_of(st.none(), st.floats(1, 86400)),
})


def _planned(values: dict) -> Run:
    dist = values["distribution"]
    run_id = run_id_for(values["label"], b"{}", values["parameters"], "lock", inputs=values["inputs"] or None,
                        distribution=dist)
    return _run(run_id, values["experiment"], parameters=values["parameters"], inputs=values["inputs"],
                distribution=dist, gpus=dist.gpus_per_node if dist else 1, retries=values["retries"],
                timeout_s=values["timeout_s"])


def _allowed(run: Run, compute: str, shm_size: str | None, share_url: str) -> bool:
    from nbbatch.store.azfiles import parse_azfiles_url

    places = [parse_azfiles_url(share_url), *(parse_azfiles_url(u) for u in run.inputs.values())]
    carried = all(c == " " or (c not in "#%+?@" and c.isprintable() and not c.isspace())
                  for place in places for c in place.prefix)
    return (carried and RULES["experiment"].allows(run.experiment) and RULES["compute"].allows(compute)
            and (shm_size is None or RULES["shm_size"].allows(shm_size))
            and all(RULES["storage_account"].allows(p.account) and RULES["file_share"].allows(p.share) for p in places))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(values=RUNS, compute=COMPUTES, shm_size=SHM_SIZES, share_url=SHARE_URLS, datastore=st.sampled_from([None, "ds"]))
def test_every_job_the_backend_builds_satisfies_the_rules(tmp_path_factory, values, compute, shm_size, share_url,
                                                          datastore):
    run = _planned(values)
    aml = FakeAzureML()
    if not _allowed(run, compute, shm_size, share_url):
        event("refused")
        with pytest.raises(ValidationError, match="(which the service refuses|cannot carry in a datastore path)"
                                                  ".*Nothing was created in Azure ML"):
            backend = _backend(aml, compute=compute, shm_size=shm_size, datastore=datastore)
            backend.check_share(_share(share_url))
            backend.check([run])
        assert not aml.transport.calls  # refused before the service saw any request
        return
    event(f"built: {run.distribution.type if run.distribution else 'one node'}, share at root: {not share_url.split('/', 4)[4:]}")
    backend = _backend(aml, compute=compute, shm_size=shm_size, datastore=datastore)
    backend.check_share(_share(share_url))
    backend.check([run])
    assert not [c for c in aml.transport.calls if c.method != "GET"]  # checking creates nothing
    from nbbatch.store.azfiles import parse_azfiles_url

    share = parse_azfiles_url(share_url)
    job = backend.build_job(run, "azureml:nbbatch-toy:1", tmp_path_factory.getbasetemp(),
                            datastore=datastore or datastore_name_for(share.account, share.share), share_url=share_url,
                            share_prefix=share.prefix)
    assert RULES["experiment"].allows(job.experiment_name) and job.display_name == run.run_id
    assert RULES["job"].allows(job.name) and job.name.startswith(re.sub(r"[^A-Za-z0-9_-]", "-", run.run_id)[:200])
    assert RULES["compute"].allows(job.compute)
    assert shm_size is None or RULES["shm_size"].allows(job.resources.shm_size)
    assert all(RULES["input"].allows(name) for name in job.inputs)
    paths = _paths(job)
    assert len(paths) == len(run.inputs) + 1
    for path in paths:
        parsed = AzureMLDatastorePathUri(path)  # the SDK's own parser
        assert RULES["datastore"].allows(parsed.datastore) and parsed.path.endswith("/"), path
    if run.timeout_s:
        assert job.limits.timeout >= (run.retries + 1) * run.timeout_s
