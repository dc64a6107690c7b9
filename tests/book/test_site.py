"""Checks of the built site: self-contained, glued numbers pasted, launch buttons present."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import yaml

EXTERNAL_ASSET = re.compile(
    r'<(?:script|img)[^>]*\ssrc="(?:https?:)?//[^"]+"|<link[^>]*rel="stylesheet"[^>]*'
    r'href="(?:https?:)?//[^"]+"'
)


def pages(html_dir: Path):
    return [p for p in html_dir.rglob("*.html") if "_static" not in p.parts]


def test_nothing_is_fetched_from_the_network(html_dir):
    offenders = {
        str(p.relative_to(html_dir)): EXTERNAL_ASSET.findall(p.read_text()) for p in pages(html_dir)
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders


def test_every_local_image_and_script_exists(html_dir):
    missing = []
    for page in pages(html_dir):
        for ref in re.findall(r'<(?:img|script)[^>]*\ssrc="([^"]+)"', page.read_text()):
            url = urlparse(ref)
            if url.scheme or ref.startswith(("//", "data:")):
                continue
            if not (page.parent / unquote(url.path)).resolve().exists():
                missing.append(f"{page.relative_to(html_dir)}: {ref}")
    assert not missing


def test_mathjax_is_served_from_the_site(html_dir):
    assert (html_dir / "_static" / "mathjax" / "tex-chtml.js").exists()
    assert (html_dir / "_static" / "mathjax" / "output" / "chtml" / "fonts" / "woff-v2").is_dir()


def test_glued_numbers_and_figure_are_pasted_in_the_introduction(html_dir):
    html = (html_dir / "book" / "intro.html").read_text()
    pasted = re.findall(r'<span class="pasted-text">([^<]+)</span>', html)
    assert len(pasted) >= 3
    for value in pasted:
        float(value)  # a formatted number, not a placeholder
    assert re.search(
        r'<figure class="glued-figure[^"]*" id="fig-intro-rows">\s*<a[^>]*>'
        r'<img[^>]*src="\.\./_images/[0-9a-f]+\.png"',
        html,
    )
    assert "Fig. 1" in html


def test_colab_and_repository_buttons(html_dir):
    config = yaml.safe_load((html_dir.parents[1] / "_config.yml").read_text())
    url = config["repository"]["url"].rstrip("/")
    html = (html_dir / "notebooks" / "00_introduction.html").read_text()
    repo = url.removeprefix("https://github.com/")
    assert (
        f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/00_introduction.ipynb"
    ) in html
    assert f'href="{url}"' in html


def test_api_page_renders_the_docstrings(html_dir):
    """autodoc output must be rendered, not shown as raw reST (which is what happens when
    MyST reads an {autofunction} directive's output as Markdown)."""
    import lnlib

    html = (html_dir / "book" / "api.html").read_text(encoding="utf-8")
    assert ".. py:function::" not in html and "processed by numpydoc" not in html
    for name in lnlib.__all__:
        assert f'id="lnlib.{name}"' in html, f"lnlib.{name} has no rendered entry on the API page"
