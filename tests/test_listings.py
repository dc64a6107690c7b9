"""The book's code listings are included from the source files the tests and the benchmark run:
every ``literalinclude`` of book/*.md must find its file and its markers, in order."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```\{literalinclude\}\s+(\S+)\n((?::[\w-]+:.*\n)*)```")


def listings():
    """(page, included path, {option: value}) for every literalinclude in the book."""
    found = []
    for page in sorted((ROOT / "book").glob("*.md")):
        for m in BLOCK.finditer(page.read_text()):
            options = dict(re.findall(r":([\w-]+):\s*(.*)", m.group(2)))
            found.append((page.name, m.group(1), options))
    return found


def test_the_book_has_listings_from_both_kernels():
    paths = {p for _, p, _ in listings()}
    assert any("_cpu/" in p for p in paths) and any("_cuda/" in p for p in paths), paths


@pytest.mark.parametrize("page,path,options", listings(), ids=lambda v: str(v)[:40])
def test_listing_markers_are_in_the_source(page, path, options):
    source = (ROOT / "book" / path).resolve()
    assert source.is_file(), f"{page}: {path} does not exist"
    text = source.read_text()
    starts = [options[k] for k in ("start-at", "start-after") if k in options]
    ends = [options[k] for k in ("end-at", "end-before") if k in options]
    assert starts and ends, f"{page}: the listing of {path} must be between two markers"
    first = text.find(starts[0])
    assert first >= 0, f"{page}: marker {starts[0]!r} is missing from {path}"
    assert text.count(starts[0]) == 1, f"{page}: marker {starts[0]!r} is not unique in {path}"
    last = text.find(ends[0], first + len(starts[0]))
    assert last > first, f"{page}: marker {ends[0]!r} is missing after the start in {path}"
