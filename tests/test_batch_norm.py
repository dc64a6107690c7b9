"""BatchNorm: against torch.nn.functional.batch_norm (outputs, gradients, running statistics)."""

import numpy as np
import pytest
import torch.nn.functional as F
from conftest import assert_close, torch_tensor

import lnlib
from lnlib import reference

SHAPES = [(8, 3), (4, 3, 5), (2, 3, 4, 5), (3, 2, 2, 2, 3)]
DTYPES = [np.float64, np.float32, np.float16]


def _data(rng, shape, dtype):
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    w = (1 + 0.3 * rng.standard_normal(c)).astype(dtype)
    b = rng.standard_normal(c).astype(dtype)
    return x, w, b, rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("training", [True, False])
def test_matches_torch(rng, shape, dtype, training):
    x, w, b, dy = _data(rng, shape, dtype)
    c = shape[1]
    rm, rv = (
        (0.1 * rng.standard_normal(c)).astype(np.float32),
        (1 + rng.random(c)).astype(np.float32),
    )
    rm_t, rv_t = torch_tensor(rm).double(), torch_tensor(rv).double()  # torch updates these
    y, mean, rstd = lnlib.batch_norm_forward(
        x, rm, rv, w, b, training=training, momentum=0.2, eps=1e-5
    )
    dx, dw, db = lnlib.batch_norm_backward(dy, x, mean, rstd, w, training=training)
    t64 = [torch_tensor(a.astype(np.float64), True) for a in (x, w, b)]
    ty = F.batch_norm(t64[0], rm_t, rv_t, t64[1], t64[2], training, 0.2, 1e-5)
    ty.backward(torch_tensor(dy.astype(np.float64)))
    assert y.dtype == dx.dtype == x.dtype and mean.shape == rstd.shape == (c,)
    m = x.size // c
    assert_close(y, ty.detach().numpy(), dtype)
    assert_close(dx, t64[0].grad.numpy(), dtype, factor=4)
    assert_close(dw, t64[1].grad.numpy(), dtype, factor=m)
    assert_close(db, t64[2].grad.numpy(), dtype, factor=m)
    assert_close(rm, rm_t.numpy(), np.float32)
    assert_close(rv, rv_t.numpy(), np.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("training", [True, False])
def test_reference_and_finite_differences(rng, shape, training):
    x, w, b, dy = _data(rng, shape, np.float64)
    c = shape[1]
    stats = [np.zeros(c), np.ones(c)]
    ref_stats = [s.copy() for s in stats]
    y, mean, rstd = lnlib.batch_norm_forward(x, *stats, w, b, training=training)
    yr, mr, rr = reference.batch_norm_forward(x, *ref_stats, w, b, training=training)
    for g, v in zip((y, mean, rstd, *stats), (yr, mr, rr, *ref_stats)):
        np.testing.assert_allclose(g, v, rtol=1e-12, atol=1e-12)
    dx, dw, db = lnlib.batch_norm_backward(dy, x, mean, rstd, w, training=training)
    for g, v in zip(
        (dx, dw, db), reference.batch_norm_backward(dy, x, mean, rstd, w, training=training)
    ):
        np.testing.assert_allclose(g, v, rtol=1e-12, atol=1e-12)

    def f(v, which):
        args = [x, w, b]
        args[which] = v
        return lnlib.batch_norm(
            args[0], np.zeros(c), np.ones(c), args[1], args[2], training=training
        )

    lnlib.check_grad(lambda v: f(v, 0), x, dy, dx)
    lnlib.check_grad(lambda v: f(v, 1), w, dy, dw, name="dweight")
    lnlib.check_grad(lambda v: f(v, 2), b, dy, db, name="dbias")


def test_training_and_evaluation_differ_for_the_same_input(rng):
    x = (rng.standard_normal((4, 3)) + 5).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    y_train = lnlib.batch_norm(x, rm.copy(), rv.copy(), training=True)
    y_eval = lnlib.batch_norm(x, rm, rv, training=False)
    assert np.abs(y_train - y_eval).max() > 1


def test_running_statistics_are_updated_in_place_but_nothing_else(rng):
    x, w, b, dy = _data(rng, (5, 3, 4), np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    ids = id(rm), id(rv)
    copies = [a.copy() for a in (x, w, b)]
    lnlib.batch_norm(x, rm, rv, w, b, training=True, momentum=1.0)
    assert (id(rm), id(rv)) == ids
    x64 = x.astype(np.float64).transpose(1, 0, 2).reshape(3, -1)
    np.testing.assert_allclose(rm, x64.mean(1), rtol=1e-5)
    np.testing.assert_allclose(rv, x64.var(1, ddof=1), rtol=1e-5)  # unbiased
    for a, c in zip((x, w, b), copies):
        np.testing.assert_array_equal(a, c)
    before = rm.copy(), rv.copy()
    lnlib.batch_norm(x, rm, rv, w, b, training=False)
    np.testing.assert_array_equal(rm, before[0])
    np.testing.assert_array_equal(rv, before[1])


def test_training_without_running_statistics(rng):
    x = rng.standard_normal((6, 2))
    y = lnlib.batch_norm(x, None, None, training=True)
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-12)


def test_bad_batch_norm_input(rng):
    x = rng.standard_normal((4, 3))
    rm, rv = np.zeros(3), np.ones(3)
    with pytest.raises(ValueError, match="more than one value per channel"):
        lnlib.batch_norm(x[:1], rm, rv, training=True)
    with pytest.raises(ValueError, match="running_mean must have shape"):
        lnlib.batch_norm(x, np.zeros(4), rv, training=True)
    with pytest.raises(ValueError, match="required when training=False"):
        lnlib.batch_norm(x, None, None, training=False)
    with pytest.raises(ValueError, match="momentum"):
        lnlib.batch_norm(x, rm, rv, training=True, momentum=1.5)
    with pytest.raises(ValueError, match=r"x must have shape \(N, C, ...\)"):
        lnlib.batch_norm(np.zeros(3), rm, rv, training=True)
    with pytest.raises(TypeError, match="running_mean must be an array"):
        lnlib.batch_norm(x, [0.0, 0.0, 0.0], rv, training=True)
    with pytest.raises(TypeError, match="training must be True or False"):
        lnlib.batch_norm(x, rm, rv, training="yes")
    with pytest.raises(TypeError):
        lnlib.batch_norm(x, rm, rv)  # training is required
    with pytest.raises(ValueError, match="weight must have shape"):
        lnlib.batch_norm(x, rm, rv, np.ones(2), training=True)
    with pytest.raises(ValueError, match="mean must have shape"):
        lnlib.batch_norm_backward(x, x, np.zeros(2), np.ones(2))
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        lnlib.batch_norm_backward(x[:2], x, rm, rv)


def test_float32_statistics_do_not_depend_on_layout():
    """Issue 8: a plain float32 mean gave 1009.6 and rstd 0.104 for this (2^20, 2) input."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1 << 20, 2)) + 1000).astype(np.float32)
    x64 = x.astype(np.float64)
    want_mean, want_rstd = x64.mean(0), 1 / np.sqrt(x64.var(0) + 1e-5)
    for layout in (x, np.ascontiguousarray(x.T)[None]):  # (N, C) and (1, C, N)
        _, mean, rstd = lnlib.batch_norm_forward(layout, None, None, training=True)
        np.testing.assert_allclose(mean, want_mean, rtol=1e-7)
        np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)


def test_parameter_gradients_do_not_drift_over_many_rows():
    """Issue 8: dbias summed row by row in float32 was 1 % off at 2^20 rows of 0.1."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1 << 20, 2)).astype(np.float32)
    dy = np.full(x.shape, 0.1, np.float32)
    _, mean, rstd = lnlib.batch_norm_forward(x, None, None, training=True)
    _, dw, db = lnlib.batch_norm_backward(dy, x, mean, rstd)
    want = dy.astype(np.float64).sum(0)
    np.testing.assert_allclose(db, want, rtol=1e-6)
    xhat = (x.astype(np.float64) - mean) * rstd.astype(np.float64)
    np.testing.assert_allclose(dw, (dy * xhat).sum(0), atol=1e-6 * np.abs(xhat).sum(0).max())


def test_read_only_running_var_fails_before_anything_changes(rng):
    x = rng.standard_normal((4, 3))
    rm, rv = np.zeros(3), np.ones(3)
    rv.flags.writeable = False
    with pytest.raises(ValueError, match="running_var is read-only"):
        lnlib.batch_norm(x, rm, rv, training=True)
    np.testing.assert_array_equal(rm, 0)
    lnlib.batch_norm(x, rm, rv, training=False)  # evaluation only reads it


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_memory_at_most_twice_the_input(rng, dtype):
    """Issue 8: the backward held 4x the input (12x for float16), the forward 2x."""
    from conftest import peak_bytes

    x = rng.standard_normal((64, 64, 1024)).astype(dtype)  # 16 MiB in float32
    dy = rng.standard_normal(x.shape).astype(dtype)
    w = np.ones(64, dtype)
    _, mean, rstd = lnlib.batch_norm_forward(x, None, None, w, w, training=True)
    fwd = peak_bytes(lnlib.batch_norm_forward, x, None, None, w, w, training=True)
    bwd = peak_bytes(lnlib.batch_norm_backward, dy, x, mean, rstd, w)
    assert fwd <= 2 * x.nbytes, f"forward held {fwd / x.nbytes:.2f}x the input"
    assert bwd <= 2 * x.nbytes, f"backward held {bwd / x.nbytes:.2f}x the input"


def test_float16_statistics_do_not_lower_the_backward_precision(rng):
    """Statistics saved in float16 must not turn a float32 backward into float16: every
    result is bitwise that of the statistics cast to float32 by the caller, and the float64
    computation with the float16 statistics' values to float32 accuracy."""
    x, w, _, dy = _data(rng, (4096, 3), np.float32)
    dy = np.abs(dy) * 30  # a dbias near 1e5: inf if accumulated in float16
    _, mean, rstd = lnlib.batch_norm_forward(x, None, None, training=True)
    m16, r16 = mean.astype(np.float16), rstd.astype(np.float16)
    got = lnlib.batch_norm_backward(dy, x, m16, r16, w)
    cast = lnlib.batch_norm_backward(dy, x, m16.astype(np.float32), r16.astype(np.float32), w)
    want = reference.batch_norm_backward(*(a.astype(np.float64) for a in (dy, x, m16, r16, w)))
    for i, (g, c, e) in enumerate(zip(got, cast, want)):
        assert g.dtype == np.float32, f"result {i}"
        np.testing.assert_array_equal(g, c, err_msg=f"result {i}")
        assert_close(g, e, np.float32)
