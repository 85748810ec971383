"""report.html (and the diff page) opened in headless Chromium with Playwright: plots load, links resolve.

Screenshots go to ``test-artifacts/``. Skipped without Debian's ``/usr/bin/chromium`` or Playwright
(``pip install playwright``; the browser is the system's, never ``playwright install``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import unquote

import pytest
from support.notebooks import make_run
from support.nvml import FakeNvml

from nbbatch.execute.telemetry import TELEMETRY_FILE, GpuSampler
from nbbatch.results import compare, diff
from nbbatch.store.runjson import RunRecord

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's chromium at {CHROMIUM}"),
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
        )
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two frameworks × three learning rates, one run failing part-way; GPU series from a stand-in NVML."""
    root = tmp_path_factory.mktemp("report")
    share, notebooks = root / "share", root / "notebooks"
    folders = [make_run(share, "lr-sweep", fw, {"LR": lr, "EPOCHS": 2}, notebooks)
               for fw in ("pytorch", "keras") for lr in (0.003, 0.03, 0.3)]
    folders.append(make_run(share, "lr-sweep", "keras", {"LR": 0.1, "EPOCHS": 2, "FAIL": True}, notebooks))
    monkeypatch = pytest.MonkeyPatch()
    try:
        for gpu, folder in enumerate(folders[:2]):
            monkeypatch.setattr("nbbatch.execute.telemetry.pynvml", FakeNvml(gpus=2))
            with GpuSampler([gpu], interval_s=0.1) as sampler:
                time.sleep(0.6)
            sampler.write_series(folder / TELEMETRY_FILE)
            record = RunRecord.from_json((folder / "run.json").read_bytes())
            record.telemetry, record.gpu_ids = sampler.summary(), [gpu]
            (folder / "run.json").write_bytes(record.to_json())
    finally:
        monkeypatch.undo()
    return share


def test_report_plots_render_and_links_resolve(browser, share: Path, tmp_path: Path) -> None:
    frame = compare.collect(share, "lr-sweep")
    assert frame["telemetry.samples"].notna().sum() == 2
    report = compare.write_report(frame, tmp_path / "mail" / "report.html", title="LR sweep")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(report.as_uri())
    page.wait_for_load_state("load")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)

    images = page.eval_on_selector_all(
        "img", "els => els.map(e => ({w: e.naturalWidth, h: e.naturalHeight, src: e.src.slice(0, 22), "
               "complete: e.complete, alt: e.alt}))")
    assert len(images) == 4, images  # accuracy by framework, accuracy vs. time, accuracy vs. LR, GPU telemetry
    for image in images:
        assert image["complete"] and image["w"] > 0 and image["h"] > 0, image
        assert image["src"] == "data:image/png;base64,"  # embedded: the file can be mailed
    assert page.title() == "LR sweep"
    assert page.locator("table.runs tbody tr").count() == 7
    assert page.locator("table.failures").inner_text().count("RuntimeError") == 1

    hrefs = page.eval_on_selector_all("table.runs a", "els => els.map(e => e.getAttribute('href'))")
    assert len(hrefs) == 7
    for href in hrefs:
        assert not href.startswith(("/", "file:")), href  # relative to the report
        assert (report.parent / unquote(href)).resolve().is_file(), href
    page.close()


def test_diff_page_renders(browser, share: Path, tmp_path: Path) -> None:
    runs = sorted(p.name for p in (share / "lr-sweep").iterdir())
    good = next(r for r in runs if r.startswith("pytorch"))
    failed = next(p.parent.name for p in (share / "lr-sweep").glob("*/run.json")
                  if RunRecord.from_json(p.read_bytes()).status == "failed")
    result = diff.diff_runs(f"lr-sweep/{good}", f"lr-sweep/{failed}", share=share)
    path = result.write_html(tmp_path / "diff.html")
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(path.as_uri())
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "diff.png"), full_page=True)
    changed = page.locator("table.parameters tr.changed td:first-child").all_inner_texts()
    assert "FAIL" in changed and "LR" in changed
    assert page.locator("section.cell.modified").count() >= 2
    assert "RuntimeError: diverged: loss is nan" in page.inner_text("body")
    page.close()
