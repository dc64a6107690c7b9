"""The compiled CPU kernel: built where a compiler exists, accurate on long rows and long
columns, bitwise invariant to batch, threads and alignment, bound with checked types, and
described pass by pass by ``lnlib._cpu.kernels.PASSES``."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import lnlib
from lnlib._cpu import kernels

KERNEL_DIR = Path(lnlib.__file__).parent / "kernels"


@pytest.fixture
def kernel():
    """The kernel's row functions; skipped with the reason where the module was not built."""
    usable, reason = kernels.available()
    if not usable:
        pytest.skip(f"compiled kernel not available: {reason}")
    return kernels


def test_kernel_is_built_where_a_compiler_exists():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the NumPy fast path is used")
    info = kernels.info()
    assert info["kernel"], info["reason"]
    assert Path(info["path"]).parent == Path(kernels.__file__).parent  # inside the package


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


def test_binding_rejects_wrong_dtypes_and_argument_counts(kernel):
    x = np.ones((2, 4), dtype=np.float32)
    y, mean, rstd = np.empty_like(x), np.empty(2, np.float32), np.empty(2, np.float32)
    ffi, lib = kernels._state["module"].ffi, kernels._state["module"].lib

    def p(a):
        return ffi.from_buffer(("float" if a.dtype == np.float32 else "double") + "[]", a)

    ones, zeros = p(np.ones(4, np.float32)), p(np.zeros(4, np.float32))
    lib.layer_norm_forward_f32(p(x), 4, ones, zeros, p(y), p(mean), p(rstd), 2, 4, 1e-5)
    np.testing.assert_allclose(y, 0)
    with pytest.raises(TypeError):  # a float64 array where float * is declared
        lib.layer_norm_forward_f32(
            p(x), 4, ones, zeros, p(y), p(mean.astype(np.float64)), p(rstd), 2, 4, 1e-5
        )
    with pytest.raises(TypeError):  # eps forgotten
        lib.layer_norm_forward_f32(p(x), 4, ones, zeros, p(y), p(mean), p(rstd), 2, 4)
    with pytest.raises(TypeError):  # a length where a pointer is declared
        lib.layer_norm_forward_f32(p(x), 4, 4, zeros, p(y), p(mean), p(rstd), 2, 4, 1e-5)


def test_read_only_input_is_accepted_and_never_written(kernel, rng):
    x = rng.standard_normal((4, 9)).astype(np.float32)
    x.flags.writeable = False
    y, _, _ = kernel.layer_norm_forward_rows(x, None, None, 1e-5)
    assert y.flags.writeable and not x.flags.writeable


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


def _row_function_body(op):
    """The body of ``FN(<op>_row)``, with the helpers it calls (other than the row sums
    ``row_*``) spelled out in place, so that every pass over the row shows."""
    source = (KERNEL_DIR / "norms_cpu_typed.h").read_text()
    body = _function_body(source, op + "_row")
    assert body, f"no row function for {op} in norms_cpu_typed.h"
    helper = re.compile(r"FN\((?!row_)(\w+)\)\([^;]*;")
    return helper.sub(lambda m: _function_body(source, m.group(1)) or m.group(0), body)


@pytest.mark.parametrize("op", sorted(kernels.PASSES))
def test_passes_match_the_c_source(op):
    passes = [m.group("call") or m.group("loop") for m in _PASS.finditer(_row_function_body(op))]
    described = kernels.PASSES[op]
    assert len(passes) == len(described), f"{op}: C makes {len(passes)} passes over a row"
    for text, want in zip(passes, described):
        used = {a for a in _ARRAYS if re.search(rf"\b{a}\b", text)}
        written = {a for a in _ARRAYS if re.search(rf"\b{a}\[i\] \+?=", text)}
        assert written == set(want["writes"]), (op, text)
        assert used == set(want["reads"]) | written, (op, text)


def test_passes_cover_every_kernel_in_the_header():
    header = (KERNEL_DIR / "norms.h").read_text()
    declared = set(re.findall(r"void (\w+)_f32\(", header))
    assert declared == set(kernels.PASSES)


# --- Every vector width gives the same bits -------------------------------------------------

_WIDTHS = {"baseline": [], "avx2": ["-mavx2"], "avx512f": ["-mavx512f"]}
#: The baseline built without the compiler's vector extension (the plain loops other compilers
#: get): must give the same bits as the vector code.
_PLAIN = {"plain_loops": ["-DNORMS_NO_VECTORS"], "no_stream": ["-DNORMS_NO_STREAM"]}


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

    spec = importlib.util.spec_from_file_location("build_norms", KERNEL_DIR / "build_norms.py")
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
            str(KERNEL_DIR / "norms_cpu.c"),
            "-lm",
        ],
        check=True,
    )
    ffi = cffi.FFI()
    ffi.cdef(builder.declarations())
    return ffi, ffi.dlopen(str(out))


def _run_variant(ffi, lib, x, w, b, dy):
    """Every kernel of ``lib`` on the same inputs; returns all outputs."""
    ctype, suffix = ("float", "f32") if x.dtype == np.float32 else ("double", "f64")
    m, n = x.shape
    blocks = -(-m // lib.NORMS_BLOCK_ROWS)
    out = {
        k: np.zeros(s, x.dtype)
        for k, s in (
            ("y", (m, n)),
            ("mean", m),
            ("rstd", m),
            ("dx", (m, n)),
            ("ry", (m, n)),
            ("rrstd", m),
            ("rdx", (m, n)),
        )
    }
    out.update({k: np.zeros((blocks, n)) for k in ("dw", "db", "rdw")})
    p = {
        k: ffi.from_buffer(("double" if k in ("dw", "db", "rdw") else ctype) + "[]", v)
        for k, v in out.items()
    }
    px, pw, pb, pdy = (ffi.from_buffer(ctype + "[]", a) for a in (x, w, b, dy))
    getattr(lib, f"layer_norm_forward_{suffix}")(
        px, n, pw, pb, p["y"], p["mean"], p["rstd"], m, n, 1e-5
    )
    getattr(lib, f"layer_norm_backward_{suffix}")(
        pdy, n, px, n, p["mean"], p["rstd"], pw, p["dx"], p["dw"], p["db"], m, n
    )
    getattr(lib, f"rms_norm_forward_{suffix}")(px, n, pw, p["ry"], p["rrstd"], m, n, 1e-5)
    getattr(lib, f"rms_norm_backward_{suffix}")(
        pdy, n, px, n, p["rrstd"], pw, p["rdx"], p["rdw"], m, n
    )
    return out


def test_every_vector_width_gives_the_same_bits(kernel, tmp_path):
    """The baseline build, the AVX2 and AVX-512 builds (where this CPU runs them), the
    baseline without vector extensions and the installed multi-version module agree bit for
    bit."""
    flags = _cpu_flags()
    widths = {k: v for k, v in _WIDTHS.items() if k == "baseline" or k in flags}
    if len(widths) < 2:
        pytest.skip(f"this CPU runs only the baseline build (flags: {sorted(flags)[:5]}...)")
    widths.update(_PLAIN)
    variants = {k: _build_variant(tmp_path, k, v) for k, v in widths.items()}
    variants["installed"] = (kernel._state["module"].ffi, kernel._state["module"].lib)
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
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
