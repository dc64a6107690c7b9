"""Property-based tests (hypothesis): shapes, dtypes and magnitudes; the invariances the book
claims."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lnlib
from lnlib import reference

# Every test here runs with the compiled CPU kernel and with the NumPy fast path.
pytestmark = pytest.mark.usefixtures("cpu_path")

# Magnitudes per dtype: float64 over 1e-20..1e20; float32/float16 where squares stay finite
# in the float32 accumulator and the values themselves are normal numbers of the dtype.
EXPONENTS = {np.float64: (-20, 20), np.float32: (-15, 15), np.float16: (-3, 4)}


@st.composite
def problems(draw, dtypes=(np.float64, np.float32, np.float16)):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=6))
    k = draw(st.integers(1, len(shape)))
    lo, hi = EXPONENTS[dtype]
    magnitude = 10.0 ** draw(st.integers(lo, hi))
    offset = draw(st.sampled_from([0.0, 1.0, -3.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = ((rng.standard_normal(shape) + offset) * magnitude).astype(dtype)
    return x, k, rng


def _relative_error(got, want, scale=None):
    """Largest error relative to ``scale`` (default: the largest magnitude of ``want``)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want), initial=0.0) if scale is None else scale
    return np.max(np.abs(got - want), initial=0.0) / max(scale, 1e-300)


def _dx_scale(rstd, dy):
    """The natural size of dx = rstd * (g - ...): it may cancel to far less, so judge against
    this."""
    return float(np.max(rstd, initial=0.0)) * float(
        np.max(np.abs(dy.astype(np.float64)), initial=0.0)
    )


TOL = {np.float64: 1e-9, np.float32: 1e-4, np.float16: 4e-3}


@given(problems())
def test_layer_norm_is_accurate_at_every_magnitude(p):
    """LN(x; eps) in the dtype agrees with the float64 reference; eps is scaled with x so
    that the expected output is of order one (LN(s x; eps s^2) = LN(x; eps))."""
    x, k, rng = p
    scale = float(np.max(np.abs(x.astype(np.float64)), initial=0.0))
    assume(scale > 0)
    eps = 1e-5 * scale**2
    assume(np.isfinite(eps))
    y, mean, rstd = lnlib.layer_norm_forward(x, eps=eps, normalized_ndim=k)
    want, wmean, wrstd = reference.layer_norm_forward(
        x.astype(np.float64), eps=eps, normalized_ndim=k
    )
    assert y.shape == x.shape and y.dtype == x.dtype
    assert mean.shape == rstd.shape == x.shape[: x.ndim - k]
    assert np.all(np.isfinite(y))
    assert _relative_error(y, want) < TOL[x.dtype.type]
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    dx, dw, db = lnlib.layer_norm_backward(dy, x, mean, rstd)
    wdx, wdw, wdb = reference.layer_norm_backward(
        dy.astype(np.float64), x.astype(np.float64), wmean, wrstd
    )
    assert dx.dtype == x.dtype and dw.shape == x.shape[x.ndim - k :]
    assert np.all(np.isfinite(dx))
    assert _relative_error(dx, wdx, _dx_scale(wrstd, dy)) < 8 * TOL[x.dtype.type]


@given(problems())
def test_rms_norm_is_accurate_at_every_magnitude(p):
    x, k, rng = p
    scale = float(np.max(np.abs(x.astype(np.float64)), initial=0.0))
    assume(scale > 0)
    eps = 1e-6 * scale**2
    y, rstd = lnlib.rms_norm_forward(x, eps=eps, normalized_ndim=k)
    want, wrstd = reference.rms_norm_forward(x.astype(np.float64), eps=eps, normalized_ndim=k)
    assert y.dtype == x.dtype and rstd.shape == x.shape[: x.ndim - k]
    assert _relative_error(y, want) < TOL[x.dtype.type]
    dy = rng.standard_normal(x.shape).astype(x.dtype)
    dx, _ = lnlib.rms_norm_backward(dy, x, rstd)
    wdx, _ = reference.rms_norm_backward(dy.astype(np.float64), x.astype(np.float64), wrstd)
    assert _relative_error(dx, wdx, _dx_scale(wrstd, dy)) < 8 * TOL[x.dtype.type]


@given(problems(dtypes=(np.float64,)), st.floats(0.01, 100), st.floats(-100, 100))
def test_layer_norm_invariant_to_shifting_and_scaling_each_row(p, rho, nu):
    """With eps = 0, LN(rho x + nu) = LN(x) for every rho > 0 and nu (nu drawn relative to |x|, so
    that the shifted input still carries the row's information in float64)."""
    x, k, _ = p
    nu = nu * float(np.max(np.abs(x)))
    axes = tuple(range(x.ndim - k, x.ndim))
    spread = np.std(x, axis=axes)
    assume(np.all(spread > 1e-6 * np.max(np.abs(x), axis=axes)))  # no (near-)constant rows
    y = lnlib.layer_norm(x, eps=0.0, normalized_ndim=k)
    np.testing.assert_allclose(
        lnlib.layer_norm(rho * x + nu, eps=0.0, normalized_ndim=k), y, atol=1e-6
    )


@given(problems(dtypes=(np.float64,)), st.floats(0.01, 100))
def test_rms_norm_invariant_to_scaling_only(p, rho):
    x, k, _ = p
    assume(np.all(np.abs(x).max(axis=tuple(range(x.ndim - k, x.ndim))) > 0))
    np.testing.assert_allclose(
        lnlib.rms_norm(rho * x, eps=0.0, normalized_ndim=k),
        lnlib.rms_norm(x, eps=0.0, normalized_ndim=k),
        atol=1e-9,
    )


@given(problems(), st.data())
def test_rows_are_independent_bitwise(p, data):
    """A row's output does not depend on the other rows or on its place in the batch."""
    x, k, rng = p
    rows = x.reshape(-1, *x.shape[x.ndim - k :])
    assume(rows.shape[0] >= 2)
    y = lnlib.layer_norm(rows, normalized_ndim=k)
    perm = rng.permutation(rows.shape[0])
    np.testing.assert_array_equal(lnlib.layer_norm(rows[perm], normalized_ndim=k), y[perm])
    i = data.draw(st.integers(0, rows.shape[0] - 1))
    np.testing.assert_array_equal(lnlib.layer_norm(rows[i : i + 1], normalized_ndim=k)[0], y[i])
    np.testing.assert_array_equal(
        lnlib.rms_norm(rows[i : i + 1], normalized_ndim=k)[0],
        lnlib.rms_norm(rows, normalized_ndim=k)[i],
    )


@given(problems())
def test_normalized_rows_lie_on_the_sphere(p):
    """Without affine parameters and eps = 0, each row has mean 0 and squared norm H."""
    x, k, _ = p
    x = x.astype(np.float64)
    axes = tuple(range(x.ndim - k, x.ndim))
    assume(np.all(np.std(x, axis=axes) > 1e-6 * np.max(np.abs(x), axis=axes)))
    y = lnlib.layer_norm(x, eps=0.0, normalized_ndim=k)
    h = int(np.prod(x.shape[x.ndim - k :]))
    np.testing.assert_allclose(y.sum(axis=axes), 0, atol=1e-9 * h)
    np.testing.assert_allclose((y * y).sum(axis=axes), h, rtol=1e-9)
