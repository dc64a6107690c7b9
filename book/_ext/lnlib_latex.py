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
  not Exercise 1.5.2) because the figure numbering depth stays the web book's.
"""

from __future__ import annotations

import posixpath
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
    tools/lnlib_glue.py wrote it. XeLaTeX would stop at the first one.
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


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _override_jupyterbook_latex, priority=900)
    app.connect("builder-inited", _restore_numfig_depth, priority=900)
    app.add_post_transform(ArrangeBook)
    app.add_post_transform(GluedImagePaths)
    app.add_post_transform(LocalCitations)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
