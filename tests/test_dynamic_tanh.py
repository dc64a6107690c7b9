"""Dynamic Tanh: against a torch composition, the reference and finite differences; errors."""

import numpy as np
import pytest
import torch
from conftest import assert_close, torch_tensor

import lnlib
from lnlib import reference

SHAPES = [(7, 16), (3, 5, 8), (2, 3, 4, 5), (9,)]
DTYPES = [np.float64, np.float32, np.float16]


def _data(rng, shape, dtype):
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(shape[-1])).astype(dtype)
    b = rng.standard_normal(shape[-1]).astype(dtype)
    return x, w, b, rng.standard_normal(shape).astype(dtype)


def _torch(x, alpha, w, b, dy):
    """DyT as a torch composition (float32 for float16 inputs), with its gradients."""
    dtype = np.float32 if x.dtype == np.float16 else x.dtype
    tx = torch_tensor(x.astype(dtype), True)
    ta = torch.tensor(float(alpha), dtype=tx.dtype, requires_grad=True)
    tw = None if w is None else torch_tensor(w.astype(dtype), True)
    tb = None if b is None else torch_tensor(b.astype(dtype), True)
    ty = torch.tanh(ta * tx)
    ty = ty if tw is None else tw * ty
    ty = ty if tb is None else ty + tb
    ty.backward(torch_tensor(dy.astype(dtype)))
    return ty.detach().numpy(), [None if t is None else t.grad.numpy() for t in (tx, ta, tw, tb)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("alpha", [0.5, np.array(1.7)])
def test_matches_torch(rng, shape, dtype, affine, alpha):
    x, w, b, dy = _data(rng, shape, dtype)
    w, b = (w, b) if affine else (None, None)
    y = lnlib.dynamic_tanh(x, alpha, w, b)
    dx, dalpha, dw, db = lnlib.dynamic_tanh_backward(dy, x, alpha, w)
    ty, (tdx, tda, tdw, tdb) = _torch(x, alpha, w, b, dy)
    assert y.dtype == dx.dtype == x.dtype and y.shape == x.shape
    assert dalpha.shape == () and isinstance(dalpha, np.ndarray)
    assert dalpha.dtype == (alpha.dtype if isinstance(alpha, np.ndarray) else x.dtype)
    assert_close(y, ty, dtype)
    assert_close(dx, tdx, dtype, factor=2.0)
    assert_close(dalpha, tda, dtype, factor=x.size)
    if affine:
        assert dw.dtype == db.dtype == w.dtype
        assert_close(dw, tdw, dtype, factor=x.size / w.size)
        assert_close(db, tdb, dtype, factor=x.size / w.size)
    if dtype == np.float64:
        np.testing.assert_allclose(dx, tdx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dalpha, tda, rtol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_reference(rng, shape, dtype):
    x, w, b, dy = _data(rng, shape, dtype)
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    assert_close(
        lnlib.dynamic_tanh(x, 0.8, w, b), reference.dynamic_tanh(x64, 0.8, w64, b64), dtype
    )
    got = lnlib.dynamic_tanh_backward(dy, x, 0.8, w)
    want = reference.dynamic_tanh_backward(dy64, x64, 0.8, w64)
    for a, e in zip(got, want):
        assert_close(a, e, dtype, factor=2.0 * x.size)


@pytest.mark.parametrize("shape", [(3, 6), (2, 3, 4)])
def test_finite_differences(rng, shape):
    x, w, b, dy = _data(rng, shape, np.float64)
    alpha = 0.7
    dx, dalpha, dw, db = lnlib.dynamic_tanh_backward(dy, x, alpha, w)
    lnlib.check_grad(lambda v: lnlib.dynamic_tanh(v, alpha, w, b), x, dy, dx)
    lnlib.check_grad(
        lambda v: lnlib.dynamic_tanh(x, v, w, b), np.array(alpha), dy, dalpha, name="dalpha"
    )
    lnlib.check_grad(lambda v: lnlib.dynamic_tanh(x, alpha, v, b), w, dy, dw, name="dweight")
    lnlib.check_grad(lambda v: lnlib.dynamic_tanh(x, alpha, w, v), b, dy, db, name="dbias")
    dx1, _, dw1, _ = lnlib.dynamic_tanh_backward(dy, x, alpha)
    lnlib.check_grad(lambda v: lnlib.dynamic_tanh(v, alpha), x, dy, dx1)
    lnlib.check_grad(lambda v: lnlib.dynamic_tanh(x, alpha, v), np.ones(shape[-1]), dy, dw1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance_bitwise(rng, dtype):
    x, w, b, dy = _data(rng, (300, 64), dtype)
    y = lnlib.dynamic_tanh(x, 0.5, w, b)
    dx = lnlib.dynamic_tanh_backward(dy, x, 0.5, w)[0]
    perm = rng.permutation(300)
    np.testing.assert_array_equal(lnlib.dynamic_tanh(x[perm], 0.5, w, b), y[perm])
    np.testing.assert_array_equal(
        lnlib.dynamic_tanh_backward(dy[perm], x[perm], 0.5, w)[0], dx[perm]
    )
    np.testing.assert_array_equal(lnlib.dynamic_tanh(x[7:8], 0.5, w, b)[0], y[7])
    np.testing.assert_array_equal(
        lnlib.dynamic_tanh(x[::-1, ::-1], 0.5, w[::-1], b[::-1]), y[::-1, ::-1]
    )


def test_inputs_not_modified_and_float16_large_values(rng):
    x = (500 * rng.standard_normal((20, 30))).astype(np.float16)
    w = rng.standard_normal(30).astype(np.float16)
    b = rng.standard_normal(30).astype(np.float16)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    alpha = np.array(0.5, dtype=np.float16)
    copies = [a.copy() for a in (x, w, b, dy, alpha)]
    y = lnlib.dynamic_tanh(x, alpha, w, b)
    grads = lnlib.dynamic_tanh_backward(dy, x, alpha, w)
    for a, c in zip((x, w, b, dy, alpha), copies):
        np.testing.assert_array_equal(a, c)
    assert all(np.all(np.isfinite(a)) for a in (y, *grads))


def test_layer_and_torch_module(rng):
    from lnlib import torch_bridge as tb

    x, w, b, dy = _data(rng, (4, 3, 6), np.float64)
    layer = lnlib.DynamicTanh(6, alpha_init=0.9, dtype=np.float64)
    layer.weight[...], layer.bias[...] = w, b
    y = layer(x)
    dx = layer.backward(dy)
    np.testing.assert_array_equal(y, lnlib.dynamic_tanh(x, 0.9, w, b))
    want = lnlib.dynamic_tanh_backward(dy, x, 0.9, w)
    for got, e in zip((dx, layer.dalpha, layer.dweight, layer.dbias), want):
        np.testing.assert_array_equal(got, e)
    module = tb.DynamicTanh(6, alpha_init_value=0.9, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(w))
        module.bias.copy_(torch.from_numpy(b))
    tx = torch_tensor(x, True)
    module(tx).backward(torch_tensor(dy))
    np.testing.assert_allclose(tx.grad.numpy(), dx, atol=1e-14)
    np.testing.assert_allclose(module.alpha.grad.numpy(), layer.dalpha, rtol=1e-12)
    a = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    params = [torch_tensor(p, True) for p in (w, b)]
    assert torch.autograd.gradcheck(
        lambda x, a, w, b: tb.dynamic_tanh(x, a, w, b), (torch_tensor(x, True), a, *params)
    )
    with pytest.raises(RuntimeError, match="backward called before forward"):
        lnlib.DynamicTanh(3).backward(np.ones((1, 3)))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x: lnlib.dynamic_tanh(x, np.ones(2)), ValueError, "alpha must be a scalar"),
        (lambda x: lnlib.dynamic_tanh(x, "0.5"), TypeError, "alpha must be a real number"),
        (lambda x: lnlib.dynamic_tanh(x, True), TypeError, "alpha must be a real number"),
        (lambda x: lnlib.dynamic_tanh(x, float("nan")), ValueError, "alpha must be finite"),
        (lambda x: lnlib.dynamic_tanh(x, np.array(1)), TypeError, "alpha must have a floating"),
        (lambda x: lnlib.dynamic_tanh(x.astype(int), 0.5), TypeError, "x must have a floating"),
        (
            lambda x: lnlib.dynamic_tanh(x[0, 0, 0], 0.5),
            ValueError,
            "x must have at least one axis",
        ),
        (
            lambda x: lnlib.dynamic_tanh(x, 0.5, np.ones(3)),
            ValueError,
            r"weight must have shape \(4,\)",
        ),
        (lambda x: lnlib.dynamic_tanh(x, 0.5, None, np.ones((1, 4))), ValueError, "bias must"),
        (
            lambda x: lnlib.dynamic_tanh_backward(x[:1], x, 0.5),
            ValueError,
            "dy must have the shape",
        ),
        (lambda x: lnlib.dynamic_tanh_backward(x, x, 0.5, np.ones(5)), ValueError, "weight must"),
    ],
)
def test_bad_input_names_the_argument(rng, call, error, words):
    with pytest.raises(error, match=words):
        call(rng.standard_normal((2, 3, 4)))
