r"""Checkers for the exercises of the chapter "Implementation".

Each checker runs the reader's function on ordinary and edge-case inputs against a reference
from lnlib, prints one line that says PASS or what is wrong, and returns a
:class:`~lnlib.exercises.CheckResult`.

==================================  ===================================================
checker                             the reader writes
==================================  ===================================================
:func:`check_merge`                 ``fn(n_a, mean_a, m2_a, n_b, mean_b, m2_b) -> (n, mean, m2)``
:func:`check_welford`               ``fn(x) -> (mean, var)``, one pass over the last axis
:func:`check_backward_from_output`  ``fn(dy, y, rstd, weight, bias) -> dx``
:func:`check_min_time`              ``fn(B, D, itemsize, bandwidth_GBps, backward=False) -> s``
:func:`check_sharded_rms_rstd`      ``fn(shards, eps) -> rstd`` of RMSNorm over sharded rows
:func:`check_lane_sum`              ``fn(x, lanes=16) -> sums``, in the kernel's lane order
:func:`check_add_layer_norm`        ``fn(x, residual, weight, bias, eps, residual_dtype) -> (y, h)``
:func:`check_add_backward`          ``fn(dy, dh, h, mean, rstd, weight) -> dsum``
:func:`check_fused_bytes`           ``fn(B, D, x_itemsize, h_itemsize, fused, backward=False)``
==================================  ===================================================

The book derives each of them in Chapter 5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ..distributed import merge_moments
from ..layer_norm import layer_norm, layer_norm_backward, layer_norm_forward
from ..recompute import layer_norm_backward_from_output
from ._core import Case, CheckResult, check

__all__ = [
    "check_add_backward",
    "check_add_layer_norm",
    "check_backward_from_output",
    "check_fused_bytes",
    "check_lane_sum",
    "check_merge",
    "check_min_time",
    "check_sharded_rms_rstd",
    "check_welford",
]


def _rng() -> np.random.Generator:
    return np.random.default_rng(5)


def _moments(x):
    """(count, mean, m2) over the last axis, in float64."""
    mean = x.mean(axis=-1)
    return x.shape[-1], mean, ((x - mean[..., None]) ** 2).sum(axis=-1)


# ------------------------------------------------------------- exercise: Chan's merge


def _ref_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n, mean, m2 = merge_moments([n_a, n_b], [mean_a, mean_b], [m2_a, m2_b])
    return n, mean, m2


def check_merge(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(n_a, mean_a, m2_a, n_b, mean_b, m2_b) -> (n, mean, m2)``.

    The inputs are the count, mean and sum of squared deviations of two pieces of the same
    rows; the result must describe the union. Means and M2 are float64 arrays of shape (N,)
    (or scalars); counts are ints.
    """
    rng = _rng()
    cases = []
    for desc, x, split in [
        ("two halves of 4 random rows", rng.normal(size=(4, 16)), 8),
        ("unequal pieces, 1 and 9 columns", rng.normal(size=(3, 10)), 1),
        ("a large mean and a small spread: 1e6 + N(0, 1)", 1e6 + rng.normal(size=(2, 64)), 20),
        (
            "pieces with very different means",
            np.concatenate(
                [rng.normal(-50.0, 1.0, size=(2, 5)), rng.normal(50.0, 1.0, size=(2, 7))], 1
            ),
            5,
        ),
        ("constant rows (M2 = 0 everywhere)", np.full((2, 6), 3.5), 3),
    ]:
        na, ma, m2a = _moments(x[:, :split])
        nb, mb, m2b = _moments(x[:, split:])
        cases.append(Case(desc, (na, ma, m2a, nb, mb, m2b), rtol=1e-9, atol=1e-9))
    m_a, m_b = np.float64(2.0), np.float64(4.0)
    cases.append(
        Case(
            "scalars: (1, 2.0, 0.0) and (1, 4.0, 0.0)",
            (1, m_a, np.float64(0.0), 1, m_b, np.float64(0.0)),
        )
    )
    return check(fn, _ref_merge, cases, name=getattr(fn, "__name__", "merge"), check_dtype=False)


# ---------------------------------------------------------- exercise: one-pass Welford


def _ref_welford(x):
    x = np.asarray(x, dtype=np.float64)
    return x.mean(axis=-1), x.var(axis=-1)


def check_welford(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x) -> (mean, var)``: mean and biased variance over the last axis of a
    float64 array, computed in one pass (Welford's update), as float64 arrays of shape
    ``x.shape[:-1]``. The cases include a mean of 1e8 with a spread of 1, where
    ``mean(x^2) - mean(x)^2`` loses every digit.
    """
    rng = _rng()
    cases = [
        Case("4 random rows of 32", rng.normal(size=(4, 32))),
        Case("a single column (variance 0)", rng.normal(size=(3, 1))),
        Case(
            "a mean of 1e8 and a spread of 1", 1e8 + rng.normal(size=(2, 200)), rtol=1e-6, atol=1e-6
        ),
        Case("three dimensions (2, 3, 7)", rng.normal(size=(2, 3, 7))),
        Case("constant rows", np.full((2, 9), -4.25)),
    ]
    return check(
        fn,
        _ref_welford,
        cases,
        name=getattr(fn, "__name__", "welford"),
        rtol=1e-10,
        atol=1e-12,
        check_dtype=False,
    )


# ------------------------------------------------- exercise: backward from the output


def _ref_backward_from_output(dy, y, rstd, weight, bias):
    return layer_norm_backward_from_output(dy, y, rstd, weight, bias)[0]


def check_backward_from_output(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(dy, y, rstd, weight, bias) -> dx``: the LayerNorm input gradient computed
    from the forward's *output* ``y`` (and ``rstd``), without ``x`` or ``mean``. Arrays are
    float64, shapes (B, D) for ``dy`` and ``y``, (B,) for ``rstd``, (D,) for the parameters;
    ``weight`` has no zero entry.
    """
    rng = _rng()
    cases = []
    for desc, shape, shift in [
        ("a (4, 8) batch", (4, 8), 0.0),
        ("a (3, 64) batch with a large mean", (3, 64), 100.0),
        ("one feature, D = 1", (3, 1), 0.0),
    ]:
        x = rng.normal(shift, 2.0, size=shape)
        weight = rng.choice([-1.0, 1.0], size=shape[1]) * rng.uniform(0.5, 2.0, size=shape[1])
        bias = rng.normal(size=shape[1])
        y, _, rstd = reference.layer_norm_forward(x, weight, bias)
        cases.append(Case(desc, (rng.normal(size=shape), y, rstd, weight, bias)))
    x = rng.normal(size=(2, 5))
    y, _, rstd = reference.layer_norm_forward(x, np.ones(5), np.zeros(5))
    cases.append(
        Case(
            "weight of ones and bias of zeros",
            (rng.normal(size=(2, 5)), y, rstd, np.ones(5), np.zeros(5)),
        )
    )
    return check(
        fn,
        _ref_backward_from_output,
        cases,
        name=getattr(fn, "__name__", "backward_from_output"),
        rtol=1e-9,
        atol=1e-10,
    )


# -------------------------------------------------------- exercise: the roofline bound


def _ref_min_time(B, D, itemsize, bandwidth_GBps, backward=False):
    elements = (5 if backward else 2) * B * D
    return elements * itemsize / (bandwidth_GBps * 1e9)


def check_min_time(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(B, D, itemsize, bandwidth_GBps, backward=False) -> seconds``: the least
    time a LayerNorm over a (B, D) array can take when it only has to move its data at the
    given bandwidth (1 GB = 1e9 bytes). Count the arrays of B x D elements only: the forward
    reads ``x`` and writes ``y``; with ``backward=True``, the forward and then the backward,
    which reads ``dy`` and ``x`` and writes ``dx``.
    """
    cases = [
        Case("forward, (4096, 4096) float32 at 20 GB/s", (4096, 4096, 4, 20.0)),
        Case("forward, (32768, 768) float16 at 100 GB/s", (32768, 768, 2, 100.0)),
        Case(
            "forward and backward, (4096, 4096) float32 at 20 GB/s",
            (4096, 4096, 4, 20.0),
            {"backward": True},
        ),
        Case("forward and backward, (1, 1) float64 at 1 GB/s", (1, 1, 8, 1.0), {"backward": True}),
    ]
    return check(
        fn,
        _ref_min_time,
        cases,
        name=getattr(fn, "__name__", "min_time"),
        rtol=1e-9,
        atol=0.0,
        check_dtype=False,
    )


# -------------------------------------------------- exercise: RMSNorm over shards


def _ref_sharded_rms_rstd(shards, eps):
    x = np.concatenate([np.asarray(s) for s in shards], axis=-1)  # the whole rows, to compare
    return reference.rms_norm_forward(x, eps=eps)[1]


#: The NumPy functions that join arrays: what a rank, which holds its own columns only,
#: cannot do with the other ranks' shards.
_JOINS = {
    np.concatenate,
    np.stack,
    np.hstack,
    np.vstack,
    np.dstack,
    np.column_stack,
    np.block,
    np.append,
}


class _RankShard(np.ndarray):
    """One rank's columns of the rows: joining it with other shards into whole rows raises."""

    def __array_function__(self, func, types, args, kwargs):
        if func in _JOINS:
            raise ValueError(
                f"shards: np.{func.__name__} gathers whole rows, which no rank holds; combine "
                "one number per row from each shard"
            )
        return super().__array_function__(func, types, args, kwargs)


def check_sharded_rms_rstd(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(shards, eps) -> rstd``: the RMSNorm ``rstd`` (shape (N,)) of rows split by
    columns into the float64 arrays ``shards`` (each (N, h_r)), combining one number per row
    per shard, as the ranks of a sharded RMSNorm would. In the last case the shards refuse to
    be joined (``np.concatenate``, ``np.stack``, ``np.hstack``, ...): gathering whole rows is
    what the sharded computation avoids.
    """
    rng = _rng()
    x = rng.normal(size=(4, 12))
    cases = [
        Case("two equal shards", ([x[:, :6], x[:, 6:]], 1e-6)),
        Case("four unequal shards", (np.array_split(x, [1, 4, 9], axis=1), 1e-6)),
        Case("one shard", ([x], 1e-6)),
        Case("eps = 0.5", ([x[:, :5], x[:, 5:]], 0.5)),
        Case("a zero row", ([np.zeros((2, 3)), np.zeros((2, 4))], 1e-6)),
        Case(
            "three shards held by three ranks (no rank may join them into whole rows)",
            ([s.view(_RankShard) for s in np.array_split(x, [5, 7], axis=1)], 1e-6),
        ),
    ]
    return check(
        fn,
        _ref_sharded_rms_rstd,
        cases,
        name=getattr(fn, "__name__", "sharded_rms_rstd"),
        rtol=1e-10,
        atol=0.0,
        check_dtype=False,
    )


# ------------------------------------------- exercise: the compiled kernel's summation order


def _ref_lane_sum(x, lanes=16):
    """Sum over the last axis as lnlib's CPU kernel sums one block of a row (exercise 5.6):
    element ``i`` added, in order, to lane ``i % lanes`` in the dtype of ``x``, the lanes
    then widened to float64 and added pairwise (``lanes_total`` in ``norms_rows.h``)."""
    x = np.asarray(x)
    n = x.shape[-1]
    acc = np.zeros(x.shape[:-1] + (lanes,), dtype=x.dtype)  # one partial sum per lane
    for i in range(0, n, lanes):
        group = x[..., i : i + lanes]  # the last group may be short: lanes 0, 1, ... only
        acc[..., : group.shape[-1]] += group
    acc = acc.astype(np.float64)  # exact: every float32 or float64 is a float64
    width = lanes // 2
    while width:
        acc[..., :width] += acc[..., width : 2 * width]
        width //= 2
    return acc[..., 0]


def check_lane_sum(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, lanes=16) -> sums``: the sum over the last axis of ``x`` (float32 or
    float64, any number of leading axes, at most 256 values per row: one block of lnlib's
    compiled kernel) in the order in which the kernel sums a block, so that the float64
    result is equal **bit for bit**:

    element ``i`` is added, in order, to partial sum (lane) ``i % lanes``, in the dtype of
    ``x`` (so the last ``n % lanes`` elements go to lanes ``0, 1, ...``); the lanes are then
    converted to float64 and combined pairwise in float64, ``acc[k] += acc[k + w]`` for
    ``k < w`` and ``w = lanes/2, lanes/4, ..., 1``; the result is ``acc[0]``, a float64.
    ``lanes`` is a power of two. The kernel uses 16 lanes, cuts longer rows into blocks of
    256 and adds the blocks' totals pairwise in float64 (float16 rows are converted to
    float32 first).
    """
    rng = _rng()

    def rows(shape, dtype=np.float32):
        return (1000 + rng.normal(size=shape)).astype(dtype)  # a large mean: order shows

    cases = [
        Case("float32 rows of 256 values (mean 1000): one full block", rows((64, 256))),
        Case("float32 rows of 250 values: 10 left over after 15 groups", rows((64, 250))),
        Case("rows of exactly 16 values", rows((16, 16))),
        Case("rows shorter than the lanes (5 values)", rows((8, 5))),
        Case("rows of 1 value", rows((3, 1))),
        Case("lanes=4 on rows of 37 values", rows((16, 37)), {"lanes": 4}),
        Case("float64 rows of 203 values", 1e8 * rows((32, 203), np.float64)),
        Case("three dimensions (2, 3, 70)", rows((2, 3, 70))),
    ]
    return check(
        fn, _ref_lane_sum, cases, name=getattr(fn, "__name__", "lane_sum"), rtol=0.0, atol=0.0
    )


# ------------------------------------------------- exercise: the fused residual add


def _ref_add_layer_norm(x, residual, weight, bias, eps, residual_dtype):
    h_dtype = np.dtype(residual.dtype if residual_dtype is None else residual_dtype)
    add_dtype = np.result_type(x.dtype, residual.dtype, h_dtype)
    h = (residual.astype(add_dtype) + x.astype(add_dtype)).astype(h_dtype)
    y = layer_norm(h, weight, bias, eps=eps).astype(x.dtype)
    return y, h


def check_add_layer_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, residual, weight, bias, eps, residual_dtype) -> (y, h)``.

    ``h = residual + x``, added in the widest of the dtypes of ``x``, ``residual`` and
    ``residual_dtype`` and rounded once to ``residual_dtype`` (None: the dtype of ``residual``);
    ``y`` has the dtype of ``x`` and must be, bit for bit, ``lnlib.layer_norm(h, weight,
    bias, eps=eps)`` cast to the dtype of ``x``: the statistics are those of h as stored.
    ``weight`` and ``bias`` are float32 (or float64 for float64 rows), or None.
    """
    rng = _rng()
    cases = []
    for desc, shape, xd, rd, hd in [
        ("(4, 64) float32, residual float32", (4, 64), np.float32, np.float32, None),
        ("(3, 100) float64", (3, 100), np.float64, np.float64, None),
        (
            "(2, 32): x float16, residual float32 (the stream in float32)",
            (2, 32),
            np.float16,
            np.float32,
            None,
        ),
        (
            "(2, 48): x and residual float16, residual_dtype=float32",
            (2, 48),
            np.float16,
            np.float16,
            np.float32,
        ),
        ("(5, 1): one value per row (y = bias)", (5, 1), np.float32, np.float32, None),
        (
            "(4, 64): x float64 on a float32 stream (added in float64, rounded once)",
            (4, 64),
            np.float64,
            np.float32,
            None,
        ),
        (
            "(4, 64): float32 x and residual, residual_dtype=float16 (rounded once)",
            (4, 64),
            np.float32,
            np.float32,
            np.float16,
        ),
    ]:
        pd = np.float64 if xd == np.float64 else np.float32
        x = rng.normal(size=shape).astype(xd)
        residual = (3.0 + 4.0 * rng.normal(size=shape)).astype(rd)
        weight = rng.uniform(0.5, 1.5, size=shape[-1]).astype(pd)
        bias = rng.normal(size=shape[-1]).astype(pd)
        cases.append(Case(desc, (x, residual, weight, bias, 1e-5, hd)))
    x = rng.normal(size=(3, 16)).astype(np.float32)
    r = rng.normal(size=(3, 16)).astype(np.float32)
    cases.append(Case("no weight and no bias", (x, r, None, None, 1e-5, None)))
    return check(
        fn,
        _ref_add_layer_norm,
        cases,
        name=getattr(fn, "__name__", "add_layer_norm"),
        rtol=0.0,
        atol=0.0,
    )


def _ref_add_backward(dy, dh, h, mean, rstd, weight):
    dx = layer_norm_backward(dy.astype(h.dtype), h, mean, rstd, weight)[0]
    return dx if dh is None else dh + dx


def check_add_backward(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(dy, dh, h, mean, rstd, weight) -> dsum``.

    ``h = residual + x`` fed both the next residual and the LayerNorm whose output had the
    gradient ``dy``; ``dh`` is the gradient that arrived along the residual stream (None:
    zero). ``mean`` and ``rstd`` are those of ``lnlib.layer_norm_forward(h, ...)``. The result
    is the gradient of x and of residual alike, in the dtype of h (float64 here; compared to
    ``rtol=1e-10``).
    """
    rng = _rng()
    cases = []
    for desc, shape, has_dh, wscale in [
        ("(4, 32) with a gradient along the stream", (4, 32), True, 1.0),
        ("(2, 257) with a gradient along the stream", (2, 257), True, 1.0),
        ("(3, 16), dh None (nothing arrives along the stream)", (3, 16), False, 1.0),
        ("(3, 16), a stream gradient 100 times dy", (3, 16), True, 100.0),
    ]:
        h = 2.0 + 3.0 * rng.normal(size=shape)
        weight = rng.uniform(0.5, 1.5, size=shape[-1])
        _, mean, rstd = layer_norm_forward(h, weight, None)
        dy = rng.normal(size=shape)
        dh = wscale * rng.normal(size=shape) if has_dh else None
        cases.append(Case(desc, (dy, dh, h, mean, rstd, weight)))
    return check(
        fn,
        _ref_add_backward,
        cases,
        name=getattr(fn, "__name__", "add_backward"),
        rtol=1e-10,
        atol=1e-12,
    )


def _ref_fused_bytes(B, D, x_itemsize, h_itemsize, fused, backward=False):
    n = B * D
    if fused:
        fwd = n * (2 * x_itemsize + 2 * h_itemsize)  # read x, residual; write y, h
        bwd = n * (x_itemsize + 3 * h_itemsize)  # read dy, dh, h; write dsum
    else:
        fwd = n * (2 * x_itemsize + 3 * h_itemsize)  # add: x, residual -> h; norm: h -> y
        bwd = n * (x_itemsize + 5 * h_itemsize)  # norm: dy, h -> dx; add: dh, dx -> dsum
    return fwd + bwd if backward else fwd


def check_fused_bytes(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(B, D, x_itemsize, h_itemsize, fused, backward=False) -> bytes``.

    The bytes that must move between memory and the core for ``h = residual + x; y =
    norm(h)`` on (B, D) arrays, fused (one kernel) or not (an add, then a norm that writes y
    in the dtype of x). x, y and dy have ``x_itemsize`` bytes per element; residual, h, dh,
    the norm's dx and dsum have ``h_itemsize``. With ``backward=True``: the forward and the
    backward together.
    """
    cases = []
    for B, D, xi, hi in [(4096, 4096, 4, 4), (32768, 768, 2, 4), (8, 8, 2, 2), (1, 3, 8, 8)]:
        for fused in (False, True):
            for bwd in (False, True):
                kind = "fused" if fused else "unfused"
                part = "forward and backward" if bwd else "forward"
                desc = f"({B}, {D}), x {xi} bytes, h {hi} bytes, {kind}, {part}"
                cases.append(Case(desc, (B, D, xi, hi, fused), {"backward": bwd}))
    return check(
        fn,
        _ref_fused_bytes,
        cases,
        name=getattr(fn, "__name__", "fused_bytes"),
        rtol=0.0,
        atol=0.0,
        check_dtype=False,
    )
