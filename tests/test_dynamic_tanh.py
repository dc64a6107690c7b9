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


@pytest.mark.parametrize("shape", [(3, 4), ()])
def test_layer_and_module_take_one_size_at_construction(shape):
    """Both layers normalise over the last axis only: another normalized_shape is refused when
    the layer is made (the torch module used to accept (3, 4) and fail at its first forward)."""
    from lnlib import torch_bridge as tb

    match = "normalized_shape must be" + (" one size" if shape else "")
    for make in (lnlib.DynamicTanh, tb.DynamicTanh):
        with pytest.raises(ValueError, match=match):
            make(shape)


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


def _ulp(v, dtype):
    """The spacing of ``dtype`` (a torch floating dtype) at the magnitudes ``v`` (float64)."""
    info = torch.finfo(dtype)
    mag = v.abs().clamp(min=info.smallest_normal)
    return info.eps * torch.exp2(torch.floor(torch.log2(mag)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("alpha", [0.1, 0.7, -1.3])
def test_bridge_float_alpha_is_not_rounded_to_the_dtype_of_x(rng, dtype, alpha):
    """A Python float alpha is used as torch's ``tanh(alpha * x)`` uses it (and as
    lnlib.dynamic_tanh does): not rounded to float16/bfloat16 first (0.1 -> 0.0999755859375)."""
    from lnlib import torch_bridge as tb

    x = torch.from_numpy(3 * rng.standard_normal(20000)).to(dtype).requires_grad_()
    dy = torch.from_numpy(rng.standard_normal(20000)).to(dtype)
    got = tb.dynamic_tanh(x, alpha)
    got.backward(dy)
    assert got.dtype == x.grad.dtype == dtype
    # lnlib's own function on the same values (bfloat16 is computed in float32, cast back)
    as_np = (lambda t: t.detach().float().numpy()) if dtype == torch.bfloat16 else None
    as_np = as_np or (lambda t: t.detach().numpy())
    own = lnlib.dynamic_tanh(as_np(x), alpha)
    own_dx = lnlib.dynamic_tanh_backward(as_np(dy), as_np(x), alpha)[0]
    torch.testing.assert_close(got.detach(), torch.from_numpy(own).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, torch.from_numpy(own_dx).to(dtype), rtol=0, atol=0)
    # torch's tanh(alpha * x) in float64: float16/bfloat16 results are correctly rounded (half
    # an ulp, plus the float32 arithmetic's few float32 ulps); float32 within 4 ulps
    want = torch.tanh(alpha * x.detach().double())
    err = (got.detach().double() - want).abs()
    f32 = 4 * torch.finfo(torch.float32).eps * want.abs()
    tol = 4 * _ulp(want, dtype) if dtype == torch.float32 else 0.5 * _ulp(want, dtype) + f32
    assert (err <= tol).all(), f"{int((err > tol).sum())} values off by more than tol"
    # and torch's own tanh(alpha * x) in the dtype of x (rounded twice): within one ulp
    native = torch.tanh(alpha * x.detach()).double()
    big = torch.maximum(got.detach().double().abs(), native.abs())
    assert ((got.detach().double() - native).abs() <= _ulp(big, dtype)).all()


class _AuthorsDyT(torch.nn.Module):
    """DyT as the authors' code lays it out: alpha a parameter of shape (1,)."""

    def __init__(self, d, alpha_init_value=0.5):
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.ones(1, dtype=torch.float64) * alpha_init_value)
        self.weight = torch.nn.Parameter(torch.ones(d, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(self.alpha * x) * self.weight + self.bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_alpha_of_shape_one_as_in_the_authors_checkpoints(rng, dtype):
    """alpha of shape (1,) gives the results of the 0-d alpha; dalpha has the shape of alpha
    (public functions, the reference, the layer)."""
    x, w, b, dy = _data(rng, (4, 3, 8), dtype)
    a0, a1 = np.array(0.7, dtype), np.array([0.7], dtype)
    np.testing.assert_array_equal(lnlib.dynamic_tanh(x, a1, w, b), lnlib.dynamic_tanh(x, a0, w, b))
    got, want = lnlib.dynamic_tanh_backward(dy, x, a1, w), lnlib.dynamic_tanh_backward(dy, x, a0, w)
    assert got[1].shape == (1,) and got[1].dtype == dtype and want[1].shape == ()
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g.reshape(e.shape), e)
    ref = reference.dynamic_tanh_backward(dy, x, a1, w)
    assert ref[1].shape == (1,)
    assert_close(ref[1], got[1], dtype, factor=x.size)
    layer = lnlib.DynamicTanh(8, dtype=dtype)
    layer.weight[...], layer.bias[...] = w, b
    layer.alpha = a1.copy()  # loaded from such a checkpoint
    np.testing.assert_array_equal(layer(x), lnlib.dynamic_tanh(x, a0, w, b))
    np.testing.assert_array_equal(layer.backward(dy), want[0])
    assert layer.dalpha.shape == (1,)
    np.testing.assert_array_equal(layer.dalpha[0], want[1])


@pytest.mark.parametrize("shape", [(2,), (1, 1), (1, 1, 1), (0,)])
def test_alpha_of_another_shape_is_refused(rng, shape):
    x = rng.standard_normal((2, 3))
    for call in (
        lambda: lnlib.dynamic_tanh(x, np.full(shape, 0.5)),
        lambda: lnlib.dynamic_tanh_backward(x, x, np.full(shape, 0.5)),
    ):
        with pytest.raises(ValueError, match=r"alpha must be a scalar.*\(\) or \(1,\)"):
            call()


def test_torch_module_loads_the_authors_state_dict(rng):
    """A state dict with alpha of shape (1,) loads into lnlib's torch module (also with
    assign=True); an alpha parameter of shape (1,) runs forward and backward, its gradient of
    that shape, as in the authors' module."""
    from lnlib import torch_bridge as tb

    theirs = _AuthorsDyT(8, alpha_init_value=0.8)
    with torch.no_grad():
        theirs.weight.copy_(torch.from_numpy(rng.standard_normal(8)))
        theirs.bias.copy_(torch.from_numpy(rng.standard_normal(8)))
    x = torch.from_numpy(rng.standard_normal((5, 8)))
    want = theirs(x)
    for assign in (False, True):
        ours = tb.DynamicTanh(8, dtype=torch.float64)
        ours.load_state_dict(theirs.state_dict(), assign=assign)
        torch.testing.assert_close(ours(x), want, rtol=1e-12, atol=1e-12)
    ours = tb.DynamicTanh(8, dtype=torch.float64)
    ours.alpha = torch.nn.Parameter(theirs.alpha.detach().clone())  # shape (1,), as theirs
    ours.weight, ours.bias = (
        torch.nn.Parameter(p.detach().clone()) for p in (theirs.weight, theirs.bias)
    )
    dy = torch.from_numpy(rng.standard_normal((5, 8)))
    theirs(x).backward(dy)
    ours(x).backward(dy)
    assert ours.alpha.grad.shape == theirs.alpha.grad.shape == (1,)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    a = torch.tensor([0.6], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, a: tb.dynamic_tanh(x, a), (x.clone().requires_grad_(), a)
    )
