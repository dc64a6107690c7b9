"""Execute notebooks in place, deterministically, so that they can be committed with outputs.

Usage: python tools/execute_notebook.py notebooks/01_motivation.ipynb [more.ipynb ...]
(or `make execute NB=notebooks/01_motivation.ipynb`).

Every notebook runs from a fresh kernel named ``python3`` in the notebook's folder (as the
book build and nbval run it), with a fixed hash seed. Execution counts are renumbered from
1, transient metadata is dropped and the kernelspec is fixed, so re-executing an unchanged
notebook gives an identical file (and a clean git diff). The time each notebook takes is
printed: the house rule is under 60 s on a 2-core machine.

nbval's comment markers (``# NBVAL_IGNORE_OUTPUT``) are moved into cell tags first
(tools/nbval_tags.py), so that readers of the book do not see them in the code.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbval_tags import convert as move_nbval_markers

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
TIMEOUT_S = 120


def normalise(nb: nbformat.NotebookNode) -> None:
    """Drop what changes between runs but carries no content."""
    nb.metadata = nbformat.NotebookNode(
        {
            "kernelspec": KERNELSPEC,
            "language_info": {"name": "python", "pygments_lexer": "ipython3"},
        }
        | {
            k: v
            for k, v in nb.metadata.items()
            if k not in ("kernelspec", "language_info", "widgets", "vscode", "colab")
        }
    )
    count = 0
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
        cell.pop("id", None)
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            for output in cell.outputs:
                if "execution_count" in output:
                    output.execution_count = count
                output.get("metadata", {}).pop("execution", None)


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    move_nbval_markers(nb, str(path))
    nb.metadata["kernelspec"] = KERNELSPEC
    os.environ["PYTHONHASHSEED"] = "0"
    client = NotebookClient(
        nb,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    normalise(nb)
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):  # stable cell ids: nbformat 4.5 requires them
        cell["id"] = f"cell-{i:03d}"
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for name in argv:
        elapsed = execute(Path(name))
        flag = "" if elapsed < 60 else "  (over the 60 s budget!)"
        print(f"{name}: executed in {elapsed:.1f} s{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
