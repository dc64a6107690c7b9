"""Rewrite every notebook's Colab setup cell from tools/notebook_template.py: the repository
address in _config.yml, lnlib[notebooks], and the no-deps packages the notebook imports.

Usage: python tools/sync_repository_url.py   (or `make sync-url`), then commit the notebooks.
Only the setup cell's source changes; it has no output, so no re-execution is needed.
"""

from __future__ import annotations

import sys

import nbformat
from notebook_template import (
    ROOT,
    SETUP_MARKER,
    needs_no_deps,
    repository_url,
    setup_cell_source,
)


def main() -> int:
    url = repository_url()
    changed = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        expected = setup_cell_source(url, needs_no_deps(nb))
        cells = [c for c in nb.cells if c.cell_type == "code" and SETUP_MARKER in c.source]
        if len(cells) != 1:
            print(f"{path.name}: expected one setup cell, found {len(cells)}; fix it by hand")
            continue
        if cells[0].source != expected:
            cells[0].source = expected
            nbformat.write(nb, path)
            changed += 1
            print(f"{path.name}: setup cell updated")
    print(f"{changed} notebook(s) changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
