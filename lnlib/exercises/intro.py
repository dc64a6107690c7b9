"""Checkers of the exercises of the introduction (notebooks/00_introduction.ipynb)."""

from __future__ import annotations

import numpy as np

from ._core import Case, CheckResult, check


def _reference_standardize(x, eps=1e-5):
    import lnlib

    return lnlib.layer_norm(x, eps=eps)


def _standardize_cases() -> list[Case]:
    rng = np.random.default_rng(2016)
    return [
        Case("a batch of 4 rows of 8 numbers", (rng.normal(size=(4, 8)),)),
        Case("one vector (1-D input)", (rng.normal(3.0, 2.0, size=5),)),
        Case("rows of very different scales", (rng.normal(size=(3, 6)) * [[0.01], [1], [100]],)),
        Case("a constant row: its variance is 0, eps keeps it finite", (np.full((2, 4), 7.0),)),
        Case("a 3-D input (batch, tokens, features)", (rng.normal(size=(2, 3, 5)),)),
        Case("eps given as a keyword", (rng.normal(size=(2, 3)) * 0.1,), {"eps": 0.01}),
        Case(
            "float32 rows with mean 1000 and spread 1, where mean(x*x) - mean(x)**2 cancels",
            ((1000 + rng.normal(size=(2, 64))).astype(np.float32),),
            rtol=1e-3,
            atol=1e-3,
        ),
        # The same cancellation in float64, so that mean(x*x) - mean(x)**2 fails in any dtype:
        # its relative error is about u (mean/spread)^2 = 1.1e-16 * 1e16, of order 1.
        Case(
            "float64 rows with mean 1e8 and spread 1, where mean(x*x) - mean(x)**2 cancels",
            (1e8 + rng.normal(size=(2, 64)),),
        ),
    ]


def check_standardize(standardize) -> CheckResult:
    """Check ``standardize(x, eps=1e-5)``: each row (last axis) to mean 0, variance 1 up to eps.

    The answer must use the biased variance with ``eps`` inside the square root, keep
    the input's shape and dtype, and leave ``x`` unchanged. Two cases (float32 with mean
    1000, float64 with mean 1e8, both with spread 1) reject the one-pass variance
    ``mean(x*x) - mean(x)**2``, whether it is computed in the input's dtype or in float64.
    """
    return check(
        standardize,
        _reference_standardize,
        _standardize_cases(),
        rtol=1e-6,
        atol=1e-6,
        name="standardize",
    )
