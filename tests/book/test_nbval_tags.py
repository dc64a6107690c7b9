"""tools/nbval_tags.py moves nbval's comment markers into cell tags with the same effect, and
the committed notebooks carry none (readers of the book would see them in the code)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import nbformat
import pytest
from nbval.plugin import find_comment_markers, find_metadata_tags

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from nbval_tags import MARKER_TAGS, MarkerError, convert, main, marked_cells  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def notebook(*sources: str, tags=None) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# NBVAL_SKIP in Markdown is prose")]
    for source in sources:
        cell = nbformat.v4.new_code_cell(source)
        if tags is not None:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    return nb


@pytest.mark.parametrize("marker", sorted(MARKER_TAGS))
def test_the_tag_means_to_nbval_what_the_comment_meant(marker):
    source = f"# {marker}\n# why: the digits depend on the CPU\nprint(1)"
    nb = notebook(source)
    assert convert(nb) == 1
    cell = nb.cells[1]
    assert dict(find_metadata_tags(cell.metadata)) == dict(find_comment_markers(source))
    assert cell.source == "# why: the digits depend on the CPU\nprint(1)"
    assert not list(find_comment_markers(cell.source))


def test_markers_anywhere_are_moved_and_other_lines_kept():
    nb = notebook("x = 1\n  ##  NBVAL_IGNORE_OUTPUT  \n\nprint(x)  # NBVAL_SKIP is not a line")
    convert(nb)
    assert nb.cells[1].source == "x = 1\n\nprint(x)  # NBVAL_SKIP is not a line"
    assert nb.cells[1].metadata["tags"] == ["nbval-ignore-output"]


def test_existing_tags_are_kept_and_not_duplicated():
    nb = notebook("# NBVAL_IGNORE_OUTPUT\nprint(1)", tags=["hide-input", "nbval-ignore-output"])
    assert convert(nb) == 1
    assert nb.cells[1].metadata["tags"] == ["hide-input", "nbval-ignore-output"]


def test_a_second_run_changes_nothing():
    nb = notebook("# NBVAL_IGNORE_OUTPUT\nprint(1)", "# NBVAL_RAISES_EXCEPTION\n1 / 0", "y = 2")
    assert convert(nb) == 2
    once = copy.deepcopy(nb)
    assert convert(nb) == 0
    assert nb == once
    assert nb.cells[2].metadata["tags"] == ["raises-exception"]
    assert nb.cells[0].source == "# NBVAL_SKIP in Markdown is prose"
    assert "tags" not in nb.cells[3].metadata


def test_a_look_alike_is_refused_and_nothing_is_changed():
    nb = notebook("# NBVAL_IGNORE_OUTPUT\nprint(1)", "# NBVAL_IGNORE_OUTPUT: timings\nprint(2)")
    before = copy.deepcopy(nb)
    with pytest.raises(MarkerError, match=r"cell 2, line 1: '# NBVAL_IGNORE_OUTPUT: timings'"):
        convert(nb)
    assert nb == before


def test_the_command_rewrites_only_notebooks_with_markers(tmp_path, capsys):
    marked, clean = tmp_path / "marked.ipynb", tmp_path / "clean.ipynb"
    nbformat.write(notebook("# NBVAL_IGNORE_OUTPUT\nprint(1)"), marked)
    nbformat.write(notebook("print(1)"), clean)
    clean_bytes = clean.read_bytes()
    assert main(["--check", str(marked), str(clean)]) == 1
    assert main([str(marked), str(clean)]) == 0
    assert clean.read_bytes() == clean_bytes
    assert main(["--check", str(marked), str(clean)]) == 0
    assert nbformat.read(marked, as_version=4).cells[1].metadata["tags"] == ["nbval-ignore-output"]
    assert main([str(tmp_path / "missing.ipynb")]) == 2
    assert "not a notebook file" in capsys.readouterr().err


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_carry_tags_not_marker_comments(path):
    """Fix: `.venv/bin/python tools/nbval_tags.py notebooks/*.ipynb` (or `make execute`)."""
    cells = marked_cells(nbformat.read(path, as_version=4))
    assert not cells, f"{path.name}: NBVAL comment markers in code cells {cells}"
