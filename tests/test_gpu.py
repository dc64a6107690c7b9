"""The public functions on CuPy arrays agree with NumPy. Needs a CUDA GPU; skipped otherwise."""

import numpy as np
import pytest

import lnlib


def _cupy_with_gpu():
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy if cupy.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a broken CUDA install means no GPU for these tests
        return None


cp = _cupy_with_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="needs CuPy and a CUDA GPU")]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_layer_and_rms_norm_on_gpu_match_numpy(rng, dtype):
    x = rng.standard_normal((64, 3, 40)).astype(dtype)
    w = rng.standard_normal((3, 40)).astype(dtype)
    b = rng.standard_normal((3, 40)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    tol = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 5e-3}[dtype]
    host = lnlib.layer_norm_forward(x, w, b, normalized_ndim=2)
    dev = lnlib.layer_norm_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b), normalized_ndim=2)
    for h, d in zip(host, dev):
        assert isinstance(d, cp.ndarray) and d.dtype == h.dtype
        np.testing.assert_allclose(cp.asnumpy(d).astype(float), h.astype(float), atol=tol * 10, rtol=tol)
    hb = lnlib.layer_norm_backward(dy, x, *host[1:], w)
    db = lnlib.layer_norm_backward(cp.asarray(dy), cp.asarray(x), *dev[1:], cp.asarray(w))
    for h, d in zip(hb, db):
        np.testing.assert_allclose(cp.asnumpy(d).astype(float), h.astype(float), atol=tol * 1000, rtol=tol * 10)
    hy, hr = lnlib.rms_norm_forward(x, w, normalized_ndim=2)
    dyv, dr = lnlib.rms_norm_forward(cp.asarray(x), cp.asarray(w), normalized_ndim=2)
    np.testing.assert_allclose(cp.asnumpy(dyv).astype(float), hy.astype(float), atol=tol * 10, rtol=tol)


def test_mixing_numpy_and_cupy_is_a_type_error():
    with pytest.raises(TypeError, match="different array libraries"):
        lnlib.layer_norm(cp.ones((2, 3)), np.ones(3))
