"""The fused residual add (lnlib.add_layer_norm*, lnlib.add_rms_norm*) on CuPy arrays, checked
bitwise against the row contract of ``lnlib._rows`` ("The fused residual add"): h is
``residual + x`` added in the widest dtype and rounded once to h's dtype, y is bitwise the norm
of h cast to x's dtype, dsum is bitwise the norm's dx on h plus dh, added in the widest dtype and
rounded once; dweight/dbias are bitwise the norm's.

Needs CuPy and a CUDA GPU: skipped with the reason where either is missing, failing instead
under ``LNLIB_REQUIRE_GPU=1`` (``make gpu-check`` sets it).
"""

import os

import numpy as np
import pytest
from conftest import _cupy_with_gpu

import lnlib

REQUIRE = os.environ.get("LNLIB_REQUIRE_GPU", "") == "1"
cp, REASON = _cupy_with_gpu()
pytestmark = pytest.mark.gpu

#: (x dtype, residual dtype, residual_dtype argument): same dtypes, and the float32 stream
#: under a float16 sublayer (residual_in_fp32).
DTYPES = [
    ("float32", "float32", None),
    ("float16", "float16", None),
    ("float64", "float64", None),
    ("float16", "float32", None),
    ("float16", "float16", "float32"),
]
#: One warp, odd (element path), the usual width, several tiles.
LENGTHS = [32, 1001, 768, 65536]


@pytest.fixture(autouse=True)
def _gpu_present():
    if cp is None:
        if REQUIRE:
            pytest.fail(f"LNLIB_REQUIRE_GPU=1 but {REASON}")
        pytest.skip(REASON)


def _bits(a, b, what):
    a, b = cp.asnumpy(a), cp.asnumpy(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
    )
    assert a.tobytes() == b.tobytes(), f"{what}: not bitwise equal"


def _h_want(x, residual, h_dtype):
    """h as the contract defines it: added in the widest dtype, rounded once to h's."""
    wide = np.result_type(x.dtype, residual.dtype, np.dtype(h_dtype))
    return (residual.astype(wide) + x.astype(wide)).astype(h_dtype)


def _inputs(d, xd, rd):
    rng = np.random.default_rng(d)
    m = max(2, min(40, 2**20 // d))
    x = cp.asarray(rng.standard_normal((m, d)) + 0.5).astype(xd)
    residual = cp.asarray(2.0 * rng.standard_normal((m, d))).astype(rd)
    dy = cp.asarray(rng.standard_normal((m, d))).astype(xd)
    weight = cp.asarray(1.0 + 0.1 * rng.standard_normal(d)).astype(xd)
    bias = cp.asarray(0.1 * rng.standard_normal(d)).astype(xd)
    return x, residual, dy, weight, bias


@pytest.mark.parametrize("d", LENGTHS)
@pytest.mark.parametrize("xd,rd,res_dtype", DTYPES)
def test_add_layer_norm_is_the_composition_bitwise(d, xd, rd, res_dtype):
    x, residual, dy, weight, bias = _inputs(d, xd, rd)
    x0, r0 = x.copy(), residual.copy()
    y, h, mean, rstd = lnlib.add_layer_norm_forward(
        x, residual, weight, bias, residual_dtype=res_dtype
    )
    assert isinstance(y, cp.ndarray) and isinstance(h, cp.ndarray)
    h_dtype = np.dtype(res_dtype or rd)
    _bits(h, _h_want(x, residual, h_dtype), f"h d={d}")
    y_ln, mean_ln, rstd_ln = lnlib.layer_norm_forward(h, weight, bias)
    _bits(y, y_ln.astype(xd), f"y d={d}")
    _bits(mean, mean_ln, f"mean d={d}")
    _bits(rstd, rstd_ln, f"rstd d={d}")
    y2, h2 = lnlib.add_layer_norm(x, residual, weight, bias, residual_dtype=res_dtype)
    _bits(y2, y, "add_layer_norm y")
    _bits(h2, h, "add_layer_norm h")

    dh = cp.asarray(np.random.default_rng(d + 1).standard_normal(h.shape)).astype(h.dtype)
    dsum, dw, db = lnlib.add_layer_norm_backward(dy, dh, h, mean, rstd, weight)
    dx, dw_ln, db_ln = lnlib.layer_norm_backward(dy.astype(h.dtype), h, mean, rstd, weight)
    _bits(dsum, (dh + dx).astype(h.dtype), f"dsum d={d}")
    _bits(dw, dw_ln, f"dweight d={d}")
    _bits(db, db_ln, f"dbias d={d}")
    dsum0, _, _ = lnlib.add_layer_norm_backward(dy, None, h, mean, rstd, weight)
    _bits(dsum0, dx, f"dsum without dh d={d}")
    _bits(x, x0, "x unchanged")
    _bits(residual, r0, "residual unchanged")


@pytest.mark.parametrize("d", LENGTHS)
@pytest.mark.parametrize("xd,rd,res_dtype", DTYPES)
def test_add_rms_norm_is_the_composition_bitwise(d, xd, rd, res_dtype):
    x, residual, dy, weight, _bias = _inputs(d, xd, rd)
    y, h, rstd = lnlib.add_rms_norm_forward(x, residual, weight, residual_dtype=res_dtype)
    h_dtype = np.dtype(res_dtype or rd)
    _bits(h, _h_want(x, residual, h_dtype), f"h d={d}")
    y_n, rstd_n = lnlib.rms_norm_forward(h, weight)
    _bits(y, y_n.astype(xd), f"y d={d}")
    _bits(rstd, rstd_n, f"rstd d={d}")
    y2, h2 = lnlib.add_rms_norm(x, residual, weight, residual_dtype=res_dtype)
    _bits(y2, y, "add_rms_norm y")
    _bits(h2, h, "add_rms_norm h")

    dh = cp.asarray(np.random.default_rng(d + 2).standard_normal(h.shape)).astype(h.dtype)
    dsum, dw = lnlib.add_rms_norm_backward(dy, dh, h, rstd, weight)
    dx, dw_n = lnlib.rms_norm_backward(dy.astype(h.dtype), h, rstd, weight)
    _bits(dsum, (dh + dx).astype(h.dtype), f"dsum d={d}")
    _bits(dw, dw_n, f"dweight d={d}")


def test_h_written_over_the_residual_in_place():
    """``out=`` with h over the residual (as vLLM does) gives the bits of the out-of-place call."""
    x, residual, _dy, weight, bias = _inputs(768, "float32", "float32")
    y_want, h_want, mean_want, rstd_want = lnlib.add_layer_norm_forward(x, residual, weight, bias)
    stream = residual.copy()
    out = (cp.empty_like(x), stream, cp.empty_like(mean_want), cp.empty_like(rstd_want))
    got = lnlib.add_layer_norm_forward(x, stream, weight, bias, out=out)
    assert got[1] is stream
    for g, w, name in zip(got, (y_want, h_want, mean_want, rstd_want), ("y", "h", "mean", "rstd")):
        _bits(g, w, f"in place {name}")


def test_bitwise_batch_invariance():
    """A row's y and h do not depend on the other rows of the batch."""
    x, residual, _dy, weight, bias = _inputs(4096, "float16", "float32")
    y, h = lnlib.add_layer_norm(x, residual, weight, bias)
    y1, h1 = lnlib.add_layer_norm(x[3:4], residual[3:4], weight, bias)
    _bits(y[3:4], y1, "y of one row")
    _bits(h[3:4], h1, "h of one row")
