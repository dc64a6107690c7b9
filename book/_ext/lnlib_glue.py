"""Sphinx extension of the lnlib book: pasting from a chapter's notebook into its page.

MyST-NB 1.4 pastes glued values across documents with ``path::key`` (``{glue:text}``,
``{glue}``) and pastes a glued figure with the ``{glue}`` directive and its ``:doc:``
option, but ``{glue:figure}`` (caption, label for ``{numref}``) works only inside the
notebook that glued it. This extension adds two things:

``glued-figure`` directive
    A numbered figure with a caption whose image is glued in another document::

        ```{glued-figure} ../notebooks/01_motivation.ipynb::fig_scales
        :name: fig-scales
        :width: 80%

        The caption, in Markdown.
        ```

Image files
    MyST-NB links a figure pasted from another document to ``_images/<sha256>.png`` but
    writes that file only if the notebook itself shows the figure; a figure glued with
    ``display=False`` (shown only in the page) would be a broken image. The file is
    written here.

Dependency tracking
    A page that pastes from a notebook is re-read whenever that notebook changes, so an
    incremental build never shows stale numbers (Sphinx does not know this on its own).
"""

from __future__ import annotations

import hashlib
from binascii import a2b_base64
from mimetypes import guess_extension
from pathlib import Path
from typing import ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from myst_nb.ext.glue.crossref import read_glue_cache
from myst_nb.ext.glue.utils import (
    PendingGlueReference,
    PendingGlueReferenceError,
    create_pending_glue_ref,
)
from sphinx.transforms.post_transforms import SphinxPostTransform
from sphinx.util.docutils import SphinxDirective


class GluedFigure(SphinxDirective):
    """A figure whose image is a value glued in another document (``path::key``)."""

    required_arguments = 1
    final_argument_whitespace = False
    has_content = True
    option_spec: ClassVar[dict] = {
        "name": directives.unchanged,
        "alt": directives.unchanged,
        "width": directives.unchanged,
        "figclass": directives.class_option,
    }

    def run(self) -> list[nodes.Node]:
        ref = self.arguments[0]
        if "::" not in ref:
            raise self.error(f"glued-figure needs `path::key`, got {ref!r}")
        doc, key = ref.split("::", 1)
        try:
            pending = create_pending_glue_ref(
                self.state.document, self.env.docname, self.lineno, doc, key
            )
        except PendingGlueReferenceError as exc:
            raise self.error(str(exc)) from exc
        figure = nodes.figure(
            "", pending, classes=["glued-figure"] + self.options.get("figclass", [])
        )
        for option in ("width", "alt"):
            if option in self.options:
                figure[f"glued_{option}"] = self.options[option]
        self.set_source_info(figure)
        self.add_name(figure)
        if self.content:
            body = nodes.Element()
            self.state.nested_parse(self.content, self.content_offset, body)
            first = body[0]
            if isinstance(first, nodes.paragraph):
                caption = nodes.caption(first.rawsource, "", *first.children)
                caption.source, caption.line = first.source, first.line
                figure += caption
                rest = body.children[1:]
            else:
                rest = body.children
            if rest:
                figure += nodes.legend("", *rest)
        return [figure]


class ApplyGluedFigureOptions(SphinxPostTransform):
    """Give the pasted image the width and alt text of its glued-figure."""

    default_priority = 6  # after MyST-NB's ReplacePendingGlueReferences (5)

    def run(self, **kwargs) -> None:
        for figure in self.document.findall(nodes.figure):
            if "glued-figure" not in figure["classes"]:
                continue
            for image in figure.findall(nodes.image):
                if "glued_width" in figure:
                    image["width"] = figure["glued_width"]
                if "glued_alt" in figure:
                    image["alt"] = figure["glued_alt"]


class WriteGluedImages(SphinxPostTransform):
    """Write the image files of figures pasted from other documents."""

    default_priority = 4  # before MyST-NB's ReplacePendingGlueReferences (5)

    def run(self, **kwargs) -> None:
        folder = self.env.mystnb_config.output_folder
        imgdir = Path(self.app.builder.outdir) / self.app.builder.imagedir
        for node in self.document.findall(PendingGlueReference):
            output = read_glue_cache(folder, node.refdoc).get(node.key)
            if output is None:
                continue  # MyST-NB warns about the missing key
            for mime, data in output["data"].items():
                if mime not in ("image/png", "image/jpeg", "image/gif"):
                    continue
                # The same file name as MyST-NB's cross-document glue computes.
                content = a2b_base64(data)
                ext = guess_extension(mime) or "." + mime.rsplit("/")[-1]
                ext = ".jpeg" if ext == ".jpe" else ext
                path = imgdir / f"{hashlib.sha256(content).hexdigest()}{ext}"
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(content)


def _note_glue_sources(app, doctree) -> None:
    env = app.env
    for node in doctree.findall(PendingGlueReference):
        if node.refdoc in env.found_docs:
            env.note_dependency(str(env.doc2path(node.refdoc)))


def setup(app):
    app.add_directive("glued-figure", GluedFigure)
    app.add_post_transform(WriteGluedImages)
    app.add_post_transform(ApplyGluedFigureOptions)
    app.connect("doctree-read", _note_glue_sources)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
