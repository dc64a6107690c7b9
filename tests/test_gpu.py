"""lnlib's CUDA kernels on CuPy arrays (lnlib._cuda): against the float64 reference, against
torch on CUDA, bitwise batch invariance and determinism, strided inputs, float16, float32 and
float64 (bfloat16, and parameter gradients over many rows per unit: tests/test_gpu_rows.py).

Needs CuPy and a CUDA GPU: every test is skipped with the reason when either is missing, and
fails instead when ``LNLIB_REQUIRE_GPU=1`` (``make gpu-check`` sets it), so a GPU machine
cannot pass this file without running it.
"""

import numpy as np
import pytest
from conftest import _cupy_with_gpu, host, skip_or_fail
from error_bounds import UNIT_ROUNDOFF, column_sum_bound, gamma, summand_errors

import lnlib
from lnlib import _backend, reference

cp, REASON = _cupy_with_gpu()
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu_present():
    if cp is None:
        skip_or_fail(f"the test needs CuPy and a CUDA GPU: {REASON}")


def _torch_cuda():
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        skip_or_fail("the test needs torch with CUDA")
    return torch


DTYPES = [np.float32, np.float16, np.float64]
#: Largest error allowed against the float64 reference, relative to the values' scale.
TOL = {np.float64: 1e-11, np.float32: 1e-5, np.float16: 2e-3}
#: Row lengths: 1, odd and prime sizes, one warp's worth and around it, the usual widths, a
#: row of several tiles (65536) and 2^20.
LENGTHS = [1, 3, 31, 33, 127, 768, 1001, 4096, 4099, 65536, 2**20]


def _shape(d):
    return max(2, min(48, 2**21 // d)), d


def _close(got, want, dtype, factor=1.0, what=""):
    got = cp.asnumpy(got).astype(np.float64) if isinstance(got, cp.ndarray) else got
    want = cp.asnumpy(want).astype(np.float64) if isinstance(want, cp.ndarray) else want
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    err = float(np.max(np.abs(got - want), initial=0.0))
    tol = TOL[dtype] * factor * scale
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} ({np.dtype(dtype).name})"


def _data(rng, shape, dtype, shift=0.0):
    return (rng.standard_normal(shape) + shift).astype(dtype)


def _same_bits(a, b, what):
    a, b = cp.asnumpy(a), cp.asnumpy(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), f"{what}: not bitwise equal"


def test_cupy_input_selects_the_cuda_kernels():
    from lnlib._cuda import cuda_kernel

    assert cuda_kernel.available()[0], cuda_kernel.available()[1]
    for op in _backend.OPS:
        assert _backend.select(op, cp) is getattr(cuda_kernel, f"{op}_rows")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", LENGTHS)
def test_layer_norm_against_float64_reference(rng, dtype, d):
    shape = _shape(d)
    x = _data(rng, shape, dtype, shift=3.0)  # a mean far from zero tests the variance
    w, b = _data(rng, d, dtype), _data(rng, d, dtype)
    dy = _data(rng, shape, dtype)
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    y_ref, mean_ref, rstd_ref = reference.layer_norm_forward(x64, w64, b64, eps=1e-5)
    ref_back = reference.layer_norm_backward(dy64, x64, mean_ref, rstd_ref, w64)
    with lnlib.use_implementation("cuda"):
        y, mean, rstd = lnlib.layer_norm_forward(cp.asarray(x), cp.asarray(w), cp.asarray(b))
        back = lnlib.layer_norm_backward(cp.asarray(dy), cp.asarray(x), mean, rstd, cp.asarray(w))
    assert isinstance(y, cp.ndarray) and y.dtype == dtype
    _close(y, y_ref, dtype, 4, "y")
    _close(mean, mean_ref, dtype, 4, "mean")
    _close(rstd, rstd_ref, dtype, 4, "rstd")
    # Backward from the reference's statistics of x as given (the kernel gets its own).
    for got, want, name, f in zip(back, ref_back, ("dx", "dweight", "dbias"), (40, 40, 40)):
        assert got.dtype == dtype
        _close(got, want, dtype, f, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", LENGTHS)
def test_rms_norm_against_float64_reference(rng, dtype, d):
    shape = _shape(d)
    x, w, dy = _data(rng, shape, dtype, 1.0), _data(rng, d, dtype), _data(rng, shape, dtype)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    y_ref, rstd_ref = reference.rms_norm_forward(x64, w64, eps=1e-6)
    dx_ref, dw_ref = reference.rms_norm_backward(dy64, x64, rstd_ref, w64)
    with lnlib.use_implementation("cuda"):
        y, rstd = lnlib.rms_norm_forward(cp.asarray(x), cp.asarray(w))
        dx, dw = lnlib.rms_norm_backward(cp.asarray(dy), cp.asarray(x), rstd, cp.asarray(w))
    _close(y, y_ref, dtype, 4, "y")
    _close(rstd, rstd_ref, dtype, 4, "rstd")
    _close(dx, dx_ref, dtype, 40, "dx")
    _close(dw, dw_ref, dtype, 40, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 5, 768, 4096, 65536])
def test_without_weight_and_bias(rng, dtype, d):
    x, dy = _data(rng, _shape(d), dtype), _data(rng, _shape(d), dtype)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    y_ref, mean_ref, rstd_ref = reference.layer_norm_forward(x64)
    ref_back = reference.layer_norm_backward(dy64, x64, mean_ref, rstd_ref)
    y, mean, rstd = lnlib.layer_norm_forward(cp.asarray(x))
    back = lnlib.layer_norm_backward(cp.asarray(dy), cp.asarray(x), mean, rstd)
    _close(y, y_ref, dtype, 4, "y")
    for got, want, name in zip(back, ref_back, ("dx", "dweight", "dbias")):
        _close(got, want, dtype, 40, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 33, 768, 4096, 4099, 65536])
def test_bitwise_batch_invariance(rng, dtype, d):
    """A row's outputs are bitwise the same alone, in a small batch and in a large one."""
    m = max(8, min(600, 2**22 // d))
    x, dy, w = _data(rng, (m, d), dtype), _data(rng, (m, d), dtype), _data(rng, d, dtype)
    xg, dyg, wg = cp.asarray(x), cp.asarray(dy), cp.asarray(w)
    full = lnlib.layer_norm_forward(xg, wg, wg)
    full_b = lnlib.layer_norm_backward(dyg, xg, full[1], full[2], wg)
    rms = lnlib.rms_norm_forward(xg, wg)
    for lo, hi in ((0, 1), (3, 7), (m - 5, m)):
        part = lnlib.layer_norm_forward(xg[lo:hi], wg, wg)
        for a, b, name in zip(part, full, ("y", "mean", "rstd")):
            _same_bits(a, b[lo:hi], f"{name} rows {lo}:{hi}")
        dx = lnlib.layer_norm_backward(dyg[lo:hi], xg[lo:hi], part[1], part[2], wg)[0]
        _same_bits(dx, full_b[0][lo:hi], f"dx rows {lo}:{hi}")
        _same_bits(lnlib.rms_norm_forward(xg[lo:hi], wg)[0], rms[0][lo:hi], "rms y")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 768, 4096, 65536])
def test_strided_and_misaligned_inputs_give_the_same_bits(rng, dtype, d):
    """Rows in a wider array (read in place), every other column (copied), and rows that
    start one element off a 16-byte boundary (element-wise loads) all give the contiguous
    result bit for bit."""
    m = max(4, min(64, 2**20 // d))
    x = _data(rng, (m, d), dtype)
    w = _data(rng, d, dtype)
    want = lnlib.layer_norm_forward(cp.asarray(x), cp.asarray(w))
    wide = cp.zeros((m, 2 * d + 1), dtype=dtype)
    wide[:, 1 : d + 1] = cp.asarray(x)  # row stride 2d+1, first element off alignment
    every_other = cp.zeros((m, 2 * d), dtype=dtype)
    every_other[:, ::2] = cp.asarray(x)
    for view, name in ((wide[:, 1 : d + 1], "offset rows"), (every_other[:, ::2], "strided")):
        before = view.copy()
        got = lnlib.layer_norm_forward(view, cp.asarray(w))
        _same_bits(view, before, f"{name}: input modified")
        for a, b, out in zip(got, want, ("y", "mean", "rstd")):
            _same_bits(a, b, f"{name} {out}")
    dy = _data(rng, (m, d), dtype)
    back = lnlib.layer_norm_backward(cp.asarray(dy), cp.asarray(x), want[1], want[2], cp.asarray(w))
    back_view = lnlib.layer_norm_backward(
        cp.asarray(dy)[:, :], wide[:, 1 : d + 1], want[1], want[2], cp.asarray(w)
    )
    for a, b, out in zip(back_view, back, ("dx", "dweight", "dbias")):
        _same_bits(a, b, f"offset rows {out}")


@pytest.mark.parametrize("d", [768, 4096, 65536])
def test_parameter_gradients_are_deterministic(rng, d):
    """No atomics: the same call gives the same dweight and dbias bits every time."""
    m = 2**22 // d
    x, dy, w = (cp.asarray(_data(rng, s, np.float32)) for s in ((m, d), (m, d), d))
    _y, mean, rstd = lnlib.layer_norm_forward(x, w)
    first = lnlib.layer_norm_backward(dy, x, mean, rstd, w)
    for _ in range(3):
        again = lnlib.layer_norm_backward(dy, x, mean, rstd, w)
        for a, b, name in zip(again, first, ("dx", "dweight", "dbias")):
            _same_bits(a, b, name)


def _torch_close(got, t, tol, what):
    want = t.detach().double().cpu().numpy()
    err = float(np.max(np.abs(host(got).astype(np.float64) - want)))
    scale = max(1.0, float(np.max(np.abs(want))))
    assert err <= tol * scale, f"{what}: {err:.3g} vs torch, more than {tol:.3g} x scale"


def _torch_within(got, t, bound, what):
    err = np.abs(host(got).astype(np.float64) - t.detach().double().cpu().numpy())
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (
        f"{what}: {int(np.sum(err > bound))} of {err.size} columns differ from torch by more "
        f"than the bound; column {worst}: {err[worst]:.3g} > {bound[worst]:.3g}"
    )


def check_against_torch(xp, device, dtype, d, rng):
    r"""LayerNorm and RMSNorm of lnlib on ``xp`` arrays against torch on ``device``.

    ``y`` and ``dx`` agree within a few rounding steps of the dtype. For float16 and float32,
    ``dweight`` and ``dbias`` agree within the sum of the two implementations' rounding-error
    bounds, per column (tests/error_bounds.py): both read the same ``dy`` and ``x``; each forms
    every summand :math:`dy\,\hat{x}` from its own float32 mean and rstd (lnlib's from
    ``layer_norm_forward``, torch's from ``torch.native_layer_norm``, their errors
    :math:`\delta_\mu, \rho` measured against the float64 reference) with at most four float32
    roundings, adds the ``m`` summands of a column in float32 in some order
    (:math:`\gamma_{m-1}`) and rounds the sum once to the dtype, so that

    .. math::

        |s' - s| \le E + u\,(|s| + E), \qquad
        E = \sum_i e_i + \gamma_{m-1} \sum_i (|t_i| + e_i),

    with :math:`e_i` the error of summand :math:`t_i` (``summand_errors``) and :math:`u` the
    unit roundoff of the dtype (none for float32, whose sums are not rounded again). torch's
    RMSNorm returns no rstd: its relative error is taken as
    :math:`0.6\,\gamma_{d+1} + 5u_{32}` (:math:`u_{32}` float32's unit roundoff), what a float32
    mean of ``d`` squares and a reciprocal square root good to 2 ulps give, and its
    :math:`\hat{x}` and products may be rounded to the dtype (torch's composite rms_norm does).
    float64 keeps a tolerance relative to the values' scale.
    """
    import torch
    import torch.nn.functional as F

    shape = _shape(d)
    x, w, b, dy = (_data(rng, s, dtype) for s in (shape, d, d, shape))
    xt, wt, bt = (torch.tensor(a, device=device, requires_grad=True) for a in (x, w, b))
    yt, mean_t, rstd_t = torch.native_layer_norm(xt, (d,), wt, bt, 1e-5)
    yt.backward(torch.tensor(dy, device=device))
    y, mean, rstd = lnlib.layer_norm_forward(xp.asarray(x), xp.asarray(w), xp.asarray(b))
    back = lnlib.layer_norm_backward(xp.asarray(dy), xp.asarray(x), mean, rstd, xp.asarray(w))
    # Both round to the dtype: compare within a few of its rounding steps.
    tol = 2 * {np.float64: 1e-11, np.float32: 1e-5, np.float16: 4e-3}[dtype]
    _torch_close(y, yt, tol * 2, "y")
    _torch_close(back[0], xt.grad, tol * 20, "dx")
    xr = torch.tensor(x, device=device, requires_grad=True)
    wr = torch.tensor(w, device=device, requires_grad=True)
    yr = F.rms_norm(xr, (d,), wr, 1e-6)
    yr.backward(torch.tensor(dy, device=device))
    y2, rstd2 = lnlib.rms_norm_forward(xp.asarray(x), xp.asarray(w))
    dx2, dw2 = lnlib.rms_norm_backward(xp.asarray(dy), xp.asarray(x), rstd2, xp.asarray(w))
    _torch_close(y2, yr, tol * 2, "rms y")
    _torch_close(dx2, xr.grad, tol * 20, "rms dx")
    if dtype == np.float64:
        pairs = (
            (back[1], wt.grad, "dweight"),
            (back[2], bt.grad, "dbias"),
            (dw2, wr.grad, "rms dw"),
        )
        for got, t, name in pairs:
            _torch_close(got, t, tol * 200, name)
        return
    name = np.dtype(dtype).name
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    _y, mean64, rstd64 = reference.layer_norm_forward(x64, eps=1e-5)
    mu, r = mean64[:, None], rstd64[:, None]  # (M, 1)

    def errors(mean_used, rstd_used):
        mean_err = np.abs(mean_used.reshape(-1) - mean64)[:, None]
        rstd_err = np.abs(rstd_used.reshape(-1) / rstd64 - 1)[:, None]
        return summand_errors(dy64, x64, mu, r, mean_err, rstd_err, "float32")

    ours = errors(host(mean).astype(np.float64), host(rstd).astype(np.float64))
    theirs = errors(*(s.detach().double().cpu().numpy() for s in (mean_t, rstd_t)))
    terms = dy64 * (x64 - mu) * r  # (M, D)
    bound = sum(column_sum_bound(terms, e, "float32", name) for e in (ours, theirs))
    _torch_within(back[1], wt.grad, bound, "dweight")
    _torch_within(back[2], bt.grad, 2 * column_sum_bound(dy64, 0.0, "float32", name), "dbias")
    _y, rstd64 = reference.rms_norm_forward(x64, eps=1e-6)
    r = rstd64[:, None]
    u32, u = UNIT_ROUNDOFF["float32"], UNIT_ROUNDOFF[name]
    rstd_err = np.abs(host(rstd2).astype(np.float64) / rstd64 - 1)[:, None]
    ours = summand_errors(dy64, x64, 0.0, r, 0.0, rstd_err, "float32")
    assumed = 0.6 * gamma(d + 1, u32) + 5 * u32
    theirs = summand_errors(dy64, x64, 0.0, r, 0.0, assumed, "float32", extra=(1 + u) ** 2 - 1)
    terms = dy64 * x64 * r
    bound = sum(column_sum_bound(terms, e, "float32", name) for e in (ours, theirs))
    _torch_within(dw2, wr.grad, bound, "rms dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 33, 768, 4096, 65536])
def test_against_torch_on_cuda(rng, dtype, d):
    _torch_cuda()
    check_against_torch(cp, "cuda", dtype, d, rng)


def test_dlpack_bridge_is_zero_copy(rng):
    torch = _torch_cuda()
    from lnlib._cuda import dlpack

    t = torch.randn(16, 40, device="cuda")[:, :32]  # strided: no copy either
    a = dlpack.to_cupy(t)
    assert a.data.ptr == t.data_ptr() and a.shape == (16, 32)
    assert dlpack.to_torch(a).data_ptr() == t.data_ptr()
    with dlpack.torch_stream(t):
        y = lnlib.layer_norm(a)
    want = torch.nn.functional.layer_norm(t, (32,))
    assert torch.allclose(dlpack.to_torch(y), want, atol=1e-5)
    with pytest.raises(TypeError, match="CUDA tensor"):
        dlpack.to_cupy(torch.ones(3))


def test_empty_batch_and_mixed_libraries(rng):
    x = cp.zeros((0, 7), dtype=cp.float32)
    y, mean, _rstd = lnlib.layer_norm_forward(x, cp.ones(7, cp.float32))
    assert y.shape == (0, 7) and mean.shape == (0,)
    with pytest.raises(TypeError, match="different array libraries"):
        lnlib.layer_norm(cp.ones((2, 3)), np.ones(3))
