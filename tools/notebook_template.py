"""The notebook template of the lnlib book, and a command that starts a new notebook from it.

Usage:
    python tools/notebook_template.py notebooks/03_properties.ipynb "Properties of LayerNorm"

Every notebook follows the house template (shared STYLE.md):

1. a Markdown cell: the title and a two-line overview;
2. the setup cell, exactly as ``setup_cell_source`` writes it (tests/book checks this):
   only inside Colab, it installs ``lnlib[notebooks]`` from the book's repository (and, with
   ``--no-deps``, any package of requirements/no-deps.txt the notebook imports); elsewhere
   it does nothing;
3. a code cell with all imports, ``rng = np.random.default_rng(0)`` and print options;
4. sections: explain or derive, compute from scratch, compare with lnlib, plot;
5. exercises, each checked by a checker from ``lnlib.exercises``;
6. a summary and what comes next.
"""

from __future__ import annotations

import re
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


def no_deps_packages() -> dict[str, str]:
    """Import name -> pinned requirement of the packages installed without their dependencies
    (requirements/no-deps.txt)."""
    found = {}
    for line in (ROOT / "requirements" / "no-deps.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "--")):
            requirement = line.split()[0]
            found[requirement.split("==")[0].replace("-", "_")] = requirement
    return found


def needs_no_deps(nb: nbformat.NotebookNode) -> list[str]:
    """The no-deps requirements a notebook imports, in the order of requirements/no-deps.txt."""
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return [
        req
        for name, req in no_deps_packages().items()
        if re.search(rf"^\s*(from|import)\s+{name}\b", code, re.MULTILINE)
    ]


def setup_cell_source(url: str | None = None, no_deps: list[str] | tuple = ()) -> str:
    """The source of a notebook's setup cell: in Colab, install lnlib with the packages the
    notebooks import (the ``notebooks`` extra), and the ``no_deps`` requirements without
    their declared dependencies."""
    url = url or repository_url()
    lines = [
        "# Setup: inside Colab, install lnlib and what the notebooks import; elsewhere do nothing.",
        "import sys",
        "",
        f"if {SETUP_MARKER}:",
        f'    %pip install --quiet "lnlib[notebooks] @ git+{url}"',
    ]
    lines += [f'    %pip install --quiet --no-deps "{req}"' for req in no_deps]
    return "\n".join(lines)


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
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            f"# {title}\n\nIn this notebook you will ... (two lines: what the reader does "
            "and what they get out of it)."
        ),
        nbformat.v4.new_code_cell(setup_cell_source()),
        nbformat.v4.new_code_cell(IMPORTS),
        nbformat.v4.new_markdown_cell(
            "## First section\n\nExplain, compute from scratch, compare with lnlib, plot."
        ),
        nbformat.v4.new_code_cell(""),
        nbformat.v4.new_markdown_cell(
            "## Exercises\n\n**Exercise 1.** ... Write `my_fn` and run the check below."
        ),
        nbformat.v4.new_code_cell(
            'def my_fn(x):\n    raise NotImplementedError("your code here")\n\n\n'
            "# from lnlib.exercises import chNN\n# chNN.check_my_fn(my_fn)"
        ),
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
