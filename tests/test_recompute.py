"""Backward from the output equals the usual backward from the input."""

import numpy as np
import pytest

import lnlib
from lnlib.recompute import (
    layer_norm_backward_from_output,
    rms_norm_backward_from_output,
    saved_bytes,
)


def _data(shape, k, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    norm = shape[len(shape) - k :]
    x = rng.normal(2.0, 3.0, size=shape).astype(dtype)
    weight = (rng.choice([-1.0, 1.0], size=norm) * rng.uniform(0.5, 1.5, size=norm)).astype(dtype)
    bias = rng.normal(size=norm).astype(dtype)
    dy = rng.normal(size=shape).astype(dtype)
    return x, weight, bias, dy


@pytest.mark.parametrize("shape, k", [((5, 8), 1), ((2, 3, 4, 6), 2), ((7,), 1)])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_from_output_equals_from_input(shape, k, affine):
    x, weight, bias, dy = _data(shape, k, seed=len(shape))
    if not affine:
        weight = bias = None
    y, mean, rstd = lnlib.layer_norm_forward(x, weight, bias, normalized_ndim=k)
    expected = lnlib.layer_norm_backward(dy, x, mean, rstd, weight)
    got = layer_norm_backward_from_output(dy, y, rstd, weight, bias)
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_from_output_equals_from_input(affine):
    x, weight, _, dy = _data((6, 10), 1, seed=3)
    weight = weight if affine else None
    y, rstd = lnlib.rms_norm_forward(x, weight)
    expected = lnlib.rms_norm_backward(dy, x, rstd, weight)
    got = rms_norm_backward_from_output(dy, y, rstd, weight)
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


def test_float32_is_close():
    x, weight, bias, dy = _data((64, 256), 1, seed=4, dtype=np.float32)
    y, mean, rstd = lnlib.layer_norm_forward(x, weight, bias)
    dx = lnlib.layer_norm_backward(dy, x, mean, rstd, weight)[0]
    dx2 = layer_norm_backward_from_output(dy, y, rstd, weight, bias)[0]
    assert np.max(np.abs(dx2 - dx)) < 1e-4 * np.max(np.abs(dx))


def test_zero_weight_is_refused():
    x, weight, bias, dy = _data((3, 4), 1, seed=5)
    weight[2] = 0.0
    y, _, rstd = lnlib.layer_norm_forward(x, weight, bias)
    with pytest.raises(ValueError, match="weight"):
        layer_norm_backward_from_output(dy, y, rstd, weight, bias)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_backward_from_output(dy, y, rstd, weight)


def test_bad_shapes():
    y = np.zeros((3, 4))
    with pytest.raises(ValueError, match="dy"):
        layer_norm_backward_from_output(np.zeros((3, 5)), y, np.ones(3))
    with pytest.raises(ValueError, match="rstd"):
        layer_norm_backward_from_output(y, y, np.ones(4))
    with pytest.raises(ValueError, match="bias"):
        layer_norm_backward_from_output(y, y, np.ones(3), np.ones(4), np.ones(3))


def test_saved_bytes_counts_shared_buffers_once():
    a = np.zeros((10, 10))
    assert saved_bytes(a, a, a[2:], a.T, None) == a.nbytes
    assert saved_bytes(a, np.zeros(5)) == a.nbytes + 40


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_keeping_rstd_does_not_keep_mean(cpu_path, dtype):
    """The backward from the output keeps rstd only: mean must be a buffer of its own, or
    keeping rstd would hold mean's memory too (what chapter 5's memory count measures)."""
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(dtype)
    _, mean, rstd = lnlib.layer_norm_forward(x)
    assert not np.shares_memory(mean, rstd)
    assert saved_bytes(rstd) == rstd.nbytes
