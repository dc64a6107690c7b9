"""``out=`` of the LayerNorm and RMSNorm functions: results written into the caller's arrays.

The written results are bitwise those of the allocating call, on every CPU path and dtype;
the kernel writes in place (no array of the output's size is allocated); arrays that cannot
be written in place (strided, overlapping an input) still receive the right result; and a
bad ``out`` is refused, naming it, before anything is written.
"""

import math
import re

import numpy as np
import pytest
from conftest import peak_bytes

import lnlib

DTYPES = [np.float16, np.float32, np.float64]
ACC = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}


def _inputs(rng, dtype, shape=(6, 5, 33)):
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal(shape[-1]).astype(dtype)
    b = rng.standard_normal(shape[-1]).astype(dtype)
    return x, dy, w, b


def _like(results):
    """Fresh arrays of the results' shapes and dtypes, filled with NaN (so a result that is
    not written shows)."""
    return tuple(np.full(r.shape, np.nan, dtype=r.dtype) for r in results)


def _calls(x, dy, w, b):
    """Each function with ``out`` as a tuple, as ``name -> call(out)``."""
    mean, rstd = lnlib.layer_norm_forward(x, w, b)[1:]
    rrstd = lnlib.rms_norm_forward(x, w)[1]
    return {
        "layer_norm_forward": lambda out=None: lnlib.layer_norm_forward(x, w, b, out=out),
        "layer_norm_backward": lambda out=None: lnlib.layer_norm_backward(
            dy, x, mean, rstd, w, out=out
        ),
        "rms_norm_forward": lambda out=None: lnlib.rms_norm_forward(x, w, out=out),
        "rms_norm_backward": lambda out=None: lnlib.rms_norm_backward(dy, x, rrstd, w, out=out),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_written_into_out_are_the_allocated_results(cpu_path, rng, dtype):
    for name, call in _calls(*_inputs(rng, dtype)).items():
        want = call()
        out = _like(want)
        got = call(out)
        for i, (g, o, w) in enumerate(zip(got, out, want)):
            assert g is o, f"{name}: result {i} is not the out array"
            np.testing.assert_array_equal(o, w, err_msg=f"{name} result {i} {cpu_path}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_none_entries_are_allocated(cpu_path, rng, dtype):
    for name, call in _calls(*_inputs(rng, dtype)).items():
        want = call()
        out = (np.full(want[0].shape, np.nan, dtype=want[0].dtype),) + (None,) * (len(want) - 1)
        got = call(out)
        assert got[0] is out[0], name
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)


def test_single_result_functions_take_one_array(cpu_path, rng):
    x, _, w, b = _inputs(rng, np.float32)
    for fn, args in ((lnlib.layer_norm, (x, w, b)), (lnlib.rms_norm, (x, w))):
        want = fn(*args)
        out = np.full_like(x, np.nan)
        assert fn(*args, out=out) is out
        np.testing.assert_array_equal(out, want)


def test_strided_out_gets_the_same_result(cpu_path, rng):
    x, dy, w, b = _inputs(rng, np.float32)
    want = lnlib.layer_norm_forward(x, w, b)
    big = np.full((x.shape[0], x.shape[1], 2 * x.shape[2]), np.nan, dtype=x.dtype)
    y = big[:, :, ::2]  # every other element: not contiguous
    mean, rstd = np.empty_like(want[1]), np.empty_like(want[2])
    got = lnlib.layer_norm_forward(x, w, b, out=(y, mean, rstd))
    assert got[0] is y
    np.testing.assert_array_equal(y, want[0])
    assert np.isnan(big[:, :, 1::2]).all(), "wrote outside the out array"


def test_out_may_overlap_the_input(cpu_path, rng):
    """In place: the result is computed from the input as it was, as without ``out``."""
    x, dy, w, b = _inputs(rng, np.float32)
    want = lnlib.layer_norm(x, w, b)
    x2 = x.copy()
    assert lnlib.layer_norm(x2, w, b, out=x2) is x2
    np.testing.assert_array_equal(x2, want)
    mean, rstd = lnlib.layer_norm_forward(x, w, b)[1:]
    want_dx = lnlib.layer_norm_backward(dy, x, mean, rstd, w)[0]
    dy2 = dy.copy()
    got = lnlib.layer_norm_backward(dy2, x, mean, rstd, w, out=(dy2, None, None))
    assert got[0] is dy2
    np.testing.assert_array_equal(dy2, want_dx)
    r = lnlib.rms_norm_forward(x, w)
    x3 = x.copy()
    lnlib.rms_norm_forward(x3, w, out=(x3, None))
    np.testing.assert_array_equal(x3, r[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kernel_writes_in_place_without_allocating_the_output(rng, dtype):
    """With ``out``, no array the size of y (or dx) is allocated: the kernel writes into it
    (float16 too; tracemalloc does not see the float16 kernel's scratch rows, allocated in C,
    a few rows long)."""
    if not lnlib.show_config(file=False)["implementations"]["kernel"]["available"]:
        pytest.skip("compiled kernel not available")
    x = rng.standard_normal((512, 1024)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    w = np.ones(1024, dtype)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, w)
    out = (np.empty_like(y), np.empty_like(mean), np.empty_like(rstd))
    assert peak_bytes(lnlib.layer_norm_forward, x, w, w) >= x.nbytes
    assert peak_bytes(lnlib.layer_norm_forward, x, w, w, out=out) < x.nbytes / 8
    dx_out = (np.empty_like(x), None, None)
    assert peak_bytes(lnlib.layer_norm_backward, dy, x, mean, rstd, w, out=dx_out) < x.nbytes / 8
    rout = (np.empty_like(y), np.empty_like(rstd))
    assert peak_bytes(lnlib.rms_norm_forward, x, w, out=rout) < x.nbytes / 8
    rdx = (np.empty_like(x), None)
    assert peak_bytes(lnlib.rms_norm_backward, dy, x, rstd, w, out=rdx) < x.nbytes / 8


def _bad_outs(x, mean):
    """(out, exception, words the message must contain) for layer_norm_forward."""
    y, m, r = np.empty_like(x), np.empty_like(mean), np.empty_like(mean)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    return [
        (y, TypeError, "out must be a tuple of 3"),
        ((y, m), TypeError, "length 2"),
        ((y.tolist(), m, r), TypeError, "out[0] (y) must be a numpy.ndarray"),
        ((y[:-1], m, r), ValueError, "out[0] (y) must have shape"),
        ((y, m.astype(np.float64), r), ValueError, "out[1] (mean) must have shape"),
        ((ro, m, r), ValueError, "out[0] (y) is read-only"),
        ((y, m, m), ValueError, "out[1] (mean) and out[2] (rstd) share memory"),
    ]


def test_bad_out_is_refused_before_anything_is_written(cpu_path, rng):
    x, dy, w, b = _inputs(rng, np.float32)
    mean = lnlib.layer_norm_forward(x, w, b)[1]
    for out, exc, words in _bad_outs(x, mean):
        with pytest.raises(exc, match=re.escape(words)):
            lnlib.layer_norm_forward(x, w, b, out=out)
    y, m, r = np.full_like(x, 7.0), np.empty_like(mean), np.empty_like(mean)
    with pytest.raises(ValueError, match=r"out\[2\] \(rstd\)"):
        lnlib.layer_norm_forward(x, w, b, out=(y, m, r[:-1]))
    assert (y == 7.0).all(), "y was written although out[2] was refused"
    with pytest.raises(ValueError, match=r"out must have shape"):
        lnlib.layer_norm(x, w, b, out=np.empty((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"out\[1\] \(dweight\) must have shape"):
        lnlib.rms_norm_backward(dy, x, mean, w, out=(np.empty_like(x), np.empty(3, np.float32)))


def _overlapping(rng, shape, dtype, shift):
    """An input and an out array of ``shape`` in one buffer, ``abs(shift)`` elements apart
    (the out array after the input for shift > 0, before it for shift < 0): they partly
    overlap. Returns ``(buf, a, out, where)``, ``where`` the slice of ``buf`` that is out."""
    n = math.prod(shape)
    buf = (rng.standard_normal(n + abs(shift)) * 2 + 1).astype(dtype)
    first, last = slice(0, n), slice(abs(shift), n + abs(shift))
    where, other = (last, first) if shift > 0 else (first, last)
    return buf, buf[other].reshape(shape), buf[where].reshape(shape), where


def _assert_outside_unchanged(buf, before, where, what):
    outside = np.ones(buf.shape, bool)
    outside[where] = False
    np.testing.assert_array_equal(buf[outside], before[outside], err_msg=f"{what} outside out")


#: Shifts between an input and its out array: one element either way, half a row, a row and one.
SHIFTS = [1, -1, 16, 34]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("shape", [(8, 33), (3, 4, 33)])
def test_out_partly_overlapping_x_gets_the_allocated_result(any_path, rng, dtype, shift, shape):
    """``x = buf[:-1]``, ``out = buf[1:]`` (and other shifts): the result is that of the
    allocating call on the unmodified ``x``, and nothing outside ``out`` is written."""
    w = rng.standard_normal(shape[-1]).astype(dtype)
    b = rng.standard_normal(shape[-1]).astype(dtype)
    for fn, params in ((lnlib.layer_norm_forward, (w, b)), (lnlib.rms_norm_forward, (w,))):
        buf, x, y, where = _overlapping(rng, shape, dtype, shift)
        before = buf.copy()
        want = fn(x.copy(), *params)
        got = fn(x, *params, out=(y,) + (None,) * (len(want) - 1))
        assert got[0] is y
        for i, (g, e) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, e, err_msg=f"{fn.__name__} {i} on {any_path}")
        _assert_outside_unchanged(buf, before, where, f"{fn.__name__} on {any_path} wrote")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("overlaps", ["dy", "x"])
def test_backward_out_partly_overlapping_an_input_gets_the_allocated_result(
    any_path, rng, dtype, shift, overlaps
):
    """dx partly overlapping ``dy`` or ``x``, and dweight partly overlapping ``weight``: the
    results of the allocating call on the unmodified inputs; nothing else written."""
    shape = (8, 33)
    values = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    other = rng.standard_normal(shape).astype(dtype)
    for name in ("layer_norm", "rms_norm"):
        buf, a, dx, where = _overlapping(rng, shape, dtype, shift)
        a[...] = values
        wbuf, w, dw, wwhere = _overlapping(rng, shape[-1:], dtype, 1 if shift > 0 else -1)
        dy, x = (a, other) if overlaps == "dy" else (other, a)
        stats = getattr(lnlib, f"{name}_forward")(x.copy(), w.copy())[1:]
        stats = stats if name == "layer_norm" else stats[-1:]  # rstd only for RMSNorm
        fn = getattr(lnlib, f"{name}_backward")
        want = fn(dy.copy(), x.copy(), *stats, w.copy())
        before, wbefore = buf.copy(), wbuf.copy()
        got = fn(dy, x, *stats, w, out=(dx, dw) + (None,) * (len(want) - 2))
        assert got[0] is dx and got[1] is dw
        for i, (g, e) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, e, err_msg=f"{name} backward {i} on {any_path}")
        _assert_outside_unchanged(buf, before, where, f"{name} backward on {any_path} wrote")
        _assert_outside_unchanged(wbuf, wbefore, wwhere, f"{name} backward wrote dweight")
