"""Tests of the PDF edition, _build/pdf/lnlib.pdf (built by `make pdf`; run by `make pdf-test`).

They read the PDF with the poppler tools (pdfinfo, pdftotext, pdfimages) and compare it
with the sources (_toc.yml, the page titles) and with the web book in _build/html (its
figures, their numbers and the equation numbers): `make test` builds both before.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PDF = ROOT / "_build" / "pdf" / "lnlib.pdf"
AUX = ROOT / "_build" / "latex" / "lnlib.aux"
HTML = ROOT / "_build" / "html"
POINTS_PER_UNIT = {"cm": 72 / 2.54, "mm": 72 / 25.4, "in": 72.0, "pt": 72 / 72.27, "bp": 1.0}
# How far (in PDF points) a line may reach past the text block: italic overhang, rounding.
MARGIN_TOLERANCE = 2.0

sys.path.insert(0, str(ROOT / "tools"))
import build_pdf  # noqa: E402  (tools/build_pdf.py: its checks are tested below)


def _poppler(*args: str) -> str:
    tool = args[0]
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is missing: install poppler-utils (make tex does it as root)")
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


@functools.cache
def _pdf() -> Path:
    if not PDF.is_file():
        pytest.fail(f"{PDF} does not exist: run `make pdf` first")
    return PDF


@functools.cache
def _text() -> str:
    return _poppler("pdftotext", "-enc", "UTF-8", str(_pdf()), "-")


@functools.cache
def _bbox() -> str:
    return _poppler("pdftotext", "-bbox-layout", "-enc", "UTF-8", str(_pdf()), "-")


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


def toc_docnames() -> list[str]:
    return build_pdf.toc_docnames()


def source_title(docname: str) -> str:
    """The first level-1 heading of a page of the book (Markdown or notebook)."""
    md, nb = ROOT / f"{docname}.md", ROOT / f"{docname}.ipynb"
    if md.is_file():
        lines = md.read_text().splitlines()
    else:
        cells = json.loads(nb.read_text())["cells"]
        lines = [
            line
            for cell in cells
            if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines()
        ]
    for line in lines:
        if line.startswith("# "):
            return line[2:].strip()
    raise AssertionError(f"{docname} has no level-1 heading")


def _html_pages() -> list[str]:
    if not HTML.is_dir():
        pytest.fail(f"{HTML} does not exist: run `make book` first (the PDF is compared with it)")
    return [(HTML / f"{name}.html").read_text() for name in toc_docnames()]


def text_block(config_path: Path = ROOT / "_config.yml") -> tuple[float, float]:
    """Left and right edges of the text block in PDF points, from sphinxsetup's hmargin."""
    config = yaml.safe_load(config_path.read_text())
    setup = config["sphinx"]["config"]["latex_elements"]["sphinxsetup"]
    match = re.search(r"hmargin=\{?([\d.]+)(cm|mm|in|pt|bp),\s*([\d.]+)(cm|mm|in|pt|bp)", setup)
    assert match, f"no hmargin={{left,right}} in sphinxsetup: {setup!r}"
    left = float(match[1]) * POINTS_PER_UNIT[match[2]]
    right = float(match[3]) * POINTS_PER_UNIT[match[4]]
    return left, right


def lines_outside(bbox_html: str, left: float, right: float) -> list[str]:
    """The text lines of pdftotext -bbox-layout's output that reach into a side margin."""
    outside = []
    for number, page in enumerate(re.split(r"<page ", bbox_html)[1:], start=1):
        width = float(re.match(r'width="([\d.]+)"', page)[1])
        for x_min, x_max, body in re.findall(
            r'<line xMin="([\d.]+)" yMin="[\d.]+" xMax="([\d.]+)" yMax="[\d.]+">(.*?)</line>',
            page,
            flags=re.S,
        ):
            if float(x_min) < left - MARGIN_TOLERANCE or float(x_max) > (
                width - right + MARGIN_TOLERANCE
            ):
                words = " ".join(re.findall(r">([^<]*)</word>", body))
                outside.append(f"page {number}, x {x_min}..{x_max}: {words[:100]}")
    return outside


# --- the PDF ------------------------------------------------------------------------------


def test_page_count_and_size():
    info = _poppler("pdfinfo", str(_pdf()))
    pages = int(re.search(r"^Pages:\s+(\d+)", info, re.M)[1])
    # The whole book: 12 pages and 8 notebooks (about 280 pages in January 2026). Far fewer
    # means that a part is missing; far more, that something is printed many times.
    assert 150 <= pages <= 600, pages
    assert re.search(r"^Page size:.*\(A4\)", info, re.M), info


def test_title_page_and_table_of_contents():
    first_pages = _normalize(_text()[:20000])
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert _normalize(config["title"]) in first_pages
    assert _normalize(config["author"]) in first_pages
    assert "contents" in first_pages
    # The table of contents gives the page of each chapter: "Why normalize ... 17".
    assert re.search(r"why normalize[ .]*\d+", first_pages), "no page numbers in the contents"


def test_every_page_title_in_order():
    pages = _text().split("\f")
    # The body starts after the table of contents (its pages have dot leaders), which lists
    # the titles too.
    contents = [i for i, page in enumerate(pages[:30]) if ". . . . ." in page]
    assert contents, "no table of contents"
    text = _normalize(" ".join(pages[contents[-1] + 1 :]))
    position = 0
    for docname in toc_docnames():
        title = _normalize(source_title(docname))
        found = text.find(title, position)
        assert found >= 0, f"the title of {docname}, {title!r}, is missing or out of order"
        position = found + len(title)


def test_no_unresolved_reference():
    assert "??" not in _text()


def test_as_many_figures_as_the_web_book():
    images = [line.split() for line in _poppler("pdfimages", "-list", str(_pdf())).splitlines()[2:]]
    in_pdf = sum(1 for row in images if row[2] == "image")  # not their alpha masks ("smask")
    on_web = sum(len(re.findall(r'<img [^>]*src="[^"]*_images/', page)) for page in _html_pages())
    assert on_web > 0
    assert in_pdf == on_web


def test_figure_numbers_as_on_the_web():
    in_pdf = re.findall(r"^Fig\. ([\d.]+): ", _text(), flags=re.M)
    on_web = [
        n for page in _html_pages() for n in re.findall(r'caption-number">Fig\. ([\d.]+) ', page)
    ]
    assert on_web and in_pdf == on_web


def test_equation_numbers_as_on_the_web():
    on_web = {}
    for name, page in zip(toc_docnames(), _html_pages()):
        for number, label in re.findall(
            r'class="eqno">\(([\d.]+)\)<a class="headerlink" href="#equation-([^"]+)"', page
        ):
            on_web[f"{name}:{label}"] = number
    if not AUX.is_file():
        pytest.fail(f"{AUX} does not exist: run `make pdf` first")
    in_pdf = dict(re.findall(r"\\newlabel\{equation:([^}]+)\}\{\{([\d.]+)\}", AUX.read_text()))
    assert on_web and in_pdf == on_web
    text = _text()
    for number in on_web.values():
        assert f"({number})" in text


def test_exercises_and_solutions_numbered_as_on_the_web():
    pages = _html_pages()
    exercises = sorted(
        {n for p in pages for n in re.findall(r'caption-number">Exercise ([\d.]+)', p)}
    )
    solutions = sorted(
        n for p in pages for n in re.findall(r"Solution to<a [^>]*> Exercise ([\d.]+)[ <]", p)
    )
    title = r"(?: \(.*\))?$"  # "Exercise 2.1 (The forward pass)"
    text = _text()
    assert (
        exercises
        and sorted(set(re.findall(r"^Exercise ([\d.]+)" + title, text, re.M))) == exercises
    )
    assert (
        solutions
        and sorted(re.findall(r"^Solution to Exercise ([\d.]+)" + title, text, re.M)) == solutions
    )


def test_every_box_has_a_title():
    # sphinx-proof's proofs had none: Sphinx's LaTeX writer took the paragraph's start for
    # the title, an empty bar above the proof.
    tex_file = AUX.with_suffix(".tex")
    if not tex_file.is_file():
        pytest.fail(f"{tex_file} does not exist: run `make pdf` first")
    boxes = re.findall(r"\\begin\{sphinxadmonition\}\{\w+\}(.*)", tex_file.read_text())
    untitled = [box for box in boxes if not box.startswith("{") or box.startswith("{}")]
    assert boxes and not untitled, f"{len(untitled)} boxes without a title"
    assert "{Proof}" in boxes


def _shown_outputs(cell: dict) -> list[dict]:
    """The outputs of a notebook cell that the book shows (not glue's recorded values)."""
    return [o for o in cell.get("outputs", []) if "scrapbook" not in o.get("metadata", {})]


def test_hidden_inputs_with_an_output_are_printed():
    # On the web a hide-input cell's code (a notebook's solution to an exercise) is behind a
    # button; on paper it is printed when its output (the checker's PASS) is.
    text = _normalize(_text())
    shown = hidden = 0
    for docname in toc_docnames():
        notebook = ROOT / f"{docname}.ipynb"
        if not notebook.is_file():
            continue
        for cell in json.loads(notebook.read_text())["cells"]:
            if "hide-input" not in cell.get("metadata", {}).get("tags", []):
                continue
            lines = [_normalize(line) for line in "".join(cell["source"]).splitlines()]
            first = lines[0]
            if _shown_outputs(cell):
                # Every line short enough not to wrap, without its comment, which pdftotext
                # reads as a block of its own (a solution's first line is often the same as
                # its exercise's placeholder's).
                code = [re.sub(r"\s*#.*$", "", line) for line in lines if len(line) <= 70]
                missing = [line for line in code if line and line not in text]
                assert not missing, f"{docname}: hidden solution {first!r} not in the PDF"
                shown += 1
            else:
                assert first not in text, f"{docname}: bookkeeping cell {first!r} printed"
                hidden += 1
    assert shown and hidden


def test_no_text_outside_the_text_block():
    left, right = text_block()
    outside = lines_outside(_bbox(), left, right)
    assert not outside, "\n".join(outside[:30])


# --- the checks themselves ---------------------------------------------------------------


def test_lines_outside_finds_a_line_in_the_margin():
    page = (
        '<page width="595.28" height="841.89"><line xMin="71.0" yMin="1" xMax="524.0" '
        'yMax="2"><word xMin="71.0" yMin="1" xMax="524.0" yMax="2">inside</word></line>'
        '<line xMin="71.0" yMin="3" xMax="540.0" yMax="4"><word xMin="71.0" yMin="3" '
        'xMax="540.0" yMax="4">too_long_a_name</word></line></page>'
    )
    outside = lines_outside(page, 70.87, 70.87)
    assert len(outside) == 1 and "too_long_a_name" in outside[0]


def test_text_block_reads_the_margins(tmp_path):
    config = tmp_path / "_config.yml"
    config.write_text(
        'sphinx: {config: {latex_elements: {sphinxsetup: "hmargin={1in,2cm}, vmargin=3cm"}}}'
    )
    left, right = text_block(config)
    assert left == pytest.approx(72.0) and right == pytest.approx(2 * 72 / 2.54)


@pytest.mark.parametrize(
    "log_line",
    [
        "LaTeX Warning: Reference `book/02_math:fig-ch02-axes' on page 40 undefined.",
        "LaTeX Warning: Hyper reference `book/api::doc' on page 1 undefined on input line 9.",
        "LaTeX Warning: Citation `book/bibliography:id2' on page 5 undefined on input line 7.",
        "LaTeX Warning: There were undefined references.",
        "! Unable to load picture or PDF file '../ae1f.png'.",
        "LaTeX Warning: File `fig.png' not found on input line 4.",
        "Missing character: There is no ∯ (U+222F) in font FreeSerif:mode=node;!",
        "LaTeX Warning: Label `x' multiply defined.",
    ],
)
def test_build_check_fails_on(log_line):
    aux = "".join(f"\\newlabel{{{name}::doc}}{{}}\n" for name in toc_docnames())
    assert build_pdf.check("", "", aux) == []
    problems = build_pdf.check(f"line before\n{log_line}\nline after", "", aux)
    assert len(problems) == 1 and log_line.strip() in problems[0]


def test_build_check_fails_on_a_missing_page_or_a_broken_link():
    names = toc_docnames()
    aux = "".join(f"\\newlabel{{{name}::doc}}{{}}\n" for name in names[:-1])
    assert build_pdf.check("", "", aux) == [
        f"missing page: {names[-1]} (in _toc.yml, not in lnlib.tex)"
    ]
    full = aux + f"\\newlabel{{{names[-1]}::doc}}{{}}\n"
    driver = "xdvipdfmx:warning: Object @cite.x used, but not defined. Replaced by null."
    assert len(build_pdf.check("", driver, full)) == 1


def test_the_web_book_links_to_the_pdf_beside_it():
    front = (HTML / "book" / "intro.html").read_text() if HTML.is_dir() else ""
    assert 'href="../lnlib.pdf"' in front, "the front page (book/intro.md) has no link to the PDF"
    # make pdf copies the PDF there when the web book exists (the Pages workflow publishes
    # _build/html): so make test builds the book first.
    beside = HTML / "lnlib.pdf"
    assert beside.is_file(), f"no {beside}: make pdf after make book puts it there"
    assert beside.read_bytes() == _pdf().read_bytes(), f"{beside} is not the PDF built last"
