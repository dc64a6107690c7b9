"""Rewrite every notebook's Colab setup cell for the repository address in _config.yml.

Usage: python tools/sync_repository_url.py   (or `make sync-url`), then commit the notebooks.
Only the setup cell's source changes; it has no output, so no re-execution is needed.
"""

from __future__ import annotations

import sys

import nbformat

from notebook_template import ROOT, SETUP_MARKER, repository_url, setup_cell_source


def main() -> int:
    expected = setup_cell_source(repository_url())
    changed = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
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
