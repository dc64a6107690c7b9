"""Tables in the PDF edition: each kind that Sphinx's LaTeX writer makes fits the text block
(and where inline code may break).

A small document with the book's LaTeX extension (book/_ext/lnlib_latex.py, lnlibbook.sty) and
page setup is built with XeLaTeX: a tabulary (a short table, as on the notation page), a
longtable (more than 30 rows), a tabular (a list in a cell) and a Markdown table with an empty
cell. None of them depends on the book's pages, which change. Without the extension's table
layout the tabulary squeezes its code column until `normalized_ndim` runs past the margin, the
longtable's prose column is one line as wide as its longest entry, and the empty cell adds an
empty line to its row.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml
from test_pdf import ROOT, lines_outside, text_block

sys.path.insert(0, str(ROOT / "book" / "_ext"))
import lnlib_latex  # noqa: E402

PROSE = (
    "a sentence long enough to need several lines in any column that is narrower than the"
    " text block, so that the widths the columns get decide whether a table fits the page"
)
SHORT_ROWS = [
    (r"\mu = \frac{1}{D}\sum_i x_i", PROSE, "normalized_ndim"),
    (r"\sigma^2 = \frac{1}{D}\sum_i (x_i-\mu)^2", "biased variance of the features", "var"),
    (r"\lVert v \rVert", "Euclidean length of :math:`v`", "np.linalg.norm(v)"),
]
# MyST writes an empty cell of a Markdown table as an empty paragraph.
EMPTY_CELL = (
    "| symbol | meaning | in code |\n|---|---|---|\n| {math}`\\ell` | index of a layer | |\n"
)
LONG_ROWS = [(rf"x_{{{i}}}", f"entry {i}: {PROSE}", f"x[{i}]") for i in range(35)]


def _list_table(rows, list_in_cell=False):
    lines = [".. list-table::", "   :header-rows: 1", ""]
    lines += ["   * - symbol", "     - meaning", "     - in code"]
    for symbol, meaning, code in rows:
        lines += [f"   * - :math:`{symbol}`"]
        if list_in_cell:
            lines += ["     - * " + meaning, "", "       * " + meaning]
        else:
            lines += ["     - " + meaning]
        lines += [f"     - ``{code}``"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The small document's LaTeX source and the text lines of its PDF outside the block."""
    for tool in ("xelatex", "latexmk", "pdftotext"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run `make tex` (installs TeX and poppler as root)")
    src = tmp_path_factory.mktemp("tables")
    book = yaml.safe_load((ROOT / "_config.yml").read_text())
    elements = book["sphinx"]["config"]["latex_elements"]
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'book' / '_ext')!r})\n"
        "project = 'tables'\n"
        "extensions = ['myst_parser', 'sphinxcontrib.bibtex', 'lnlib_latex']\n"
        f"bibtex_bibfiles = [{str(ROOT / 'references.bib')!r}]\n"
        "latex_engine = 'xelatex'\n"
        f"latex_elements = {elements!r}\n"
        "latex_documents = [('index', 'tables.tex', 'Tables', 'lnlib', 'manual')]\n"
    )
    tables = [_list_table(SHORT_ROWS), _list_table(LONG_ROWS), _list_table(SHORT_ROWS, True)]
    (src / "index.md").write_text(
        "# Tables\n\n```{eval-rst}\n" + "\n".join(tables) + "```\n\n" + EMPTY_CELL
    )
    out = src / "_build"
    subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "latex", "-W", "-q", str(src), str(out)],
        check=True,
    )
    latex = subprocess.run(
        ["make", "-C", str(out), "all-pdf", "LATEXMKOPTS=-interaction=nonstopmode -halt-on-error"],
        capture_output=True,
        text=True,
    )
    assert latex.returncode == 0, latex.stdout[-3000:]
    pdf = out / "tables.pdf"
    bbox = subprocess.run(
        ["pdftotext", "-bbox-layout", "-enc", "UTF-8", str(pdf), "-"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    text = subprocess.run(
        ["pdftotext", "-enc", "UTF-8", str(pdf), "-"], check=True, capture_output=True, text=True
    ).stdout
    return (out / "tables.tex").read_text(), text, lines_outside(bbox, *text_block())


def test_every_kind_of_table_is_made(built):
    tex, _, _ = built
    assert re.findall(r"\\begin\{(tabulary|longtable|tabular)\}", tex) == [
        "tabulary",
        "longtable",
        "tabular",
        "tabulary",
    ]


def test_no_table_runs_past_the_margin(built):
    _, _, outside = built
    assert not outside, "\n".join(outside)


def test_short_code_entries_keep_one_line(built):
    _, text, _ = built
    lines = [line.strip() for line in text.splitlines()]
    for _, _, code in SHORT_ROWS:
        assert lines.count(code) == 2, code  # in the tabulary and in the tabular


def test_an_empty_cell_adds_no_empty_line(built):
    tex, _, _ = built
    # Sphinx writes an empty paragraph as \sphinxAtStartPar and a paragraph break.
    assert tex.count("index of a layer") == 1
    assert not re.search(r"\\sphinxAtStartPar\n\n\\\\", tex)


def test_tables_without_tabulary_get_widths_from_their_text(built):
    tex, _, _ = built
    for table in ("longtable", "tabular"):
        spec = re.search(r"\\begin\{" + table + r"\}(?:\[[^]]*\])?\{([^\n]*)\}\n", tex)[1]
        widths = [int(w) for w in re.findall(r"\\X\{(\d+)\}\{\d+\}", spec)]
        assert len(widths) == 3 and widths[1] == max(widths), (table, spec)
        assert widths[0] < widths[2] < widths[1] if table == "tabular" else widths[1] > 50


@pytest.mark.parametrize(
    ("natural", "expected"),
    [
        ([5.0, 300.0, 14.0], [8, 73, 18]),  # narrow columns keep their width
        ([200.0, 200.0], [50, 50]),  # wide columns share the line
        ([1.0] * 4, [25, 25, 25, 25]),  # narrow ones fill the line together
        ([5.0, 300.0, 300.0, 300.0, 300.0], [8, 23, 23, 23, 23]),
    ],
)
def test_column_widths(natural, expected):
    assert lnlib_latex.column_widths(natural) == expected


def test_column_widths_are_never_under_the_bound():
    # A wide column of little text beside a very wide one still gets 30 % of the line.
    widths = lnlib_latex.column_widths([40.0, 2000.0])
    assert widths[0] == 30 and sum(widths) == 100
    with pytest.raises(ValueError, match="natural"):
        lnlib_latex.column_widths([])


@pytest.mark.parametrize(
    ("code", "kept"),
    [
        ("np.sign(x1 - x2)", "np.sign(x1\u00a0- x2)"),
        ("a ** 2 + b == c", "a\u00a0** 2\u00a0+ b\u00a0== c"),
        ("f(x, eps=1e-5)", "f(x, eps=1e-5)"),  # no operator between spaces
        ("a -b", "a -b"),
    ],
)
def test_inline_code_never_breaks_before_an_operator(code, kept):
    assert lnlib_latex.keep_operator_with_left_operand(code) == kept
