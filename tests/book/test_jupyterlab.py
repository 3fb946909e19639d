"""A learner's path through JupyterLab: open Chapter 1 and Lab 1, Run All, read the verdicts.

JupyterLab is served on 127.0.0.1 and driven by Playwright with Debian's Chromium
(/usr/bin/chromium; never a browser Playwright downloads). Without Chromium these tests skip, unless
MINIOFFLOAD_REQUIRE_BROWSER=1 (as in CI), where a missing browser is a failure.
Screenshots go to .cache/browser/ for a person to look at.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / ".cache" / "browser"

pytestmark = [pytest.mark.browser, pytest.mark.slow]

if not Path(CHROMIUM).exists():
    if os.environ.get("MINIOFFLOAD_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a scratch copy of the notebooks (running them must not touch the repo)."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "book" / "chapters" / "01_memory_wall.ipynb", work)
    shutil.copy(ROOT / "exercises" / "lab01_memory.ipynb", work)
    shutil.copy(ROOT / "book" / "chapters" / "02_moving_bytes.ipynb", work)
    # JupyterLab 4 renders only the cells in view; render them all so every output is in the page.
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    news = work / "settings" / "@jupyterlab" / "apputils-extension"  # no "get notified of news?" popup
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = free_port(), secrets.token_hex(16)
    argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            f"--IdentityProvider.token={token}", f"--notebook-dir={work}",
            f"--LabApp.user_settings_dir={work / 'settings'}", f"--LabApp.workspaces_dir={work / 'ws'}",
            "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    log = open(work / "server.log", "w")  # noqa: SIM115  (closed below)
    # a reader's kernel: not the strict sim the unit tests use (chapter 2 plants a missing wait on purpose)
    env = {k: v for k, v in os.environ.items() if k != "MINIOFFLOAD_SIM_STRICT"}
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(
                    f"JupyterLab did not start:\n{(work / 'server.log').read_text()[-3000:]}") from None
            time.sleep(0.5)
    yield base, token
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield chromium
        chromium.close()


def run_all(browser, lab, notebook: str, last_line: str | re.Pattern) -> tuple[list[str], object]:
    """Open `notebook`, wait for an idle kernel, Run All, wait for `last_line`; return output lines."""
    base, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # a workspace of its own, so tabs a previous test opened are not restored here
    page.goto(f"{base}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?reset&token={token}")
    # the kernel is up: the status bar reads "Python 3 (ipykernel) | Idle"
    page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\|\s*Idle")).first.wait_for(timeout=90_000)
    page.locator(".jp-Notebook").first.click()  # focus the notebook, not the file browser
    page.get_by_role("menuitem", name="Run").first.click()
    page.get_by_text("Run All Cells", exact=True).click()
    page.locator(".jp-OutputArea-output", has_text=last_line).first.wait_for(timeout=180_000)
    outputs = page.locator(".jp-OutputArea-output pre").all_inner_texts()
    lines = [line for text in outputs for line in text.splitlines()]
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{Path(notebook).stem}.png"))
    return lines, page


def assert_redraws(page, change) -> None:
    """`change()` a control of the first explorer on the page (a Vega-Lite chart, minioffload.course.explore, drawn
    by JupyterLab's own Vega renderer, on a canvas): its figure must be drawn again (different pixels)."""
    chart = page.locator(".jp-RenderedVegaLite .vega-embed").first
    chart.scroll_into_view_if_needed()
    chart.locator("canvas.marks").first.wait_for(timeout=30_000)
    pixels = "c => c.querySelector('canvas.marks').toDataURL()"
    before = chart.evaluate(pixels)
    change(chart)
    page.wait_for_function(
        "before => { const c = document.querySelector('.jp-RenderedVegaLite .vega-embed canvas.marks');"
        " return c !== null && c.toDataURL() !== before; }", arg=before, timeout=30_000)


def task_count(notebook: Path) -> int:
    """The check cells of a lab: one `check.task("N.M", ...)` call per graded task."""
    return len(set(re.findall(r'check\.task\(\\"(\d+\.\d+)', notebook.read_text())))


def test_chapter_one_runs_in_jupyterlab_and_every_check_passes(browser, lab):
    lines, page = run_all(browser, lab, "01_memory_wall.ipynb", "PASS torch Adam")
    verdicts = [line for line in lines if line.startswith(VERDICTS)]
    # a verdict on a time measured here says "(timed)": with Chromium beside it, it may miss (nbval_sanitize.cfg)
    checks = [v for v in verdicts if "(timed)" not in v]
    assert len(checks) >= 7 and all(v.startswith(("PASS ", "MET ")) for v in checks), [
        v for v in checks if not v.startswith(("PASS ", "MET "))]
    assert page.locator('[data-mime-type="application/vnd.jupyter.error"]').count() == 0, "a cell raised"
    # the explorer is live in JupyterLab too: changing the placement redraws its figure
    assert_redraws(page, lambda chart: chart.locator("select[name=placement]").select_option("optimizer_cpu"))
    page.screenshot(path=str(SHOTS / "01_memory_wall_widget.png"))
    page.close()


def test_lab_one_student_copy_says_todo_for_every_task(browser, lab):
    tasks = task_count(ROOT / "exercises" / "lab01_memory.ipynb")
    lines, page = run_all(browser, lab, "lab01_memory.ipynb", f"TODO Task 1.{tasks}")
    verdicts = [line for line in lines if line.split(" ")[0] in ("PASS", "FAIL", "TODO")]
    assert verdicts and all(v.startswith("TODO Task 1.") for v in verdicts), verdicts
    assert len(verdicts) == tasks >= 4
    page.close()


VERDICTS = ("PASS ", "FAIL ", "MET ", "MISSED")  # check.expect's and check.target's lines


# Chapter 2's checks that time copies and pipelines ("(timed)" in their lines): with Chromium and the server on the
# same two cores they can miss, which this UI test is not about.
def test_chapter_two_runs_in_jupyterlab_and_its_timeline_explorer_redraws(browser, lab):
    # the last check of the chapter, passed or not
    lines, page = run_all(browser, lab, "02_moving_bytes.ipynb",
                          re.compile(r"(PASS|FAIL)( \(timed\))? the sim keeps its link model"))
    verdicts = [line for line in lines if line.startswith(VERDICTS)]
    assert len(verdicts) >= 11, verdicts
    timed = [v for v in verdicts if "(timed)" in v]
    assert len(timed) >= 3, timed
    untimed = [v for v in verdicts if v not in timed]
    assert all(v.startswith(("PASS ", "MET ")) for v in untimed), [
        v for v in untimed if not v.startswith(("PASS ", "MET "))]
    assert page.locator('[data-mime-type="application/vnd.jupyter.error"]').count() == 0, "a cell raised"
    # untick a lane in the explorer: its figure is drawn again without that lane
    assert_redraws(page, lambda chart: chart.locator(".vega-bindings input[type=checkbox]").first.uncheck())
    page.screenshot(path=str(SHOTS / "02_moving_bytes_widget.png"))
    page.close()
