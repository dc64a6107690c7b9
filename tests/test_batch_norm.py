"""BatchNorm: against torch.nn.functional.batch_norm (outputs, gradients, running statistics)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lnlib
from lnlib import reference
from conftest import assert_close, torch_tensor

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
    rm, rv = (0.1 * rng.standard_normal(c)).astype(np.float32), (1 + rng.random(c)).astype(np.float32)
    rm_t, rv_t = torch_tensor(rm).double(), torch_tensor(rv).double()  # torch updates these
    y, mean, rstd = lnlib.batch_norm_forward(x, rm, rv, w, b, training=training, momentum=0.2, eps=1e-5)
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
    for g, v in zip((dx, dw, db), reference.batch_norm_backward(dy, x, mean, rstd, w, training=training)):
        np.testing.assert_allclose(g, v, rtol=1e-12, atol=1e-12)

    def f(v, which):
        args = [x, w, b]
        args[which] = v
        return lnlib.batch_norm(args[0], np.zeros(c), np.ones(c), args[1], args[2], training=training)

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
