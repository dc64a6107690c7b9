"""Sphinx extension of the lnlib book: the LaTeX (PDF) edition, built by ``make pdf``.

Jupyter Book 1 builds a PDF through sphinx-jupyterbook-latex, which turns the ``_toc.yml``
parts into LaTeX parts and the front page into the opening text. It also forces its own
document class (``jupyterBook.cls``: a 17.5 cm wide text block on letter paper, and the
``bbm``, ``tikz`` and ``pgfplots`` packages, which the book does not use and ``bbm`` is not in
the small TeX installation of tools/ensure_tex.sh), loads ``ucharclasses`` and numbers the
figures by section. This extension keeps its transforms and changes the rest:

- Sphinx's own ``manual`` class, with the paper, font size and margins of ``latex_elements``
  in ``_config.yml``, and ``book/_ext/lnlibbook.sty`` at the end of the preamble;
- no ``ucharclasses`` (the text font, GNU FreeSerif, has the Greek letters and the math
  symbols of the prose);
- numbers as in the web book: the pages of the parts that ``_toc.yml`` does not number
  (Getting started, Reference) are unnumbered chapters, so that the numbered chapters start
  at 1; their figures and equations are numbered 1, 2, ... across those pages, the others
  chapter by chapter (1.1, 1.2, ...); and exercises, solutions and proofs, whose numbers
  sphinx-exercise and sphinx-proof write as text, get the web book's numbers (Exercise 1.2,
  not Exercise 1.5.2) because the figure numbering depth stays the web book's;
- the code of notebook cells hidden on the web behind a "show" button (tag ``hide-input``:
  the exercises' solutions) printed when the cell shows an output, which paper has no button
  to reveal (:class:`ShowHiddenInputs`; sphinx-jupyterbook-latex drops every such input);
- proofs with a title bar ("Proof", as the exercises and propositions have theirs) instead
  of an empty one (:class:`ProofTitles`);
- inline code that never starts a line with an operator ("x1 - x2" breaks after the minus,
  not before: :class:`CodeOperators`);
- tables that fit the text block: lnlibbook.sty sets the widths of the tables that Sphinx
  puts in a ``tabulary`` (the most); :class:`TableLayout` gives column widths to the others
  (longer than 30 rows, or with lists or code in a cell), which Sphinx would make equal or,
  in a long table, as wide as their longest entry on one line.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.builders.latex import LaTeXBuilder
from sphinx.builders.latex.nodes import thebibliography
from sphinx.config import Config
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util import texescape

STY = Path(__file__).with_name("lnlibbook.sty")

# Lines of sphinx-jupyterbook-latex's preamble that are dropped (see the module docstring).
_DROPPED_PREAMBLE_LINES = ("\\usepackage[Latin,Greek]{ucharclasses}",)


def _override_jupyterbook_latex(app: Sphinx, config: Config) -> None:
    """config-inited, after sphinx-jupyterbook-latex's handler (priority 500)."""
    config["latex_theme"] = "manual"
    elements = config["latex_elements"]
    kept = [
        line
        for line in elements.get("preamble", "").splitlines()
        if line.strip() not in _DROPPED_PREAMBLE_LINES
    ]
    elements["preamble"] = "\n".join(kept) + "\n\\usepackage{lnlibbook}\n"
    files = list(config["latex_additional_files"])
    if str(STY) not in files:
        files.append(str(STY))
    config["latex_additional_files"] = files
    app.lnlib_numfig_secnum_depth = config["numfig_secnum_depth"]


def _restore_numfig_depth(app: Sphinx) -> None:
    """builder-inited, after sphinx-jupyterbook-latex set numfig_secnum_depth to 2.

    The LaTeX numbering is set in lnlibbook.sty; what depends on this value is the numbers
    that Sphinx computes (exercise and proof titles), which must be the web book's.
    """
    if isinstance(app.builder, LaTeXBuilder):
        app.config.numfig_secnum_depth = app.lnlib_numfig_secnum_depth


class ArrangeBook(SphinxPostTransform):
    r"""Arrange the assembled book after sphinx-jupyterbook-latex.

    - Put ``\lnlibunnumbered`` or ``\lnlibnumbered`` (lnlibbook.sty) before every page: a
      page is numbered when it is numbered in the web book, that is when Sphinx gave it a
      section number (the ``numbered`` parts of ``_toc.yml``).
    - Give the root page, whose text sphinx-jupyterbook-latex puts before the first part
      without its title, an unnumbered chapter with that title (in the table of contents
      and the page headers).
    - Put the bibliography back at the end of its page (sphinx-jupyterbook-latex moves it to
      the end of the book, which leaves that page empty and gives two "Bibliography"
      chapters); lnlibbook.sty drops the heading of the bibliography's own environment.
    """

    builders = ("latex",)
    default_priority = 900  # after sphinx-jupyterbook-latex's rearrangement (700)

    def run(self, **kwargs) -> None:
        starts = list(self.document.findall(addnodes.start_of_file))
        if not starts:
            return  # not the assembled book
        numbered = self.env.toc_secnumbers
        for start in starts:
            docname = start.get("docname")
            if docname not in self.env.found_docs:
                continue  # a part heading made by sphinx-jupyterbook-latex
            macro = r"\lnlibnumbered" if numbered.get(docname) else r"\lnlibunnumbered"
            start.insert(0, nodes.raw("", macro + "\n", format="latex"))
        self._move_bibliographies(starts)
        root = self.app.config.root_doc
        title = texescape.escape(self.env.titles[root].astext())
        self.document.insert(
            0, nodes.raw("", f"\\lnlibunnumbered\n\\chapter{{{title}}}\n", format="latex")
        )

    def _move_bibliographies(self, starts: list[addnodes.start_of_file]) -> None:
        sections = {}
        for start in starts:
            first = next(iter(start.findall(nodes.section)), None)
            if first is not None:
                sections.setdefault(start.get("docname"), first)
        for bib in list(self.document.findall(thebibliography)):
            if bib.parent is not self.document:
                continue  # not moved
            citation = next(iter(bib.findall(nodes.citation)), None)
            home = sections.get(citation.get("docname")) if citation is not None else None
            if home is None:
                continue
            bib.parent.remove(bib)
            home.append(bib)


class LocalCitations(SphinxPostTransform):
    """Keep the citations of the API docstrings (numpydoc's ``References``) where they are.

    Sphinx's LaTeX builder gathers every citation of the book into one list at its end,
    where the API page's ``[1]`` of each function would stand, seven times, before the
    book's bibliography. As on the web, they stay under their function here, with links
    from their ``[1]``; only sphinxcontrib-bibtex's citations (the Bibliography page) make the
    bibliography.
    """

    builders = ("latex",)
    default_priority = 740  # before Sphinx's BibliographyTransform (750)

    def run(self, **kwargs) -> None:
        bibtex_ids = {c.citation_id for c in self.env.get_domain("cite").citations}
        targets = {}
        for citation in list(self.document.findall(nodes.citation)):
            if not citation["ids"] or citation["ids"][0] in bibtex_ids:
                continue
            key = f"lnlib-citation:{citation['docname']}:{citation['ids'][0]}"
            label = citation[0].astext() if isinstance(citation[0], nodes.label) else "?"
            targets[(citation["docname"], citation["ids"][0])] = (key, label)
            head = nodes.paragraph(
                "",
                "",
                nodes.raw("", rf"\hypertarget{{{key}}}{{}}", format="latex"),
                nodes.Text(f"[{label}] "),
            )
            body = [child for child in citation.children if not isinstance(child, nodes.label)]
            citation.replace_self(nodes.container("", head, *body, classes=["citation"]))
        for ref in list(self.document.findall(nodes.citation_reference)):
            target = targets.get((ref.get("docname"), ref.get("refname")))
            if target is not None:
                key, label = target
                ref.replace_self(
                    nodes.raw("", rf"\hyperlink{{{key}}}{{[{label}]}}", format="latex")
                )


class GluedImagePaths(SphinxPostTransform):
    """Give the images pasted from another document a path that LaTeX finds.

    MyST-NB writes a pasted image's path relative to the page's folder (right for HTML,
    where every page is a file); the LaTeX builder resolves the references of the whole book
    at once as the root page (``book/intro``), so that every pasted image comes out as
    ``../<sha256>.png``, while LaTeX reads it from the output folder, where
    book/_ext/lnlib_glue.py wrote it. XeLaTeX would stop at the first one.
    """

    builders = ("latex",)
    default_priority = 6  # after MyST-NB's ReplacePendingGlueReferences (5)

    def run(self, **kwargs) -> None:
        page_dir = posixpath.dirname(self.env.docname)
        for image in self.document.findall(nodes.image):
            uri = image["uri"]
            if uri in self.env.images or "://" in uri or posixpath.isabs(uri):
                continue  # an image Sphinx collected itself (copied and renamed by it)
            fixed = posixpath.normpath(posixpath.join(page_dir, uri))
            if fixed != uri and (Path(self.app.builder.outdir) / fixed).is_file():
                image["uri"] = fixed
                image["candidates"] = {"*": fixed}


class ProofTitles(SphinxPostTransform):
    """Give each proof the title "Proof" in its box.

    sphinx-proof writes a proof as a titleless admonition whose text starts with "Proof. ";
    Sphinx's LaTeX writer takes the first token of an admonition for its title, so the box got
    an empty title bar. Here the "Proof. " moves from the text into the title.
    """

    builders = ("latex",)
    default_priority = 905

    def run(self, **kwargs) -> None:
        for box in self.document.findall(nodes.admonition):
            if "proof" not in box["classes"] or any(isinstance(c, nodes.title) for c in box):
                continue
            first = box.next_node(nodes.Text)
            kind = first.astext().split(". ", 1)[0] if first is not None else ""
            if kind.lower() not in box["classes"] or not first.astext().startswith(kind + ". "):
                continue  # not the text that sphinx-proof wrote
            first.parent.replace(first, nodes.Text(first.astext()[len(kind) + 2 :]))
            box.insert(0, nodes.title("", kind))


#: A space in inline code before an operator and a space: it becomes a no-break space.
_SPACE_BEFORE_OPERATOR = re.compile(r" (?=(?:[-+*/%@<>=!]=?|\*\*|//|==) )")


def keep_operator_with_left_operand(code: str) -> str:
    """``code`` with a no-break space before each operator between spaces ("x1 - x2")."""
    return _SPACE_BEFORE_OPERATOR.sub("\u00a0", code)


class CodeOperators(SphinxPostTransform):
    """Inline code breaks after an operator, never before it.

    A line of prose may break at any space of inline code; one that broke ``x1 - x2`` before
    the minus started the next line with "- x2", which reads as a negative number.
    """

    builders = ("latex",)
    default_priority = 905

    def run(self, **kwargs) -> None:
        for literal in self.document.findall(nodes.literal):
            for text in list(literal.findall(nodes.Text)):
                kept = keep_operator_with_left_operand(text.astext())
                if kept != text.astext():
                    text.parent.replace(text, nodes.Text(kept))


class ShowHiddenInputs(SphinxPostTransform):
    """Print the code of a ``hide-input`` cell that shows an output.

    On the web such a cell's code is behind a button (the notebooks' solutions to their
    exercises, whose output is the checker's PASS); sphinx-jupyterbook-latex's
    MystNbPostTransform drops it from the PDF, which then shows a solution's PASS without the
    solution. Only a cell without output (the bookkeeping cells that glue numbers for the
    pages) stays hidden.
    """

    builders = ("latex",)
    default_priority = 390  # before sphinx-jupyterbook-latex's MystNbPostTransform (400)

    def run(self, **kwargs) -> None:
        for cell in self.document.findall(nodes.container):
            if "tag_hide-input" in cell["classes"] and any(
                isinstance(child, nodes.container) and "cell_output" in child["classes"]
                for child in cell.children
            ):
                cell["classes"].remove("tag_hide-input")


# Sphinx's LaTeX writer sets a table in a tabulary, which measures its columns, unless it has
# more than this many rows or the class longtable (then a longtable) or a cell holds one of
# _BLOCKS (then a tabular).
_TABULARY_MAX_ROWS = 30
_BLOCKS = (
    nodes.bullet_list,
    nodes.enumerated_list,
    nodes.definition_list,
    nodes.field_list,
    nodes.block_quote,
    nodes.literal_block,
    nodes.Admonition,
    nodes.table,
    addnodes.desc,
    addnodes.seealso,
    addnodes.hlist,
)
#: The text block (16 cm, 455 pt) in widths of an average character of 11 pt FreeSerif (about
#: 5 pt), the space between two columns (2 \tabcolsep = 12 pt) and a typewriter character
#: (6.6 pt, with some room) in the same unit.
LINE_CHARACTERS = 90.0
COLUMN_PADDING = 2.5
CODE_CHARACTER = 1.4


def column_widths(natural: list[float], line: float = LINE_CHARACTERS) -> list[int]:
    """Shares of the line, in whole percent, for table columns of the given natural widths.

    ``natural`` holds each column's widest entry set on one line (in the unit of ``line``).
    As lnlibbook.sty asks of tabulary: a column under 30 % of the line (or under 1/n of it,
    with n columns) keeps its width; the others share what is left in proportion to their
    natural widths, none narrower than that bound.
    """
    if not natural:
        raise ValueError("natural: a table has at least one column")
    need = [max(float(w), 0.0) + COLUMN_PADDING for w in natural]
    bound = min(0.3 * line, line / len(need))
    widths: list[float | None] = [w if w < bound else None for w in need]
    while None in widths:
        free = [i for i, w in enumerate(widths) if w is None]
        left = line - sum(w for w in widths if w is not None)
        total = sum(need[i] for i in free)
        share = {i: left * need[i] / total for i in free}
        narrow = [i for i in free if share[i] < bound]
        for i in narrow or free:
            widths[i] = bound if narrow else share[i]
    total = sum(widths)
    return [max(1, round(100 * w / total)) for w in widths]


def _text_width(node: nodes.Node) -> float:
    """Width of the text under ``node`` on one line, in widths of an average character."""
    width = 0.0
    for text in node.findall(nodes.Text):
        source = text.astext()
        if isinstance(text.parent, nodes.math):
            # A command is about one symbol wide; braces, scripts and spaces take no room.
            width += len(re.sub(r"[{}^_\s]|\\[,;!]", "", re.sub(r"\\[A-Za-z]+", "x", source)))
        elif any(isinstance(a, nodes.literal) for a in (text.parent, text.parent.parent)):
            width += CODE_CHARACTER * len(source)
        else:
            width += len(source)
    return width


class TableLayout(SphinxPostTransform):
    """Tables: no empty lines in empty cells, and column widths where tabulary is not used.

    - An empty cell (an empty paragraph: MyST writes one for ``| |``) becomes an empty entry;
      Sphinx would write a paragraph break there, which gives the row an empty line.
    - A table that Sphinx does not set in a tabulary (see ``_BLOCKS``) and that has no
      widths of its own (``:widths:``, ``tabularcolumns``) gets the widths of
      :func:`column_widths`, from the text of its cells.
    """

    builders = ("latex",)
    default_priority = 910

    def run(self, **kwargs) -> None:
        for entry in list(self.document.findall(nodes.entry)):
            if len(entry) == 1 and isinstance(entry[0], nodes.paragraph) and not len(entry[0]):
                entry.remove(entry[0])
        for table in list(self.document.findall(nodes.table)):
            self._set_widths(table)

    @staticmethod
    def _set_widths(table: nodes.table) -> None:
        if "colwidths-given" in table["classes"]:
            return
        index = table.parent.index(table) if table.parent is not None else 0
        if index > 0 and isinstance(table.parent[index - 1], addnodes.tabular_col_spec):
            return
        tgroup = next((c for c in table.children if isinstance(c, nodes.tgroup)), None)
        if tgroup is None:
            return
        colspecs = [c for c in tgroup.children if isinstance(c, nodes.colspec)]
        rows = [
            row
            for part in tgroup.children
            if isinstance(part, (nodes.thead, nodes.tbody))
            for row in part.children
        ]
        blocks = any(
            isinstance(node, _BLOCKS) for entry in tgroup.findall(nodes.entry) for node in entry
        )
        long = len(rows) > _TABULARY_MAX_ROWS or "longtable" in table["classes"]
        if not colspecs or not (long or blocks):
            return  # a tabulary: lnlibbook.sty
        natural = [0.0] * len(colspecs)
        for row in rows:
            column = 0
            for entry in row.children:
                spans = entry.get("morecols", 0) or entry.get("morerows", 0)
                if column < len(natural) and not spans:
                    natural[column] = max(natural[column], _text_width(entry))
                column += 1 + entry.get("morecols", 0)
        for colspec, width in zip(colspecs, column_widths(natural)):
            colspec["colwidth"] = width
        table["classes"].append("colwidths-given")


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _override_jupyterbook_latex, priority=900)
    app.connect("builder-inited", _restore_numfig_depth, priority=900)
    app.add_post_transform(ArrangeBook)
    app.add_post_transform(GluedImagePaths)
    app.add_post_transform(LocalCitations)
    app.add_post_transform(TableLayout)
    app.add_post_transform(ShowHiddenInputs)
    app.add_post_transform(ProofTitles)
    app.add_post_transform(CodeOperators)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
