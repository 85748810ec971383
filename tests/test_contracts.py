"""The plug-in points, held to their contract by the smallest plug-ins (tests/support/plugins.py): a backend and a
share scheme found through entry points, as a pip-installed package would register them."""

from __future__ import annotations

import pytest
from support.notebooks import make_notebook
from support.plugins import BACKEND_NAME, SHARE_SCHEME, MemoryShare, MinimalBackend, install_plugins

import nbbatch.backends
import nbbatch.store.share
from nbbatch.api import submit
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import load_records
from nbbatch.store.runjson import Status
from nbbatch.store.share import open_share


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """The plug-ins installed (a dist-info on sys.path), and nbbatch's registries as if nothing were loaded yet."""
    monkeypatch.syspath_prepend(str(install_plugins(tmp_path / "site")))
    monkeypatch.setattr(nbbatch.backends, "_REGISTRY", {})
    monkeypatch.setattr(nbbatch.store.share, "_SHARES", {})
    monkeypatch.setattr(MemoryShare, "_by_url", {})


def test_a_backend_plugin_is_found_by_its_entry_point(plugins):
    assert BACKEND_NAME in nbbatch.backends.backend_names()
    assert nbbatch.backends.backend_class(BACKEND_NAME) is MinimalBackend
    backend = nbbatch.backends.get_backend(BACKEND_NAME)
    assert backend.compute().backend == BACKEND_NAME


@pytest.mark.kernel
def test_a_backend_plugin_runs_an_experiment_into_a_share_plugin(plugins, project):
    make_notebook(project / "nb.ipynb", ["print('ran', A)"])
    experiment = {"experiment": "contract", "notebooks": ["nb.ipynb"], "sweep": {"grid": {"A": [1, 2]}},
                  "backend": {"name": BACKEND_NAME}, "share": f"{SHARE_SCHEME}://results"}
    result = submit(experiment, progress=False)
    assert result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    assert {r.backend for r in result.records} == {BACKEND_NAME}
    share = open_share(f"{SHARE_SCHEME}://results")
    records, _ = load_records(share, "contract")
    assert sorted(r.parameters["A"] for r in records if r.status == Status.SUCCEEDED) == [1, 2]
    for record in records:
        log = share.read_bytes(run_paths("contract", record.run_id).log).decode()
        assert f"ran {record.parameters['A']}" in log
