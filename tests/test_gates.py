"""House gates that keep the tree in order (run by ``make test``).

* ``ruff`` (lint and format, configured in ``pyproject.toml``) is clean over lnlib/, tests/, tools/
  and book/_ext/ (the book's Sphinx extensions);
* every public name of lnlib has a numpydoc docstring that describes every parameter and return
  value (numpydoc's own validator), and every public function and class says where the book
  covers it with a cross-reference (``Covered in :ref:`label```) to a label that exists, which
  the strict book build (``-n``) then resolves;
* no function in lnlib is longer than 60 lines of code, docstring excluded.
"""

import ast
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def _ruff():
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.fail("ruff is not installed: it is pinned in requirements/lock.txt (make env)")
    return exe


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_clean(args):
    run = subprocess.run(
        [_ruff(), *args, "lnlib", "tests", "tools", "book/_ext"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def _public_names(module):
    """The module's ``__all__``, or else the functions and classes it defines without a ``_``."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    ]


def _methods(cls):
    """Public methods defined by ``cls`` itself (static methods unwrapped)."""
    for meth, fn in vars(cls).items():
        fn = fn.__func__ if isinstance(fn, staticmethod) else fn
        if not meth.startswith("_") and inspect.isfunction(fn):
            yield meth, fn


def _public_objects(methods=True):
    """(qualified name, object) of every public function and class of lnlib, and their methods."""
    import lnlib.distributed
    import lnlib.formulas
    import lnlib.recompute
    import lnlib.reference
    import lnlib.torch_bridge

    seen = []
    modules = (lnlib, lnlib.reference, lnlib.formulas, lnlib.torch_bridge, lnlib.recompute)
    modules += (lnlib.distributed,)
    for module in modules:
        for name in _public_names(module):
            obj = getattr(module, name)
            seen.append((f"{module.__name__}.{name}", obj))
            if methods and inspect.isclass(obj):
                seen.extend((f"{module.__name__}.{name}.{meth}", fn) for meth, fn in _methods(obj))
    return seen


# Checks a docstring must pass: a summary; every parameter documented (PR01), none unknown
# (PR02), in the order of the signature (PR03), each with a description (PR07); a Returns
# section (RT01) whose entries are described (RT03).
NUMPYDOC_CHECKS = {"PR01", "PR02", "PR03", "PR07", "RT01", "RT03", "SS01", "GL08"}


def _inherited_signature(obj):
    """A ``torch.autograd.Function`` subclass is never instantiated (one calls its ``apply``):
    numpydoc sees the ``(*args, **kwargs)`` of torch's deprecated constructor, which no docstring
    can describe truthfully. Its parameter checks are made on its ``forward`` and ``backward``
    (static methods, validated below) instead; its summary and docstring are still checked."""
    torch = sys.modules.get("torch")
    return torch is not None and inspect.isclass(obj) and issubclass(obj, torch.autograd.Function)


@pytest.mark.parametrize(
    "name,obj", _public_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_numpydoc(name, obj):
    from numpydoc.validate import validate

    result = validate(f"{obj.__module__}.{obj.__qualname__}")
    checks = NUMPYDOC_CHECKS - ({"PR01", "PR02"} if _inherited_signature(obj) else set())
    errors = [f"{code}: {msg}" for code, msg in result["errors"] if code in checks]
    assert not errors, f"{name}:\n" + "\n".join(errors)


def test_numpydoc_gate_sees_methods_and_the_reference():
    """The gate covers what it claims: methods (static ones too) and lnlib.reference."""
    names = {name for name, _ in _public_objects()}
    assert {
        "lnlib.LayerNorm.backward",
        "lnlib.BatchNorm.eval",
        "lnlib.torch_bridge.LayerNormFunction.backward",
        "lnlib.torch_bridge.RMSNorm.reset_parameters",
        "lnlib.reference.layer_norm_forward",
        "lnlib.recompute.saved_bytes",
    } <= names


# ``Covered in :ref:`label``` or ``:doc:`/book/page``` (optionally ``title <target>``).
COVERED_IN = re.compile(r"Covered in\s+(?:the book,\s+)?:(ref|doc):`(?:[^`<]*<)?([^`>]+)>?`")


def _book_labels():
    labels = set()
    for page in (ROOT / "book").glob("*.md"):
        labels.update(re.findall(r"^\(([\w-]+)\)=\s*$", page.read_text(), flags=re.M))
    return labels


@pytest.mark.parametrize(
    "name,obj", _public_objects(methods=False), ids=lambda v: v if isinstance(v, str) else ""
)
def test_covered_in_is_a_checked_cross_reference(name, obj):
    """Each public function and class links the book section that covers it, to a target
    that exists (the strict build, ``-n``, would fail on a missing one as well)."""
    links = COVERED_IN.findall(inspect.getdoc(obj) or "")
    assert links, f"{name}: no 'Covered in :ref:`label`' (or :doc:) in its docstring"
    labels = _book_labels()
    for role, target in links:
        if role == "ref":
            assert target in labels, f"{name}: :ref:`{target}` is no label in book/*.md"
        else:
            page = ROOT / target.lstrip("/")
            assert page.with_suffix(".md").exists() or page.with_suffix(".ipynb").exists(), (
                f"{name}: :doc:`{target}` is no page (use a path from the root, /book/...)"
            )


def _code_lines(source, node):
    """Lines of code of a function: not blank, not a comment, not its docstring."""
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    body = node.body
    skip = range(0)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        skip = range(body[0].lineno - node.lineno, body[0].end_lineno - node.lineno + 1)
    return sum(
        1
        for i, line in enumerate(lines)
        if i not in skip and line.strip() and not line.strip().startswith("#")
    )


def _function_lengths(source, where):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{where}:{node.lineno} {node.name}", _code_lines(source, node)


def _long_functions(limit=MAX_FUNCTION_LINES):
    for path in sorted((ROOT / "lnlib").rglob("*.py")):
        for where, n in _function_lengths(path.read_text(), path.relative_to(ROOT)):
            if n > limit:
                yield f"{where} ({n} lines)"


def test_functions_fit_on_a_screen():
    long = list(_long_functions())
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code:\n" + "\n".join(long)


def test_function_length_counts_code_only():
    """The counter is not vacuous: docstring (blank lines included), blank and comment lines are
    left out, every other line of the function counts (the def line too)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    doc = '    """Summary.\n\n    More.\n\n    """\n'
    source = f"def f():\n{doc}    # a comment\n\n{body}\n    return x0\n"
    assert list(_function_lengths(source, "t")) == [("t:1 f", 61)]
    assert list(_long_functions(limit=10)), "the gate finds no function over 10 lines in lnlib"
