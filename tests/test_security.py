"""No credential lands in an executed notebook, a run record, a log, the project's state or a report, and the
servers the tests start listen on 127.0.0.1 and ask for a key or token. See docs/security.md."""

from __future__ import annotations

import ast
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from support.notebooks import make_notebook

from nbbatch import backends
from nbbatch.api import submit
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.errors import BackendError
from nbbatch.ui import cli

pytestmark = pytest.mark.timeout(180)

TESTS = Path(__file__).resolve().parent
SECRET_ENV = ("AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET", "CI_DEPLOY_TOKEN", "NBBATCH_UPLOAD_TOKEN", "db_password",
              "AZURE_STORAGE_CONNECTION_STRING", "MYSQL_PWD", "IDENTITY_HEADER", "DATABASE_URL", "PIP_INDEX_URL")
# a secret by its value only: a name like any other, a URL with credentials in it
SECRET_BY_VALUE = {"DATABASE_URL": "postgres://u:{}@db.example.internal/db",
                   "PIP_INDEX_URL": "https://__token__:{}@pkgs.example.internal/simple"}


def _fake(label: str) -> str:
    """A value no file could hold by chance, made at run time (nothing real-looking is committed)."""
    return f"planted-{label}-{secrets.token_hex(10)}"


@pytest.fixture
def planted(monkeypatch) -> dict[str, str]:
    """The planted variables' secret parts by name (the value set is built around it for some)."""
    values = {name: _fake(name.lower()) for name in SECRET_ENV}
    for name, secret in values.items():
        if name == "AZURE_STORAGE_CONNECTION_STRING":
            monkeypatch.setenv(name, f"AccountName=acct;AccountKey={secret}")
        else:
            monkeypatch.setenv(name, SECRET_BY_VALUE.get(name, "{}").format(secret))
    monkeypatch.setenv("NBBATCH_TEST_VISIBLE", "visible-marker")  # proves the notebook really printed its environment
    monkeypatch.setenv("NBBATCH_TEST_URL", "https://pypi.org/simple")  # a URL without credentials stays
    return values


class KeyedLocalBackend(LocalBackend):
    """A backend that legitimately takes credentials as settings (as a cloud backend might), some nested."""

    def __init__(self, access_key: str | None = None, sas_token: str | None = None, options: dict | None = None,
                 mounts: list | None = None, **settings):
        super().__init__(**settings)
        self.access_key, self.sas_token, self.options, self.mounts = access_key, sas_token, options, mounts


def _nested_settings() -> tuple[dict, list[str]]:
    """Backend settings with secrets nested in them (dict in dict, list of dicts, list of strings), and the secrets."""
    fakes = [_fake(f"nested-{i}") for i in range(7)]
    settings = {
        "access_key": fakes[0],
        "options": {"env": {"AZURE_STORAGE_KEY": fakes[1], "PLAIN_SETTING": "kept-plain-setting"},
                    "inner": {"deeper": {"MYSQL_PWD": fakes[2]}, "kept": "kept-inner"},
                    "DATABASE_URL": f"postgres://u:{fakes[3]}@h/db"},
        "mounts": [{"name": "data", "IDENTITY_HEADER": fakes[4]},
                   {"name": "CI_DEPLOY_TOKEN", "value": fakes[5]},  # a Kubernetes-style variable list
                   f"https://__token__:{fakes[6]}@host/simple", "kept-list-entry"],
    }
    return settings, fakes


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.kernel
def test_planted_credentials_land_nowhere(project, planted, monkeypatch, capsys):
    monkeypatch.setitem(backends._REGISTRY, "keyed-local", KeyedLocalBackend)
    nested, nested_secrets = _nested_settings()
    settings_secrets = {"sas_token": _fake("sas-token"), **nested}
    make_notebook(project / "env.ipynb", [
        "import os, subprocess\nprint(dict(os.environ))",
        "print(subprocess.run(['env'], capture_output=True, text=True).stdout)",
        "print(open('/proc/self/environ', 'rb').read().replace(b'\\0', b'\\n').decode(errors='replace'))",
        "import nbbatch\nnbbatch.record(env_names=sorted(os.environ))",
    ])
    make_notebook(project / "fails.ipynb", ["import os\nraise RuntimeError('failing on purpose in ' + os.getcwd())"])
    result = submit({"experiment": "sec", "notebooks": ["env.ipynb", "fails.ipynb"], "env": {"RUN_SETTING": "kept"},
                     "backend": {"name": "keyed-local", **settings_secrets}}, progress=False)
    by_name = {r.notebook: r for r in result.records}
    assert by_name["env.ipynb"].status == "succeeded" and by_name["fails.ipynb"].status == "failed"

    names = set(by_name["env.ipynb"].metrics["env_names"])
    assert {"NBBATCH_TEST_VISIBLE", "NBBATCH_TEST_URL", "RUN_SETTING", "NBBATCH_RUN_ID"} <= names
    assert not names & set(SECRET_ENV), "a credential variable reached the kernel"

    compare = pytest.importorskip("nbbatch.results.compare")
    pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    compare.write_report(compare.collect(project / "results", "sec"), project / "report" / "report.html")
    assert cli.main(["status", "sec", "--json"]) == 0
    assert cli.main(["logs", "sec", by_name["fails.ipynb"].run_id]) == 0
    out, err = capsys.readouterr()

    printed = nbformat.read(project / "results/sec" / by_name["env.ipynb"].run_id / "output.ipynb", as_version=4)
    assert "visible-marker" in str(printed)
    checked = _files(project / "results") + _files(project / ".nbbatch") + _files(project / "report")
    assert any(p.name == "experiments.json" for p in checked) and any(p.suffix == ".html" for p in checked)
    assert sum(p.name in ("output.ipynb", "run.json", "log.txt") for p in checked) == 6
    stored = (project / ".nbbatch" / "experiments.json").read_text()
    for kept in ("kept-plain-setting", "kept-inner", "kept-list-entry"):  # the settings were stored, less their secrets
        assert kept in stored
    for value in [*planted.values(), settings_secrets["sas_token"], *nested_secrets]:
        for path in checked:
            assert value.encode() not in path.read_bytes(), f"{value[:20]}… found in {path.relative_to(project)}"
        assert value not in out + err


def test_a_secret_in_unknown_local_backend_settings_is_refused_without_echoing_it(project):
    make_notebook(project / "nb.ipynb", ["pass"])
    value = _fake("storage-key")
    with pytest.raises(BackendError, match="unknown local backend setting `storage_key`") as caught:
        submit({"experiment": "sec", "notebooks": ["nb.ipynb"], "backend": {"name": "local", "storage_key": value}},
               progress=False)
    assert value not in str(caught.value)
    assert not (project / "results").exists()
    assert all(value.encode() not in p.read_bytes() for p in _files(project))


@pytest.mark.parametrize("name, value", [
    ("MYSQL_PWD", "x"), ("SMTP_PASS", "x"), ("IDENTITY_HEADER", "x"), ("HTTP_AUTHORIZATION", "x"),
    ("DATABASE_URL", "postgres://u:pw@h/db"), ("PIP_INDEX_URL", "https://__token__:abc@host/simple"),
    ("PIP_EXTRA_INDEX_URL", "https://pypi.org/simple https://u:pw@host/simple"),
    ("REPO", "https://ghp_0123456789abcdefghijklmn@github.com/o/r"),
    ("SQL_DSN", "Driver=x;Server=y;Uid=u;Pwd=p"), ("BLOB_URL", "https://a.blob.core.windows.net/c?sv=1&sig=abc"),
    ("STORAGE", "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=abc"), ("HEADER", "Bearer abcdefghijkl"),
])
def test_the_secret_rule_knows_names_and_values(name, value):
    from nbbatch.redact import is_secret

    assert is_secret(name, value)


@pytest.mark.parametrize("name, value", [
    ("PWD", "/home/u"), ("OLDPWD", "/tmp"), ("DATABASE_URL", "postgres://u@h/db"), ("PIP_INDEX_URL", "https://pypi.org/simple"),
    ("REPO", "ssh://git@github.com/o/r"), ("LS_COLORS", "rs=0:di=01;34:ln=01;36"), ("KERAS_BACKEND", "jax"),
    ("IDENTITY_ENDPOINT", "http://localhost:42356/msi/token"), ("AZURE_AUTHORITY_HOST", "https://login.example"),
])
def test_the_secret_rule_leaves_plain_variables(name, value):
    from nbbatch.redact import is_secret

    assert not is_secret(name, value)


def test_stored_backend_settings_lose_secrets_at_any_depth():
    from nbbatch.backends.ray import RayBackend

    settings, fakes = _nested_settings()
    stored = KeyedLocalBackend.storable_settings(settings)
    assert stored == {"options": {"env": {"PLAIN_SETTING": "kept-plain-setting"}, "inner": {"deeper": {},
                                                                                              "kept": "kept-inner"}},
                      "mounts": [{"name": "data"}, "kept-list-entry"]}
    secret = _fake("ray-env")
    ray_stored = RayBackend.storable_settings({"env": {"AZURE_STORAGE_KEY": secret, "KERAS_BACKEND": "jax"},
                                               "runtime_env": {"env_vars": {"HF_TOKEN": secret}, "pip": ["x"]}})
    assert ray_stored == {"env": {"KERAS_BACKEND": "jax"}, "runtime_env": {"env_vars": {}, "pip": ["x"]}}


def test_a_bad_nested_setting_is_refused_without_echoing_its_secrets():
    from nbbatch.backends.ray import RayBackend

    value = _fake("nested-key")
    with pytest.raises(BackendError, match="backend setting `resources` must be a mapping") as caught:
        RayBackend(resources=[{"AZURE_STORAGE_KEY": value}])
    assert value not in str(caught.value) and "a value" in str(caught.value)


# --- servers started by the tests ----------------------------------------------------------------

@pytest.mark.azure
def test_fake_azure_files_server_listens_on_loopback_and_refuses_unsigned_requests():
    from fakes.azure_files_server import FakeAzureFiles

    with FakeAzureFiles() as server:
        assert server._server.server_address[0] == "127.0.0.1"
        server.create_share("s")
        request = urllib.request.Request(f"{server.endpoint}/s?restype=share", headers={"x-ms-version": "2025-01-05"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 403


SERVER_CALLS = {"bind", "HTTPServer", "ThreadingHTTPServer", "TCPServer", "ThreadingTCPServer", "create_server"}


def _strings(node: ast.AST) -> list[str]:
    """The literal text of the string and f-string elements of a list/tuple (f-string fields as {})."""
    out = []
    for element in getattr(node, "elts", []):
        if isinstance(element, ast.Constant) and isinstance(element.value, str):
            out.append(element.value)
        elif isinstance(element, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in element.values))
    return out


def test_servers_started_by_tests_bind_loopback_and_require_a_token():
    """Every socket/HTTP server a test binds names 127.0.0.1, and every Jupyter server it launches is given
    --ServerApp.ip=127.0.0.1 and a token (found by reading the tests' own source)."""
    binds, jupyter_launches = 0, 0
    for path in [*TESTS.glob("*.py"), *TESTS.glob("fakes/*.py")]:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in SERVER_CALLS and node.args and isinstance(node.args[0], ast.Tuple):
                    host = node.args[0].elts[0]
                    assert isinstance(host, ast.Constant) and host.value in ("127.0.0.1", "localhost"), \
                        f"{path.name}:{node.lineno} binds {ast.unparse(host)}"
                    binds += 1
            if isinstance(node, ast.List):
                args = _strings(node)
                if any(a in ("jupyterlab", "jupyter_server", "notebook", "jupyter-lab") for a in args) \
                        and any(a.startswith("--ServerApp") for a in args):
                    jupyter_launches += 1
                    assert "--ServerApp.ip=127.0.0.1" in args, f"{path.name}:{node.lineno}"
                    tokens = [a for a in args if a.startswith(("--IdentityProvider.token=", "--ServerApp.token="))]
                    assert tokens and all(t.split("=", 1)[1] not in ("", "''", '""') for t in tokens), \
                        f"{path.name}:{node.lineno} starts Jupyter without a token"
                    assert not any("disable_check_xsrf" in a or "allow_origin='*'" in a for a in args)
    assert binds >= 1 and jupyter_launches >= 1
