"""Move nbval's comment markers (``# NBVAL_IGNORE_OUTPUT`` ...) into the cell tags nbval reads.

Usage:
    python tools/nbval_tags.py notebooks/*.ipynb          rewrite the notebooks in place
    python tools/nbval_tags.py --check notebooks/*.ipynb  list the cells still marked; exit 1

A marker comment is part of the code a reader sees in the book; a cell tag is not (nbval
reads both: ``nbval-ignore-output`` does what ``# NBVAL_IGNORE_OUTPUT`` does). nbval takes
every whole-line comment of a code cell whose text is a marker, wherever it stands, so every
such line is moved; the other lines (a comment saying why the output is not compared) stay.
``# NBVAL_RAISES_EXCEPTION`` becomes the tag ``raises-exception``, which nbval and the book
build (MyST-NB) both read, so the book build lets that cell raise as nbval does.

Running it again changes nothing, and a notebook without markers is not rewritten. A comment
that looks like a marker but is none (``# NBVAL_IGNORE_OUTPUTS``) would be ignored by nbval
without a word: it is reported as an error and nothing is written.
tools/execute_notebook.py applies the same conversion to every notebook it executes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

# nbval's comment markers (nbval/plugin.py: comment_markers) -> the tag with the same effect.
MARKER_TAGS = {
    "NBVAL_IGNORE_OUTPUT": "nbval-ignore-output",
    "PYTEST_VALIDATE_IGNORE_OUTPUT": "nbval-ignore-output",
    "NBVAL_CHECK_OUTPUT": "nbval-check-output",
    "NBVAL_RAISES_EXCEPTION": "raises-exception",
    "NBVAL_SKIP": "nbval-skip",
}
# A comment line that starts like a marker (nbval strips the '#'s and the spaces around).
MARKER_PREFIX = re.compile(r"^\s*#+\s*(NBVAL_|PYTEST_VALIDATE_)")


class MarkerError(ValueError):
    """A comment that looks like an nbval marker but is not one nbval knows."""


def marker_of(line: str) -> str | None:
    """The marker a source line is (as nbval reads it), or None."""
    comment = line.strip()
    if not comment.startswith("#"):
        return None
    comment = comment.lstrip("#").strip()
    return comment if comment in MARKER_TAGS else None


def convert_cell(cell: nbformat.NotebookNode, where: str = "cell") -> bool:
    """Move the markers of one code cell into its tags; True when the cell changed."""
    if cell.cell_type != "code":
        return False
    lines = cell.source.splitlines()
    kept, tags = [], []
    for number, line in enumerate(lines, 1):
        marker = marker_of(line)
        if marker is not None:
            tags.append(MARKER_TAGS[marker])
        elif MARKER_PREFIX.match(line):
            raise MarkerError(
                f"{where}, line {number}: {line.strip()!r} is not a marker nbval knows "
                f"(expected one of {', '.join(sorted(MARKER_TAGS))})"
            )
        else:
            kept.append(line)
    if not tags:
        return False
    while kept and not kept[0].strip():  # the marker was the first line: no blank line left
        kept.pop(0)
    cell.source = "\n".join(kept) + ("\n" if cell.source.endswith("\n") and kept else "")
    existing = list(cell.metadata.get("tags", []))
    cell.metadata["tags"] = existing + [t for t in dict.fromkeys(tags) if t not in existing]
    return True


def convert(nb: nbformat.NotebookNode, name: str = "notebook") -> int:
    """Convert every code cell of a notebook in place; the number of cells changed.

    Every cell is checked before any is changed, so a bad marker leaves ``nb`` as it was."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for number, line in enumerate(cell.source.splitlines(), 1):
                if MARKER_PREFIX.match(line) and marker_of(line) is None:
                    raise MarkerError(
                        f"{name}, cell {index}, line {number}: {line.strip()!r} is not a "
                        f"marker nbval knows (expected one of {', '.join(sorted(MARKER_TAGS))})"
                    )
    return sum(convert_cell(cell, f"{name}, cell {i}") for i, cell in enumerate(nb.cells))


def marked_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells that still carry a comment marker."""
    return [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        and any(MARKER_PREFIX.match(line) for line in cell.source.splitlines())
    ]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"]
    if not paths:
        print(__doc__)
        return 2
    missing = [str(p) for p in paths if p.suffix != ".ipynb" or not p.is_file()]
    if missing:
        print(f"not a notebook file: {', '.join(missing)}", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if check:
            cells = marked_cells(nb)
            if cells:
                print(f"{path}: NBVAL comment markers in cells {cells}")
                status = 1
            continue
        try:
            changed = convert(nb, str(path))
        except MarkerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        if changed:
            nbformat.write(nb, path)
            print(f"{path}: markers moved into the tags of {changed} cells")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
