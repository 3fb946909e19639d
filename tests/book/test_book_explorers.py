"""The built book's explorers respond in Chromium with no kernel and no network (issue 18).

Opens each page of EXPLORERS from the built book over file:// with every other request blocked, waits for the
explorer's chart (minioffload.course.explore) to draw, then moves each of its sliders, menus and checkboxes and
checks that the drawn figure (its SVG) changes; a page without a working explorer fails, and so does a console
error or uncaught exception from the explorers' code (the Vega scripts, the chart's loader). Errors the rest of the
page raises (the theme, the widget manager) are another test's business. The footprint explorer's numbers are also
read back and compared with memory.footprint.

Build the book first (`make book`, or `make book-stored` after nbval); MINIOFFLOAD_BOOK_HTML names another build
folder (default book/_build/html). Debian's Chromium only (/usr/bin/chromium; never a browser Playwright downloads):
without it these tests skip, unless MINIOFFLOAD_REQUIRE_BROWSER=1 (as in CI), where a missing browser is a failure.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from minioffload.predict.memory import footprint

ROOT = Path(__file__).resolve().parents[2]
HTML = Path(os.environ.get("MINIOFFLOAD_BOOK_HTML", ROOT / "book" / "_build" / "html"))
CHROMIUM = "/usr/bin/chromium"

# (page under the build folder, explorer: the Chart's name) -- the one list to edit when a chapter gains one
EXPLORERS = [
    ("chapters/01_memory_wall.html", "footprint"),
    ("chapters/02_moving_bytes.html", "timeline"),
    ("chapters/04_optimizer_offload.html", "timeline"),
    ("chapters/08_streaming.html", "streaming"),
    ("chapters/09_planning.html", "plan"),
    ("chapters/appendix_hiding.html", "hiding"),
]

pytestmark = pytest.mark.book_html

if not Path(CHROMIUM).exists():
    if os.environ.get("MINIOFFLOAD_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")

OURS = ("_static/vega/", "vega", "Vega", "minioffload", "explorer")  # what marks an error as the explorers'
DRAWN = 30_000  # ms for the Vega scripts to load and draw (two busy cores)
REDRAWN = 10_000  # ms for a chart to redraw after a control changes


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield chromium
        chromium.close()


def open_page(browser, relative: str):
    """The page over file://, every request outside the build folder aborted and recorded; the explorers' errors
    kept (console errors and uncaught exceptions that name them or come from their scripts)."""
    path = HTML / relative
    assert path.exists(), f"{path} is missing: build the book first (`make book`) or set MINIOFFLOAD_BOOK_HTML"
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    blocked, errors = [], []
    root = HTML.resolve().as_uri()

    def only_the_book(route) -> None:
        url = route.request.url
        if url.startswith((root + "/", "data:", "blob:")):
            route.continue_()
        else:
            blocked.append(url)
            route.abort()

    page.route("**/*", only_the_book)
    def ours(text: str, where: str) -> None:
        inside = where.replace(root, "")  # the build folder's own path may hold a mark (a clone in /tmp/minioffload-x)
        if any(mark in f"{text} {inside}" for mark in OURS):
            errors.append(f"{text} ({where})")

    page.on("console", lambda m: ours(m.text, m.location.get("url", "")) if m.type == "error" else None)
    page.on("pageerror", lambda e: ours(str(e), e.stack or ""))
    page.goto(path.resolve().as_uri())
    return page, blocked, errors


def wait_drawn(page, name: str):
    """The explorer `name` on the page, once drawn; fails if it is missing or could not load its scripts."""
    selector = f'.minioffload-explorer[data-explorer="{name}"]'
    if page.locator(selector).count() == 0:  # the page has loaded: every explorer's script has put its box there
        pytest.fail(f"{page.url} has no {name} explorer (explorers there: "
                    f"{page.eval_on_selector_all('.minioffload-explorer', 'bs => bs.map(b => b.dataset.explorer)')})")
    try:
        page.wait_for_selector(f"{selector}[data-ready]", state="attached", timeout=DRAWN)
    except sync_api.TimeoutError:
        pytest.fail(f"no {name} explorer drew on {page.url} within {DRAWN / 1e3:.0f} s (found "
                    f"{page.locator('.minioffload-explorer').count()} explorer(s) in all)")
    box = page.locator(selector).first
    assert box.get_attribute("data-ready") == "true", f"the {name} explorer failed: {box.inner_text()[:300]}"
    box.scroll_into_view_if_needed()
    return box


def figure(box) -> str:
    return box.evaluate("b => [...b.querySelectorAll('svg')].map(s => s.outerHTML).join('')")


def change(control, attempt: int) -> None:
    """Move one bound control: a range to its min or max, a menu to another option, a checkbox over."""
    kind = control.evaluate("e => e.tagName.toLowerCase() + ':' + (e.type || '')")
    if kind == "select:select-one":
        options = control.evaluate("e => [...e.options].map(o => o.value)")
        current = control.input_value()
        others = [o for o in options if o != current]
        control.select_option(others[attempt % len(others)])
    elif kind == "input:range":
        control.evaluate("(e, a) => { const v = Number(e.value), lo = Number(e.min), hi = Number(e.max);"
                         " e.value = String([lo, hi, (lo + hi) / 2][a % 3] === v ? (a % 3 ? lo : hi) : [lo, hi,"
                         " (lo + hi) / 2][a % 3]); e.dispatchEvent(new Event('input', {bubbles: true})); }", attempt)
    elif kind in ("input:checkbox", "input:radio"):
        control.click()
    else:
        raise AssertionError(f"an explorer control of a kind this test does not move: {kind}")


@pytest.mark.parametrize(("relative", "name"), EXPLORERS, ids=[f"{p}:{n}" for p, n in EXPLORERS])
def test_every_control_of_the_explorer_redraws_it_offline(browser, relative, name):
    page, blocked, errors = open_page(browser, relative)
    box = wait_drawn(page, name)
    controls = box.locator(".vega-bindings input, .vega-bindings select")
    assert controls.count() >= 1, f"the {name} explorer on {relative} has no slider, menu or checkbox"
    unchanged = []
    for i in range(controls.count()):
        control = controls.nth(i)
        before = figure(box)
        for attempt in range(3):  # a menu's next option may draw the same figure (adam and adamw hold the same)
            change(control, attempt)
            try:
                page.wait_for_function("([b, before]) => [...b.querySelectorAll('svg')].map(s => s.outerHTML)"
                                       ".join('') !== before", arg=[box.element_handle(), before], timeout=REDRAWN)
                break
            except sync_api.TimeoutError:
                continue
        else:
            unchanged.append(control.evaluate("e => e.name || e.parentElement.textContent"))
    page.screenshot(path=str(HTML.parent / f"explorer_{Path(relative).stem}_{name}.png"), full_page=False)
    page.close()
    assert not unchanged, f"moving {unchanged} did not change the {name} explorer's figure on {relative}"
    assert not blocked, f"{relative} asked the network for {blocked}"
    assert not errors, f"the explorers on {relative} logged errors: {errors}"


def test_the_footprint_explorer_draws_the_calculators_numbers(browser):
    relative = next((p for p, n in EXPLORERS if n == "footprint"), None)
    if relative is None:
        pytest.skip("no page in EXPLORERS carries the footprint explorer")
    page, _, _ = open_page(browser, relative)
    box = wait_drawn(page, "footprint")
    checked = []
    for log10_params, precision, placement in ((10.0, "fp32", "device"), (11.0, "mixed_bf16", "optimizer_cpu")):
        box.locator("select[name=precision]").select_option(precision)
        box.locator("select[name=placement]").select_option(placement)
        box.locator("select[name=optimizer]").select_option("adam")
        box.locator("input[name=log10_params]").evaluate(
            "(e, v) => { e.value = String(v); e.dispatchEvent(new Event('input', {bubbles: true})); }", log10_params)
        device_gb = footprint(precision, "adam", placement).bytes(10 ** log10_params, "device") / 1e9
        expected = f"device {device_gb:,.0f} GB"
        page.wait_for_function("([b, t]) => b.textContent.includes(t)", arg=[box.element_handle(), expected],
                               timeout=REDRAWN)
        text = box.evaluate("b => [...b.querySelectorAll('svg text')].map(t => t.textContent).join(' | ')")
        checked.append(re.search(r"[^|]*params: device[^|]*", text).group(0).strip())
    page.close()
    assert len(checked) == 2, checked
