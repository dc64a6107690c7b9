"""lnlib._docs: the Parameters sections written from a signature and a table of entries."""

import inspect

import pytest

from lnlib import _docs

TABLE = {
    "eps": "eps : float, default {default}\n    Added to the variance.",
    "dtype": "dtype : dtype, default {default}\n    Dtype of the parameters.",
}


def test_parameters_follow_the_signature_with_its_defaults():
    @_docs.parameters(TABLE)
    def f(x, eps=1e-5, *, dtype=float):
        """Summary.

        Parameters
        ----------
        x : ndarray
            Input.

        Returns
        -------
        ndarray
            Output.
        """

    doc = inspect.getdoc(f)
    params = doc[doc.index("Parameters") : doc.index("Returns")]
    assert params.split("\n")[2:] == [
        "x : ndarray",
        "    Input.",
        "eps : float, default 1e-5",
        "    Added to the variance.",
        "dtype : dtype, default float",
        "    Dtype of the parameters.",
        "",
        "",
    ]
    assert doc.startswith("Summary.\n\nParameters\n----------\n")
    assert doc.rstrip().endswith("Returns\n-------\nndarray\n    Output.")


def test_own_entries_win_and_a_shared_entry_stands_for_its_names():
    class C:
        """Summary.

        Parameters
        ----------
        a, b : int
            Both.
        eps : float
            Its own.
        """

        def __init__(self, a, b, eps=0.1, dtype=None):
            pass

    doc = inspect.getdoc(_docs.parameters(TABLE, dtype="dtype : None\n    More.")(C))
    assert doc.count("a, b : int") == 1 and "Its own." in doc and "Added to" not in doc
    assert doc.endswith("dtype : None\n    More.")


def test_a_section_goes_before_the_later_ones_and_a_missing_entry_fails():
    def g(eps=1e-6):
        """Summary.

        Returns
        -------
        None
            Nothing.
        """

    doc = inspect.getdoc(_docs.parameters(TABLE)(g))
    assert doc.index("eps : float, default 1e-6") < doc.index("Returns")

    def h(nothing_known):
        """Summary."""

    with pytest.raises(KeyError, match="nothing_known"):
        _docs.parameters(TABLE)(h)


def test_a_bridge_function_gets_returns_and_raises_from_its_signature():
    """torch_function: the differentiable inputs and the checks are those of the signature."""

    def plain(x, normalized_shape, weight=None, eps=1e-5):
        """Summary.

        Covered in here.
        """

    def fused(x, residual, normalized_shape, weight=None, residual_dtype=None):
        """Summary."""

    def scalar(x, alpha, bias=None):
        """Summary."""

    table = {**TABLE, **{n: f"{n} : object\n    Its {n}." for n in ("x", "weight", "bias")}}
    table.update({n: f"{n} : object\n    Its {n}." for n in ("normalized_shape", "residual")})
    table.update({n: f"{n} : object\n    Its {n}." for n in ("alpha", "residual_dtype")})
    docs = [inspect.getdoc(_docs.torch_function("f", table)(g)) for g in (plain, fused, scalar)]
    docs = [doc.replace("\n    ", " ") for doc in docs]  # unwrapped
    for doc in docs:
        sections = [doc.index(s) for s in ("Parameters\n---", "Returns\n---", "Raises\n---")]
        assert sections == sorted(sections) and doc.endswith("as :func:`lnlib.f`.")
    assert "in ``x`` and ``weight``." in docs[0] and "``normalized_shape``" in docs[0]
    assert "y : torch.Tensor" in docs[1] and "``residual_dtype`` is not" in docs[1]
    assert "``alpha`` (a tensor) and ``bias``" in docs[2]
    assert "normalized_shape" not in docs[2] and "residual" not in docs[2]
