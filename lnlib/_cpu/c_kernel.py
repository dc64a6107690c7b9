r"""The compiled C kernels, the ``"kernel"`` row of :data:`lnlib._backend.TABLE`: the row
contract of :mod:`lnlib._rows` for float16, float32 and float64.

The C source is ``lnlib/_cpu/norms.c`` (declarations in ``norms.h``). It is compiled
when the package is built (``pip install``, ``pip wheel``, the editable install of
``make env``) into the extension module ``lnlib._cpu._norms``, bound with cffi, which reads
``norms.h``: a call with a missing argument, or an array of the wrong dtype where the C
function wants ``float *``, ``double *`` or ``uint16_t *`` (float16), raises ``TypeError``.
Nothing is compiled or loaded from a cache folder at run time: only the module installed with
the package is imported.

Where the package was installed without a C compiler, or the module is not byte for byte the
one the build wrote (its sha256 is recorded beside it, in ``_norms.sha256``), lnlib runs
its NumPy path and says so once, with a :class:`RuntimeWarning`, at first use;
:func:`info` says which path runs and why.

The four ``*_rows`` functions split the rows into one chunk per thread (one C call each; cffi
releases the GIL during the call). Every sum over a row runs in a fixed order that depends on
the row length only, and the parameter gradients are summed per block of
``NORMS_BLOCK_ROWS`` rows and the blocks added pairwise, so results are bitwise the same for
any batch, thread count or alignment. :data:`PASSES` lists what each kernel does to a row.

float16 rows are, by definition, computed by the float32 kernel: each row is converted to
float32 (exactly) in a scratch row, and ``y``/``dx`` are rounded once to float16 (to nearest,
ties to even); ``mean``, ``rstd`` and the parameter gradients are float32, the float32
kernel's bits (``weight``/``bias`` come in float32, the accumulation dtype). A backward of
float16 ``x`` with a float32 or float64 ``dy`` runs the float32 kernel on ``x`` converted and
``dy`` in float32 (the float16 kernels take ``dy`` in float16, which would round it), so
``dy`` is used as the NumPy and reference paths use it.

Covered in the book, chapter "Implementation", section "A compiled kernel".
"""

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import threading
import warnings

import numpy as np

from .._rows import (
    add_norm_backward_blocks,
    add_norm_forward_blocks,
    out_array,
    run_chunks,
    written,
)

__all__ = [
    "add_layer_norm_forward_rows",
    "add_layer_norm_backward_rows",
    "add_rms_norm_forward_rows",
    "add_rms_norm_backward_rows",
    "PASSES",
    "available",
    "info",
    "layer_norm_backward_rows",
    "layer_norm_forward_rows",
    "rms_norm_backward_rows",
    "rms_norm_forward_rows",
]

#: The passes each kernel makes over one row, in order: the arrays read and written (arrays of
#: length D; ``dweight``/``dbias`` are the row block's float64 column sums, which stay in
#: cache) and what the pass computes. A pass computes its sums (one or two) in one loop over
#: each block of 256 elements; rows up to 8192 elements long are taken two at a time, the same
#: block of both rows in that loop. When a row fits in the core's cache (a few hundred KiB),
#: only the first pass reads it from memory. ``tests/test_cpu_kernels.py``
#: checks this list against the C source.
PASSES = {
    "layer_norm_forward": (
        {"reads": ("x",), "writes": (), "computes": "mean0 = sum(x) / D"},
        {
            "reads": ("x",),
            "writes": (),
            "computes": "delta = sum(x - mean0) / D, mean = mean0 + delta, "
            "rstd = 1 / sqrt(sum((x - mean0)^2) / D - delta^2 + eps)",
        },
        {
            "reads": ("x", "weight", "bias"),
            "writes": ("y",),
            "computes": "y = (x - mean) rstd weight + bias",
        },
    ),
    "layer_norm_backward": (
        {
            "reads": ("dy", "weight", "x"),
            "writes": (),
            "computes": "mean(g), mean(g xhat) with g = dy weight",
        },
        {
            "reads": ("x", "dy", "weight"),
            "writes": ("dx", "dweight", "dbias"),
            "computes": "dx = rstd (g - mean(g) - xhat mean(g xhat)); dweight += dy xhat; "
            "dbias += dy",
        },
    ),
    "rms_norm_forward": (
        {"reads": ("x",), "writes": (), "computes": "rstd = 1 / sqrt(sum(x^2) / D + eps)"},
        {"reads": ("x", "weight"), "writes": ("y",), "computes": "y = x rstd weight"},
    ),
    "rms_norm_backward": (
        {"reads": ("dy", "weight", "x"), "writes": (), "computes": "mean(g xhat), g = dy weight"},
        {
            "reads": ("x", "dy", "weight"),
            "writes": ("dx", "dweight"),
            "computes": "dx = rstd (g - xhat mean(g xhat)); dweight += dy xhat",
        },
    ),
}

_CTYPES = {
    np.dtype(np.float16): ("uint16_t", "f16"),  # the C side sees float16's bits
    np.dtype(np.float32): ("float", "f32"),
    np.dtype(np.float64): ("double", "f64"),
}
_F16 = np.dtype(np.float16)
_CDECL = {dtype: f"{ctype}[]" for dtype, (ctype, _) in _CTYPES.items()}
#: The dtype of mean, rstd, weight, bias and the parameter gradients, by the dtype of x.
_ACC = {dtype: np.dtype(np.float64 if dtype == np.float64 else np.float32) for dtype in _CTYPES}
_FILLED = {}  # read-only ones and zeros for absent parameters, by (D, dtype, value)
_C_FUNCTIONS = {}  # the loaded module's exports, by (direction, suffix)
#: The exported kernels (norms.h): one forward and one backward per dtype mix.
_FUNCTIONS = [
    f"norms_{direction}_{suffix}"
    for direction in ("forward", "backward")
    for suffix in ("f16", "f32", "f64", "f16f32")
]
_DIGEST_FILE = "_norms.sha256"  # beside the module: its sha256, written by the build
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_lock = threading.Lock()
_state = {"module": None, "loaded": False, "reason": "not loaded yet", "path": None}
#: Values of ``LNLIB_CPU_KERNEL`` that switch the compiled kernel off, and those that keep it.
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def _load():
    """Import the extension module built with the package; ``(module, reason)``."""
    name = f"{__package__}._norms"
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None, (
            "extension module lnlib._cpu._norms was not built (lnlib was installed "
            "without a C compiler?)"
        )
    problem = _digest_problem(spec.origin)
    if problem:
        return None, f"extension module {spec.origin} {problem}"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, f"extension module {spec.origin} cannot be imported ({exc})"
    missing = [
        f
        for f in _FUNCTIONS
        + [
            "sum_blocks_pairwise",
            "norms_kernel_version",
            "norms_set_streaming",
            "norms_half_conversion",
        ]
        if not hasattr(getattr(module, "lib", None), f)
    ]
    if missing:
        return None, (
            f"extension module {spec.origin} lacks {', '.join(missing)} "
            "(built from another version of lnlib?)"
        )
    return module, f"compiled kernel {spec.origin}"


def _digest_problem(path):
    """Why the module at ``path`` must not be loaded, or None when its sha256 is the one
    recorded beside it when it was built (``lnlib/_cpu/build.py``).

    A damaged library is not refused by the loader: it can kill the process inside
    ``dlopen`` (zeroed program headers: SIGSEGV) or at its first use (truncated: SIGBUS),
    before any check of what was loaded could run. So nothing is loaded that is not, byte for
    byte, what the build wrote.
    """
    record = os.path.join(os.path.dirname(path), _DIGEST_FILE)
    try:
        with open(record, encoding="ascii") as f:
            recorded = f.read().split()
    except (OSError, UnicodeDecodeError):
        return f"has no digest recorded beside it ({_DIGEST_FILE}, written when lnlib is built)"
    with open(path, "rb") as f:
        actual = hashlib.sha256(f.read()).hexdigest()
    if recorded != [actual, os.path.basename(path)]:
        return (
            f"does not match the digest recorded when it was built ({_DIGEST_FILE}): "
            "damaged or replaced"
        )
    return None


def _module():
    """The extension module, imported once; warns once when it cannot be used."""
    if not _state["loaded"]:
        with _lock:
            if not _state["loaded"]:
                module, reason = _load()
                _state.update(
                    module=module,
                    reason=reason,
                    loaded=True,
                    path=None if module is None else module.__file__,
                )
                if module is None:
                    warnings.warn(
                        f"lnlib: the compiled CPU kernel is not available: {reason}; "
                        "using the NumPy path (reinstall lnlib where a C compiler "
                        "exists to get it)",
                        RuntimeWarning,
                        stacklevel=_caller_level(),
                    )
    return _state["module"]


def _caller_level():
    """The ``stacklevel`` of the first frame outside lnlib: a warning points at the user's call."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


#: The vector registers of each version of the kernels (norms_kernel_version), in bytes.
_VECTOR_BYTES = {"avx512f": 64, "avx2": 32, "default": 16}


def info():
    """Whether the compiled kernel runs here, and why.

    Returns
    -------
    dict
        ``{"kernel": bool, "reason": str, "path": str or None, "version": str or None,
        "vector_bytes": int or None, "float16": str or None, "flags": list of str,
        "source": str}``: ``path`` is the loaded extension module, ``version`` the version
        the loader picked for this CPU (``"avx512f"``, ``"avx2"`` or ``"default"``; every
        version gives the same bits), ``vector_bytes`` the width of that version's vector
        registers, into which the compiler vectorised the loops (64, 32 or 16 bytes),
        ``float16`` how the float16 kernels convert (``"f16c"``: the x86-64 instructions;
        ``"portable"``: bit operations; the same bits),
        ``flags`` the compiler flags it was built with, ``source`` the C file, relative to
        the package.
    """
    module = _module()
    lib = None if module is None else module.lib
    version = None if lib is None else module.ffi.string(lib.norms_kernel_version()).decode()
    half = None if lib is None else module.ffi.string(lib.norms_half_conversion()).decode()
    return {
        "kernel": module is not None,
        "reason": _state["reason"],
        "path": _state["path"],
        "version": version,
        "vector_bytes": _VECTOR_BYTES.get(version),
        "float16": half,
        "flags": ["-O3", "-ffp-contract=off", "-fno-math-errno"],
        "source": "_cpu/norms.c",
    }


def available():
    """Whether the compiled kernel runs here: the selection point asks on every call.

    Returns
    -------
    usable : bool
        True when ``LNLIB_CPU_KERNEL`` does not switch it off (0, false, no, off) and the
        extension module built with the package loads (the first call loads it).
    reason : str
        The loaded module's path, or why the kernel does not run. The first call that finds
        the module unusable also warns (:class:`RuntimeWarning`), once per process.

    Raises
    ------
    ValueError
        ``LNLIB_CPU_KERNEL`` is neither on (1, true, yes, on, or empty) nor off.
    """
    raw = os.environ.get("LNLIB_CPU_KERNEL", "")
    if raw not in _ON:  # the common case, "" (not set), without the string operations
        value = raw.strip().lower()
        if value in _OFF:
            return False, f"disabled by LNLIB_CPU_KERNEL={raw}"
        if value not in _ON:
            raise ValueError(
                f"LNLIB_CPU_KERNEL must be one of {', '.join(_ON[1:])} (use the kernel) or "
                f"{', '.join(_OFF)} (do not), got {raw!r}"
            )
    return _module() is not None, _state["reason"]


@contextlib.contextmanager
def ordinary_stores():
    """Inside the block, large outputs are written with ordinary stores instead of streamed.

    For the benchmark, which times both ways (the values are the same). Process-wide: not for
    use while other threads call the kernels.
    """
    lib = _module().lib
    before = lib.norms_set_streaming(0)
    try:
        yield
    finally:
        lib.norms_set_streaming(before)


def _c_function(direction, suffix):
    """``norms_forward_<suffix>`` or ``norms_backward_<suffix>`` of the loaded module (looked
    up once: a name built and found on every call costs a small call a microsecond)."""
    fn = _C_FUNCTIONS.get((direction, suffix))
    if fn is None:
        module = _module()
        if module is None:
            raise RuntimeError(
                f"lnlib: the compiled CPU kernel is not available: {_state['reason']}"
            )
        fn = _C_FUNCTIONS[direction, suffix] = getattr(module.lib, f"norms_{direction}_{suffix}")
    return fn


def _at(p, offset):
    """``p + offset``; ``p`` itself at offset 0 (the first chunk, and every call of one chunk,
    so that a small call makes no new pointer) and for NULL (an absent residual, dh, mean or
    bias)."""
    return p + offset if offset and p != _state["module"].ffi.NULL else p


def _pointer(a, writable=False):
    """A typed C pointer to the first element of ``a``: ``float *``, ``double *`` or, for
    float16, ``uint16_t *``.

    ``a`` is 1-d contiguous or 2-d with contiguous rows (row stride >= row length); the pointer
    type comes from ``a``'s dtype, so cffi rejects an array of the wrong dtype.
    """
    ffi = _state["module"].ffi
    try:  # require_writable given by position: as a keyword it costs 0.1 us more
        return ffi.from_buffer(_CDECL[a.dtype], a, writable)
    except ValueError:  # rows with a gap between them: the span from first to last element
        span = (a.shape[0] - 1) * _ld(a) + a.shape[1]
        a = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))
        return ffi.from_buffer(_CDECL[a.dtype], a, writable)


def _ld(a):
    """Row stride of a 2-d array, in elements."""
    return a.strides[0] // a.itemsize


def _rows(a, dtype):
    """``a`` (M, D) as rows the kernel can read: contiguous rows, forwards, of ``dtype``."""
    m, n = a.shape
    rows_ok = a.dtype == dtype and (n == 1 or a.strides[1] == a.itemsize)
    if rows_ok and (m == 1 or (a.strides[0] >= n * a.itemsize and a.strides[0] % a.itemsize == 0)):
        return a
    return np.ascontiguousarray(a, dtype=dtype)


def _vector(param, n, dtype, fill):
    """A parameter as a contiguous (D,) vector of ``dtype``; ``fill`` everywhere when None."""
    if param is not None:
        return np.ascontiguousarray(param, dtype=dtype)
    key = (n, dtype, fill)
    if key not in _FILLED:
        if len(_FILLED) > 32:
            _FILLED.clear()
        _FILLED[key] = np.full(n, fill, dtype=dtype)
        _FILLED[key].flags.writeable = False
    return _FILLED[key]


def _column_blocks(m, n, k=1):
    """Zeroed float64 column sums of ``k`` gradients (k, blocks, D): one row per block of
    ``NORMS_BLOCK_ROWS`` rows, in one allocation."""
    blocks = -(-m // _state["module"].lib.NORMS_BLOCK_ROWS)
    return np.zeros((k, blocks, n), dtype=np.float64)


def _column_totals(blocks, p_blocks, dtype):
    """Each gradient's block column sums added pairwise in a fixed order: (k, D) of ``dtype``.

    ``p_blocks`` is the writable pointer to ``blocks`` (k, nblocks, D); one block needs no sum.
    """
    k, nblocks, n = blocks.shape
    if nblocks == 0:
        return np.zeros((k, n), dtype=dtype)
    if nblocks > 1:
        for i in range(k):
            _state["module"].lib.sum_blocks_pairwise(p_blocks + i * nblocks * n, nblocks, n)
    return blocks[:, 0].astype(dtype)


def _block_of(start):
    """The row block where a chunk starts; chunks must start on a block boundary."""
    rows = _state["module"].lib.NORMS_BLOCK_ROWS
    if start % rows:
        raise RuntimeError(f"chunk starts at row {start}, not a multiple of {rows}")
    return start // rows


#: A call that reads fewer bytes (of x, and of dy for a backward) runs in the calling thread:
#: below this, handing half the rows to another thread cost more than it saved (measured by
#: ``python -m lnlib.bench --threads``; chapter 5 gives the figures).
PARALLEL_MIN_BYTES = 8 << 20


def _threads(threads, nbytes):
    """The threads for a call reading ``nbytes``: as asked, or one for a small call."""
    if threads is None and nbytes < PARALLEL_MIN_BYTES:
        return 1
    return threads


def _ok(status):
    """Check a kernel's return: 1 when the scratch rows a float16 call needs could not be
    allocated (a call that only streams its output runs without them)."""
    if status:
        raise MemoryError("lnlib: the float16 kernel could not allocate its scratch rows")


def _wider_dy(x, dy):
    """float16 ``x`` with a float32 or float64 ``dy``: the float16 kernels take dy in float16,
    and rounding it there would turn values beyond 65504 into inf and drop the low bits of
    the others, while the other paths use dy in float32."""
    return x.dtype == _F16 and dy.dtype != _F16


def _as_f32(x):
    """float16 rows converted (exactly) to float32: the rows the float16 kernels compute."""
    return x.astype(np.float32)


def _half_dx(dx, out):
    """``dx`` of the float32 kernel rounded once to float16 (to nearest, ties to even, as the
    float16 kernels round), into the ``out`` array when one was given; no warning where a
    value overflows to inf (the kernels do not warn either)."""
    half = out_array(out, 0, dx.shape, _F16)
    with np.errstate(over="ignore"):
        np.copyto(half, dx, casting="same_kind")
    return half


def layer_norm_forward_rows(x, weight, bias, eps, *, threads=None, out=None):
    """LayerNorm forward of rows with the compiled kernel.

    Parameters
    ----------
    x : ndarray (M, D), float16, float32 or float64
        Rows; contiguous rows are read in place, other layouts are copied.
    weight, bias : ndarray (D,), or None
        Converted to the accumulation dtype (float32 for float16 ``x``, else the dtype of
        ``x``); None means ones and zeros.
    eps : float
        Added to the variance.
    threads : int, optional
        Chunks of rows run in this many threads (default: :func:`lnlib.get_num_threads`); the
        results do not depend on it.
    out : tuple of 3 (ndarray or None), optional
        Arrays to write ``y``, ``mean`` and ``rstd`` into, as the row contract of
        :mod:`lnlib._rows` says (C-contiguous, of the result's shape and dtype, overlapping
        no input); None entries are allocated.

    Returns
    -------
    y : ndarray (M, D), dtype of ``x``
    mean, rstd : ndarray (M,), the accumulation dtype
    """
    suffix = _CTYPES[x.dtype][1]
    return _forward(False, suffix, x, None, (weight, bias), eps, x.dtype, out, threads)


def layer_norm_backward_rows(dy, x, mean, rstd, weight, *, threads=None, out=None):
    """LayerNorm backward of rows with the compiled kernel.

    Parameters
    ----------
    dy, x : ndarray (M, D), float16, float32 or float64
        Gradient of the output and the forward input; ``dy`` is converted to the dtype of
        ``x``, or to float32 for float16 ``x`` with a wider ``dy``.
    mean, rstd : ndarray (M,)
        From the forward; converted to the accumulation dtype (float32 for float16 ``x``,
        else the dtype of ``x``).
    weight : ndarray (D,) or None
        Converted to the accumulation dtype; None means ones.
    threads : int, optional
        As in :func:`layer_norm_forward_rows`; the results do not depend on it.
    out : tuple of 3 (ndarray or None), optional
        Arrays to write ``dx``, ``dweight`` and ``dbias`` into, as in
        :func:`layer_norm_forward_rows`.

    Returns
    -------
    dx : ndarray (M, D), dtype of ``x``
    dweight, dbias : ndarray (D,), the accumulation dtype
        Column sums accumulated in float64 per block of rows, the blocks added pairwise.
    """
    if _wider_dy(x, dy):
        dx, dweight, dbias = layer_norm_backward_rows(
            dy, _as_f32(x), mean, rstd, weight, threads=threads
        )
        return written(out, (_half_dx(dx, out), dweight, dbias))
    suffix = _CTYPES[x.dtype][1]
    return _backward(False, suffix, _rows(dy, x.dtype), None, x, (mean, rstd), weight, out, threads)


def rms_norm_forward_rows(x, weight, eps, *, threads=None, out=None):
    """RMSNorm forward of rows with the compiled kernel.

    Parameters
    ----------
    x : ndarray (M, D), float16, float32 or float64
    weight : ndarray (D,) or None
        Converted to the accumulation dtype (float32 for float16 ``x``, else the dtype of
        ``x``); None means ones.
    eps : float
        Added to the mean square.
    threads : int, optional
        As in :func:`layer_norm_forward_rows`; the results do not depend on it.
    out : tuple of 2 (ndarray or None), optional
        Arrays to write ``y`` and ``rstd`` into, as in :func:`layer_norm_forward_rows`.

    Returns
    -------
    y : ndarray (M, D), dtype of ``x``
    rstd : ndarray (M,), the accumulation dtype
    """
    suffix = _CTYPES[x.dtype][1]
    return _forward(True, suffix, x, None, (weight,), eps, x.dtype, out, threads)


def rms_norm_backward_rows(dy, x, rstd, weight, *, threads=None, out=None):
    """RMSNorm backward of rows with the compiled kernel.

    Parameters
    ----------
    dy, x : ndarray (M, D), float16, float32 or float64
        As in :func:`layer_norm_backward_rows`.
    rstd : ndarray (M,)
        From the forward; converted to the accumulation dtype (float32 for float16 ``x``,
        else the dtype of ``x``).
    weight : ndarray (D,) or None
        Converted to the accumulation dtype; None means ones.
    threads : int, optional
        As in :func:`layer_norm_forward_rows`; the results do not depend on it.
    out : tuple of 2 (ndarray or None), optional
        Arrays to write ``dx`` and ``dweight`` into, as in :func:`layer_norm_forward_rows`.

    Returns
    -------
    dx : ndarray (M, D), dtype of ``x``
    dweight : ndarray (D,), the accumulation dtype
    """
    if _wider_dy(x, dy):
        dx, dweight = rms_norm_backward_rows(dy, _as_f32(x), rstd, weight, threads=threads)
        return written(out, (_half_dx(dx, out), dweight))
    suffix = _CTYPES[x.dtype][1]
    return _backward(True, suffix, _rows(dy, x.dtype), None, x, (rstd,), weight, out, threads)


# The fused residual add (the row contract in lnlib._rows): one C pass per chunk of rows (norms.h,
# add_*): two rows at a time, the add into h, then the norm's row code on those rows of h while
# they are in cache; the backward the norm's dx of two rows, then dh added.

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
#: The dtype mixes the C pass takes, (x, residual, h) -> the suffix of its functions: one dtype
#: throughout, or float16 x with the stream (residual, h) in float32 (``residual_in_fp32``).
#: Other mixes (float32 x on a float16 or float64 stream, float16 residual widened to float32,
#: ...) are rare and each would need an add loop of its own: they run this module's kernels on
#: blocks from Python (lnlib._rows.add_norm_forward_blocks), which gives the same bits.
_FUSED_FORWARD = {
    (_F32, _F32, _F32): "f32",
    (_F64, _F64, _F64): "f64",
    (_F16, _F16, _F16): "f16",
    (_F16, _F32, _F32): "f16f32",
}
#: The backward's mixes, (dy, h) -> suffix; dh is None or of h's dtype (else the blocks from
#: Python, as above): dy of x's dtype, float16 on a float32 stream.
_FUSED_BACKWARD = {
    (_F32, _F32): "f32",
    (_F64, _F64): "f64",
    (_F16, _F16): "f16",
    (_F16, _F32): "f16f32",
}


def _forward(rms, suffix, x, residual, params, eps, h_dtype, out, threads=None):
    """One C forward over chunks of rows: ``y, mean, rstd`` (``y, rstd`` for rms), or with a
    residual (the fused add) ``y, h, mean, rstd``; ``suffix`` names the C function's dtypes,
    and ``h_dtype`` (a ``np.dtype``, as ``_ACC`` is keyed) is that of h, or of x without one."""
    m, n = x.shape
    fn = _c_function("forward", suffix)
    null = _state["module"].ffi.NULL
    acc = _ACC[h_dtype]
    x = _rows(x, x.dtype)
    y = out_array(out, 0, (m, n), x.dtype)  # (M, D)
    fused = residual is not None
    h = out_array(out, 1, (m, n), h_dtype) if fused else None  # (M, D)
    # mean and rstd in buffers of their own: a caller that keeps only rstd (the backward from
    # the output) must not keep mean alive with it
    rstd = out_array(out, fused + 1 + (not rms), m, acc)  # (M,)
    stats = (rstd,) if rms else (out_array(out, fused + 1, m, acc), rstd)  # (M,) each
    weight = _vector(params[0], n, acc, 1)
    bias = None if rms else _vector(params[1], n, acc, 0)
    p_w, p_b = _pointer(weight), null if rms else _pointer(bias)
    p_x, p_y, p_rstd = _pointer(x), _pointer(y, True), _pointer(rstd, True)
    p_mean = null if rms else _pointer(stats[0], True)
    p_r, ld_r, p_h, nbytes = null, 0, null, x.nbytes
    if fused:
        residual = _rows(residual, residual.dtype)
        p_r, ld_r, p_h = _pointer(residual), _ld(residual), _pointer(h, True)
        nbytes += residual.nbytes
    ld_x = _ld(x)

    def chunk(start, stop, _block_rows):
        px, pr, py, ph, pm, ps = p_x, p_r, p_y, p_h, p_mean, p_rstd
        if start:  # pointers to the chunk's first row (a call of one chunk makes none)
            px, pr, py, ph = (
                _at(px, start * ld_x),
                _at(pr, start * ld_r),
                _at(py, start * n),
                _at(ph, start * n),
            )
            pm, ps = _at(pm, start), _at(ps, start)
        _ok(fn(rms, px, ld_x, pr, ld_r, p_w, p_b, py, ph, pm, ps, stop - start, n, eps))

    rows = _state["module"].lib.NORMS_BLOCK_ROWS if fused else 1
    run_chunks(m, n, chunk, block_rows=rows, threads=_threads(threads, nbytes))
    return (y, h, *stats) if fused else (y, *stats)


def _backward(rms, suffix, dy, dh, x, stats, weight, out, threads=None):
    """One C backward over chunks of rows: ``dx, dweight, dbias`` (``dx, dweight`` for rms); with
    ``dh`` (the fused add) dx + dh in place of dx. ``x`` is h for the fused add."""
    m, n = x.shape
    fn = _c_function("backward", suffix)
    null = _state["module"].ffi.NULL
    acc = _ACC[x.dtype]
    dy, x = _rows(dy, dy.dtype), _rows(x, x.dtype)
    dh = None if dh is None else _rows(dh, x.dtype)
    weight = _vector(weight, n, acc, 1)
    dx = out_array(out, 0, (m, n), x.dtype)  # (M, D)
    blocks = _column_blocks(m, n, 1 if rms else 2)  # (k, blocks, D) float64: dweight's, dbias's
    p_dy, p_x, p_w = _pointer(dy), _pointer(x), _pointer(weight)
    p_rstd = _pointer(np.ascontiguousarray(stats[-1], dtype=acc))  # (M,)
    p_mean = null if rms else _pointer(np.ascontiguousarray(stats[0], dtype=acc))  # (M,)
    p_dh, ld_dh = (null, 0) if dh is None else (_pointer(dh), _ld(dh))
    p_dx, p_dw = _pointer(dx, True), _pointer(blocks, True)
    p_db = null if rms else p_dw + blocks.shape[1] * n
    ld_dy, ld_x = _ld(dy), _ld(x)

    def chunk(start, stop, _block_rows):
        pdy, pdh, px, pm, ps, pdx, pdw, pdb = p_dy, p_dh, p_x, p_mean, p_rstd, p_dx, p_dw, p_db
        if start:  # pointers to the chunk's first row and its row block's column sums
            pdy, pdh, px = _at(pdy, start * ld_dy), _at(pdh, start * ld_dh), _at(px, start * ld_x)
            pm, ps, pdx = _at(pm, start), _at(ps, start), _at(pdx, start * n)
            b = _block_of(start)
            pdw, pdb = _at(pdw, b * n), _at(pdb, b * n)
        _ok(fn(rms, pdy, ld_dy, pdh, ld_dh, px, ld_x, pm, ps, p_w, pdx, pdw, pdb, stop - start, n))

    rows = _state["module"].lib.NORMS_BLOCK_ROWS
    nbytes = dy.nbytes + x.nbytes + (0 if dh is None else dh.nbytes)
    run_chunks(m, n, chunk, block_rows=rows, threads=_threads(threads, nbytes))
    return written(out, (dx, *_column_totals(blocks, p_dw, acc)))


def _fused_forward(rms, x, residual, params, eps, h_dtype, out):
    """The C pass of the fused forward: ``y, h, mean, rstd`` (``y, h, rstd`` for rms)."""
    h_dtype = np.dtype(h_dtype)
    suffix = _FUSED_FORWARD.get((x.dtype, residual.dtype, h_dtype))
    if suffix is None:  # a rare mix: blocks from Python (see _FUSED_FORWARD)
        norm = rms_norm_forward_rows if rms else layer_norm_forward_rows
        nstats = 1 if rms else 2
        return add_norm_forward_blocks(norm, x, residual, params, eps, h_dtype, nstats, out)
    return _forward(rms, suffix, x, residual, params, eps, h_dtype, out)


def _fused_backward(rms, dy, dh, h, stats, weight, out):
    """The C pass of the fused backward: ``dsum, dweight, dbias`` (``dsum, dweight`` for rms)."""
    suffix = _FUSED_BACKWARD.get((dy.dtype, h.dtype))
    if suffix is None or (dh is not None and dh.dtype != h.dtype):  # see _FUSED_BACKWARD
        norm = rms_norm_backward_rows if rms else layer_norm_backward_rows
        nparams = 1 if rms else 2
        return add_norm_backward_blocks(norm, dy, dh, h, stats, weight, nparams, out)
    return _backward(rms, suffix, dy, dh, h, stats, weight, out)


def add_layer_norm_forward_rows(x, residual, weight, bias, eps, h_dtype, *, out=None):
    """``y, h, mean, rstd``: h = residual + x, then :func:`layer_norm_forward_rows` of h, in
    one pass (the dtype mixes of ``_FUSED_FORWARD``; others by blocks from Python)."""
    return _fused_forward(False, x, residual, (weight, bias), eps, h_dtype, out)


def add_layer_norm_backward_rows(dy, dh, h, mean, rstd, weight, *, out=None):
    """``dsum, dweight, dbias``: :func:`layer_norm_backward_rows` of h, plus dh, in one pass."""
    return _fused_backward(False, dy, dh, h, (mean, rstd), weight, out)


def add_rms_norm_forward_rows(x, residual, weight, eps, h_dtype, *, out=None):
    """``y, h, rstd``: h = residual + x, then :func:`rms_norm_forward_rows` of h, in one pass."""
    return _fused_forward(True, x, residual, (weight,), eps, h_dtype, out)


def add_rms_norm_backward_rows(dy, dh, h, rstd, weight, *, out=None):
    """``dsum, dweight``: :func:`rms_norm_backward_rows` of h, plus dh, in one pass."""
    return _fused_backward(True, dy, dh, h, (rstd,), weight, out)
