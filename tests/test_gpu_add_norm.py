"""The fused residual add (lnlib.add_layer_norm*, lnlib.add_rms_norm*) on CuPy arrays, checked
bitwise against the row contract of ``lnlib._rows`` ("The fused residual add"): h is
``residual + x`` added in the widest dtype and rounded once to h's dtype, y is bitwise the norm
of h cast to x's dtype, dsum is bitwise the norm's dx on h plus dh, added in the widest dtype and
rounded once; dweight/dbias are bitwise the norm's.

The combinations of ``lnlib._cuda.build.FUSED`` run the fused kernels (``add_*_norm_fwd``,
``add_*_norm_bwd`` of ``lnlib/_cuda/norms.cu``): the tests make the unfused fallback fail for
them, so a bitwise match is the fused kernel's. The fallback (CuPy's add, then the norm's kernel)
is checked for the other combinations. The cases cover rows of one warp, of several tiles, not
16-byte aligned (odd lengths, strided rows), more rows than units (the grid capped), dh absent
or of another dtype, and h written over the residual.

Needs CuPy and a CUDA GPU: skipped with the reason where either is missing, failing instead
under ``LNLIB_REQUIRE_GPU=1`` (``make gpu-check`` sets it).
"""

import numpy as np
import pytest
from conftest import _cupy_with_gpu, skip_or_fail

import lnlib
from lnlib._cuda import build, cuda_kernel

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
        skip_or_fail(REASON)


@pytest.fixture(autouse=True)
def _fused_only(monkeypatch):
    """The unfused fallback raises for a combination that has a fused kernel."""
    fallback = cuda_kernel.add_norm_forward_unfused

    def checked(norm_rows, x, residual, params, eps, h_dtype, out):
        dtypes = (x.dtype.name, residual.dtype.name, np.dtype(h_dtype).name)
        assert dtypes not in build.FUSED["fwd"], f"{dtypes} has a fused kernel, not run"
        return fallback(norm_rows, x, residual, params, eps, h_dtype, out)

    monkeypatch.setattr(cuda_kernel, "add_norm_forward_unfused", checked)


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


#: Combinations without a fused forward (the fallback) and dh dtypes other than h's.
FALLBACK_DTYPES = [("float32", "float64", None), ("float32", "float16", None)]
CASES = [
    # x dtype, residual dtype, residual_dtype, d, dh dtype (None: h's; "none": no dh)
    ("float32", "float32", None, 4097, "float64"),  # dh wider than h: added after the kernel
    ("float16", "float32", None, 768, "float16"),  # dh narrower: converted exactly
    ("float16", "float16", None, 20000, "none"),
    ("float64", "float64", None, 3, None),
    *[(xd, rd, res, d, None) for xd, rd, res in FALLBACK_DTYPES for d in (768, 65536)],
]


def _check_pair(norm, x, residual, dy, dh, weight, bias, res_dtype, where=""):
    """Forward and backward of the fused op against the norm of h and dh + its backward."""
    fwd = getattr(lnlib, f"add_{norm}_forward")
    bwd = getattr(lnlib, f"add_{norm}_backward")
    params = (weight, bias) if norm == "layer_norm" else (weight,)
    y, h, *stats = fwd(x, residual, *params, residual_dtype=res_dtype)
    _bits(h, _h_want(x, residual, np.dtype(res_dtype or residual.dtype)), f"h{where}")
    want = getattr(lnlib, f"{norm}_forward")(h, *params)
    _bits(y, want[0].astype(x.dtype), f"y{where}")
    for got, w in zip(stats, want[1:]):
        _bits(got, w, f"statistics{where}")
    grads = bwd(dy, dh, h, *stats, weight)
    dx, *pgrads = getattr(lnlib, f"{norm}_backward")(dy, h, *stats, weight)
    if dh is None:
        _bits(grads[0], dx, f"dsum without dh{where}")
    else:
        wide = np.result_type(dh.dtype, h.dtype)
        _bits(grads[0], (dh.astype(wide) + dx.astype(wide)).astype(h.dtype), f"dsum{where}")
    for got, w in zip(grads[1:], pgrads):
        _bits(got, w, f"parameter gradient{where}")


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("xd,rd,res_dtype,d,dh_dtype", CASES)
def test_fallback_and_dh_dtypes(norm, xd, rd, res_dtype, d, dh_dtype):
    x, residual, dy, weight, bias = _inputs(d, xd, rd)
    h_dtype = np.dtype(res_dtype or rd)
    dh = None
    if dh_dtype != "none":
        rng = np.random.default_rng(d + 3)
        dh = cp.asarray(rng.standard_normal(x.shape)).astype(dh_dtype or h_dtype)
    _check_pair(norm, x, residual, dy, dh, weight, bias, res_dtype, f" {xd}/{rd} d={d}")


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("d", [768, 1001, 20000])
def test_more_rows_than_units(monkeypatch, norm, d):
    """A grid capped to 256 threads: each unit takes many rows, in forward and backward (the
    partial parameter gradients in registers, for one-tile rows and in the long-row kernels'
    units alike: one cluster on sm_90, the two-launch kernel's units elsewhere); the results
    stay bitwise those of the unfused kernels under the same cap."""
    monkeypatch.setitem(build.GRID_THREADS, "fwd", 256)
    monkeypatch.setitem(build.GRID_THREADS, "bwd", 256)
    x, residual, dy, weight, bias = _inputs(d, "float16", "float32")
    rows = 300 if d > 10000 else 2000
    rng = np.random.default_rng(7)
    x = cp.asarray(rng.standard_normal((rows, d))).astype(x.dtype)
    residual = cp.asarray(rng.standard_normal((rows, d))).astype(residual.dtype)
    dy = cp.asarray(rng.standard_normal((rows, d))).astype(dy.dtype)
    dh = cp.asarray(rng.standard_normal((rows, d))).astype(residual.dtype)
    r, _maxv, tiles = build.launch_shape(f"add_{norm}_bwd", ("float16", "float32"), d)
    units = build.grid("bwd", rows, r, d, tiles) * (build.block_threads(r) // r)
    assert units < rows // 4, "the cap no longer makes units take several rows"
    _check_pair(norm, x, residual, dy, dh, weight, bias, None, f" capped d={d}")


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_strided_rows(norm):
    """Rows that are slices of wider arrays (not vector aligned: element by element)."""
    d = 768
    x, residual, dy, weight, bias = _inputs(d + 4, "float32", "float32")
    sl = (slice(None), slice(1, d + 1))
    _check_pair(norm, x[sl], residual[sl], dy[sl], 2 * dy[sl], weight[1:-3], bias[1:-3], None)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("d", [32, 1001, 65536])
@pytest.mark.parametrize(
    "xd,rd", [("float32", "float32"), ("float16", "float32"), ("float16", "float16")]
)
def test_in_place_every_shape(norm, d, xd, rd):
    """h over the residual, also where a row spans several tiles (the kernel rereads h it has
    written over the residual): the bits of the out-of-place call."""
    x, residual, _dy, weight, bias = _inputs(d, xd, rd)
    fwd = getattr(lnlib, f"add_{norm}_forward")
    params = (weight, bias) if norm == "layer_norm" else (weight,)
    want = fwd(x, residual, *params)
    stream = residual.copy()
    out = (cp.empty_like(x), stream, *(cp.empty_like(w) for w in want[2:]))
    got = fwd(x, stream, *params, out=out)
    assert got[1] is stream
    for i, (g, w) in enumerate(zip(got, want)):
        _bits(g, w, f"in place result {i} d={d}")


def _bf16(values):
    """The bfloat16 nearest float32 ``values`` (ties to even), as uint16 bit patterns."""
    b = cp.ascontiguousarray(values, dtype=cp.float32).view(cp.uint32)
    half = cp.uint32(0x7FFF) + ((b >> cp.uint32(16)) & cp.uint32(1))
    return ((b + half) >> cp.uint32(16)).astype(cp.uint16)


def _f32(bits):
    return (bits.astype(cp.uint32) << cp.uint32(16)).view(cp.float32)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("d", [768, 1001, 20000])
def test_bfloat16_row_functions(monkeypatch, norm, d):
    """The bfloat16 fused kernels, reached through the row functions with uint16 arrays holding
    bfloat16 bit patterns (CuPy has no bfloat16 dtype, as in tests/test_gpu_rows.py): h is the
    float32 sum rounded once to bfloat16, y bitwise the bfloat16 norm kernel's on h, dsum the
    bfloat16 of dh + dx."""
    for key, value in (("TYPE_NAMES", "__nv_bfloat16"), ("ITEMSIZE", 2)):
        monkeypatch.setitem(getattr(build, key), "uint16", value)
    fused = {
        k: tuple(tuple(t.replace("bfloat16", "uint16") for t in c) for c in v)
        for k, v in build.FUSED.items()
    }
    monkeypatch.setattr(build, "FUSED", fused)
    rng = np.random.default_rng(d)
    x, residual, dy, dh = (
        _bf16(cp.asarray(rng.standard_normal((50, d)), dtype=cp.float32)) for _ in range(4)
    )
    weight = cp.asarray(1 + 0.1 * rng.standard_normal(d), dtype=cp.float32)
    params = (weight, 0.1 * weight) if norm == "layer_norm" else (weight,)
    u16 = np.dtype(np.uint16)
    fwd = getattr(cuda_kernel, f"add_{norm}_forward_rows")
    y, h, *stats = fwd(x, residual, *params, 1e-5, u16)
    _bits(h, _bf16(_f32(residual) + _f32(x)), "bfloat16 h")
    want = getattr(cuda_kernel, f"{norm}_forward_rows")(h, *params, 1e-5)
    for g, w in zip((y, *stats), want):
        _bits(g, w, "bfloat16 forward")
    dsum, *grads = getattr(cuda_kernel, f"add_{norm}_backward_rows")(dy, dh, h, *stats, weight)
    dx, *pgrads = getattr(cuda_kernel, f"{norm}_backward_rows")(dy, h, *stats, weight)
    _bits(dsum, _bf16(_f32(dh) + _f32(dx)), "bfloat16 dsum")
    for g, w in zip(grads, pgrads):
        _bits(g, w, "bfloat16 parameter gradient")
