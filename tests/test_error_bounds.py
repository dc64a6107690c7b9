"""The rounding-error bounds of tests/error_bounds.py, which the GPU tests compare parameter
gradients with, checked on the CPU: they hold for float32 sums of float16 data in any order and
grouping, with either form of xhat, and they fail a sum that lost a row, repeated one or
accumulated in float16. The torch comparison of tests/test_gpu.py runs here too, with lnlib's
CPU paths and torch's CPU kernels standing in for the CUDA ones."""

import numpy as np
import pytest
from error_bounds import UNIT_ROUNDOFF, column_sum_bound, gamma, summand_errors

M, D = 48, 512


def _float16_rows(rng, shift):
    x = (rng.standard_normal((M, D)) + shift).astype(np.float16)
    dy = rng.standard_normal((M, D)).astype(np.float16)
    return x, dy


def _float32_summands(x, dy, form):
    """float32 statistics (two passes), xhat in one of its two forms, products: as a kernel."""
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    mean = x32.mean(axis=1, dtype=np.float32)[:, None]  # (M, 1)
    var = ((x32 - mean) ** 2).mean(axis=1, dtype=np.float32)[:, None]
    rstd = (np.float32(1) / np.sqrt(var + np.float32(1e-5))).astype(np.float32)
    xhat = (x32 - mean) * rstd if form == "centered" else x32 * rstd - mean * rstd
    return dy32 * xhat, mean.astype(np.float64), rstd.astype(np.float64)


def _sums(t, rng):
    """Column sums of float32 summands ``t`` (M, D) in several orders, in float32."""
    orders = {
        "in order": np.arange(M),
        "reversed": np.arange(M)[::-1],
        "shuffled": rng.permutation(M),
    }
    for name, order in orders.items():
        s = np.zeros(D, np.float32)
        for i in order:
            s = s + t[i]
        yield name, s
    yield "pairwise", np.add.reduce(t, axis=0, dtype=np.float32)
    units = np.zeros((5, D), np.float32)  # partial sums per unit, then the units added
    for i in range(M):
        units[i % 5] += t[i]
    yield "five units", units.sum(axis=0, dtype=np.float32)


def _exact(x, dy):
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mean = x64.mean(axis=1, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mean) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    return x64, dy64, mean, rstd


@pytest.mark.parametrize("form", ["centered", "expanded"])
@pytest.mark.parametrize("shift", [0.0, 3.0])
def test_the_bound_holds_for_float32_sums_in_any_order(rng, shift, form):
    x, dy = _float16_rows(rng, shift)
    x64, dy64, mean, rstd = _exact(x, dy)
    t32, mean32, rstd32 = _float32_summands(x, dy, form)
    errors = summand_errors(
        dy64, x64, mean, rstd, abs(mean32 - mean), abs(rstd32 / rstd - 1), "float32"
    )
    terms = dy64 * (x64 - mean) * rstd
    assert np.all(np.abs(t32 - terms) <= errors), "a summand outside its bound"
    exact = terms.sum(axis=0)
    for out in (None, "float16"):
        bound = column_sum_bound(terms, errors, "float32", out)
        for name, s in _sums(t32, rng):
            got = s if out is None else s.astype(np.float16)
            err = np.abs(got.astype(np.float64) - exact)
            assert np.all(err <= bound), f"{name}, rounded to {out}: {np.max(err - bound):.3g}"
    # dbias: exact summands
    for name, s in _sums(dy.astype(np.float32), rng):
        err = np.abs(s.astype(np.float16).astype(np.float64) - dy64.sum(axis=0))
        assert np.all(err <= column_sum_bound(dy64, 0.0, "float32", "float16")), name


def test_the_bound_fails_a_wrong_sum(rng):
    """A lost row, a repeated row, or a float16 running sum each break the bound in some
    column; the bound is tighter than 1 % of the values' scale, where the old tolerance of the
    torch comparison (1.6 times the scale) passed anything."""
    x, dy = _float16_rows(rng, 0.0)
    x64, dy64, mean, rstd = _exact(x, dy)
    t32, mean32, rstd32 = _float32_summands(x, dy, "centered")
    errors = summand_errors(
        dy64, x64, mean, rstd, abs(mean32 - mean), abs(rstd32 / rstd - 1), "float32"
    )
    terms = dy64 * (x64 - mean) * rstd
    exact = terms.sum(axis=0)
    bound = column_sum_bound(terms, errors, "float32", "float16")
    scale = np.max(np.abs(exact))
    assert np.max(bound) < 0.01 * scale, (np.max(bound), scale)
    right = t32.sum(axis=0, dtype=np.float32)
    running16 = np.zeros(D, np.float16)
    for i in range(M):
        running16 = (running16 + t32[i].astype(np.float16)).astype(np.float16)
    wrong = {
        "a lost row": right - t32[M // 2],
        "a repeated row": right + t32[M // 2],
        "a float16 running sum": running16,
    }
    for name, s in wrong.items():
        err = np.abs(s.astype(np.float16).astype(np.float64) - exact)
        assert np.any(err > bound), f"{name} passes the bound"


def test_gamma():
    u = UNIT_ROUNDOFF["float32"]
    assert gamma(0, u) == 0 and gamma(1, u) > u and gamma(100, u) < 101 * u
    with pytest.raises(AssertionError):
        gamma(2**23, u)


@pytest.mark.parametrize("d", [1, 33, 768, 4096, 65536])
def test_the_torch_comparison_on_the_cpu(rng, d):
    """tests/test_gpu.py's check_against_torch with NumPy arrays and torch's CPU kernels, in
    float32: its bounds hold for implementations other than lnlib's CUDA kernels. (Not in
    float16: torch's CPU LayerNorm keeps float16 statistics and its float16 dbias is off the
    exact sum by more than float32 accumulation allows; torch's CUDA kernels accumulate in
    float32, T_ACC in aten/src/ATen/native/cuda/layer_norm_kernel.cu.)"""
    from test_gpu import check_against_torch

    check_against_torch(np, "cpu", np.float32, d, rng)
