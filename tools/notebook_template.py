"""The notebook template of the lnlib book, and a command that starts a new notebook from it.

Usage: python tools/notebook_template.py notebooks/03_properties.ipynb "Properties of layer normalization"

Every notebook follows the house template (shared STYLE.md):

1. a Markdown cell: the title and a two-line overview;
2. the setup cell, exactly as ``setup_cell_source`` writes it (tests/book checks this):
   it installs lnlib from the book's repository only inside Colab and does nothing elsewhere;
3. a code cell with all imports, ``rng = np.random.default_rng(0)`` and print options;
4. sections: explain or derive, compute from scratch, compare with lnlib, plot;
5. exercises, each checked by a checker from ``lnlib.exercises``;
6. a summary and what comes next.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SETUP_MARKER = '"google.colab" in sys.modules'


def repository_url() -> str:
    """The repository address, from _config.yml (the one place it is set)."""
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    return config["repository"]["url"].rstrip("/")


def setup_cell_source(url: str | None = None) -> str:
    """The source of every notebook's setup cell."""
    url = url or repository_url()
    return (
        "# Setup: inside Colab, install lnlib from the book's repository; elsewhere do nothing.\n"
        "import sys\n"
        "\n"
        f"if {SETUP_MARKER}:\n"
        f'    %pip install --quiet "lnlib @ git+{url}"'
    )


IMPORTS = (
    "import numpy as np\n"
    "import matplotlib.pyplot as plt\n"
    "\n"
    "import lnlib\n"
    "from lnlib.exercises import glue\n"
    "\n"
    "rng = np.random.default_rng(0)\n"
    "np.set_printoptions(precision=4, suppress=True)"
)


def new_notebook(title: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            f"# {title}\n\nIn this notebook you will ... (two lines: what the reader does "
            "and what they get out of it)."),
        nbformat.v4.new_code_cell(setup_cell_source()),
        nbformat.v4.new_code_cell(IMPORTS),
        nbformat.v4.new_markdown_cell("## First section\n\nExplain, compute from scratch, "
                                      "compare with lnlib, plot."),
        nbformat.v4.new_code_cell(""),
        nbformat.v4.new_markdown_cell(
            "## Exercises\n\n**Exercise 1.** ... Write `my_fn` and run the check below."),
        nbformat.v4.new_code_cell(
            "def my_fn(x):\n    raise NotImplementedError(\"your code here\")\n\n\n"
            "# from lnlib.exercises import chNN\n# chNN.check_my_fn(my_fn)"),
        nbformat.v4.new_markdown_cell("## Summary\n\n- ...\n\nNext: ..."),
    ]
    return nb


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    path = Path(argv[0])
    if path.exists():
        print(f"{path} exists; not overwriting it")
        return 1
    nbformat.write(new_notebook(argv[1]), path)
    print(f"wrote {path}; fill it in, then `make execute NB={path}` and commit it")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
