"""The built book renders its mathematics with no network: MathJax comes from the site.

Pages are opened in headless Chromium with every address but 127.0.0.1 unreachable, and the
DOM after MathJax has run must contain typeset equations (``mjx-container`` elements), as
many as the page has math, and no MathJax error.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Pages with both display and inline math.
PAGES = ["book/notation.html", "book/intro.html"]
VIRTUAL_TIME_MS = "20000"


def dump_dom(chromium, url: str) -> str:
    result = chromium(f"--virtual-time-budget={VIRTUAL_TIME_MS}", "--dump-dom", url)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def math_in_source(html: str) -> tuple[int, int]:
    """Numbers of (inline, display) math elements that Sphinx wrote into a page."""
    inline = len(re.findall(r'<span class="math notranslate nohighlight">', html))
    display = len(re.findall(r'<div class="math notranslate nohighlight"', html))
    return inline, display


@pytest.mark.parametrize("page", PAGES)
def test_math_is_typeset_offline(chromium, site_url, html_dir, page):
    source = (html_dir / page).read_text()
    inline, display = math_in_source(source)
    assert inline > 0 and display > 0, f"{page} should have inline and display math"
    assert re.search(r'<script[^>]*src="\.\./_static/mathjax/tex-chtml\.js[?"]', source)

    dom = dump_dom(chromium, f"{site_url}/{page}")
    containers = re.findall(r"<mjx-container[^>]*>", dom)
    displayed = [c for c in containers if 'display="true"' in c]
    assert len(containers) >= inline + display, (
        f"{page}: {len(containers)} typeset formulas for {inline} inline + {display} display"
    )
    assert len(displayed) >= display
    assert "<mjx-merror" not in dom, "MathJax reported a TeX error"
    # The typeset formulas contain MathJax's glyph elements, not just empty wrappers.
    assert dom.count("<mjx-c ") + dom.count("<mjx-c>") > 50


def test_the_browser_really_is_offline(chromium, site_url, tmp_path, html_dir):
    """Negative control: MathJax from a CDN must NOT render, or the test above proves nothing."""
    probe = html_dir / "_offline_probe.html"
    probe.write_text(
        "<html><head><script>window.MathJax={tex:{inlineMath:[['\\\\(','\\\\)']]}};</script>"
        '<script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"></script>'
        "</head><body><p>\\(x^2\\)</p></body></html>"
    )
    try:
        dom = dump_dom(chromium, f"{site_url}/_offline_probe.html")
    finally:
        probe.unlink()
    assert "<mjx-container" not in dom


def test_screenshot(chromium, site_url):
    """A picture of the introduction, rendered offline, to look at by eye."""
    out = ROOT / "_build" / "screenshots" / "intro.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    result = chromium(
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        "--window-size=1280,1700",
        "--hide-scrollbars",
        f"--screenshot={out}",
        f"{site_url}/book/intro.html",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.exists() and out.stat().st_size > 20_000
