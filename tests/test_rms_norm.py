"""RMSNorm: against PyTorch, the reference and finite differences; batch invariance."""

import numpy as np
import pytest
import torch.nn.functional as F
from conftest import assert_close, host, on, torch_tensor

import lnlib
from lnlib import reference

# Every test here runs with the compiled CPU kernel and with the NumPy fast path.
pytestmark = pytest.mark.usefixtures("cpu_path")

SHAPES = [((7, 16), 1), ((3, 5, 8), 1), ((4, 6, 5), 2), ((2, 3, 4, 5), 3), ((9,), 1)]
DTYPES = [np.float64, np.float32, np.float16]


def _data(rng, shape, k, dtype):
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(shape[len(shape) - k :])).astype(dtype)
    return x, w, rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch(rng, xp, shape, k, dtype, affine):
    x, w, dy = _data(rng, shape, k, dtype)
    w = w if affine else None
    y, rstd = lnlib.rms_norm_forward(*on(xp, x, w), eps=1e-6, normalized_ndim=k)
    dx, dw = lnlib.rms_norm_backward(*on(xp, dy, x), rstd, on(xp, w))
    y, rstd, dx, dw = map(host, (y, rstd, dx, dw))
    tx = torch_tensor(x, True)
    tw = torch_tensor(w, True) if affine else None
    ty = F.rms_norm(tx, x.shape[x.ndim - k :], tw, 1e-6)
    ty.backward(torch_tensor(dy))
    assert y.dtype == dx.dtype == x.dtype and rstd.shape == shape[: len(shape) - k]
    factor = 2.0 if dtype == np.float16 else 1.0
    assert_close(y, ty.detach().numpy(), dtype, factor=factor)
    assert_close(dx, tx.grad.numpy(), dtype, factor=4 * factor)
    if affine:
        assert_close(dw, tw.grad.numpy(), dtype, factor=factor * x.size / w.size)
    if dtype == np.float64:
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(rng, xp, shape, k, dtype):
    x, w, dy = _data(rng, shape, k, dtype)
    y, rstd = lnlib.rms_norm_forward(*on(xp, x, w), normalized_ndim=k)
    yr, rr = reference.rms_norm_forward(x, w, normalized_ndim=k)
    assert isinstance(y, xp.ndarray) and y.dtype == yr.dtype
    assert_close(host(y), yr, dtype)
    assert_close(host(rstd), rr, dtype)
    fast = lnlib.rms_norm_backward(*on(xp, dy, x, rr, w))
    for got, want in zip(fast, reference.rms_norm_backward(dy, x, rr, w)):
        assert got.dtype == want.dtype
        assert_close(host(got), want, dtype, factor=x.size)


@pytest.mark.parametrize("shape,k", [((3, 6), 1), ((2, 3, 4), 2)])
def test_finite_differences(rng, xp, shape, k):
    x, w, dy = _data(rng, shape, k, np.float64)
    y, rstd = lnlib.rms_norm_forward(*on(xp, x, w), normalized_ndim=k)
    dx, dw = map(host, lnlib.rms_norm_backward(*on(xp, dy, x), rstd, on(xp, w)))

    def f(x, w):
        return host(lnlib.rms_norm(*on(xp, x, w), normalized_ndim=k))

    lnlib.check_grad(lambda v: f(v, w), x, dy, dx)
    lnlib.check_grad(lambda v: f(x, v), w, dy, dw, name="dweight")
    dx1, dw1 = map(host, lnlib.rms_norm_backward(*on(xp, dy, x), rstd))
    lnlib.check_grad(lambda v: f(x, v), np.ones_like(w), dy, dw1)


def test_zero_row_is_zero_with_finite_gradients(rng):
    x = rng.standard_normal((3, 10)).astype(np.float32)
    x[1] = 0
    w = rng.standard_normal(10).astype(np.float32)
    y, rstd = lnlib.rms_norm_forward(x, w)
    np.testing.assert_array_equal(y[1], 0)
    dx, dw = lnlib.rms_norm_backward(rng.standard_normal(x.shape).astype(np.float32), x, rstd, w)
    assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance_and_strides_bitwise(rng, dtype):
    x = rng.standard_normal((600, 200)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, rstd = lnlib.rms_norm_forward(x)
    dx = lnlib.rms_norm_backward(dy, x, rstd)[0]
    perm = rng.permutation(600)
    yp, rp = lnlib.rms_norm_forward(x[perm])
    np.testing.assert_array_equal(yp, y[perm])
    np.testing.assert_array_equal(lnlib.rms_norm_backward(dy[perm], x[perm], rp)[0], dx[perm])
    y1, r1 = lnlib.rms_norm_forward(x[7:8])
    np.testing.assert_array_equal(y1[0], y[7])
    yr, rr = lnlib.rms_norm_forward(x[::-1, ::-1])
    np.testing.assert_array_equal(
        yr, lnlib.rms_norm_forward(np.ascontiguousarray(x[::-1, ::-1]))[0]
    )


def test_inputs_not_modified_and_float16_no_overflow(rng):
    x = (500 * rng.standard_normal((20, 300))).astype(np.float16)
    w = rng.standard_normal(300).astype(np.float16)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    copies = [a.copy() for a in (x, w, dy)]
    y, rstd = lnlib.rms_norm_forward(x, w)
    dx, dw = lnlib.rms_norm_backward(dy, x, rstd, w)
    for a, c in zip((x, w, dy), copies):
        np.testing.assert_array_equal(a, c)
    assert all(np.all(np.isfinite(a)) for a in (y, rstd, dx, dw))
    assert_close(
        y, reference.rms_norm_forward(x.astype(np.float64), w.astype(np.float64))[0], np.float16
    )


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_weight_offset_matches_gemma_style_torch_composition(rng, dtype):
    """Issue 12: Gemma's RMSNorm, x * rstd * (1 + weight), with weight initialised at zero."""
    x = (rng.standard_normal((5, 3, 12)) * 2 + 0.5).astype(dtype)
    w = (0.1 * rng.standard_normal(12)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, rstd = lnlib.rms_norm_forward(x, w, weight_offset=1.0)
    dx, dw = lnlib.rms_norm_backward(dy, x, rstd, w, weight_offset=1.0)
    tx, tw = (torch_tensor(a.astype(np.float64), True) for a in (x, w))
    ty = F.rms_norm(tx, (12,), 1.0 + tw, 1e-6)
    ty.backward(torch_tensor(dy.astype(np.float64)))
    assert_close(y, ty.detach().numpy(), dtype, factor=2)
    assert_close(dx, tx.grad.numpy(), dtype, factor=8)
    assert_close(dw, tw.grad.numpy(), dtype, factor=16)
    if dtype == np.float64:
        lnlib.check_grad(lambda v: lnlib.rms_norm(v, w, weight_offset=1.0), x, dy, dx)
        lnlib.check_grad(
            lambda v: lnlib.rms_norm(x, v, weight_offset=1.0), w, dy, dw, name="dweight"
        )
    with pytest.raises(ValueError, match="needs a weight"):
        lnlib.rms_norm_backward(dy, x, rstd, None, weight_offset=1.0)
