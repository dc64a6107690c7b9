r"""Checkers for the exercises of the chapter "The math of LayerNorm".

Each checker takes the reader's function (or, for :func:`check_naive_failure`, the reader's
input), runs it on ordinary and edge-case inputs against :mod:`lnlib.reference`, prints one
line that says PASS or what is wrong, and returns a :class:`~lnlib.exercises.CheckResult`.

================================  =====================================================
checker                           the reader writes
================================  =====================================================
:func:`check_forward`             ``fn(x, weight, bias, eps=1e-5) -> y``
:func:`check_jacobian`            ``fn(x, eps=1e-5) -> J`` with ``J[i, j] = d xhat_i / d x_j``
:func:`check_dgamma`              ``fn(dy, x, eps=1e-5) -> (dweight, dbias)``
:func:`check_backward`            ``fn(dy, x, weight, eps=1e-5) -> dx``
:func:`check_naive_failure`       a float32 row on which the one-pass variance fails
================================  =====================================================

All of them normalize over the last axis of ``x`` (``normalized_ndim=1``), of length D;
``weight`` and ``bias`` are the book's :math:`\gamma` and :math:`\beta`, of shape (D,). The
chapter derives the formulas (the backward pass section) and its notebook
``notebooks/02_math.ipynb`` holds the exercises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ._core import Case, CheckResult, Failure, check

__all__ = [
    "WORKED_EXAMPLE",
    "check_backward",
    "check_dgamma",
    "check_forward",
    "check_jacobian",
    "check_naive_failure",
    "one_pass_variance",
    "two_pass_variance",
]

#: The three 4-vectors of the worked example (one per row), float64.
WORKED_EXAMPLE = np.array([[3.0, 5.0, 2.0, 8.0], [1.0, 3.0, 5.0, 8.0], [3.0, 2.0, 7.0, 9.0]])


def _rng() -> np.random.Generator:
    # A fixed seed: the checkers print the same message every time they are run.
    return np.random.default_rng(2)


# ---------------------------------------------------------------- exercise: the forward pass


def _ref_forward(x, weight, bias, eps=1e-5):
    return reference.layer_norm_forward(x, weight, bias, eps=eps)[0]


def check_forward(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, weight, bias, eps=1e-5) -> y``, LayerNorm over the last axis of ``x``.

    Cases: the worked example, a random batch, three dimensions, a constant row (whose
    output is ``bias``), a single feature, two large means (the second, 1e6, rejects the
    one-pass variance ``mean(x*x) - mean(x)**2``), and a different ``eps``. Arrays are
    float64 and the output must be float64 with the shape of ``x``.
    """
    rng = _rng()
    d = 4
    cases = [
        Case(
            "the worked example, weight = 1.5 and bias = 0.5",
            (WORKED_EXAMPLE, np.full(d, 1.5), np.full(d, 0.5)),
        ),
        Case(
            "a random (5, 16) batch with random weight and bias",
            (rng.normal(size=(5, 16)), rng.normal(size=16), rng.normal(size=16)),
        ),
        Case(
            "three dimensions (2, 3, 8): normalize the last axis only",
            (rng.normal(size=(2, 3, 8)), rng.normal(size=8), rng.normal(size=8)),
        ),
        Case(
            "a constant row (the output should be the bias)",
            (np.full((2, 6), 7.0), rng.normal(size=6), rng.normal(size=6)),
        ),
        Case("a single feature, D = 1", (rng.normal(size=(3, 1)), np.ones(1), np.zeros(1))),
        Case(
            "a large mean: 1e4 + N(0, 1)",
            (1e4 + rng.normal(size=(3, 32)), np.ones(32), np.zeros(32)),
        ),
        # In float64 the one-pass variance mean(x*x) - mean(x)**2 errs by about u (mu/sigma)^2,
        # 1e-4 here: far outside rtol, while two passes stay at 1e-10.
        Case(
            "a very large mean: 1e6 + N(0, 1), where mean(x*x) - mean(x)**2 cancels",
            (1e6 + rng.normal(size=(3, 32)), np.ones(32), np.zeros(32)),
        ),
        Case(
            "eps = 0.5 passed as a keyword",
            (rng.normal(size=(2, 5)), np.ones(5), np.zeros(5)),
            {"eps": 0.5},
        ),
    ]
    return check(
        fn, _ref_forward, cases, rtol=1e-7, atol=1e-9, name=getattr(fn, "__name__", "forward")
    )


# ------------------------------------------------------------- exercise: the Jacobian of xhat


def _ref_jacobian(x, eps=1e-5):
    xhat, _, rstd = reference.layer_norm_forward(x, eps=eps)  # xhat: (D,), rstd: ()
    d = x.shape[-1]
    return rstd / d * (d * np.eye(d) - np.ones((d, d)) - np.outer(xhat, xhat))


def check_jacobian(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, eps=1e-5) -> J``, the (D, D) Jacobian of xhat with respect to x.

    ``x`` is one vector of shape (D,); ``J[i, j]`` is the derivative of ``xhat[i]`` with
    respect to ``x[j]``. One case (mean 1e7, spread 1) rejects the one-pass variance.
    """
    rng = _rng()
    cases = [
        Case("the first vector of the worked example", (WORKED_EXAMPLE[0].copy(),)),
        Case("a random vector, D = 6", (rng.normal(size=6),)),
        Case("a vector with a large mean and spread 10", (50 + 10 * rng.normal(size=5),)),
        Case("eps = 1.0 passed as a keyword", (rng.normal(size=4),), {"eps": 1.0}),
        Case("a constant vector", (np.full(3, 2.0),)),
        # mean(x*x) - mean(x)**2 errs by about u (mu/sigma)^2 = 1e-2 here; two passes by 1e-9.
        Case(
            "a very large mean: 1e7 + N(0, 1), where mean(x*x) - mean(x)**2 cancels",
            (1e7 + rng.normal(size=32),),
        ),
    ]
    return check(
        fn, _ref_jacobian, cases, rtol=1e-6, atol=1e-9, name=getattr(fn, "__name__", "jacobian")
    )


# ---------------------------------------------------- exercise: the gradients of gamma and beta


def _ref_dgamma(dy, x, eps=1e-5):
    _, mean, rstd = reference.layer_norm_forward(x, eps=eps)
    _, dweight, dbias = reference.layer_norm_backward(dy, x, mean, rstd, np.ones(x.shape[-1]))
    return dweight, dbias


def check_dgamma(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(dy, x, eps=1e-5) -> (dweight, dbias)``, the gradients of gamma and beta.

    ``dy`` has the shape of ``x``; both results have shape (D,): every leading axis of ``x``
    (batch, time, ...) is summed over. One case (mean 1e6, spread 1) rejects the one-pass
    variance.
    """
    rng = _rng()
    cases = [
        Case("the worked example with dy = 1", (np.ones((3, 4)), WORKED_EXAMPLE)),
        Case("a random (6, 5) batch", (rng.normal(size=(6, 5)), rng.normal(size=(6, 5)))),
        Case(
            "three dimensions (2, 3, 4): sum over both leading axes",
            (rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))),
        ),
        Case("a single row of shape (1, 7)", (rng.normal(size=(1, 7)), rng.normal(size=(1, 7)))),
        Case(
            "eps = 0.1 passed as a keyword",
            (rng.normal(size=(3, 4)), rng.normal(size=(3, 4))),
            {"eps": 0.1},
        ),
        Case(
            "a very large mean: 1e6 + N(0, 1), where mean(x*x) - mean(x)**2 cancels",
            (rng.normal(size=(3, 32)), 1e6 + rng.normal(size=(3, 32))),
        ),
    ]
    return check(
        fn, _ref_dgamma, cases, rtol=1e-7, atol=1e-9, name=getattr(fn, "__name__", "dgamma")
    )


# ----------------------------------------------------------------- exercise: the backward pass


def _ref_backward(dy, x, weight, eps=1e-5):
    _, mean, rstd = reference.layer_norm_forward(x, weight, eps=eps)
    return reference.layer_norm_backward(dy, x, mean, rstd, weight)[0]


def check_backward(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(dy, x, weight, eps=1e-5) -> dx``, the gradient of LayerNorm with respect to x.

    Cases include a constant row (where only eps keeps the gradient finite), a single
    feature (whose gradient is zero), ``dy`` constant along the row (also a zero gradient),
    three dimensions and a mean of 1e6 with spread 1 (which rejects the one-pass variance).
    """
    rng = _rng()
    cases = [
        Case(
            "the worked example, weight = 1.5, random dy",
            (rng.normal(size=(3, 4)), WORKED_EXAMPLE, np.full(4, 1.5)),
        ),
        Case(
            "a random (4, 16) batch with a random weight",
            (rng.normal(size=(4, 16)), rng.normal(size=(4, 16)), rng.normal(size=16)),
        ),
        Case(
            "three dimensions (2, 3, 8)",
            (rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 3, 8)), rng.normal(size=8)),
        ),
        Case(
            "dy = 1 everywhere (the gradient should be zero)",
            (np.ones((2, 6)), rng.normal(size=(2, 6)), np.ones(6)),
            atol=1e-12,
        ),
        Case("a constant row", (rng.normal(size=(1, 5)), np.full((1, 5), 3.0), np.ones(5))),
        Case(
            "a single feature, D = 1",
            (rng.normal(size=(3, 1)), rng.normal(size=(3, 1)), np.ones(1)),
        ),
        Case(
            "eps = 0.5 passed as a keyword",
            (rng.normal(size=(2, 5)), rng.normal(size=(2, 5)), np.ones(5)),
            {"eps": 0.5},
        ),
        Case(
            "a very large mean: 1e6 + N(0, 1), where mean(x*x) - mean(x)**2 cancels",
            (rng.normal(size=(3, 32)), 1e6 + rng.normal(size=(3, 32)), rng.normal(size=32)),
        ),
    ]
    return check(
        fn, _ref_backward, cases, rtol=1e-6, atol=1e-9, name=getattr(fn, "__name__", "backward")
    )


# ------------------------------------------------ exercise: where the one-pass variance fails


def one_pass_variance(x: np.ndarray) -> np.ndarray:
    r"""Variance of the last axis by the one-pass formula :math:`\overline{x^2} - \mu^2`.

    Computed in x's dtype.

    Shown in the book only to be avoided: it cancels catastrophically when the mean is large
    compared with the spread. For float32 input every step is done in float32.
    """
    return (x * x).mean(axis=-1) - x.mean(axis=-1) ** 2


def two_pass_variance(x: np.ndarray) -> np.ndarray:
    r"""Variance of the last axis by two passes, :math:`\overline{(x - \mu)^2}`, in x's dtype."""
    d = x - x.mean(axis=-1, keepdims=True)
    return (d * d).mean(axis=-1)


def check_naive_failure(row: Any, *, min_error: float = 0.1) -> CheckResult:
    """Check that ``row`` is a float32 vector on which the one-pass variance fails.

    The row passes when it is a finite, non-constant float32 vector of length at least 2 whose
    squares and their sum stay finite (so that the failure is cancellation, not overflow), the
    one-pass float32 variance (:func:`one_pass_variance`) is off by a
    relative error of at least ``min_error`` (10 % by default) from the exact variance of the
    same float32 numbers (computed in float64), and the two-pass float32 variance is within
    1e-3 of it.
    """
    name = "naive variance failure"
    reason = _naive_failure_reason(row, min_error)
    if reason is None:
        message = f"PASS {name}: the one-pass variance fails on your row and two passes do not."
        failures = []
    else:
        failures = [Failure(1, "your row", reason)]
        message = f"FAIL {name}: {reason}."
    print(message)
    return CheckResult(name=name, n_cases=1, failures=failures, message=message)


def _naive_failure_reason(row: Any, min_error: float) -> str | None:
    if not isinstance(row, np.ndarray):
        return f"expected a NumPy array, got {type(row).__name__}"
    if row.dtype != np.float32:
        return (
            f"the row has dtype {row.dtype}; make it float32 (for example "
            "np.asarray(values, dtype=np.float32)), where the effect is easy to see"
        )
    if row.ndim != 1 or row.size < 2:
        return f"expected a 1-d row with at least 2 entries, got shape {row.shape}"
    if not np.all(np.isfinite(row)):
        return "the row contains NaN or inf"
    with np.errstate(over="ignore"):
        squares_finite = np.all(np.isfinite(row * row))
    if not squares_finite:
        return "the squares of some entries overflow float32; use smaller values"
    exact = float(np.var(row.astype(np.float64)))
    if exact == 0.0:
        return "the row is constant, so its variance is exactly 0 and there is nothing to miss"
    with np.errstate(over="ignore", invalid="ignore"):
        naive = float(one_pass_variance(row))
    if not np.isfinite(naive):
        return (
            "the sum of the squares overflows float32, so the one-pass variance is "
            f"{naive}: that is overflow, not cancellation; use smaller values"
        )
    two = float(two_pass_variance(row))
    err_naive = abs(naive - exact) / exact
    err_two = abs(two - exact) / exact
    if err_two > 1e-3:
        return (
            f"even the two-pass variance is off by {err_two:.3g} (relative); keep the "
            "row's mean within float32's range of exact integers (below about 1e7)"
        )
    if err_naive < min_error:
        return (
            f"the one-pass variance {naive:.6g} is within {err_naive:.3g} of the exact "
            f"{exact:.6g}; it must be off by at least {min_error:g}: make the mean much "
            "larger than the spread (mean/std of a few thousand or more)"
        )
    return None
