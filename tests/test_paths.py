"""Every CPU path gives the same answer (issue 20, items 2, 5 and 11).

The paths: the compiled kernel, the NumPy path (forced, and as "auto" chooses it with
``LNLIB_CPU_KERNEL=0``) and the reference. Each is compared with a float64 computation.
"""

import warnings

import numpy as np
import pytest

import lnlib
from lnlib import reference

F16, F32, F64 = np.float16, np.float32, np.float64
TOL = {F16: 4e-3, F32: 2e-5, F64: 1e-10}  # relative to the scale of the compared values


@pytest.fixture(params=["kernel", "numpy", "reference", "LNLIB_CPU_KERNEL=0"])
def path(request, monkeypatch):
    """Run a test on one CPU path."""
    name = request.param
    if name == "LNLIB_CPU_KERNEL=0":
        monkeypatch.setenv("LNLIB_CPU_KERNEL", "0")
        yield name
        return
    if name == "kernel":
        kernel = lnlib.show_config(file=False)["implementations"]["kernel"]
        if not kernel["available"]:
            pytest.skip(f"compiled kernel not available: {kernel['reason']}")
    with lnlib.use_implementation(name):
        yield name


def _close(actual, expected, tol, what):
    """``actual`` within ``tol`` of ``expected`` relative to its scale, and finite."""
    actual = np.asarray(actual, dtype=np.float64)
    assert np.isfinite(actual).all(), f"{what}: {np.count_nonzero(~np.isfinite(actual))} not finite"
    scale = np.max(np.abs(expected))
    err = np.max(np.abs(actual - expected)) / scale
    assert err <= tol, f"{what}: error {err:.2e} of the scale {scale:.3g}, tolerance {tol:.0e}"


def _exact_backward(op, dy, x, stats, weight):
    """The float64 backward of the given arrays (with the saved statistics as they are)."""
    f64 = [None if a is None else a.astype(F64) for a in (dy, x, *stats, weight)]
    return getattr(reference, f"{op}_backward")(*f64)


def _backward_case(op, x_dtype, dy, rng, spread):
    m, n = dy.shape
    x = (spread * rng.standard_normal((m, n))).astype(x_dtype)
    weight = rng.uniform(0.5, 1.5, n).astype(F64 if x_dtype == F64 else F32)
    if op == "layer_norm":
        _, mean, rstd = lnlib.layer_norm_forward(x, weight)
        stats = (mean, rstd)
    else:
        stats = (lnlib.rms_norm_forward(x, weight)[1],)
    got = getattr(lnlib, f"{op}_backward")(dy, x, *stats, weight)
    return got, _exact_backward(op, dy, x, stats, weight), x


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("scale", [1.0, 1e5], ids=["in-range", "beyond-float16"])
def test_float16_x_with_float32_dy(path, op, scale, rng):
    """Issue 20, item 2: dy is used as given, not rounded to float16 first. Beyond 65504 a
    rounded dy is inf (dx NaN); in range it loses its low bits (dweight off by ~1e-4)."""
    dy = (scale * rng.standard_normal((64, 96))).astype(F32)  # not float16 values
    got, exact, _ = _backward_case(op, F16, dy, rng, spread=32.0)  # dx ~ dy / 32
    assert got[0].dtype == F16 and all(g.dtype == F32 for g in got[1:])
    _close(got[0], exact[0], TOL[F16], "dx")
    for name, g, e in zip(("dweight", "dbias"), got[1:], exact[1:]):
        _close(g, e, TOL[F32], name)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("x_dtype", [F16, F32, F64], ids=["x16", "x32", "x64"])
@pytest.mark.parametrize("dy_dtype", [F16, F32, F64], ids=["dy16", "dy32", "dy64"])
def test_every_dtype_combination_of_x_and_dy(path, op, x_dtype, dy_dtype, rng):
    """Every (x, dy) dtype pair: dy converted exactly or rounded to the accumulation dtype,
    never to a narrower one; the results within the tolerance of x's (dx) and the
    accumulation dtype (the parameter gradients)."""
    dy = rng.standard_normal((40, 72)).astype(dy_dtype)
    got, exact, _ = _backward_case(op, x_dtype, dy, rng, spread=4.0)
    acc = F64 if x_dtype == F64 else F32
    _close(got[0], exact[0], TOL[x_dtype], "dx")
    for name, g, e in zip(("dweight", "dbias"), got[1:], exact[1:]):
        _close(g, e, TOL[acc], name)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_kernel_float16_x_with_float32_dy_is_the_float32_kernel(op, rng):
    """The kernel's float16 rows are by definition its float32 rows on x converted: with a
    float32 dy too, bit for bit (dx rounded once to float16), also into an out= array."""
    if not lnlib.show_config(file=False)["implementations"]["kernel"]["available"]:
        pytest.skip("compiled kernel not available")
    dy = (1e5 * rng.standard_normal((300, 80))).astype(F32)
    x = (32 * rng.standard_normal(dy.shape)).astype(F16)
    weight = rng.uniform(0.5, 1.5, 80).astype(F32)
    with lnlib.use_implementation("kernel"):
        fwd = getattr(lnlib, f"{op}_forward")(x, weight)
        stats = fwd[1:]
        got = getattr(lnlib, f"{op}_backward")(dy, x, *stats, weight)
        wide = getattr(lnlib, f"{op}_backward")(dy, x.astype(F32), *stats, weight)
        dx = np.full(x.shape, np.nan, F16)
        into = getattr(lnlib, f"{op}_backward")(
            dy, x, *stats, weight, out=(dx,) + (None,) * (len(got) - 1)
        )
    np.testing.assert_array_equal(got[0], wide[0].astype(F16))
    assert into[0] is dx
    for a, b, c in zip(got, wide, into):
        np.testing.assert_array_equal(a, b.astype(a.dtype))
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rstd_of_a_row_of_2_24_within_4_ulp(path, op):
    """Issue 20, item 5: the error of a row's sums does not grow with its length on any path.
    One float32 dot over the row put the NumPy path's rstd 686 (LayerNorm) and 35 (RMSNorm)
    ulp off; blocked sums put it under 1."""
    n = 1 << 24
    x = (np.random.default_rng(5).standard_normal((1, n), dtype=F32) + 3).astype(F32)
    x64 = x.astype(F64)
    if op == "layer_norm":
        rstd = lnlib.layer_norm_forward(x)[2]
        exact = 1 / np.sqrt(((x64 - x64.mean()) ** 2).mean() + 1e-5)
    else:
        rstd = lnlib.rms_norm_forward(x)[1]
        exact = 1 / np.sqrt((x64**2).mean() + 1e-6)
    ulps = abs(float(rstd[0]) - exact) / float(np.spacing(F32(exact)))
    assert ulps <= 4, f"rstd is {ulps:.1f} float32 ulp from float64"


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_long_rows_are_batch_invariant_and_deterministic(op, rng):
    """The NumPy path's blocked sums (rows longer than ROW_BLOCK, with a partial last block):
    a row alone, in a batch, at an odd offset in memory and with any number of threads gives
    the same bits."""
    from lnlib._cpu import numpy_path

    n = 2 * numpy_path.ROW_BLOCK + 37
    buf = rng.standard_normal(12 * n + 1).astype(F32)
    x = buf[1:].reshape(12, n)  # rows at an address that is not 8-byte aligned
    weight, bias = rng.uniform(0.5, 1.5, n).astype(F32), rng.standard_normal(n).astype(F32)
    dy = rng.standard_normal(x.shape).astype(F32)

    def run(rows, threads):
        if op == "layer_norm":
            fwd = numpy_path.layer_norm_forward_rows(rows, weight, bias, 1e-5, threads=threads)
            bwd = numpy_path.layer_norm_backward_rows(
                dy[: len(rows)], rows, *fwd[1:], weight, threads=threads, block_rows=2
            )
        else:
            fwd = numpy_path.rms_norm_forward_rows(rows, weight, 1e-6, threads=threads)
            bwd = numpy_path.rms_norm_backward_rows(
                dy[: len(rows)], rows, fwd[1], weight, threads=threads, block_rows=2
            )
        return fwd, bwd

    one, two = run(x, 1), run(x, 2)
    for a, b in zip(one[0] + one[1], two[0] + two[1]):
        np.testing.assert_array_equal(a, b)
    alone = run(np.ascontiguousarray(x[5:6]), 1)[0]
    for a, b in zip(alone, one[0]):
        np.testing.assert_array_equal(
            a[:1] if a.ndim == 1 else a[0], b[5:6] if b.ndim == 1 else b[5]
        )


_ROWS = np.array(
    [
        np.linspace(-2, 3, 40),
        np.r_[np.nan, np.linspace(-2, 3, 39)],
        np.r_[np.linspace(-2, 3, 39), np.inf],
        np.r_[-np.inf, np.linspace(-2, 3, 38), np.inf],
        np.full(40, np.nan),
        np.linspace(1, 9, 40) ** 2,
    ]
)


def _masks(a):
    a = np.asarray(a)
    return np.isnan(a), np.isposinf(a), np.isneginf(a)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_nan_and_inf_give_no_warnings_and_the_same_results(path, op, dtype, rng):
    """Issue 20, item 11: NaN and inf in x give NaN and inf in the same places on every path
    (those of float64), without RuntimeWarnings (the NumPy path warned, the kernel did not);
    the finite rows are unaffected."""
    x = _ROWS.astype(dtype)
    weight = rng.uniform(0.5, 1.5, 40).astype(F64 if dtype == F64 else F32)
    dy = rng.standard_normal(x.shape).astype(dtype)
    exact = {}
    with np.errstate(all="ignore"):
        x64, w64 = x.astype(F64), weight.astype(F64)
        if op == "layer_norm":
            exact["y"], *stats = reference.layer_norm_forward(x64, w64)
        else:
            exact["y"], *stats = reference.rms_norm_forward(x64, w64)
        exact["dx"] = _exact_backward(op, dy, x, stats, weight)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fwd = getattr(lnlib, f"{op}_forward")(x, weight)
        got = {"y": fwd[0], "dx": getattr(lnlib, f"{op}_backward")(dy, x, *fwd[1:], weight)[0]}
    finite = [0, 5]
    for name in ("y", "dx"):
        for a, b in zip(_masks(got[name]), _masks(exact[name])):
            np.testing.assert_array_equal(a, b, err_msg=name)
        _close(got[name][finite], exact[name][finite], TOL[dtype], name)
    for s, e in zip(fwd[1:], stats):
        np.testing.assert_array_equal(np.isfinite(s), np.isfinite(e))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [F16, F32, F64])
def test_an_eps_below_float32_range_still_counts(path, op, dtype):
    """Issue 20, item 11: eps is added in float64 on every path (as the kernel does), so a
    constant row with eps = 1e-46 (0 in float32) has rstd = 1/sqrt(1e-46), not inf, and y is
    its bias, not NaN."""
    eps = 1e-46
    x = np.full((3, 33), 2.5 if op == "layer_norm" else 0.0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, *stats = getattr(lnlib, f"{op}_forward")(x, eps=eps)
    acc = F64 if dtype == F64 else F32
    np.testing.assert_array_equal(stats[-1], np.full(3, 1 / np.sqrt(eps), dtype=acc))
    np.testing.assert_array_equal(y, np.zeros_like(x))
