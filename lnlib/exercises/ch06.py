r"""Checkers for the exercises of the chapter "LayerNorm at work".

Each checker runs the reader's function on ordinary and edge-case inputs against a reference
built on lnlib's public functions, prints one line that says PASS or what is wrong, and
returns a :class:`~lnlib.exercises.CheckResult`.

==================================  ===================================================
checker                             the reader writes
==================================  ===================================================
:func:`check_residual_block`        ``fn(h, f, placement, eps=1e-5) -> y``: one residual
                                    block with the norm in the place ``placement`` names
:func:`check_scaling_exponent`      ``fn(depths, grad_norms) -> p``: the exponent of a
                                    power law ``grad_norm ~ depth**p`` fitted in log-log
:func:`check_adaln_zero_block`      ``fn(h, c, f, weight, bias, eps=1e-6) -> y``: a
                                    residual block conditioned through adaLN-Zero
:func:`check_td_targets`            ``fn(rewards, q_next, dones, gamma) -> targets``
:func:`check_outlier_features`      ``fn(x, factor=6.0) -> indices`` of outlier features
:func:`check_fold_norm_gain`        ``fn(weight, W) -> W_folded``: a norm's gain folded into the
                                    linear layer that follows it
==================================  ===================================================

The book derives each of them in Chapter 6.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..ada_norm import ada_layer_norm, adaln_modulation
from ..layer_norm import layer_norm
from ._core import Case, CheckResult, check

__all__ = [
    "check_adaln_zero_block",
    "check_fold_norm_gain",
    "check_outlier_features",
    "check_residual_block",
    "check_scaling_exponent",
    "check_td_targets",
]

PLACEMENTS = ("post", "pre", "peri")


def _rng() -> np.random.Generator:
    # A fixed seed: the checkers print the same message every time they are run.
    return np.random.default_rng(6)


def _name(fn: Callable[..., Any], default: str) -> str:
    return getattr(fn, "__name__", default)


class _Sublayer:
    """A fixed sublayer ``f(z) = tanh(z @ W) @ V`` with a readable repr (shown in messages)."""

    def __init__(self, d: int, seed: int, scale: float = 1.0):
        r = np.random.default_rng(seed)
        self.W = r.normal(size=(d, 2 * d)) / np.sqrt(d)  # (D, 2D)
        self.V = r.normal(size=(2 * d, d)) * scale / np.sqrt(2 * d)  # (2D, D)

    def __call__(self, z):
        return np.tanh(z @ self.W) @ self.V

    def __repr__(self) -> str:
        return f"f(z) = tanh(z @ W) @ V with D={self.W.shape[0]}"

    def __eq__(self, other) -> bool:
        # The checker compares arguments before and after the call (changed in place?).
        return (
            isinstance(other, _Sublayer)
            and np.array_equal(self.W, other.W)
            and np.array_equal(self.V, other.V)
        )

    __hash__ = None


# ------------------------------------------------------- exercise: where the norm sits


def _ref_residual_block(h, f, placement, eps=1e-5):
    if placement == "post":
        return layer_norm(h + f(h), eps=eps)
    if placement == "pre":
        return h + f(layer_norm(h, eps=eps))
    if placement == "peri":
        return h + layer_norm(f(layer_norm(h, eps=eps)), eps=eps)
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def check_residual_block(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(h, f, placement, eps=1e-5) -> y``: one residual block, three placements.

    ``h``, the residual stream, has shape (B, D) and ``f`` maps (B, D) to (B, D). With ``LN`` a
    LayerNorm without gain or bias (:func:`lnlib.layer_norm`) over the last axis, ``placement``
    is ``"post"``: ``LN(h + f(h))``; ``"pre"``: ``h + f(LN(h))``; ``"peri"``:
    ``h + LN(f(LN(h)))``. Any other placement raises ValueError.
    """
    rng = _rng()
    f8, f16 = _Sublayer(8, 1), _Sublayer(16, 2, scale=5.0)
    x8 = rng.normal(size=(4, 8))
    big = rng.normal(size=(3, 16)) * 100 + 7
    cases = [
        Case("Post-LN on a (4, 8) batch", (x8, f8, "post")),
        Case("Pre-LN on the same batch", (x8, f8, "pre")),
        Case("Peri-LN on the same batch", (x8, f8, "peri")),
        Case("Pre-LN on a large residual stream (it must stay large)", (big, f16, "pre")),
        Case(
            "Post-LN on a large residual stream (it must come out normalized)", (big, f16, "post")
        ),
        Case("Post-LN with eps = 0.5 passed as a keyword", (x8, f8, "post"), {"eps": 0.5}),
        Case("Pre-LN with eps = 0.5 passed as a keyword", (x8, f8, "pre"), {"eps": 0.5}),
        Case("Peri-LN with eps = 0.5 passed as a keyword", (x8, f8, "peri"), {"eps": 0.5}),
        Case("an unknown placement", (x8, f8, "middle"), raises=ValueError),
    ]
    return check(
        fn, _ref_residual_block, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "residual_block")
    )


# ----------------------------------------------- exercise: the exponent of a power law


def _ref_scaling_exponent(depths, grad_norms):
    logs_l = np.log(np.asarray(depths, dtype=np.float64))
    logs_g = np.log(np.asarray(grad_norms, dtype=np.float64))
    return float(np.polyfit(logs_l, logs_g, 1)[0])


def check_scaling_exponent(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(depths, grad_norms) -> p``: least-squares slope of log(grad) on log(depth).

    ``depths`` and ``grad_norms`` are 1-d sequences of positive numbers of the same length
    (at least 2). The answer ``p`` is a Python float: the slope of the straight line fitted by
    least squares to the points ``(log depth, log grad_norm)``, so that ``grad_norm`` is close
    to ``C * depth**p``.
    """
    rng = _rng()
    depths = np.array([1, 2, 4, 8, 16, 32])
    noisy = 3.0 * depths**-0.5 * np.exp(rng.normal(scale=0.1, size=depths.size))
    cases = [
        Case("an exact power law with exponent -1/2", (depths, 2.0 * depths**-0.5)),
        Case("a constant (exponent 0)", (depths, np.full(depths.size, 4.2))),
        Case("a noisy power law (least squares, not the end points)", (depths, noisy)),
        Case("two points given as lists", ([2, 8], [1.0, 4.0])),
        Case(
            "depths that are not powers of two",
            (np.array([3, 5, 7, 11]), np.array([1.0, 0.8, 0.7, 0.55])),
        ),
    ]
    return check(
        fn,
        _ref_scaling_exponent,
        cases,
        rtol=1e-9,
        atol=1e-12,
        check_dtype=False,
        name=_name(fn, "scaling_exponent"),
    )


# ------------------------------------------------------------ exercise: an adaLN-Zero block


def _ref_adaln_zero_block(h, c, f, weight, bias, eps=1e-6):
    shift, scale, gate = adaln_modulation(c, weight, bias)  # each (B, D)
    return h + gate * f(ada_layer_norm(h, shift, scale, eps=eps))


def check_adaln_zero_block(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(h, c, f, weight, bias, eps=1e-6) -> y``: a block conditioned through adaLN.

    ``h``, the residual stream, is (B, D), ``c`` is (B, D_c), ``weight`` is (D_c, 3 D) and
    ``bias`` is (3 D,). The block computes ``shift, scale, gate = split(SiLU(c) @ weight + bias,
    3)`` (as :func:`lnlib.adaln_modulation`) and returns
    ``h + gate * f(LN(h) * (1 + scale) + shift)`` with a LayerNorm without gain or bias. With
    adaLN-Zero's initialisation (``weight`` and ``bias`` zero) the block is the identity.
    """
    rng = _rng()
    b, d, cdim = 5, 8, 3
    f = _Sublayer(d, 3)
    x, c = rng.normal(size=(b, d)), rng.normal(size=(b, cdim))
    w, bias = rng.normal(size=(cdim, 3 * d)) * 0.5, rng.normal(size=3 * d) * 0.5
    zero_w, zero_b = np.zeros((cdim, 3 * d)), np.zeros(3 * d)
    cases = [
        Case("adaLN-Zero initialisation: the block must return h", (x, c, f, zero_w, zero_b)),
        Case("random modulation", (x, c, f, w, bias)),
        Case("only the bias set (the condition is ignored)", (x, c, f, zero_w, bias)),
        Case("a large residual stream", (x * 50 + 3, c, f, w, bias)),
        Case("eps = 0.1 passed as a keyword", (x, c, f, w, bias), {"eps": 0.1}),
    ]
    return check(
        fn, _ref_adaln_zero_block, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "adaln_zero_block")
    )


# ---------------------------------------------------------- exercise: the TD targets


def _ref_td_targets(rewards, q_next, dones, gamma):
    rewards = np.asarray(rewards, dtype=np.float64)
    best = np.asarray(q_next, dtype=np.float64).max(axis=-1)
    return rewards + gamma * (1.0 - np.asarray(dones, dtype=np.float64)) * best


def check_td_targets(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(rewards, q_next, dones, gamma) -> targets``: Q-learning's bootstrapped targets.

    ``rewards`` (B,), ``q_next`` (B, A): the network's values of the next states, ``dones``
    (B,) of 0/1 (1: the episode ended, nothing follows), ``gamma`` a float. The target is
    ``r + gamma * (1 - done) * max_a q_next[:, a]``, a float64 array of shape (B,).
    """
    rng = _rng()
    q = rng.normal(size=(6, 3))
    r = rng.normal(size=6)
    cases = [
        Case("no episode ends", (r, q, np.zeros(6), 0.99)),
        Case("some episodes end (no bootstrap there)", (r, q, np.array([0, 1, 0, 1, 1, 0]), 0.9)),
        Case("gamma = 0: the reward alone", (r, q, np.zeros(6), 0.0)),
        Case(
            "all next values negative (the max, not the max of |q|)",
            (r, -np.abs(q) - 1, np.zeros(6), 0.5),
        ),
        Case("one action", (r[:2], q[:2, :1], np.zeros(2), 0.99)),
    ]
    return check(
        fn,
        _ref_td_targets,
        cases,
        rtol=1e-9,
        atol=1e-12,
        check_dtype=False,
        name=_name(fn, "td_targets"),
    )


# ---------------------------------------------------- exercise: find the outlier features


def _ref_outlier_features(x, factor=6.0):
    x = np.asarray(x, dtype=np.float64)
    rms = np.sqrt((x * x).mean(axis=0))  # (D,)
    return np.flatnonzero(rms > factor * np.median(rms)).astype(np.int64)


def check_outlier_features(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, factor=6.0) -> indices``: features whose RMS is far above the median.

    ``x`` has shape (T, D): T activation vectors (tokens) entering a norm. The root mean
    square of feature ``i`` over the T rows is compared with the median of these D values;
    the result is the sorted int64 array of the features whose RMS exceeds ``factor`` times
    that median (empty when there is none).
    """
    rng = _rng()
    x = rng.normal(size=(40, 32))
    spiky = x.copy()
    spiky[:, [3, 17]] *= 20.0
    one_token = x.copy()
    one_token[0, 5] = 400.0  # one huge value in one feature is enough for its RMS
    shifted = x.copy()
    shifted[:, 9] += 30.0  # a large mean, not a large spread, also counts
    many = x.copy()
    many[:, :8] *= 5.0  # a quarter of the features large: they lift the mean RMS, not the median
    peak = x.copy()
    peak[:, 4] *= 3.0  # large values throughout, but an RMS under 2.5 times the median
    peak[0, 11] = 20.0  # one large value: RMS over 2.5 times the median, mean |x| not
    cases = [
        Case("no outliers", (x,)),
        Case("two outlier features, 20 times larger", (spiky,)),
        Case("one huge value in one token", (one_token,)),
        Case("a feature with a large mean (RMS, not standard deviation)", (shifted,)),
        Case("factor = 25 passed as a keyword (nothing is that large)", (spiky,), {"factor": 25.0}),
        Case("float32 input", (spiky.astype(np.float32),)),
        Case(
            "eight outlier features, factor = 3 (the median, not the mean, of the RMS)",
            (many,),
            {"factor": 3.0},
        ),
        Case(
            "factor = 2.5 (the RMS, not the mean or the largest |x|)",
            (peak,),
            {"factor": 2.5},
        ),
    ]
    return check(fn, _ref_outlier_features, cases, name=_name(fn, "outlier_features"))


# ---------------------------------------------- exercise: fold a norm's gain into a layer


def _ref_fold_norm_gain(weight, W):
    return np.asarray(weight)[:, None] * np.asarray(W)


def check_fold_norm_gain(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(weight, W) -> W_folded``: fold a norm's gain into the next linear layer.

    The norm's output ``x_hat * weight`` (``weight`` of shape (D,)) feeds a linear layer
    ``y @ W`` with ``W`` of shape (D, D_out), as in glassllm. The answer ``W_folded``
    (D, D_out) makes ``x_hat @ W_folded`` equal to ``(x_hat * weight) @ W`` for every
    ``x_hat``, so that the norm can run without a gain. The inputs must not be changed.
    """
    rng = _rng()
    cases = [
        Case("a (4, 3) layer", (rng.normal(size=4), rng.normal(size=(4, 3)))),
        Case("a gain of ones changes nothing", (np.ones(5), rng.normal(size=(5, 2)))),
        Case(
            "a square layer (rows, not columns, are scaled)",
            (np.arange(1.0, 4.0), rng.normal(size=(3, 3))),
        ),
        Case(
            "float32",
            (rng.normal(size=6).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32)),
            rtol=1e-6,
            atol=1e-7,
        ),
        Case("one output", (rng.normal(size=7), rng.normal(size=(7, 1)))),
    ]
    return check(
        fn, _ref_fold_norm_gain, cases, rtol=1e-12, atol=1e-12, name=_name(fn, "fold_norm_gain")
    )
