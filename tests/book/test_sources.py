"""Checks of the book's sources: notebooks follow the template, solutions are hidden,
citations resolve, and the API page documents every public name of lnlib."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from notebook_template import (  # noqa: E402 - tools/ is put on sys.path just above
    SETUP_MARKER,
    needs_no_deps,
    no_deps_packages,
    repository_url,
    setup_cell_source,
)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PAGES = sorted((ROOT / "book").glob("*.md"))


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections", []))
            walk(entry.get("chapters", []))

    walk(toc.get("parts", []))
    walk(toc.get("chapters", []))
    return files


def test_repository_url_is_set_once():
    url = repository_url()
    assert url.startswith("https://"), url
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert config["html"]["use_repository_button"] is True


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_follows_the_template(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), (
        "cell 1: a Markdown title and overview"
    )
    setup = nb.cells[1]
    assert setup.cell_type == "code" and setup.source == setup_cell_source(
        no_deps=needs_no_deps(nb)
    ), (
        "cell 2 must be the Colab-only setup cell exactly as tools/notebook_template.py "
        "writes it (run `make sync-url` after changing repository.url or the imports)"
    )
    assert not setup.outputs, "the setup cell must print nothing outside Colab"
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "default_rng(0)" in sources, "seed the generator: rng = np.random.default_rng(0)"
    assert sum(SETUP_MARKER in c.source for c in nb.cells) == 1
    assert 'matplotlib.use("Agg")' not in sources and "matplotlib.use('Agg')" not in sources
    assert nb.metadata["kernelspec"]["name"] == "python3"


def notebook_extra() -> set[str]:
    """Distributions lnlib[notebooks] installs, with their own dependencies (names normalised;
    the closure is taken over the packages installed here)."""
    from importlib.metadata import PackageNotFoundError, requires

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [
        Requirement(r).name
        for r in project["dependencies"] + project["optional-dependencies"]["notebooks"]
    ]
    found = set()
    while todo:
        name = _normalise(todo.pop())
        if name in found:
            continue
        found.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [
            r.name
            for r in map(Requirement, reqs)
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return found


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_installs_what_the_notebook_imports(path):
    """In Colab only the setup cell installs: every module a notebook imports must come from
    the standard library, lnlib, lnlib[notebooks] or requirements/no-deps.txt."""
    from importlib.metadata import packages_distributions

    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    modules = set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, re.MULTILINE))
    installed = (
        notebook_extra()
        | {_normalise(r.split("==")[0]) for r in no_deps_packages().values()}
        | {"lnlib"}
    )
    dists = packages_distributions()
    missing = {}
    for module in sorted(modules - set(sys.stdlib_module_names) - {"lnlib"}):
        names = {_normalise(d) for d in dists.get(module, [module])}
        if not names & installed:
            missing[module] = sorted(names)
    assert not missing, (
        f"{path.name} imports {missing}, which lnlib[notebooks] does not install: add them to "
        "the notebooks extra in pyproject.toml (and `make lock`)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_reads_no_repository_file(path):
    """In Colab only the .ipynb exists: a notebook may not open files of the repository (data
    it needs ships in lnlib, e.g. lnlib.data.load_benchmark, or is computed)."""
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    found = re.findall(r"""["'](?:\.\./|\./)[^"']*["']""", code)
    assert not found, f"{path.name} refers to repository paths {found}: ship the data in lnlib"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_executed(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.execution_count for c in code]
    assert None not in counts, "commit the notebook executed (make execute NB=...)"
    assert counts == list(range(1, len(code) + 1)) or counts == sorted(counts), (
        "execute top to bottom from a fresh kernel"
    )
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_in_the_toc(path):
    assert f"notebooks/{path.stem}" in toc_files()


def _markdown_sources():
    for page in PAGES:
        yield page.name, page.read_text()
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        yield path.name, "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def test_solutions_are_hidden():
    for name, text in _markdown_sources():
        for match in re.finditer(
            r"(`{3,}|:{3,})\{solution(-start)?\}[^\n]*\n((?::[^\n]*\n)*)", text
        ):
            assert re.search(r":class:.*\bdropdown\b", match.group(3)), (
                f"{name}: a solution without `:class: dropdown` would be shown to the reader"
            )


def test_citations_resolve_and_required_entries_exist():
    bib = (ROOT / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,\s]+),", bib))
    for key in [
        "ba2016layer",
        "ioffe2015batch",
        "zhang2019root",
        "peebles2023scalable",
        "xiong2020layer",
    ]:
        assert key in keys
    for name, text in _markdown_sources():
        for cited in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text):
            for key in cited.split(","):
                assert key.strip() in keys, f"{name}: unknown citation {key!r}"


def test_api_page_documents_every_public_name():
    import lnlib

    api = (ROOT / "book" / "api.md").read_text()
    missing = [n for n in lnlib.__all__ if f"lnlib.{n}\n" not in api]
    assert not missing, f"add to book/api.md: {missing}"
