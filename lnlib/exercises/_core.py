"""Private machinery of :mod:`lnlib.exercises`: compare a reader's function with a reference."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Case:
    """One input on which a reader's function is compared with the reference.

    Parameters
    ----------
    description : str
        A few words that say what the case is about ("a constant row", "float32,
        large mean"); they appear in the message when the case fails.
    args : tuple
        Positional arguments passed to both functions. A single non-tuple value
        is treated as one argument.
    kwargs : dict, optional
        Keyword arguments passed to both functions.
    rtol, atol : float, optional
        Tolerances for this case only; by default those given to :func:`check`.
    raises : type of Exception, optional
        When given, the reader's function must raise this exception (or a
        subclass) on this input, and the reference is not called.
    """

    description: str
    args: Any = ()
    kwargs: Mapping[str, Any] | None = None
    rtol: float | None = None
    atol: float | None = None
    raises: type[BaseException] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.args, tuple):
            self.args = (self.args,)
        self.kwargs = dict(self.kwargs or {})


@dataclass
class Failure:
    """Why one case failed: its index (from 1), its description and the reason."""

    index: int
    description: str
    reason: str

    def __str__(self) -> str:
        return f"case {self.index} ({self.description}): {self.reason}"


@dataclass
class CheckResult:
    """What :func:`check` found. True when every case passed.

    Attributes
    ----------
    name : str
        The name of the function under test.
    n_cases : int
        How many cases were run.
    failures : list of Failure
        One entry per failing case, in order.
    message : str
        The one-line summary that :func:`check` printed.
    """

    name: str
    n_cases: int
    failures: list[Failure] = field(default_factory=list)
    message: str = ""

    @property
    def passed(self) -> bool:
        return not self.failures

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return (
            f"CheckResult(name={self.name!r}, passed={self.passed}, "
            f"n_cases={self.n_cases}, n_failed={len(self.failures)})"
        )

    def _ipython_display_(self) -> None:
        # check() has already printed the message; showing the object again at the
        # end of a notebook cell would only repeat it.
        pass


class _Mismatch(Exception):
    """Raised internally with a human-readable reason when two outputs differ."""


def _to_numpy(value: Any) -> Any:
    """Bring arrays of other libraries (CuPy, PyTorch) to NumPy; leave the rest alone."""
    if isinstance(value, np.ndarray | np.generic):
        return value
    module = type(value).__module__.split(".")[0]
    if module == "torch":
        tensor = value.detach().cpu()
        try:
            return tensor.numpy()
        except TypeError:  # a dtype NumPy has no equivalent of (bfloat16): reported as it is
            return tensor
    if module == "cupy":
        return value.get()
    return value


def _is_numeric(value: Any) -> bool:
    return isinstance(value, np.ndarray | np.generic | int | float | bool) and not isinstance(
        value, str
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float | np.floating):
        return f"{float(value):.6g}"
    return repr(value)


def _describe(value: Any) -> str:
    value = _to_numpy(value)
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of length {len(value)}"
    if value is None:
        return "None"
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor NumPy cannot hold
        kind = type(value).__module__.split(".")[0]
        return f"a {kind} array of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _compare_arrays(
    where: str, expected: Any, got: Any, rtol: float, atol: float, check_dtype: bool
) -> None:
    exp = np.asarray(expected)
    if not isinstance(got, np.ndarray | np.generic | int | float | bool):
        raise _Mismatch(f"{where} is {_describe(got)}, expected {_describe(exp)}")
    res = np.asarray(got)
    if res.shape != exp.shape:
        raise _Mismatch(f"{where} has shape {res.shape}, expected {exp.shape}")
    if check_dtype and isinstance(expected, np.ndarray | np.generic) and res.dtype != exp.dtype:
        raise _Mismatch(f"{where} has dtype {res.dtype}, expected {exp.dtype}")
    if exp.dtype.kind in "fc" or res.dtype.kind in "fc":
        e64 = exp.astype(np.complex128 if exp.dtype.kind == "c" else np.float64)
        r64 = res.astype(np.complex128 if res.dtype.kind == "c" else np.float64)
        bad = ~np.isclose(r64, e64, rtol=rtol, atol=atol, equal_nan=True)
    else:
        bad = res != exp
    if not np.any(bad):
        return
    n_bad = int(np.count_nonzero(bad))
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if exp.ndim else ()
    at = f" at index {first}" if exp.ndim else ""
    msg = (
        f"{where} differs in {n_bad} of {exp.size} entries; first{at}: "
        f"expected {_fmt(exp[first])}, got {_fmt(res[first])}"
    )
    if exp.dtype.kind in "fc":
        finite = np.isfinite(e64) & np.isfinite(r64)
        if np.any(~finite & bad):
            msg += " (non-finite values differ)"
        elif np.any(finite):
            err = float(np.max(np.abs(r64[finite] - e64[finite])))
            msg += f"; max abs error {err:.3g} (rtol={rtol:g}, atol={atol:g})"
    raise _Mismatch(msg)


def _compare(
    where: str, expected: Any, got: Any, rtol: float, atol: float, check_dtype: bool
) -> None:
    """Raise _Mismatch with a precise reason if `got` differs from `expected`."""
    expected, got = _to_numpy(expected), _to_numpy(got)
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping):
            raise _Mismatch(
                f"{where} is {_describe(got)}, expected a dict with keys {sorted(expected)}"
            )
        if set(got) != set(expected):
            raise _Mismatch(f"{where} has keys {sorted(got)}, expected {sorted(expected)}")
        for key in expected:
            _compare(f"{where}[{key!r}]", expected[key], got[key], rtol, atol, check_dtype)
        return
    if isinstance(expected, tuple | list):
        if not isinstance(got, tuple | list):
            raise _Mismatch(f"{where} is {_describe(got)}, expected {_describe(expected)}")
        if len(got) != len(expected):
            raise _Mismatch(f"{where} has {len(got)} items, expected {len(expected)}")
        for i, (e, g) in enumerate(zip(expected, got)):
            _compare(f"{where}[{i}]", e, g, rtol, atol, check_dtype)
        return
    if expected is None:
        if got is not None:
            raise _Mismatch(f"{where} is {_describe(got)}, expected None")
        return
    if _is_numeric(expected):
        _compare_arrays(where, expected, got, rtol, atol, check_dtype)
        return
    if got != expected:
        raise _Mismatch(f"{where} is {got!r}, expected {expected!r}")


def _modified_argument(before: Case, after_args: tuple, after_kwargs: dict) -> str | None:
    """Name the first argument that the function changed in place, if any."""
    pairs = [(f"argument {i + 1}", b, a) for i, (b, a) in enumerate(zip(before.args, after_args))]
    pairs += [(f"argument {k!r}", before.kwargs[k], after_kwargs[k]) for k in before.kwargs]
    for label, b, a in pairs:
        try:
            _compare(label, b, a, rtol=0.0, atol=0.0, check_dtype=True)
        except _Mismatch as exc:
            return str(exc)
    return None


def _run_case(
    user_fn: Callable,
    reference_fn: Callable,
    case: Case,
    rtol: float,
    atol: float,
    check_dtype: bool,
) -> str | None:
    """Return why `user_fn` fails on `case`, or None if it passes."""
    rtol = case.rtol if case.rtol is not None else rtol
    atol = case.atol if case.atol is not None else atol
    # Each function gets its own copy, so that neither can spoil the other's input
    # and an in-place change by the reader's function can be detected.
    user_args, user_kwargs = copy.deepcopy(case.args), copy.deepcopy(case.kwargs)
    if case.raises is not None:
        try:
            got = user_fn(*user_args, **user_kwargs)
        except case.raises:
            return None
        except Exception as exc:  # noqa: BLE001  the reader's error is reported, never raised
            return f"raised {type(exc).__name__}: {exc}; expected {case.raises.__name__}"
        return f"returned {_describe(got)}; expected it to raise {case.raises.__name__}"

    expected = reference_fn(*copy.deepcopy(case.args), **copy.deepcopy(case.kwargs))
    try:
        got = user_fn(*user_args, **user_kwargs)
    except Exception as exc:  # noqa: BLE001  the reader's error is reported, never raised
        return f"raised {type(exc).__name__}: {exc}"
    changed = _modified_argument(case, user_args, user_kwargs)
    if changed is not None:
        return f"modified its input in place: {changed.replace(' differs', ' changed')}"
    try:
        _compare("the output", expected, got, rtol, atol, check_dtype)
    except _Mismatch as exc:
        return str(exc)
    return None


def check(
    user_fn: Callable,
    reference_fn: Callable,
    cases: Sequence[Case],
    *,
    rtol: float = 1e-6,
    atol: float = 1e-8,
    name: str | None = None,
    check_dtype: bool = True,
    verbose: bool = True,
) -> CheckResult:
    """Run a reader's function and a reference on the same cases and say what differs.

    Every case is run even after a failure. For each case the reader's function
    gets a fresh copy of the inputs; its output must match the reference's in
    structure (tuples, lists, dicts), shape, dtype and values (within
    ``rtol``/``atol``, NaN equal to NaN). A function that raises, returns
    something of the wrong kind, or changes its input arrays in place fails the
    case. Nothing the reader's function does makes :func:`check` raise.

    Parameters
    ----------
    user_fn : callable
        The reader's function.
    reference_fn : callable
        The correct function, called with the same arguments.
    cases : sequence of Case
        The inputs: ordinary ones and edge cases.
    rtol, atol : float
        Tolerances of ``numpy.isclose``; a case may override them.
    name : str, optional
        Name used in the message; by default ``user_fn.__name__``.
    check_dtype : bool
        Whether the dtype of array outputs must match the reference's.
    verbose : bool
        Print the one-line message (default True).

    Returns
    -------
    CheckResult
        True when all cases pass; ``failures`` lists each failing case and why.
    """
    if not cases:
        raise ValueError("check() needs at least one Case")
    if name is None:
        name = getattr(user_fn, "__name__", "your function")
    failures = []
    for i, case in enumerate(cases, start=1):
        reason = _run_case(user_fn, reference_fn, case, rtol, atol, check_dtype)
        if reason is not None:
            failures.append(Failure(i, case.description, reason))
    n = len(cases)
    if not failures:
        message = f"PASS {name}: all {n} cases pass."
    else:
        more = len(failures) - 1
        tail = f" (and {more} more failing case{'s' if more > 1 else ''})" if more else ""
        message = f"FAIL {name}: {len(failures)} of {n} cases fail. First, {failures[0]}{tail}."
    result = CheckResult(name=name, n_cases=n, failures=failures, message=message)
    if verbose:
        print(message)
    return result


def glue(name: str, value: Any, display: bool = True) -> None:
    """Record ``value`` under ``name`` for the book's prose (MyST-NB ``glue``).

    In the book build MyST-NB is installed and this is ``myst_nb.glue``; a book page
    then pastes the value with ``{glue:text}`` (see *How to use this book*). Where MyST-NB
    is not installed (for example in Colab) it only displays the value when ``display``
    is true, so the notebooks run anywhere with lnlib alone.
    """
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        if display:
            from IPython.display import display as show

            show(value)
        return
    myst_glue(name, value, display=display)
