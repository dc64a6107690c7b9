"""Every CPU path gives the same answer (issue 20, items 2, 5 and 11).

The paths: the compiled kernel, the NumPy path (forced, and as "auto" chooses it with
``LNLIB_CPU_KERNEL=0``) and the reference. Each is compared with a float64 computation.
"""


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
