"""The compiled CPU kernel: built where a compiler exists, accurate on long rows and long
columns, bitwise invariant to batch, threads and alignment, bound with checked types, and
described pass by pass by ``lnlib._cpu.c_kernel.PASSES``."""

import platform
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import lnlib
from lnlib._cpu import c_kernel as cpu_kernel

KERNEL_DIR = Path(lnlib.__file__).parent / "_cpu"


@pytest.fixture
def kernel():
    """The kernel's row functions; skipped with the reason where the module was not built or
    ``LNLIB_CPU_KERNEL`` switches it off (the tests also run it through the selection point)."""
    row = lnlib.show_config(file=False)["implementations"]["kernel"]
    usable, reason = row["available"], row["reason"]
    if not usable:
        pytest.skip(f"compiled kernel not available: {reason}")
    return cpu_kernel


def test_kernel_is_built_where_a_compiler_exists():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the NumPy fast path is used")
    info = cpu_kernel.info()
    assert info["kernel"], info["reason"]
    assert Path(info["path"]).parent == Path(cpu_kernel.__file__).parent  # inside the package


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 255, 256, 257, 768, 4099])
def test_kernel_and_numpy_paths_agree(kernel, rng, dtype, n):
    x = (rng.standard_normal((50, n)) * 2 + 3).astype(dtype)
    w, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)

    def run():
        fwd = lnlib.layer_norm_forward(x, w, b)
        r = lnlib.rms_norm_forward(x, w)
        return (
            *fwd,
            *lnlib.layer_norm_backward(dy, x, *fwd[1:], w),
            *r,
            *lnlib.rms_norm_backward(dy, x, r[1], w),
        )

    with lnlib.use_implementation("kernel"):
        fast = run()
    with lnlib.use_implementation("numpy"):
        slow = run()
    tol = 5e-4 if dtype == np.float32 else 5e-11
    for a, c in zip(fast, slow):
        assert a.dtype == c.dtype and a.shape == c.shape
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol)


def _exact_layer_norm_stats(x):
    x64 = x.astype(np.float64)
    mean = x64.mean()
    return mean, 1 / np.sqrt(np.mean((x64 - mean) ** 2) + 1e-5)


@pytest.mark.parametrize("log2_n", [20, 22])
def test_long_row_statistics_are_correctly_rounded(kernel, log2_n):
    # 16 float32 running sums gave rstd off by 2.8e-5 (relative) at 2^22 values
    x = (3 + np.random.default_rng(log2_n).standard_normal((1, 1 << log2_n))).astype(np.float32)
    _, mean, rstd = kernel.layer_norm_forward_rows(x, None, None, 1e-5)
    want_mean, want_rstd = _exact_layer_norm_stats(x)
    ulp = np.spacing(np.float32(want_rstd))
    assert abs(float(rstd[0]) - want_rstd) <= 0.5 * ulp * 1.01  # the float32 nearest
    assert abs(float(mean[0]) - want_mean) <= 0.5 * np.spacing(np.float32(want_mean)) * 1.01
    _, rms_rstd = kernel.rms_norm_forward_rows(x, None, 1e-5)
    want = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5)
    assert abs(float(rms_rstd[0]) - want) <= 0.5 * np.spacing(np.float32(want)) * 1.01


def test_long_column_parameter_gradients_are_accurate(kernel):
    # summed row by row in float32, dbias of 2^20 rows of 1.3 was 0.4 % off
    m, n = 1 << 20, 4
    rng = np.random.default_rng(5)
    x = rng.standard_normal((m, n)).astype(np.float32)
    mean, rstd = x.mean(1), (1 / x.std(1)).astype(np.float32)
    for dy in (np.full((m, n), 1.3, np.float32), rng.random((m, n), dtype=np.float32)):
        _, dweight, dbias = kernel.layer_norm_backward_rows(dy, x, mean, rstd, None)
        want = dy.astype(np.float64).sum(0)
        np.testing.assert_allclose(dbias, want, rtol=1.2e-7)
        xhat = (x - mean[:, None]) * rstd[:, None]
        want_dw = (dy.astype(np.float64) * xhat).sum(0)
        assert np.max(np.abs(dweight - want_dw)) <= 1e-6 * np.abs(dy * xhat).sum(0).max()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_do_not_depend_on_threads_batch_or_alignment(kernel, rng, dtype):
    m, n = 1000, 300
    x = rng.standard_normal((m, n)).astype(dtype) + 5
    dy = rng.standard_normal((m, n)).astype(dtype)
    w, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)

    def all_outputs(x, dy, threads):
        y, mean, rstd = kernel.layer_norm_forward_rows(x, w, b, 1e-5, threads=threads)
        grads = kernel.layer_norm_backward_rows(dy, x, mean, rstd, w, threads=threads)
        ry, r = kernel.rms_norm_forward_rows(x, w, 1e-5, threads=threads)
        return (
            y,
            mean,
            rstd,
            *grads,
            ry,
            r,
            *kernel.rms_norm_backward_rows(dy, x, r, w, threads=threads),
        )

    base = all_outputs(x, dy, 1)
    for threads in (2, 3, 7):
        for a, c in zip(all_outputs(x, dy, threads), base):
            np.testing.assert_array_equal(a, c)
    # row 17 alone, and at an odd address inside a wider buffer (rows with a gap)
    wide = np.zeros((m, n + 3), dtype=dtype)
    wide[:, 1 : n + 1] = x
    shifted = all_outputs(wide[:, 1 : n + 1], dy, 2)
    alone = all_outputs(x[17:18].copy(), dy[17:18].copy(), 1)
    for a, c in zip(shifted, base):
        np.testing.assert_array_equal(a, c)
    for i in (0, 1, 2, 3, 6, 7, 8):  # the per-row results: y, mean, rstd, dx; y, rstd, dx
        np.testing.assert_array_equal(alone[i][0], base[i][17])


# --- float16: by definition the float32 kernel on the rows converted to float32 ---------------


def _float32_kernel_rounded(kernel, x, dy, w, b, threads=None):
    """The float16 definition: every kernel in float32 on ``x``, ``dy`` converted to float32,
    ``y``/``dx`` rounded to float16; mean, rstd and the parameter gradients as they come."""
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    return _all_rows(kernel, x32, dy32, w, b, threads, np.float16)


def _all_rows(kernel, x, dy, w, b, threads, round_to=None):
    """Every row function of ``kernel`` on the same inputs, ``(name, result)`` pairs."""
    y, mean, rstd = kernel.layer_norm_forward_rows(x, w, b, 1e-5, threads=threads)
    dx, dw, db = kernel.layer_norm_backward_rows(dy, x, mean, rstd, w, threads=threads)
    ry, rr = kernel.rms_norm_forward_rows(x, w, 1e-5, threads=threads)
    rdx, rdw = kernel.rms_norm_backward_rows(dy, x, rr, w, threads=threads)
    out = {"y": y, "mean": mean, "rstd": rstd, "dx": dx, "dweight": dw, "dbias": db}
    out.update({"rms_y": ry, "rms_rstd": rr, "rms_dx": rdx, "rms_dweight": rdw})
    if round_to is not None:
        with np.errstate(over="ignore"):
            for k in ("y", "dx", "rms_y", "rms_dx"):
                out[k] = out[k].astype(round_to)
    return out


def _half_inputs(rng, m, n):
    """float16 rows (a wide spread of values; two with a large offset), dy, and float32
    parameters, some of whose weights make y overflow float16 (to inf) in some rows."""
    x = rng.standard_normal((m, n)) * rng.choice([0.01, 1.0, 300.0], size=(m, 1))
    x[::3] += 2000.0
    x = x.astype(np.float16)
    dy = (rng.standard_normal((m, n)) * 4).astype(np.float16)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    w[::97] = 3e4
    return x, dy, w, b


@pytest.mark.parametrize("n", [1, 15, 16, 17, 255, 256, 257, 1000, 4099, 8193])
def test_float16_is_the_float32_kernel_on_converted_rows(kernel, rng, n):
    m = 301 if n <= 1000 else 5  # odd: a row without a pair; 301 rows span three row blocks
    x, dy, w, b = _half_inputs(rng, m, n)
    want = _float32_kernel_rounded(kernel, x, dy, w, b)
    got = _all_rows(kernel, x, dy, w, b, None)
    if n > 1:  # overflow to inf is exercised (a row of one element gives y = bias)
        assert np.isinf(want["y"]).any() and np.isfinite(want["y"]).any()
    for key, value in got.items():
        assert value.dtype == want[key].dtype, key
        np.testing.assert_array_equal(value, want[key], err_msg=f"{key} n={n}")
    # rows with a gap between them, at an odd address; no weight and bias
    wide = np.zeros((m, n + 3), np.float16)
    wide[:, 1 : n + 1] = x
    got = _all_rows(kernel, wide[:, 1 : n + 1], dy, None, None, None)
    want = _float32_kernel_rounded(kernel, x, dy, None, None)
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key], err_msg=f"{key} n={n} strided")


def test_float16_results_do_not_depend_on_threads_or_batch(kernel, rng):
    m, n = 1000, 300
    x, dy, w, b = _half_inputs(rng, m, n)
    base = _all_rows(kernel, x, dy, w, b, 1)
    for threads in (2, 3, 7):
        for key, value in _all_rows(kernel, x, dy, w, b, threads).items():
            np.testing.assert_array_equal(value, base[key], err_msg=f"{key} threads={threads}")
    alone = _all_rows(kernel, x[17:18].copy(), dy[17:18].copy(), w, b, 1)
    for key in ("y", "mean", "rstd", "dx", "rms_y", "rms_rstd", "rms_dx"):
        np.testing.assert_array_equal(alone[key][0], base[key][17], err_msg=key)


def test_float16_public_functions_take_the_kernel(kernel, rng):
    x, dy, w, b = _half_inputs(rng, 6, 40)
    assert lnlib._backend.select("layer_norm_forward", np) is kernel.layer_norm_forward_rows
    with lnlib.use_implementation("kernel"):
        forced = lnlib.layer_norm_forward(x, w.astype(np.float16), b.astype(np.float16))
    y, mean, rstd = lnlib.layer_norm_forward(x, w.astype(np.float16), b.astype(np.float16))
    want = kernel.layer_norm_forward_rows(
        x, w.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32), 1e-5
    )
    for got, f, c in zip((y, mean, rstd), forced, want):
        assert got.dtype == c.dtype and f.dtype == c.dtype
        np.testing.assert_array_equal(got, c)
        np.testing.assert_array_equal(f, c)


def test_float16_kernel_reports_a_failed_allocation(kernel):
    lib, ffi = cpu_kernel._state["module"].lib, cpu_kernel._state["module"].ffi
    huge = 1 << 60  # scratch rows of this length cannot be allocated; no row is touched (m=0)
    null = ffi.NULL
    for rms in (0, 1):
        args = (null, 0, null, null, null, null, null, null, 0, huge, 1e-5)
        assert lib.norms_forward_f16(rms, null, huge, *args)
        args = (null, null, null, null, null, null, 0, huge)
        assert lib.norms_backward_f16(rms, null, huge, null, 0, null, huge, *args)
    assert (
        lib.norms_forward_f16(1, null, 1, null, 0, null, null, null, null, null, null, 0, 1, 1e-5)
        == 0
    )
    with pytest.raises(MemoryError, match="scratch"):
        cpu_kernel._ok(1)


def test_binding_rejects_wrong_dtypes_and_argument_counts(kernel):
    x = np.ones((2, 4), dtype=np.float32)
    y, mean, rstd = np.empty_like(x), np.empty(2, np.float32), np.empty(2, np.float32)
    ffi, lib = cpu_kernel._state["module"].ffi, cpu_kernel._state["module"].lib

    def p(a):
        return ffi.from_buffer(("float" if a.dtype == np.float32 else "double") + "[]", a)

    ones, zeros = p(np.ones(4, np.float32)), p(np.zeros(4, np.float32))
    null = ffi.NULL
    fwd = lib.norms_forward_f32
    fwd(0, p(x), 4, null, 0, ones, zeros, p(y), null, p(mean), p(rstd), 2, 4, 1e-5)
    np.testing.assert_allclose(y, 0)
    with pytest.raises(TypeError):  # a float64 array where float * is declared
        fwd(
            0,
            p(x),
            4,
            null,
            0,
            ones,
            zeros,
            p(y),
            null,
            p(mean.astype(np.float64)),
            p(rstd),
            2,
            4,
            1e-5,
        )
    with pytest.raises(TypeError):  # eps forgotten
        fwd(0, p(x), 4, null, 0, ones, zeros, p(y), null, p(mean), p(rstd), 2, 4)
    with pytest.raises(TypeError):  # a length where a pointer is declared
        fwd(0, p(x), 4, null, 0, 4, zeros, p(y), null, p(mean), p(rstd), 2, 4, 1e-5)


def test_read_only_input_is_accepted_and_never_written(kernel, rng):
    """A read-only x is accepted (the results of a writeable copy) and its values are
    unchanged: the flag alone proves nothing, C code can write past it."""
    x = rng.standard_normal((4, 9)).astype(np.float32)
    want = kernel.layer_norm_forward_rows(x.copy(), None, None, 1e-5)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    want_dx = kernel.layer_norm_backward_rows(dy, x.copy(), *want[1:], None)
    before = x.copy()
    x.flags.writeable = False
    got = kernel.layer_norm_forward_rows(x, None, None, 1e-5)
    got_dx = kernel.layer_norm_backward_rows(dy, x, *got[1:], None)
    assert got[0].flags.writeable and not x.flags.writeable
    for g, w in zip((*got, *got_dx), (*want, *want_dx)):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(x, before)


# --- Large outputs are streamed to memory (non-temporal stores): same bits ------------------


def _offset_like(a, offset_bytes):
    """An uninitialised array like ``a`` whose data starts ``offset_bytes`` past 64-byte
    alignment (to test the unaligned head of the streamed stores)."""
    raw = np.empty(a.nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset_bytes
    return raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_streamed_outputs_equal_the_outputs_written_in_cache(kernel, rng, dtype):
    """A call that writes at least STREAM_BYTES streams its output (y, dx); small calls do
    not. Each row gets the same bits either way, wherever the output starts."""
    n = 1030  # not a multiple of the 16-byte store: every row starts at another alignment
    m = 2 * (8 << 20) // (n * np.dtype(dtype).itemsize) + 3  # 16 MiB and more: streamed
    x = (rng.standard_normal((m, n)) * 2 + 3).astype(dtype)
    dy = rng.standard_normal((m, n)).astype(dtype)
    w, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    size = np.dtype(dtype).itemsize
    for offset in (0, size, 64 - size):
        y = _offset_like(x, offset)
        mean, rstd = np.empty(m, dtype), np.empty(m, dtype)
        kernel.layer_norm_forward_rows(x, w, b, 1e-5, threads=1, out=(y, mean, rstd))
        dx = _offset_like(x, offset)
        kernel.layer_norm_backward_rows(dy, x, mean, rstd, w, threads=1, out=(dx, None, None))
        ry = _offset_like(x, offset)
        rrstd = np.empty(m, dtype)
        kernel.rms_norm_forward_rows(x, w, 1e-5, threads=1, out=(ry, rrstd))
        rdx = _offset_like(x, offset)
        kernel.rms_norm_backward_rows(dy, x, rrstd, w, threads=1, out=(rdx, None))
        with kernel.ordinary_stores():  # the benchmark's switch: the same values
            y_plain = kernel.layer_norm_forward_rows(x, w, b, 1e-5, threads=1)[0]
        np.testing.assert_array_equal(y_plain, y)
        assert kernel._module().lib.norms_set_streaming(1) == 1, "streaming left switched off"
        for start in range(0, m, 97):  # in small calls, which are not streamed
            s = slice(start, start + 97)
            y_s, mean_s, rstd_s = kernel.layer_norm_forward_rows(x[s], w, b, 1e-5)
            np.testing.assert_array_equal(y[s], y_s, err_msg=f"offset {offset}")
            np.testing.assert_array_equal(rstd[s], rstd_s)
            dx_s = kernel.layer_norm_backward_rows(dy[s], x[s], mean_s, rstd_s, w)[0]
            np.testing.assert_array_equal(dx[s], dx_s, err_msg=f"offset {offset}")
            ry_s, rrstd_s = kernel.rms_norm_forward_rows(x[s], w, 1e-5)
            np.testing.assert_array_equal(ry[s], ry_s, err_msg=f"offset {offset}")
            rdx_s = kernel.rms_norm_backward_rows(dy[s], x[s], rrstd_s, w)[0]
            np.testing.assert_array_equal(rdx[s], rdx_s, err_msg=f"offset {offset}")


# --- PASSES (the description chapter 5 imports) against the C source -------------------------

_ARRAYS = ("x", "dy", "weight", "bias", "y", "dx", "dweight", "dbias")
_PASS = re.compile(
    r"FN\(row_\w+\)\((?P<call>[^;]*);"
    r"|for \(ptrdiff_t i = 0; i < n; i\+\+\)(?P<loop>\s*\{.*?\n    \}|[^;]*;)",
    re.DOTALL,
)


def _function_body(source, name):
    """The body of the static C function ``FN(name)`` in ``source``, or None."""
    match = re.search(
        r"static \w+ FN\(" + name + r"\)\([^)]*\)\n\{\n(.*?)\n\}\n", source, re.DOTALL
    )
    return match and match.group(1)


#: The one-row form of a pass, written beside its two-row form in a row function.
_ONE_ROW = re.compile(r"\n    if \(k == 1\) \{.*?\n    \}", re.DOTALL)


def _arrays(text):
    """The arrays of length D that C ``text`` uses, and those it writes."""
    used = {a for a in _ARRAYS if re.search(rf"\b{a}\b", text)}
    return used, {a for a in _ARRAYS if re.search(rf"\b{a}\[i\] \+?=", text)}


def _row_function_body(op):
    """The body of ``FN(<op>_rows)``, with the helpers it calls (other than the row sums
    ``row_*``) spelled out in place, so that every pass over the rows shows."""
    source = (KERNEL_DIR / "norms_rows.h").read_text()
    body = _function_body(source, op + "_rows")
    assert body, f"no row function for {op} in norms_rows.h"
    helper = re.compile(r"FN\((?!row_)(\w+)\)\([^;]*;")
    return helper.sub(lambda m: _function_body(source, m.group(1)) or m.group(0), body)


@pytest.mark.parametrize("op", sorted(cpu_kernel.PASSES))
def test_passes_match_the_c_source(op):
    body = _row_function_body(op)
    one_row = _ONE_ROW.search(body)  # the same pass as the one after it, for one row
    body = _ONE_ROW.sub("", body)
    passes = [m.group("call") or m.group("loop") for m in _PASS.finditer(body)]
    described = cpu_kernel.PASSES[op]
    assert len(passes) == len(described), f"{op}: C makes {len(passes)} passes over a row"
    if one_row:
        after = body[one_row.start() :]
        following = next(t for t in passes if t in after)
        assert _arrays(one_row.group(0)) == _arrays(following), (op, one_row.group(0))
    for text, want in zip(passes, described):
        used, written = _arrays(text)
        assert written == set(want["writes"]), (op, text)
        assert used == set(want["reads"]) | written, (op, text)


def test_passes_cover_every_row_function():
    """PASSES has one entry per row function of norms_rows.h (what norms_forward_* and
    norms_backward_* run on each row), and the header exports those two per dtype mix."""
    rows = (KERNEL_DIR / "norms_rows.h").read_text()
    assert set(re.findall(r"static void FN\((\w+)_rows\)", rows)) == set(cpu_kernel.PASSES)
    header = (KERNEL_DIR / "norms.h").read_text()
    assert set(re.findall(r"int (norms_\w+)\(int rms", header)) == set(cpu_kernel._FUNCTIONS)


# --- Every vector width gives the same bits -------------------------------------------------

_WIDTHS = {"baseline": [], "avx2": ["-mavx2"], "avx512f": ["-mavx512f"]}
#: The baseline built with the float16 conversion of other machines (bit operations instead of
#: F16C): must give the same bits.
_PLAIN = {"float16_portable": ["-DNORMS_NO_F16C"]}


def _cpu_flags():
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def _build_variant(tmp_path, name, flags):
    """The kernel compiled as one version (no multi-versioning) with ``flags``, via cffi ABI."""
    import importlib.util
    import subprocess
    import sysconfig

    import cffi

    spec = importlib.util.spec_from_file_location("lnlib_cpu_build", KERNEL_DIR / "build.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc}) to build the {name} variant")
    out = tmp_path / f"norms_{name}.so"
    subprocess.run(
        [
            cc,
            *builder.FLAGS,
            *flags,
            "-DNORMS_NO_CLONES",
            "-shared",
            "-fPIC",
            "-o",
            str(out),
            str(KERNEL_DIR / "norms.c"),
            "-lm",
        ],
        check=True,
    )
    ffi = cffi.FFI()
    ffi.cdef(builder.declarations())
    return ffi, ffi.dlopen(str(out))


_VARIANT_CTYPES = {np.float16: ("uint16_t", "f16"), np.float32: ("float", "f32")}


def _run_variant(ffi, lib, x, w, b, dy):
    """Every kernel of ``lib`` on the same inputs; returns all outputs (float16 rows: float32
    ``w``, ``b``, mean and rstd)."""
    ctype, suffix = _VARIANT_CTYPES.get(x.dtype.type, ("double", "f64"))
    acc = np.float64 if x.dtype == np.float64 else np.float32
    m, n = x.shape
    blocks = -(-m // lib.NORMS_BLOCK_ROWS)
    out = {k: np.zeros((m, n), x.dtype) for k in ("y", "dx", "ry", "rdx")}
    out.update({k: np.zeros(m, acc) for k in ("mean", "rstd", "rrstd")})
    out.update({k: np.zeros((blocks, n)) for k in ("dw", "db", "rdw")})
    p = {k: ffi.from_buffer(_CTYPE_OF[v.dtype.type] + "[]", v) for k, v in out.items()}
    px, pdy = (ffi.from_buffer(ctype + "[]", a) for a in (x, dy))
    pw, pb = (ffi.from_buffer(_CTYPE_OF[acc] + "[]", a.astype(acc)) for a in (w, b))
    fwd, bwd, null = (
        getattr(lib, f"norms_forward_{suffix}"),
        getattr(lib, f"norms_backward_{suffix}"),
        ffi.NULL,
    )
    status = [
        fwd(0, px, n, null, 0, pw, pb, p["y"], null, p["mean"], p["rstd"], m, n, 1e-5),
        bwd(0, pdy, n, null, 0, px, n, p["mean"], p["rstd"], pw, p["dx"], p["dw"], p["db"], m, n),
        fwd(1, px, n, null, 0, pw, null, p["ry"], null, null, p["rrstd"], m, n, 1e-5),
        bwd(1, pdy, n, null, 0, px, n, null, p["rrstd"], pw, p["rdx"], p["rdw"], null, m, n),
    ]
    assert not any(status)
    return out


_CTYPE_OF = {np.float16: "uint16_t", np.float32: "float", np.float64: "double"}


def test_every_vector_width_gives_the_same_bits(kernel, tmp_path):
    """The baseline build, the AVX2 and AVX-512 builds (where this CPU runs them), the
    baseline with the portable float16 conversion, and the installed multi-version module
    agree bit for bit."""
    flags = _cpu_flags()
    widths = {k: v for k, v in _WIDTHS.items() if k == "baseline" or k in flags}
    if len(widths) < 2:
        pytest.skip(f"this CPU runs only the baseline build (flags: {sorted(flags)[:5]}...)")
    widths.update(_PLAIN)
    variants = {k: _build_variant(tmp_path, k, v) for k, v in widths.items()}
    variants["installed"] = (kernel._state["module"].ffi, kernel._state["module"].lib)
    rng = np.random.default_rng(3)
    for dtype in (np.float16, np.float32, np.float64):
        for n in (1, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 1000, 4099):
            m = 300 if n < 300 else 3
            x = (rng.standard_normal((m, n)) * 3 + 7).astype(dtype)
            w, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
            dy = rng.standard_normal((m, n)).astype(dtype)
            results = {k: _run_variant(*v, x, w, b, dy) for k, v in variants.items()}
            for name, got in results.items():
                for key, value in got.items():
                    np.testing.assert_array_equal(
                        value, results["baseline"][key], err_msg=f"{name} {key} {dtype} n={n}"
                    )


# --- The float16 conversions against NumPy's casts -------------------------------------------


def _conversions(ffi, lib):
    """``(widen, narrow)``: float16 bits -> float32 and float32 -> float16 bits with ``lib``."""

    def widen(h):
        f = np.empty(h.size, np.float32)
        lib.norms_half_to_float(
            ffi.from_buffer("uint16_t[]", h), ffi.from_buffer("float[]", f), h.size
        )
        return f

    def narrow(f):
        h = np.empty(f.size, np.uint16)
        lib.norms_float_to_half(
            ffi.from_buffer("float[]", f), ffi.from_buffer("uint16_t[]", h), f.size
        )
        return h

    return widen, narrow


def _floats_to_narrow(rng):
    """float32 values where rounding to float16 is delicate: every float16, the midpoints
    between neighbours (ties) and one float32 step either side, the subnormal range and its
    edges, the overflow threshold 65520, infinities, NaNs with payloads, random bit patterns."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.sort(halves[np.isfinite(halves)].astype(np.float64))
    mid = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32
    edges = np.array(
        [
            65504,
            65519.996,
            65520,
            65520.004,
            65536,
            1e30,
            2**-24,
            2**-25,
            2**-26,
            2**-25 * 1.5,
            2**-14,
            2**-14 * (1 - 2**-11),
            np.inf,
        ],
        np.float32,
    )
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FA00000, 0x7FFFFFFF, 0x7F802000], np.uint32)
    parts = [
        finite.astype(np.float32),
        mid,
        np.nextafter(mid, np.float32(np.inf)),
        np.nextafter(mid, np.float32(-np.inf)),
        edges,
        rng.uniform(-(2**-13), 2**-13, 100_000).astype(np.float32),
        rng.integers(0, 1 << 32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        nans.view(np.float32),
    ]
    f = np.concatenate(parts)
    return np.concatenate([f, -f])


def _assert_same_half_bits(got, want, what):
    """float16 bit patterns equal, NaNs excepted: a NaN must stay a NaN of the same sign."""
    nan = np.isnan(want.view(np.float16))
    np.testing.assert_array_equal(np.isnan(got.view(np.float16)), nan, err_msg=what)
    np.testing.assert_array_equal(got[nan] >> 15, want[nan] >> 15, err_msg=what)
    np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=what)


def test_float16_conversions_match_numpy(kernel, tmp_path):
    """Both conversion paths (F16C where this CPU has it, the bit operations) against
    NumPy's casts: all 65536 float16 values widened; delicate and random
    float32 values narrowed (ties to even, subnormals, overflow). NaNs stay NaNs of the same
    sign (NumPy keeps a signalling NaN signalling, the conversions quiet it) and are the same
    bits in every path."""
    paths = {
        "float16_portable": _build_variant(tmp_path, "float16_portable", ["-DNORMS_NO_F16C"]),
        "installed": (kernel._state["module"].ffi, kernel._state["module"].lib),
    }
    names = {k: ffi.string(lib.norms_half_conversion()).decode() for k, (ffi, lib) in paths.items()}
    assert names["float16_portable"] == "portable"
    if "f16c" in _cpu_flags() and platform.machine() == "x86_64":
        assert names["installed"] == "f16c"
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    floats = _floats_to_narrow(np.random.default_rng(7))
    with np.errstate(over="ignore", invalid="ignore"):
        want_wide = halves.view(np.float16).astype(np.float32)
        want_narrow = floats.astype(np.float16).view(np.uint16)
    results = {}
    for name, (ffi, lib) in paths.items():
        widen, narrow = _conversions(ffi, lib)
        wide, narrowed = widen(halves), narrow(floats)
        _assert_same_half_bits(narrowed, want_narrow, f"{name} float32 -> float16")
        nan = np.isnan(want_wide)
        np.testing.assert_array_equal(np.isnan(wide), nan, err_msg=name)
        np.testing.assert_array_equal(np.signbit(wide), np.signbit(want_wide), err_msg=name)
        np.testing.assert_array_equal(wide.view(np.uint32)[~nan], want_wide.view(np.uint32)[~nan])
        results[name] = (wide.view(np.uint32), narrowed)
    for name, (wide, narrowed) in results.items():  # NaNs included: the same bits everywhere
        np.testing.assert_array_equal(wide, results["float16_portable"][0], err_msg=name)
        np.testing.assert_array_equal(narrowed, results["float16_portable"][1], err_msg=name)


def test_the_loader_picks_the_widest_version_this_cpu_runs(kernel):
    """On x86-64 the installed module holds an AVX-512, an AVX2 and a baseline version of the
    kernels; the one that runs is the widest this CPU has (the others are compared bit for bit
    in test_every_vector_width_gives_the_same_bits)."""
    info = kernel.info()
    if platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
        assert info["version"] == "default"  # multi-versioning needs glibc's ifunc
        return
    flags = _cpu_flags()
    want = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "default"
    assert info["version"] == want
    assert info["vector_bytes"] == {"avx512f": 64, "avx2": 32, "default": 16}[want]
