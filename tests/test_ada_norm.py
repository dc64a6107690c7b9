"""AdaLN and its conditioning layer: against a torch composite, the reference and finite
differences."""

import numpy as np
import pytest
import torch.nn.functional as F
from conftest import assert_close, host, on, torch_tensor

import lnlib
from lnlib import reference

# Every test here runs with the compiled CPU kernel and with the NumPy fast path.
pytestmark = pytest.mark.usefixtures("cpu_path")

CASES = [((6, 8), (6, 8)), ((3, 5, 8), (3, 1, 8)), ((3, 5, 8), (8,)), ((2, 4, 6), (1, 4, 1))]
DTYPES = [np.float64, np.float32, np.float16]


def _data(rng, xshape, mshape, dtype):
    x = (rng.standard_normal(xshape) * 2 + 1).astype(dtype)
    shift = (0.3 * rng.standard_normal(mshape)).astype(dtype)
    scale = (0.3 * rng.standard_normal(mshape)).astype(dtype)
    return x, shift, scale, rng.standard_normal(xshape).astype(dtype)


@pytest.mark.parametrize("xshape,mshape", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch(rng, xp, xshape, mshape, dtype):
    x, shift, scale, dy = _data(rng, xshape, mshape, dtype)
    y, mean, rstd = lnlib.ada_layer_norm_forward(*on(xp, x, shift, scale))
    dx, dshift, dscale = lnlib.ada_layer_norm_backward(*on(xp, dy, x), mean, rstd, on(xp, scale))
    y, dx, dshift, dscale = map(host, (y, dx, dshift, dscale))
    t64 = [torch_tensor(a.astype(np.float64), True) for a in (x, shift, scale)]
    ty = F.layer_norm(t64[0], xshape[-1:], eps=1e-6) * (1 + t64[2]) + t64[1]
    ty.backward(torch_tensor(dy.astype(np.float64)))
    assert y.dtype == dx.dtype == x.dtype
    assert dshift.shape == shift.shape and dscale.shape == scale.shape
    n_sum = x.size / scale.size
    assert_close(y, ty.detach().numpy(), dtype)
    assert_close(dx, t64[0].grad.numpy(), dtype, factor=4)
    assert_close(dshift, t64[1].grad.numpy(), dtype, factor=n_sum)
    assert_close(dscale, t64[2].grad.numpy(), dtype, factor=n_sum)


@pytest.mark.parametrize("xshape,mshape", CASES)
def test_matches_reference_and_finite_differences(rng, xp, xshape, mshape):
    x, shift, scale, dy = _data(rng, xshape, mshape, np.float64)
    fast = [host(a) for a in lnlib.ada_layer_norm_forward(*on(xp, x, shift, scale))]
    for g, w in zip(fast, reference.ada_layer_norm_forward(x, shift, scale)):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    dx, dshift, dscale = map(host, lnlib.ada_layer_norm_backward(*on(xp, dy, x, *fast[1:], scale)))
    for g, w in zip(
        (dx, dshift, dscale), reference.ada_layer_norm_backward(dy, x, *fast[1:], scale)
    ):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)

    def f(x, shift, scale):
        return host(lnlib.ada_layer_norm(*on(xp, x, shift, scale)))

    lnlib.check_grad(lambda v: f(v, shift, scale), x, dy, dx)
    lnlib.check_grad(lambda v: f(x, v, scale), shift, dy, dshift, name="dshift")
    lnlib.check_grad(lambda v: f(x, shift, v), scale, dy, dscale, name="dscale")


def test_shift_shape_differs_from_scale(rng):
    x, _, scale, dy = _data(rng, (3, 5, 8), (3, 1, 8), np.float64)
    shift = rng.standard_normal(8)
    y, mean, rstd = lnlib.ada_layer_norm_forward(x, shift, scale)
    _, dshift, _ = lnlib.ada_layer_norm_backward(dy, x, mean, rstd, scale, shift_shape=shift.shape)
    lnlib.check_grad(lambda v: lnlib.ada_layer_norm(x, v, scale), shift, dy, dshift)


def test_zero_modulation_is_plain_layer_norm(rng):
    x = rng.standard_normal((4, 9, 16)).astype(np.float32)
    zero = np.zeros((4, 1, 16), np.float32)
    np.testing.assert_allclose(
        lnlib.ada_layer_norm(x, zero, zero), lnlib.layer_norm(x, eps=1e-6), atol=1e-6
    )


def test_modulation_layer_matches_torch_and_finite_differences(rng):
    c = rng.standard_normal((5, 7))
    weight = rng.standard_normal((7, 12)) * 0.3
    bias = rng.standard_normal(12) * 0.1
    shift, scale, gate = lnlib.adaln_modulation(c, weight, bias)
    assert shift.shape == scale.shape == gate.shape == (5, 4)
    tc, tw, tb = (torch_tensor(a, True) for a in (c, weight, bias))
    out = F.silu(tc) @ tw + tb
    np.testing.assert_allclose(
        np.concatenate([shift, scale, gate], 1), out.detach().numpy(), rtol=1e-12
    )
    douts = [rng.standard_normal((5, 4)) for _ in range(3)]
    out.backward(torch_tensor(np.concatenate(douts, 1)))
    dc, dw, db = lnlib.adaln_modulation_backward(douts, c, weight)
    for got, want in zip((dc, dw, db), (tc.grad, tw.grad, tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    dy_all = np.concatenate(douts, 1)
    lnlib.check_grad(
        lambda v: np.concatenate(lnlib.adaln_modulation(v, weight, bias), 1), c, dy_all, dc
    )
    # A missing output gradient counts as zero.
    dc2 = lnlib.adaln_modulation_backward([douts[0], None, douts[2]], c, weight)[0]
    dc3 = lnlib.adaln_modulation_backward([douts[0], np.zeros((5, 4)), douts[2]], c, weight)[0]
    np.testing.assert_array_equal(dc2, dc3)


def test_adaln_zero_starts_as_identity_modulation(rng):
    weight, bias = lnlib.adaln_zero_init(7, 4)
    assert weight.shape == (7, 12) and bias.shape == (12,) and not weight.any() and not bias.any()
    shift, scale, gate = lnlib.adaln_modulation(
        rng.standard_normal((3, 7)).astype(np.float32), weight, bias
    )
    assert not shift.any() and not scale.any() and not gate.any()
    # ... yet the weight receives a gradient, so training can move it away from zero.
    c = rng.standard_normal((3, 7)).astype(np.float32)
    _, dw, _ = lnlib.adaln_modulation_backward([np.ones((3, 4), np.float32)] * 3, c, weight)
    assert np.abs(dw).sum() > 0


def test_bad_modulation_inputs():
    c, w, b = np.zeros((2, 3)), np.zeros((3, 6)), np.zeros(6)
    with pytest.raises(ValueError, match="weight"):
        lnlib.adaln_modulation(c, np.zeros((4, 6)), b)
    with pytest.raises(ValueError, match="bias"):
        lnlib.adaln_modulation(c, w, np.zeros(5))
    with pytest.raises(ValueError, match="c must be 2-d"):
        lnlib.adaln_modulation(np.zeros(3), w, b)
    with pytest.raises(TypeError, match="c must have a floating dtype"):
        lnlib.adaln_modulation(np.zeros((2, 3), int), w, b)
    with pytest.raises(ValueError, match="doutputs"):
        lnlib.adaln_modulation_backward([np.zeros((2, 3))] * 3, c, w)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_memory_at_most_twice_the_input(rng, dtype):
    """Issue 8: the backward held 4x the input (9x for float16), the forward up to 5x."""
    from conftest import peak_bytes

    x = rng.standard_normal((64, 64, 1024)).astype(dtype)  # 16 MiB in float32
    dy = rng.standard_normal(x.shape).astype(dtype)
    scale = (0.1 * rng.standard_normal((64, 1, 1024))).astype(dtype)
    _, mean, rstd = lnlib.ada_layer_norm_forward(x, scale, scale)
    fwd = peak_bytes(lnlib.ada_layer_norm_forward, x, scale, scale)
    bwd = peak_bytes(lnlib.ada_layer_norm_backward, dy, x, mean, rstd, scale)
    assert fwd <= 2 * x.nbytes, f"forward held {fwd / x.nbytes:.2f}x the input"
    assert bwd <= 2 * x.nbytes, f"backward held {bwd / x.nbytes:.2f}x the input"


def test_float16_statistics_do_not_lower_the_backward_precision(rng):
    """Issue 8: statistics saved in float16 must not turn a float32 backward into float16:
    every result is bitwise that of the statistics cast to float32 by the caller, and the
    float64 computation with the float16 statistics' values to float32 accuracy."""
    x = rng.standard_normal((4096, 8)).astype(np.float32)
    dy = (np.abs(rng.standard_normal(x.shape)) * 30).astype(np.float32)  # dshift ~ 1e5
    shift = (0.3 * rng.standard_normal(8)).astype(np.float32)
    scale = (0.3 * rng.standard_normal(8)).astype(np.float32)
    _, mean, rstd = lnlib.ada_layer_norm_forward(x, shift, scale)
    m16, r16 = mean.astype(np.float16), rstd.astype(np.float16)
    got = lnlib.ada_layer_norm_backward(dy, x, m16, r16, scale)
    cast = lnlib.ada_layer_norm_backward(
        dy, x, m16.astype(np.float32), r16.astype(np.float32), scale
    )
    f64 = [a.astype(np.float64) for a in (dy, x, m16, r16, scale)]
    want = reference.ada_layer_norm_backward(*f64)
    assert len(got) == len(want)
    for i, (g, c, e) in enumerate(zip(got, cast, want)):
        assert g.dtype == np.float32, f"result {i}"
        np.testing.assert_array_equal(g, c, err_msg=f"result {i}")
        assert_close(g, e, np.float32)
