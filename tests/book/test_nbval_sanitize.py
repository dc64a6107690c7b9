"""The nbval sanitizers (tools/nbval_sanitize.cfg) mask what varies from machine to machine and
nothing else: every stored figure becomes the placeholder, a printed timing becomes TIME, and
no pattern edits the text of a figure before the figure pattern sees it."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbval.plugin import get_sanitize_patterns

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tools" / "nbval_sanitize.cfg"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PATTERNS = get_sanitize_patterns(CONFIG.read_text())


def sanitize(text: str) -> str:
    """What nbval does to each output string: every pattern, in the file's order."""
    for regex, replace in PATTERNS:
        text = re.sub(regex, replace, text)
    return text


def image_outputs():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for index, cell in enumerate(nb.cells):
            for output in cell.get("outputs", []):
                for mime, value in output.get("data", {}).items():
                    if "image/" in mime:
                        text = value if isinstance(value, str) else "".join(value)
                        yield pytest.param(text, id=f"{path.stem}-cell{index}-{mime}")


IMAGES = list(image_outputs())


def test_there_are_figures_to_mask():
    assert len(IMAGES) > 10


@pytest.mark.parametrize("text", IMAGES)
def test_every_stored_figure_sanitizes_to_the_placeholder(text):
    assert sanitize(text) == "PNG-IMAGE"


@pytest.mark.parametrize("text", IMAGES)
def test_the_other_patterns_leave_base64_alone(text):
    others = [(regex, replace) for regex, replace in PATTERNS if replace != "PNG-IMAGE"]
    for regex, _ in others:
        assert re.search(regex, text) is None, regex


@pytest.mark.parametrize(
    ("printed", "expected"),
    [
        ("took 12.3 ms", "took' TIME'"),
        ("1.2 µs ± 30 ns per loop", "' TIME' per loop"),
        ("forward:   9.1 ms\nbackward:  10.4 ms", "forward:' TIME'\nbackward:' TIME'"),
        ("<object at 0x7f3a9c2b10d0>", "<object at 0xADDRESS>"),
    ],
)
def test_timings_and_addresses_are_still_masked(printed, expected):
    assert sanitize(printed) == expected


@pytest.mark.parametrize("printed", ["shape (4096, 768)", "b64s", "x12ms", "3 seeds", "2.5x"])
def test_text_that_is_not_a_timing_is_kept(printed):
    assert sanitize(printed) == printed
