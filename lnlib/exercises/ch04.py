r"""Checkers for the exercises of the chapter "Variants".

Each checker takes the reader's function, runs it on ordinary and edge-case inputs against
:mod:`lnlib.reference` (or a formula written out here), prints one line that says PASS or what
is wrong, and returns a :class:`~lnlib.exercises.CheckResult`.

==================================  ===================================================
checker                             the reader writes
==================================  ===================================================
:func:`check_rms_norm`              ``fn(x, weight, eps=1e-6) -> y``
:func:`check_rms_norm_backward`     ``fn(dy, x, weight, eps=1e-6) -> dx``
:func:`check_partial_rms_norm`      ``fn(x, p, eps=1e-8) -> y`` (pRMSNorm)
:func:`check_scale_norm`            ``fn(x, g, eps=1e-5) -> y`` (ScaleNorm)
:func:`check_group_norm`            ``fn(x, num_groups, weight, bias, eps=1e-5) -> y``
:func:`check_dynamic_tanh_backward` ``fn(dy, x, alpha, weight) -> (dx, dalpha, dweight, dbias)``
==================================  ===================================================

The row-wise ones normalize over the last axis of ``x``, of length D; ``weight`` and ``bias``
are the book's :math:`\gamma` and :math:`\beta`. The chapter's notebook
``notebooks/04_variants.ipynb`` holds the exercises.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ._core import Case, CheckResult, check

__all__ = [
    "check_dynamic_tanh_backward",
    "check_group_norm",
    "check_partial_rms_norm",
    "check_rms_norm",
    "check_rms_norm_backward",
    "check_scale_norm",
    "partial_rms_norm",
    "scale_norm",
]


def _rng() -> np.random.Generator:
    # A fixed seed: the checkers print the same message every time they are run.
    return np.random.default_rng(4)


def _name(fn, default):
    return getattr(fn, "__name__", default)


# ------------------------------------------------------------------------- RMSNorm forward


def _ref_rms(x, weight, eps=1e-6):
    return reference.rms_norm_forward(x, weight, eps=eps)[0]


def check_rms_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, weight, eps=1e-6) -> y``, RMSNorm over the last axis of ``x`` (float64).

    Cases: a random batch, three dimensions, a zero-mean row (where RMSNorm is LayerNorm), a
    row with a large mean (where it is not), an all-zero row (``eps`` keeps it finite), and
    ``eps`` passed as a keyword.
    """
    rng = _rng()
    row = rng.normal(size=(1, 8))
    cases = [
        Case(
            "a random (5, 16) batch with a random weight",
            (rng.normal(size=(5, 16)), rng.normal(size=16)),
        ),
        Case(
            "three dimensions (2, 3, 8): normalize the last axis only",
            (rng.normal(size=(2, 3, 8)), rng.normal(size=8)),
        ),
        Case("a zero-mean row", (row - row.mean(), np.ones(8))),
        Case(
            "a row with mean 100: RMSNorm does not subtract it",
            (100 + rng.normal(size=(2, 8)), np.ones(8)),
        ),
        Case("an all-zero row (the output is zero)", (np.zeros((2, 5)), np.ones(5))),
        Case("eps = 0.5 passed as a keyword", (rng.normal(size=(3, 4)), np.ones(4)), {"eps": 0.5}),
    ]
    return check(fn, _ref_rms, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "rms_norm"))


# ------------------------------------------------------------------------ RMSNorm backward


def _ref_rms_backward(dy, x, weight, eps=1e-6):
    _, rstd = reference.rms_norm_forward(x, weight, eps=eps)
    return reference.rms_norm_backward(dy, x, rstd, weight)[0]


def check_rms_norm_backward(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(dy, x, weight, eps=1e-6) -> dx``, the RMSNorm gradient with respect to x.

    Cases: a random batch, three dimensions, ``dy`` along ``x`` (the gradient is then almost
    zero: only ``eps`` lets a change of length through), a large ``eps`` and one feature.
    """
    rng = _rng()
    x = rng.normal(size=(4, 6))
    cases = [
        Case("a random (4, 6) batch", (rng.normal(size=(4, 6)), x, rng.normal(size=6))),
        Case(
            "three dimensions (2, 3, 5)",
            (rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5)), rng.normal(size=5)),
        ),
        Case("dy parallel to x, weight 1 (dx is almost zero)", (x.copy(), x, np.ones(6))),
        Case(
            "eps = 1.0 passed as a keyword",
            (rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), np.ones(4)),
            {"eps": 1.0},
        ),
        Case(
            "a single feature, D = 1",
            (rng.normal(size=(3, 1)), rng.normal(size=(3, 1)), np.ones(1)),
        ),
    ]
    return check(
        fn, _ref_rms_backward, cases, rtol=1e-6, atol=1e-9, name=_name(fn, "rms_norm_backward")
    )


# ------------------------------------------------------------------------------- pRMSNorm


def partial_rms_norm(x, p, eps=1e-8):
    """pRMSNorm: RMSNorm whose root mean square is estimated from the first ``ceil(p * D)``
    features of each row only (Zhang and Sennrich, 2019); no gain."""
    k = max(1, math.ceil(p * x.shape[-1]))
    ms = (x[..., :k] ** 2).mean(axis=-1, keepdims=True)  # (..., 1)
    return x / np.sqrt(ms + eps)


def check_partial_rms_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, p, eps=1e-8) -> y``: ``x`` divided by the root mean square of its first
    ``k = ceil(p * D)`` features (at least one), over the last axis."""
    rng = _rng()
    x = rng.normal(size=(4, 16))
    cases = [
        Case("p = 1: plain RMSNorm", (x, 1.0)),
        Case("p = 0.25 on D = 16: the first 4 features", (x, 0.25)),
        Case("p = 0.25 on D = 10: ceil(2.5) = 3 features", (rng.normal(size=(3, 10)), 0.25)),
        Case("a tiny p: at least one feature", (rng.normal(size=(2, 8)), 0.01)),
        Case("three dimensions (2, 3, 8)", (rng.normal(size=(2, 3, 8)), 0.5)),
        Case("eps = 1.0 passed as a keyword", (x, 0.5), {"eps": 1.0}),
        Case("p = 0.2 on D = 16: ceil(3.2) = 4 features (rounding gives 3)", (x, 0.2)),
    ]
    return check(
        fn, partial_rms_norm, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "partial_rms_norm")
    )


# ------------------------------------------------------------------------------ ScaleNorm


def scale_norm(x, g, eps=1e-5):
    """ScaleNorm (Nguyen and Salazar, 2019): ``g * x / max(||x||, eps)`` over the last axis."""
    norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))  # (..., 1)
    return g * x / np.maximum(norm, eps)


def check_scale_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, g, eps=1e-5) -> y = g * x / max(||x||, eps)`` over the last axis."""
    rng = _rng()
    cases = [
        Case("a random (4, 8) batch, g = sqrt(8)", (rng.normal(size=(4, 8)), math.sqrt(8))),
        Case("g = 2.5 on three dimensions (2, 3, 6)", (rng.normal(size=(2, 3, 6)), 2.5)),
        Case("a row with mean 50 (not subtracted)", (50 + rng.normal(size=(2, 5)), 1.0)),
        Case("an all-zero row (eps keeps it finite: the output is zero)", (np.zeros((2, 4)), 3.0)),
        Case(
            "a row shorter than eps = 0.5: divided by eps",
            (np.full((1, 4), 0.1), 1.0),
            {"eps": 0.5},
        ),
    ]
    return check(fn, scale_norm, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "scale_norm"))


# ------------------------------------------------------------------------------ GroupNorm


def _ref_group_norm(x, num_groups, weight, bias, eps=1e-5):
    return reference.group_norm_forward(x, num_groups, weight, bias, eps=eps)[0]


def check_group_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, num_groups, weight, bias, eps=1e-5) -> y`` for ``x`` of shape
    (B, C, *spatial), with per-channel ``weight`` and ``bias`` of shape (C,).

    Cases: two spatial axes, one spatial axis, no spatial axis, InstanceNorm (G = C),
    LayerNorm over (C, H, W) (G = 1), groups with different scales, ``eps``, and groups with
    a mean of 1e6 and a spread of 1, where the one-pass variance (mean of the squares minus
    the squared mean) loses about 1e-4 and fails (chapter 2).
    """
    rng = _rng()

    def case(shape, g):
        return rng.normal(size=shape), g, rng.normal(size=shape[1]), rng.normal(size=shape[1])

    x, _, w, b = case((2, 6, 3, 3), 3)
    x[:, :2] *= 10  # the first group (two channels) is ten times larger
    cases = [
        Case("(B, C, H, W) = (2, 8, 3, 4), G = 4", case((2, 8, 3, 4), 4)),
        Case("one spatial axis (3, 6, 5), G = 2", case((3, 6, 5), 2)),
        Case("no spatial axis (4, 6), G = 3", case((4, 6), 3)),
        Case("InstanceNorm: G = C = 4", case((2, 4, 3, 3), 4)),
        Case("one group, G = 1 (LayerNorm over C, H, W)", case((2, 4, 2, 2), 1)),
        Case("G = 3 groups of different scales", (x, 3, w, b)),
        Case("eps = 0.5 passed as a keyword", case((2, 4, 2), 2), {"eps": 0.5}),
        Case(
            "a mean of 1e6, spread 1: the variance must be taken from the deviations",
            (1e6 + rng.normal(size=(2, 4, 3, 3)), 2, rng.normal(size=4), rng.normal(size=4)),
        ),
    ]
    return check(fn, _ref_group_norm, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "group_norm"))


# -------------------------------------------------------------------- Dynamic Tanh backward


def _ref_dyt_backward(dy, x, alpha, weight):
    return reference.dynamic_tanh_backward(dy, x, alpha, weight)


def check_dynamic_tanh_backward(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(dy, x, alpha, weight) -> (dx, dalpha, dweight, dbias)`` for DyT,
    ``y = weight * tanh(alpha * x) + bias`` with a scalar ``alpha`` and per-feature (last axis)
    ``weight``; ``dalpha`` is a scalar, ``dweight``/``dbias`` have shape (D,)."""
    rng = _rng()
    cases = [
        Case(
            "a random (4, 6) batch, alpha = 0.5",
            (rng.normal(size=(4, 6)), 2 * rng.normal(size=(4, 6)), 0.5, rng.normal(size=6)),
        ),
        Case(
            "three dimensions (2, 3, 4): sum dweight over both leading axes",
            (rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4)), 1.3, rng.normal(size=4)),
        ),
        Case(
            "large inputs: tanh saturates and dx vanishes",
            (rng.normal(size=(2, 5)), 50 * rng.normal(size=(2, 5)), 2.0, np.ones(5)),
        ),
        Case(
            "a negative alpha",
            (rng.normal(size=(3, 4)), rng.normal(size=(3, 4)), -0.7, rng.normal(size=4)),
        ),
    ]
    return check(
        fn, _ref_dyt_backward, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "dynamic_tanh_backward")
    )
