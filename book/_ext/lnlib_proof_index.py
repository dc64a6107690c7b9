"""Sphinx extension of the lnlib book: the proof index lists results by title.

sphinx-proof (0.4) builds its index (``prf-prf.html``) from the labels alone: an entry reads
``prop-ch02-shift``, grouped under that label. This extension records the title of every
labelled ``prf`` directive as pages are read and replaces sphinx-proof's ``ProofIndex.generate``
(there is no hook for it) with one that lists each result by its title ("Shift invariance"),
with the page it is on and its kind, under the title's first letter.
"""


def _note_proof_titles(app, doctree):
    """Remember the title of every labelled prf directive, for the proof index."""
    titles = app.env.__dict__.setdefault("lnlib_proof_titles", {})
    for node in doctree.findall(lambda n: "realtype" in getattr(n, "attributes", {})):
        if node.get("label"):
            titles[node["label"]] = node.get("title", "")


def _merge_proof_titles(app, env, docnames, other):
    env.__dict__.setdefault("lnlib_proof_titles", {}).update(
        getattr(other, "lnlib_proof_titles", {})
    )


def _proof_index_generate(self, docnames=None):
    """sphinx-proof's index, listing each result by its title ("Shift invariance") instead of
    its label ("prop-ch02-shift"), with the page it is on and its kind."""
    env = self.domain.env
    titles = getattr(env, "lnlib_proof_titles", {})
    content = {}
    for anchor, values in getattr(env, "proof_list", {}).items():
        docname = values["docname"]
        title = titles.get(anchor, "").strip().strip("()").strip() or anchor
        page = env.titles[docname].astext() if docname in env.titles else docname
        entry = (title, 0, docname, anchor, page, "", values["realtype"])
        content.setdefault(title[:1].upper(), []).append(entry)
    return sorted((letter, sorted(entries)) for letter, entries in content.items()), True


def setup(app):
    import sphinx_proof.domain

    sphinx_proof.domain.ProofIndex.generate = _proof_index_generate
    app.connect("doctree-read", _note_proof_titles)
    app.connect("env-merge-info", _merge_proof_titles)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
