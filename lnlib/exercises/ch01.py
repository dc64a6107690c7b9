r"""Checkers for the exercises of the chapter "Why normalize".

Each checker takes the reader's function, runs it on ordinary and edge-case inputs against a
reference built on :mod:`lnlib.reference`, prints one line that says PASS or what is wrong,
and returns a :class:`~lnlib.exercises.CheckResult`.

=================================  ====================================================
checker                            the reader writes
=================================  ====================================================
:func:`check_batch_normalize`      ``fn(x, eps=1e-5) -> y``: BatchNorm of an (N, C) batch
                                   with the batch's own statistics, no affine parameters
:func:`check_pair_output`          ``fn(x1, x2, eps=1e-5) -> y``: BatchNorm's output for the
                                   first row of the batch ``[x1, x2]``, from ``x1 - x2`` alone
:func:`check_running_update`       ``fn(running_mean, running_var, x, momentum=0.1)
                                   -> (new_mean, new_var)``
:func:`check_fold_eval_batch_norm` ``fn(W, b, running_mean, running_var, gamma, beta,
                                   eps=1e-5) -> (W2, b2)``
:func:`check_masked_step_stats`    ``fn(a, lengths) -> (mean, var)``: per-time-step
                                   statistics of a padded batch of sequences
=================================  ====================================================

The chapter explains why each of these matters: batch statistics, what a batch of two does to
them, the running averages used at inference, inference-mode BatchNorm as a fixed affine map,
and the per-time-step statistics that recurrent BatchNorm needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ._core import Case, CheckResult, check

__all__ = [
    "check_batch_normalize",
    "check_fold_eval_batch_norm",
    "check_masked_step_stats",
    "check_pair_output",
    "check_running_update",
]


def _rng() -> np.random.Generator:
    # A fixed seed: the checkers print the same message every time they are run.
    return np.random.default_rng(1)


def _name(fn: Callable[..., Any], default: str) -> str:
    return getattr(fn, "__name__", default)


# ------------------------------------------------------- exercise: normalize with batch statistics


def _ref_batch_normalize(x, eps=1e-5):
    return reference.batch_norm_forward(x, None, None, training=True, eps=eps)[0]


def check_batch_normalize(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, eps=1e-5) -> y``: BatchNorm in training mode without affine parameters.

    ``x`` has shape (N, C); each column (feature) is normalized with the mean and the biased
    variance of that column over the N rows, with ``eps`` inside the square root. The output
    has the shape and dtype of ``x``. One case (float64 columns with mean 1e8 and spread 1)
    rejects the one-pass variance ``mean(x*x) - mean(x)**2``.
    """
    rng = _rng()
    cases = [
        Case("a random (8, 3) batch", (rng.normal(size=(8, 3)),)),
        Case(
            "columns with different means and scales",
            (rng.normal(size=(16, 4)) * [1.0, 10.0, 0.1, 3.0] + [0.0, -5.0, 2.0, 100.0],),
        ),
        Case("a batch of two rows", (rng.normal(size=(2, 5)),)),
        Case(
            "a constant column (its output should be 0)",
            (np.column_stack([np.full(6, 4.0), rng.normal(size=6)]),),
        ),
        Case(
            "float32 input (the output should be float32)",
            (rng.normal(size=(10, 3)).astype(np.float32),),
            rtol=1e-4,
            atol=1e-5,
        ),
        Case("eps = 0.5 passed as a keyword", (rng.normal(size=(4, 3)),), {"eps": 0.5}),
        # mean(x*x) - mean(x)**2 cancels here even in float64: its relative error is about
        # u (mean/spread)^2 = 1.1e-16 * 1e16, of order 1. Two passes lose only the rounding
        # of the mean (about 1e-8 here), hence the looser tolerance.
        Case(
            "float64 columns with mean 1e8 and spread 1, where mean(x*x) - mean(x)**2 cancels",
            (1e8 + rng.normal(size=(16, 3)),),
            rtol=1e-6,
            atol=1e-6,
        ),
    ]
    return check(
        fn, _ref_batch_normalize, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "batch_normalize")
    )


# ---------------------------------------------------------------- exercise: a batch of two rows


def _ref_pair_output(a, b, eps=1e-5):
    x = np.stack([a, b])  # (2, C)
    return reference.batch_norm_forward(x, None, None, training=True, eps=eps)[0][0]


def check_pair_output(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x1, x2, eps=1e-5) -> y``: BatchNorm's training output for ``x1`` in the
    batch ``[x1, x2]``.

    ``x1`` and ``x2`` have shape (C,); the result has shape (C,). The exercise asks for a
    formula in ``x1 - x2`` and ``eps`` only; the check compares values with BatchNorm of the
    stacked batch.
    """
    rng = _rng()
    cases = [
        Case("two random rows", (rng.normal(size=6), rng.normal(size=6))),
        Case("rows far apart", (rng.normal(size=4) * 100, rng.normal(size=4))),
        Case(
            "rows close together, where eps matters",
            (np.array([1.0, 1.0, 1.0]), np.array([1.001, 0.999, 1.01])),
        ),
        Case(
            "equal entries in one feature (the output there should be 0)",
            (np.array([2.0, 3.0]), np.array([2.0, -1.0])),
        ),
        Case(
            "eps = 0.25 passed as a keyword",
            (rng.normal(size=5), rng.normal(size=5)),
            {"eps": 0.25},
        ),
    ]
    return check(fn, _ref_pair_output, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "pair_output"))


# ------------------------------------------------------------- exercise: the running statistics


def _ref_running_update(running_mean, running_var, x, momentum=0.1):
    new_mean, new_var = running_mean.copy(), running_var.copy()
    reference.batch_norm_forward(x, new_mean, new_var, training=True, momentum=momentum)
    return new_mean, new_var


def check_running_update(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(running_mean, running_var, x, momentum=0.1) -> (new_mean, new_var)``.

    ``x`` has shape (N, C) and the running statistics shape (C,). The update is
    ``new = (1 - momentum) * old + momentum * batch_statistic``, where the batch variance is
    the unbiased one (divided by N - 1), as in PyTorch. The function must return new arrays
    and leave its inputs unchanged. One case (a float64 batch with mean 1e8 and spread 1)
    rejects the one-pass variance ``mean(x*x) - mean(x)**2``.
    """
    rng = _rng()
    c = 3
    cases = [
        Case(
            "fresh statistics (mean 0, variance 1) and a random batch",
            (np.zeros(c), np.ones(c), rng.normal(size=(8, c)) * 2 + 1),
        ),
        Case(
            "momentum = 1: the batch statistics themselves",
            (rng.normal(size=c), rng.uniform(0.5, 2, size=c), rng.normal(size=(5, c))),
            {"momentum": 1.0},
        ),
        Case(
            "momentum = 0: nothing changes",
            (rng.normal(size=c), rng.uniform(0.5, 2, size=c), rng.normal(size=(5, c))),
            {"momentum": 0.0},
        ),
        Case("a batch of two rows (N - 1 = 1)", (np.zeros(c), np.ones(c), rng.normal(size=(2, c)))),
        Case(
            "momentum = 0.01, shifted data",
            (np.zeros(c), np.ones(c), rng.normal(size=(32, c)) + 10),
            {"momentum": 0.01},
        ),
        # As in check_batch_normalize: the one-pass variance is of order-1 wrong here in any dtype.
        Case(
            "float64 batch with mean 1e8 and spread 1, where mean(x*x) - mean(x)**2 cancels",
            (np.zeros(c), np.ones(c), 1e8 + rng.normal(size=(16, c))),
            rtol=1e-6,
            atol=1e-6,
        ),
    ]
    return check(
        fn, _ref_running_update, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "running_update")
    )


# -------------------------------------------- exercise: inference BatchNorm is a fixed affine map


def _ref_fold(W, b, running_mean, running_var, gamma, beta, eps=1e-5):
    s = gamma / np.sqrt(running_var + eps)  # (C,)
    return W * s[:, None], (b - running_mean) * s + beta


def check_fold_eval_batch_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(W, b, running_mean, running_var, gamma, beta, eps=1e-5) -> (W2, b2)``.

    The linear layer ``x @ W.T + b`` (``W``: (C, D_in), its bias ``b``: (C,)) followed by
    BatchNorm in evaluation mode equals one linear layer ``x @ W2.T + b2``; the function
    returns ``W2`` (C, D_in) and ``b2`` (C,).
    """
    rng = _rng()

    def args(c, d):
        return (
            rng.normal(size=(c, d)),
            rng.normal(size=c),
            rng.normal(size=c),
            rng.uniform(0.1, 3.0, size=c),
            rng.normal(size=c),
            rng.normal(size=c),
        )

    cases = [
        Case("a (4, 3) layer", args(4, 3)),
        Case("a (1, 5) layer: one channel", args(1, 5)),
        Case(
            "running statistics of a fresh layer (mean 0, variance 1), gamma 1, beta 0",
            (
                rng.normal(size=(3, 2)),
                rng.normal(size=3),
                np.zeros(3),
                np.ones(3),
                np.ones(3),
                np.zeros(3),
            ),
        ),
        Case(
            "a tiny running variance, where eps matters",
            (
                rng.normal(size=(2, 2)),
                rng.normal(size=2),
                rng.normal(size=2),
                np.array([1e-6, 1e-4]),
                rng.normal(size=2),
                rng.normal(size=2),
            ),
        ),
        Case("eps = 0.1 passed as a keyword", args(3, 3), {"eps": 0.1}),
    ]
    return check(fn, _ref_fold, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "fold_eval_batch_norm"))


# ----------------------------------------- exercise: per-time-step statistics of padded sequences


def _ref_masked_step_stats(a, lengths):
    _, t, d = a.shape
    mean, var = np.empty((t, d)), np.empty((t, d))
    for s in range(t):
        rows = a[lengths > s, s]  # (active, D): the sequences that have a step s
        mean[s] = rows.mean(axis=0)
        var[s] = ((rows - mean[s]) ** 2).mean(axis=0)
    return mean, var


def check_masked_step_stats(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(a, lengths) -> (mean, var)``: batch statistics per time step, padding excluded.

    ``a`` has shape (N, T, D): the summed inputs of the D units of a recurrent layer for N
    sequences, padded to length T; ``lengths`` (N,) holds integers with
    ``1 <= lengths[b] <= T`` and ``max(lengths) == T``. At step ``t`` (counted from 0) only the
    sequences with ``lengths[b] > t`` count. ``mean`` and ``var`` (biased) have shape (T, D).
    One case (mean 1e8, spread 1) rejects the one-pass variance.
    """
    rng = _rng()

    def padded(lengths, d, fill=0.0):
        lengths = np.asarray(lengths)
        t = int(lengths.max())
        a = rng.normal(size=(len(lengths), t, d))
        for i, n in enumerate(lengths):
            a[i, n:] = fill
        return a, lengths

    cases = [
        Case("four sequences of the same length 5", padded([5, 5, 5, 5], 3)),
        Case("lengths 2, 4, 6, padded with zeros", padded([2, 4, 6], 2)),
        Case("padding filled with 1000 (it must not count)", padded([3, 7, 5, 1], 4, 1000.0)),
        Case(
            "one long sequence: at its last steps it is alone (variance 0)",
            padded([8, 2, 3], 3, np.nan),
        ),
        Case("a single sequence", padded([4], 2)),
        Case(
            "values with mean 1e8 and spread 1, where mean(x*x) - mean(x)**2 cancels",
            tuple(np.asarray(v) + off for v, off in zip(padded([3, 5, 4], 3), (1e8, 0))),
            rtol=1e-6,
            atol=1e-6,
        ),
    ]
    return check(
        fn, _ref_masked_step_stats, cases, rtol=1e-7, atol=1e-9, name=_name(fn, "masked_step_stats")
    )
