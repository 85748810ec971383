"""The Jupyter front in a real browser: JupyterLab + Debian's Chromium driven by Playwright.

The test copies the control notebook (notebooks/ExploringBatchAI.ipynb) into a temporary project
and injects parameters: two runs of the PyTorch notebook on digits (300 images, one epoch, two
learning rates, one run at a time) in this checkout's ``nbbatch-pytorch`` kernel — or, when that
environment is not built, of a tiny notebook in the ``python3`` kernel. It starts JupyterLab on
127.0.0.1 with a token and Jupyter config/data/runtime/settings folders inside the temporary
folder, runs every cell from the browser and checks that the widgets render: the cluster form, the
progress bar, the log, and a jobs table that lists every run and reaches ``succeeded`` without a
page reload; no form label is cut and no jobs table is wider than the notebook. A second notebook
with the same calls checks the table's cancel buttons. Screenshots are kept in ``test-artifacts/``.
Playwright only drives the system's Chromium; it never downloads one.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]
# generous waits: they only run out when something is broken, or on a machine shared with heavy jobs
WAIT_MS = 150_000

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CONTROL_NOTEBOOK = REPO / "notebooks" / "ExploringBatchAI.ipynb"
ARTIFACTS = REPO / "test-artifacts"
FRAMEWORK, FRAMEWORK_NOTEBOOK = "pytorch", "PyTorch_CIFAR.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]

TINY_PARAMETERS = """\
EPOCHS = 1
LR = 0.01
BATCHSIZE = 64
MAX_SAMPLES = 300
DATASET = "digits"
SEED = 0
SECONDS_PER_EPOCH = 2.0
"""

TINY_BODY = """\
import time
import nbbatch
for epoch in range(EPOCHS):
    print(f"epoch {epoch + 1}/{EPOCHS}: training on {MAX_SAMPLES} {DATASET} images, lr={LR}", flush=True)
    time.sleep(SECONDS_PER_EPOCH)
nbbatch.record(accuracy=0.9 - abs(LR - 0.05), train_seconds=SECONDS_PER_EPOCH * EPOCHS)
"""


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    for module in ("jupyterlab", "playwright", "ipywidgets"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install jupyterlab ipywidgets playwright)"
    if not CONTROL_NOTEBOOK.exists():
        return f"{CONTROL_NOTEBOOK.name} is missing"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(TINY_PARAMETERS, metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(TINY_BODY)]
    nbformat.write(nb, path)


def _framework_ready(name: str) -> bool:
    """Whether this checkout has ``name``'s environment built (`nbbatch envs create <name>`)."""
    from nbbatch.execute.envs import env_status
    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    try:
        return env_status(get_framework(name, Project(REPO)), Project(REPO)).state == "ready"
    except Exception:  # noqa: BLE001 - no such framework here: not ready
        return False


def _control_notebook(path: Path, parameters: dict[str, Any]) -> None:
    """The real control notebook with papermill's injected-parameters cell (not executed)."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(CONTROL_NOTEBOOK))
    nb = parameterize_notebook(nb, parameters, kernel_name="python3")
    nbformat.write(nb, path)


CANCEL_CELLS = [
    "from nbbatch import Experiment\n"
    "from nbbatch.ui.widgets import print_jobs_summary, setup_cluster, submit_all",
    "experiment = Experiment.from_dict({'experiment': 'cancelling', 'notebooks': ['Tiny.ipynb'],\n"
    "                                   'sweep': {'grid': {'LR': [0.01, 0.1]}}, 'parameters': {'EPOCHS': 60}})\n"
    "submission = submit_all(experiment, setup_cluster('local', max_parallel=1))",
    "summary = print_jobs_summary(submission)",
]


def _cancel_notebook(path: Path) -> None:
    """The same calls as the control notebook, with long runs to cancel from the table's buttons."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in CANCEL_CELLS]
    nbformat.write(nb, path)


def _lab_settings(folder: Path) -> None:
    """User settings for this server only: every cell in the DOM, no news or update checks."""
    settings = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                            "checkForUpdates": False},
    }
    for name, value in settings.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(value))


def _wait_for_server(url: str, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"JupyterLab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not up yet
            time.sleep(0.3)
    raise AssertionError(f"JupyterLab did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    """A JupyterLab server on 127.0.0.1 serving a temporary project with the control notebook."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    tmp_path = tmp_path_factory.mktemp("lab")
    root = tmp_path / "project"
    root.mkdir()
    (root / ".nbbatch").mkdir()  # marks the project root
    _tiny_notebook(root / "Tiny.ipynb")
    # the control notebook as shipped (one framework, digits, 300 images, 1 epoch) with two learning rates,
    # one run at a time; without the pytorch env, a tiny notebook in the python3 kernel stands in
    framework = FRAMEWORK if _framework_ready(FRAMEWORK) else None
    parameters: dict[str, Any] = {"EXPERIMENT": "browser", "LRS": [0.01, 0.1], "MAX_PARALLEL": 1}
    if framework:
        notebook = REPO / "notebooks" / f"{FRAMEWORK_NOTEBOOK}"
        (root / "notebooks").mkdir()
        shutil.copy(notebook, root / "notebooks" / notebook.name)
        parameters.update(FRAMEWORKS=[framework], EPOCHS=1, MAX_SAMPLES=300)  # the widgets, not the accuracy
    else:
        warnings.warn(f"the {FRAMEWORK} environment is not built: the browser test runs a tiny notebook instead",
                      stacklevel=1)
        parameters.update(FRAMEWORKS=[], NOTEBOOKS=["Tiny.ipynb"], EPOCHS=3)
    _control_notebook(root / "ExploringBatchAI.ipynb", parameters)
    _cancel_notebook(root / "Cancel.ipynb")
    jupyter = tmp_path / "jupyter"
    _lab_settings(jupyter / "lab-settings")
    token = secrets.token_hex(16)
    port = _free_port()
    env = dict(os.environ)
    env.update({
        "JUPYTER_CONFIG_DIR": str(jupyter / "config"), "JUPYTER_DATA_DIR": str(jupyter / "data"),
        "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(jupyter / "lab-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(jupyter / "workspaces"), "IPYTHONDIR": str(jupyter / "ipython"),
        "JUPYTER_PATH": os.pathsep.join(p for p in (str(REPO / ".nbbatch" / "jupyter"), env.get("JUPYTER_PATH")) if p),
        # the project is the temporary folder; its frameworks, environments and kernels are this checkout's
        "NBBATCH_FRAMEWORKS_DIR": str(REPO / "frameworks"), "NBBATCH_ENVS_DIR": str(REPO / ".nbbatch" / "envs"),
        "NBBATCH_JUPYTER_DIR": str(REPO / ".nbbatch" / "jupyter"),
        "NBBATCH_PROJECT": str(root), "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    })
    env.pop("NBBATCH_WIDGETS", None)
    log = tmp_path / "jupyterlab.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
             "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly", "--ServerApp.port_retries=0",
             *(["--allow-root"] if os.geteuid() == 0 else [])],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(f"{base}/api/status?token={token}", process, log)
        yield {"base": base, "token": token, "root": root, "log": log, "label": framework or "Tiny.ipynb",
               "epochs": parameters["EPOCHS"]}
    finally:
        _stop(process)
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(log, ARTIFACTS / "jupyterlab.log")


KERNEL_IDLE = ("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
               " const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;"
               " return !!k && k.status === 'idle' && w.content && w.content.widgets.length > 0; }")


@contextlib.contextmanager
def _browser_page(lab: dict[str, Any], notebook: str) -> Iterator[Any]:
    """A Chromium page showing ``notebook`` in JupyterLab, its kernel started and idle."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(WAIT_MS)
            workspace = Path(notebook).stem.lower()  # a fresh workspace: no tab of another test restored
            page.goto(f"{lab['base']}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={lab['token']}")
            page.wait_for_function(KERNEL_IDLE, timeout=WAIT_MS)
            yield page
        finally:
            browser.close()


# how far each jobs table reaches past its own scrolling box (px), and past the notebook's visible area (cut there)
TABLE_OVERFLOW = """tables => tables.map(t => {
    const box = t.parentElement, notebook = t.closest('.jp-Notebook').getBoundingClientRect();
    return [box.scrollWidth - box.clientWidth, Math.ceil(box.getBoundingClientRect().right - notebook.right)];
})"""


def _run_all(page: Any) -> None:
    # not awaited: the command's promise resolves only when every cell has run
    page.evaluate("() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _statuses(table: Any) -> list[str]:
    return table.locator("tr[data-run]").evaluate_all("rows => rows.map(r => r.dataset.status)")


def test_control_notebook_widgets_render_and_refresh(lab: dict[str, Any]) -> None:
    started = time.monotonic()
    ARTIFACTS.mkdir(exist_ok=True)
    seen: list[list[str]] = []  # the jobs table's statuses, each time they changed
    with _browser_page(lab, "ExploringBatchAI.ipynb") as page:
        marker = page.evaluate("() => (window.__nbbatch_marker = Math.random())")
        _run_all(page)
        form = page.locator(".nbbatch-cluster")
        form.wait_for(timeout=WAIT_MS)
        assert "runs per GPU" in form.inner_text() and "max parallel runs" in form.inner_text()
        page.locator(".nbbatch-submission .widget-hprogress .progress-bar").first.wait_for(timeout=WAIT_MS)
        table = page.locator(".nbbatch-jobs-table").first
        table.wait_for(timeout=WAIT_MS)
        cancel_seen = False
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            statuses = _statuses(table)
            if not seen or seen[-1] != statuses:
                seen.append(statuses)
            if statuses and any(s in ("queued", "running") for s in statuses):
                cancel_seen = cancel_seen or page.locator(".nbbatch-jobs-summary button",
                                                          has_text="Cancel all").first.is_visible()
            if statuses == ["succeeded", "succeeded"]:
                break
            page.wait_for_timeout(200)
        assert page.evaluate("() => window.__nbbatch_marker") == marker, "the page was reloaded"
        assert seen and seen[-1] == ["succeeded", "succeeded"], f"the jobs table never reached succeeded: {seen}"
        assert any(s in ("queued", "running") for statuses in seen for s in statuses), \
            f"the table was never seen before the runs ended (no live refresh observed): {seen}"
        assert cancel_seen, "no Cancel all button while runs were active"
        summary = page.locator(".nbbatch-jobs[data-state='final']").first
        summary.wait_for(timeout=WAIT_MS)
        text = summary.inner_text()
        assert lab["label"] in text and "LR=0.01" in text and "LR=0.1" in text and "accuracy=" in text
        links = summary.locator("a", has_text="open")
        assert links.count() == 2
        href = links.first.get_attribute("href") or ""
        assert href.startswith("/lab/tree/results/browser/") and href.endswith("/output.ipynb"), href
        page.wait_for_function("() => [...document.querySelectorAll('.nbbatch-job-log')]"
                               f".some(e => e.innerText.includes('epoch {lab['epochs']}/{lab['epochs']}')"
                               " && e.innerText.includes('succeeded'))",
                               timeout=WAIT_MS)
        page.wait_for_function(KERNEL_IDLE, timeout=WAIT_MS)
        assert page.locator(".jp-Notebook .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                            has_text="Traceback").count() == 0
        cut = form.locator(".widget-label").evaluate_all(
            "labels => labels.filter(l => l.scrollWidth > l.clientWidth).map(l => l.textContent)")
        # the file browser open: at 1280 px a jobs table may scroll inside its box but never reaches past the
        # notebook's edge (where JupyterLab cuts it); at 1400 px (where a user saw its last column cut) it fits
        narrow = page.locator(".nbbatch-jobs-table").evaluate_all(TABLE_OVERFLOW)
        page.set_viewport_size({"width": 1400, "height": 900})
        page.wait_for_timeout(500)
        wide = page.locator(".nbbatch-jobs-table").evaluate_all(TABLE_OVERFLOW)
        page.locator(".nbbatch-jobs-summary").first.evaluate("e => e.scrollIntoView({block: 'center'})")
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-1400px.png"))
        assert not cut, f"the form cuts these labels: {cut}"
        assert narrow and all(past <= 0 for _scrolled, past in narrow), f"a jobs table is cut at 1280 px: {narrow}"
        assert wide and all(max(o) <= 0 for o in wide), f"a jobs table does not fit at 1400 px: {wide}"
        page.set_viewport_size({"width": 1280, "height": 900})
        form.screenshot(path=str(ARTIFACTS / "jupyterlab-cluster-form.png"))
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
        page.set_viewport_size({"width": 1200, "height": 1000})
        page.locator(".nbbatch-submission").first.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(500)
        page.screenshot(path=str(ARTIFACTS / "jupyterlab-widgets.png"))
        page.locator(".nbbatch-jobs-summary").first.screenshot(path=str(ARTIFACTS / "jupyterlab-jobs-table.png"))
    records = [json.loads(p.read_text()) for p in (lab["root"] / "results" / "browser").glob("*/run.json")]
    assert sorted(r["status"] for r in records) == ["succeeded", "succeeded"]
    (ARTIFACTS / "jupyterlab-statuses.json").write_text(
        json.dumps({"seen": seen, "seconds": round(time.monotonic() - started, 1)}, indent=1))


def test_cancel_buttons_stop_runs(lab: dict[str, Any]) -> None:
    with _browser_page(lab, "Cancel.ipynb") as page:
        _run_all(page)
        table = page.locator(".nbbatch-jobs-table").first
        table.wait_for(timeout=WAIT_MS)
        page.wait_for_function(KERNEL_IDLE, timeout=WAIT_MS)  # the buttons act while no cell runs
        running = table.locator("tr[data-status='running']")
        running.first.wait_for(timeout=WAIT_MS)
        first = running.first.get_attribute("data-run")
        page.locator(".nbbatch-jobs-summary button", has_text=f"Cancel {first}").click()
        table.locator(f"tr[data-run='{first}'][data-status='cancelled']").wait_for(timeout=WAIT_MS)
        page.locator(".nbbatch-jobs-summary button", has_text="Cancel all").click()
        page.locator(".nbbatch-jobs[data-state='final']").first.wait_for(timeout=WAIT_MS)
        assert _statuses(table) == ["cancelled", "cancelled"]
        assert not page.locator(".nbbatch-jobs-summary button", has_text="Cancel all").is_visible()
        page.locator(".nbbatch-jobs-summary").first.screenshot(path=str(ARTIFACTS / "jupyterlab-cancelled.png"))
    records = [json.loads(p.read_text()) for p in (lab["root"] / "results" / "cancelling").glob("*/run.json")]
    assert sorted(r["status"] for r in records) == ["cancelled", "cancelled"]
