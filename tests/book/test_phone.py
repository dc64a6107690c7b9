"""The built book read on a phone (400 px) and on a laptop (1280 px), in headless Chromium.

Every page of the site is loaded at both widths (offline, served from 127.0.0.1) and fails
when:

- tapping ☰ does not show the table of contents, or tapping Contents does not show the
  page's sections (at 1280 px both are shown from the start, and ☰ hides and shows the table
  of contents again);
- an element other than a scroll container (overflow-x: auto or scroll) is wider than the
  viewport, or the page scrolls sideways;
- a display equation's number is out of view, or a formula (display or inline) is cut where
  no scrolling can bring it into view;
- a line of a notebook's printed output is wrapped;
- a figure is narrower than 90 % of the text column at 400 px;
- a word in a table cell is broken, a table caption leaves the view when its table scrolls,
  or the arrow of Previous / Next is cut; a caption's contrast is under 7:1;
- the browser console reports an error (a script error, console.error, a failed load).

The checks that run inside the page are in layout_checks.js. The browser is driven over the
DevTools protocol (cdp.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from cdp import Browser

HERE = Path(__file__).resolve().parent
CHECKS = (HERE / "layout_checks.js").read_text()
WIDTHS = {"phone": (400, 900, True), "laptop": (1280, 900, False)}
# Sphinx's own pages list the site, not content; the search page needs its index script only.
SKIPPED = {"genindex.html", "search.html"}
FIGURE_SHARE = 0.9
REDIRECT = re.compile(r"<meta[^>]+http-equiv=[\"']?refresh", re.IGNORECASE)

TOC_LINK = ".bd-sidebar-primary nav.bd-links a.reference"
PAGE_TOC_LINK = ".bd-sidebar-secondary nav.page-toc a.reference, .bd-sidebar-secondary nav a"

# Is `selector`'s first element on screen and the topmost element at its centre? Evaluates to
# its link target, or null.
SHOWN = """((selector) => {
  for (const a of document.querySelectorAll(selector)) {
    const r = a.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    const x = r.left + Math.min(r.width / 2, 20), y = r.top + r.height / 2;
    if (x < 0 || y < 0 || x > innerWidth || y > innerHeight) return null;
    const hit = document.elementFromPoint(x, y);
    return hit && (hit === a || a.contains(hit)) ? a.getAttribute("href") : null;
  }
  return null;
})(%s)"""

# The centre of the first visible element matching a selector, or null.
CENTRE = """((selector) => {
  for (const e of document.querySelectorAll(selector)) {
    const r = e.getBoundingClientRect();
    if (r.width > 0 && r.height > 0 && getComputedStyle(e).visibility !== "hidden") {
      return [r.left + r.width / 2, r.top + r.height / 2];
    }
  }
  return null;
})(%s)"""

PAGE_TOC_TARGETS = """[...document.querySelectorAll(%s)].map((a) => a.getAttribute("href"))"""


def site_pages(html_dir: Path) -> list[str]:
    """The pages of the site, without Sphinx's index and search pages and the redirect
    pages (index.html only sends the browser on to the introduction)."""
    return sorted(
        str(p.relative_to(html_dir))
        for p in html_dir.rglob("*.html")
        if "_static" not in p.parts
        and p.name not in SKIPPED
        and not p.name.startswith("_")
        and not REDIRECT.search(p.read_text(encoding="utf-8")[:2000])
    )


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


def wait_until(browser: Browser, expression: str, seconds: float = 2.0):
    deadline = time.monotonic() + seconds
    while True:
        value = browser.evaluate(expression)
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def load(browser: Browser, url: str) -> dict:
    browser.open(url)
    return browser.evaluate(CHECKS)


def tap(browser: Browser, selector: str) -> bool:
    """Tap the first visible element matching `selector`, once it has stopped moving (the
    header slides when a sidebar opens or closes)."""
    centre, deadline = None, time.monotonic() + 2.0
    while True:
        now = browser.evaluate(CENTRE % json.dumps(selector))
        if now is None or now == centre or time.monotonic() > deadline:
            break
        centre = now
        time.sleep(0.1)
    if not now:
        return False
    browser.tap(*now)
    return True


def check_menus(browser: Browser, url: str, width: str, sections: list[str]) -> list[str]:
    problems = []
    toc = json.dumps(TOC_LINK)
    page_toc = json.dumps(PAGE_TOC_LINK)
    if width == "laptop":
        if not browser.evaluate(SHOWN % toc):
            problems.append("the table of contents is not shown at 1280 px")
        elif not tap(browser, ".primary-toggle"):
            problems.append("no ☰ button")
        else:
            wait_until(browser, f"!{SHOWN % toc}")
            tap(browser, ".primary-toggle")
            if not wait_until(browser, SHOWN % toc):
                problems.append("a second tap on ☰ does not show the table of contents again")
    else:
        if not tap(browser, ".primary-toggle"):
            problems.append("no ☰ button")
        elif not wait_until(browser, SHOWN % toc):
            problems.append("tapping ☰ does not show the table of contents")
        browser.open(url)  # close the menu: start again from the page as loaded
    if sections:
        if not browser.evaluate(SHOWN % page_toc):
            if not tap(browser, ".secondary-toggle"):
                problems.append("no Contents button on a page with sections")
            elif not wait_until(browser, SHOWN % page_toc):
                problems.append("tapping Contents does not show the page's sections")
        targets = set(browser.evaluate(PAGE_TOC_TARGETS % page_toc) or [])
        missing = [s for s in sections if f"#{s}" not in targets]
        if missing:
            problems.append(f"Contents lacks the sections {missing}")
    return problems


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_reads_at(width, browser, site_url, html_dir):
    w, h, mobile = WIDTHS[width]
    browser.set_viewport(w, h, mobile)
    browser.console_errors()
    failures = {}
    for page in site_pages(html_dir):
        url = f"{site_url}/{page}"
        result = load(browser, url)
        facts = result["facts"]
        problems = check_menus(browser, url, width, facts["sections"])
        # The browser asks every site for /favicon.ico by itself; the book declares none.
        problems += [f"console: {e}" for e in browser.console_errors() if "/favicon.ico" not in e]
        problems += result["problems"]
        if width == "phone":
            for figure in facts["figures"]:
                if figure["width"] < FIGURE_SHARE * facts["column"]:
                    problems.append(
                        f"figure {figure['width']:.0f} px wide in a {facts['column']:.0f} px "
                        f"column: {figure['where']}"
                    )
        if problems:
            failures[page] = problems
    report = "\n".join(
        f"{page}:\n"
        + "\n".join(f"  - {p}" for p in problems[:15])
        + (f"\n  ... and {len(problems) - 15} more" if len(problems) > 15 else "")
        for page, problems in failures.items()
    )
    assert not failures, f"{len(failures)} pages fail at {w} px:\n{report}"


def test_the_checks_can_fail(browser, site_url, html_dir):
    """Negative control: a page broken on purpose is reported on each count."""
    probe = html_dir / "_phone_probe.html"
    probe.write_text(
        "<html><head><meta name='viewport' content='width=device-width'>"
        "<style>span.math{overflow:hidden;display:inline-block;width:20px}"
        "</style></head><body><article class='bd-article'>"
        "<div style='width:700px'>wide</div>"
        "<div class='cell_output'><pre style='white-space:pre-wrap'>" + "x" * 300 + "</pre></div>"
        "<figure><img style='width:50%' src='data:image/gif;base64,"
        "R0lGODlhAQABAAAAACwAAAAAAQABAAA='></figure>"
        "<p><span class='math'><mjx-container style='display:inline-block;width:80px'>"
        "x</mjx-container></span></p>"
        "<script>console.error('probe error')</script>"
        "</article></body></html>"
    )
    try:
        browser.set_viewport(400, 900, True)
        browser.console_errors()
        result = load(browser, f"{site_url}/_phone_probe.html")
        errors = browser.console_errors()
    finally:
        probe.unlink()
    text = "\n".join(result["problems"])
    assert "wider than the 400 px viewport" in text
    assert "the page scrolls sideways" in text
    assert "notebook output wrapped" in text
    assert "inline math clipped" in text
    assert any("probe error" in e for e in errors)
    figures = result["facts"]["figures"]
    assert figures and figures[0]["width"] < FIGURE_SHARE * result["facts"]["column"]
