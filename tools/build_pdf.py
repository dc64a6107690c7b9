"""Build the PDF edition of the book (``make pdf``) strictly, into _build/pdf/lnlib.pdf.

1. ``jupyter-book build . --builder pdflatex`` with the strict options of ``make book``
   (``-W -n --keep-going``: a Sphinx warning fails the build) from an empty _build/latex;
   latexmk runs XeLaTeX until the references settle and stops at the first LaTeX error.
2. The final LaTeX log and the PDF driver's output are checked: an undefined reference or
   citation (printed "??"), a figure file that cannot be read, a character missing from the
   fonts, a link to a target that does not exist, or a page of ``_toc.yml`` that did not
   reach the LaTeX file fails the build, with every such line printed.
3. The PDF is copied to _build/pdf/lnlib.pdf, with the build output in _build/pdf/build.log,
   and, when the web book is built, to _build/html/lnlib.pdf, where its front page links to
   (the Pages workflow publishes it there).

Usage: python tools/build_pdf.py [extra jupyter-book options]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LATEX = ROOT / "_build" / "latex"
OUT = ROOT / "_build" / "pdf"
TARGET = "lnlib"  # latex.latex_documents.targetname in _config.yml, without .tex

# Lines of the final XeLaTeX log that fail the build.
LOG_ERRORS = [
    (re.compile(r"LaTeX Warning: (Reference|Hyper reference) `"), "undefined reference"),
    (re.compile(r"LaTeX Warning: Citation `"), "undefined citation"),
    (
        re.compile(r"LaTeX Warning: There were undefined (references|citations)"),
        "undefined references",
    ),
    (
        re.compile(r"LaTeX Warning: (Label|Reference|Citation)s? .*multiply defined"),
        "label defined twice",
    ),
    (re.compile(r"LaTeX Warning: File `[^']*' not found"), "missing file"),
    (
        re.compile(r"Unable to load picture|File `[^']*' not found|cannot find image file"),
        "missing figure",
    ),
    (re.compile(r"Missing character: There is no"), "character missing from the font"),
    (re.compile(r"^! "), "LaTeX error"),
]
# Lines of the PDF driver (xdvipdfmx), printed to latexmk's output, that fail the build.
DRIVER_ERRORS = [
    (
        re.compile(
            r"xdvipdfmx:warning: (Object @.* not defined|.*[Uu]ndefined destination"
            r"|Could not find image|Image inclusion failed)"
        ),
        "broken link or image",
    ),
    (re.compile(r"xdvipdfmx:fatal"), "PDF driver error"),
]


def toc_docnames() -> list[str]:
    """Every page of _toc.yml (the root, chapters and their sections), in order."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    names = [toc["root"]]

    def walk(entries):
        for entry in entries:
            if "file" in entry:
                names.append(entry["file"])
            walk(entry.get("sections", []))
            for part in entry.get("parts", []):
                walk(part.get("chapters", []))

    for part in toc.get("parts", []):
        walk(part.get("chapters", []))
    walk(toc.get("chapters", []))
    return [re.sub(r"\.(md|ipynb)$", "", name) for name in names]


def check(log_text: str, driver_text: str, aux_text: str) -> list[str]:
    """The reasons (one line each) why the built PDF is not acceptable."""
    problems = []
    for lines, rules in ((log_text, LOG_ERRORS), (driver_text, DRIVER_ERRORS)):
        for line in lines.splitlines():
            for pattern, what in rules:
                if pattern.search(line):
                    problems.append(f"{what}: {line.strip()}")
                    break
    for docname in toc_docnames():
        # Sphinx writes \label{<docname>::doc} at the start of every page it includes.
        if f"{{{docname}::doc}}" not in aux_text:
            problems.append(f"missing page: {docname} (in _toc.yml, not in {TARGET}.tex)")
    return problems


def _shown(line: str) -> bool:
    if line.startswith(("Latexmk:", "Run number", "Running '", "Output written")):
        return True
    tex = line.startswith((" ", "(", ")", "[", "<", "\\", "{", "!", "l.")) or "Warning" in line
    return not tex and bool(line.strip())


def main(argv: list[str]) -> int:
    shutil.rmtree(LATEX, ignore_errors=True)  # no stale .aux, .toc or images
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{TARGET}.pdf").unlink(missing_ok=True)
    env = dict(os.environ)
    # latexmk (run by jupyter-book through _build/latex/Makefile): never wait for input,
    # stop at the first error.
    env["LATEXMKOPTS"] = "-interaction=nonstopmode -halt-on-error -file-line-error"
    env["max_print_line"] = "100000"  # one log line per message, for the checks below
    cmd = [
        str(Path(sys.executable).with_name("jupyter-book")),
        "build",
        str(ROOT),
        "--builder",
        "pdflatex",
        "--all",
        "-W",
        "-n",
        "--keep-going",
        *argv,
    ]
    print("+", " ".join(cmd), flush=True)
    start = time.monotonic()
    with open(OUT / "build.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        output = []
        for line in proc.stdout:
            log.write(line)
            output.append(line)
            # The whole output is in build.log; the console gets Sphinx's lines and
            # latexmk's, not XeLaTeX's (whose warnings of the early runs are expected: the
            # final log is checked below).
            if _shown(line):
                sys.stdout.write(line)
        returncode = proc.wait()
    seconds = time.monotonic() - start
    pdf = LATEX / f"{TARGET}.pdf"
    log_file = LATEX / f"{TARGET}.log"
    if returncode != 0 or not pdf.is_file() or not log_file.is_file():
        if log_file.is_file():  # XeLaTeX's error, with the lines that locate it
            lines = log_file.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if line.startswith("! "):
                    print("\n".join(lines[i : i + 6]), file=sys.stderr)
        print(
            f"make pdf: the build failed (exit status {returncode}); the whole output is in"
            f" {OUT / 'build.log'}, the LaTeX log in {log_file}",
            file=sys.stderr,
        )
        return 1
    aux = LATEX / f"{TARGET}.aux"
    problems = check(
        log_file.read_text(errors="replace"),
        "".join(output),
        aux.read_text(errors="replace") if aux.is_file() else "",
    )
    if problems:
        print(f"make pdf: {len(problems)} problem(s) in the PDF build:", file=sys.stderr)
        for problem in problems:
            print("  " + problem, file=sys.stderr)
        return 1
    shutil.copy2(pdf, OUT / f"{TARGET}.pdf")
    # The web book's front page links to ../lnlib.pdf: beside the HTML, as on the site.
    html = ROOT / "_build" / "html"
    if (html / "index.html").is_file():
        shutil.copy2(pdf, html / f"{TARGET}.pdf")
    print(f"make pdf: {OUT / (TARGET + '.pdf')} built in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
