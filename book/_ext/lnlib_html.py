"""Sphinx extension of the lnlib book: each inline script once in every page.

Sphinx 7.4 registers a script added with ``app.add_js_file(None, body=...)`` after the builder
started twice: once as the builder got it (file name ``None``) and once more from the registry
when writing starts (file name ``''``), and the two do not compare equal. sphinx-thebe adds its
settings that way (``const THEBE_JS_URL = ...``), so every page declared the constant twice and
the browser reported "Identifier 'THEBE_JS_URL' has already been declared"
(sphinx-togglebutton's ``var togglebuttonSelector`` is doubled too, without an error).
"""

from __future__ import annotations


def unique_scripts(app, pagename, templatename, context, doctree) -> None:
    """Drop the second copy of a script: same file (``None`` or ``''``), body and attributes."""
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, unique = set(), []
    for script in scripts:
        filename = getattr(script, "filename", script) or ""
        attributes = tuple(sorted(getattr(script, "attributes", {}).items()))
        key = (str(filename), attributes)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    scripts[:] = unique


def setup(app):
    app.connect("html-page-context", unique_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
