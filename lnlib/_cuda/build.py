"""The CUDA kernels of ``lnlib/_cuda/norms.cu``, compiled by CuPy at first use.

The source is the header ``norms.cuh`` followed by ``norms.cu`` (pasted together here,
so that CuPy's compile cache, keyed by the source text and the options, sees an edit of either
file). Each (operation, dtype) pair (a tuple of dtypes for the fused residual add,
:data:`FUSED`) is one ``cupy.RawModule`` with NVRTC name expressions for
every launch shape it may need, compiled once per process on first use and cached on disk by
CuPy. ``import lnlib`` and this module import no CuPy; only :func:`module` does.

The launch shape (threads per row ``R`` and 16-byte vectors per thread ``MAXV``) is chosen from
the row length and the dtype alone (:func:`launch_shape`), never from the number of rows, so a
row's reduction order, and therefore its result, does not depend on the batch.

Derived in the book, chapter "Implementation", section "GPU kernels".
"""

import threading
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent
HEADER = KERNEL_DIR / "norms.cuh"
SOURCE = KERNEL_DIR / "norms.cu"

#: Options lnlib adds to CuPy's own (which add ``-ftz=true``, ``-arch=sm_XX`` and include
#: paths): C++17, and no contraction of a multiply and an add into one rounding, so each
#: operation rounds as written (as ``-ffp-contract=off`` does for the CPU kernel).
OPTIONS = ("--std=c++17", "--fmad=false")

#: CUDA C++ name of the element type of each dtype the kernels are built for.
TYPE_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}

OPS = ("layer_norm_fwd", "layer_norm_bwd", "rms_norm_fwd", "rms_norm_bwd")
#: LayerNorm with per-row weight and bias (AdaLN's modulation, GroupNorm's per-channel affine):
#: parameters (mods, d), row i taking row (i // group) % mods; one dtype, as OPS.
MOD_OPS = ("modulated_layer_norm_fwd", "modulated_layer_norm_bwd")
#: The fused residual add (lnlib.add_norm): a kernel per dtype combination, named by a tuple of
#: dtypes, ``(x, residual, h)`` for a forward and ``(dy, h)`` for a backward.
ADD_OPS = ("add_layer_norm_fwd", "add_layer_norm_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd")
#: The combinations compiled: one dtype throughout, and the float32 stream under a float16
#: sublayer (residual_in_fp32). Others are computed as the add, then the norm of h
#: (lnlib._cuda.cuda_kernel). No float16/float32 with float64: the accumulation type is h's,
#: and the contract's add in the widest dtype would then need float64 with float32 h.
FUSED = {
    "fwd": (
        ("float32", "float32", "float32"),
        ("float64", "float64", "float64"),
        ("float16", "float16", "float16"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("float16", "float32", "float32"),
        ("float16", "float16", "float32"),
    ),
    "bwd": (
        ("float32", "float32"),
        ("float64", "float64"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float16", "float32"),
    ),
}

#: Threads per block are max(R, 128) (kernels' LNLIB_BLOCK).
MIN_BLOCK = 128
#: Grid size caps, in threads: enough blocks to fill any current GPU several times over. A
#: constant, not the device's SM count, so parameter gradients group rows the same way on every
#: GPU (they depend on the number of row groups; the row outputs never do). Read at every launch
#: (:func:`grid`): tests lower it so that a few units take many rows (tests/test_gpu_rows.py).
GRID_THREADS = {"fwd": 1 << 19, "bwd": 1 << 18}
#: Elements of a partial parameter-gradient buffer (units, d) at most, for long rows.
LONG_ROW_PARTIAL = 1 << 24
#: The long-row backward (rows longer than one tile of the largest backward shape, the
#: ``*_bwd_long`` kernels, launched twice): blocks of LONG_R threads, two resident on each SM
#: (``__launch_bounds__(R, 2)`` in norms.cu: at most 128 registers a thread); first a block
#: per row for the rows' sums, then LONG_BLOCKS_PER_SM units per SM of the device, each taking
#: its rows tile by tile of columns. The number of units, and with it the grouping of rows in
#: the parameter gradients (not the row outputs), therefore depends on the GPU's SM count, as
#: it depends on the number of rows.
LONG_R = 256
LONG_BLOCKS_PER_SM = 2
#: The long-row forward (rows longer than one tile of the largest forward shape, the
#: ``*_fwd_long`` kernels): a block of LONG_FWD_R threads per row, two blocks resident on each
#: SM (``__launch_bounds__(R, 2)``: at most 64 registers a thread), tiles of LONG_FWD_R * MAXV
#: vectors; the grid is that of the one-tile forward (:func:`grid`).
LONG_FWD_R = 512
#: Columns a block of the second-stage parameter-gradient sum adds (norms.cu LNLIB_SUM_COLS),
#: with 32 lanes each: blocks of 32 * SUM_COLUMNS threads.
SUM_COLUMNS = 8
#: SM count assumed where no device is asked (the CPU model of the kernels in the tests): an
#: H100 or H200.
DEFAULT_SMS = 132

_lock = threading.Lock()
_modules = {}


def source():
    """The CUDA source CuPy compiles: the header pasted in place of its ``#include``."""
    text = SOURCE.read_text()
    include = '#include "norms.cuh"'
    if include not in text:
        raise RuntimeError(f"{SOURCE} no longer includes norms.cuh")
    header = HEADER.read_text().replace("#pragma once\n", "", 1)
    return text.replace(include, header, 1)


def _dtype_name(dtype):
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in TYPE_NAMES:
        raise TypeError(f"the CUDA kernels take float16, bfloat16, float32 or float64, not {name}")
    return name


def _dtype_names(dtype):
    """The dtype names of a kernel: one dtype, or a tuple of them (a fused op's combination)."""
    if isinstance(dtype, tuple):
        return tuple(_dtype_name(t) for t in dtype)
    return (_dtype_name(dtype),)


def _layout(dtype):
    """The dtype whose rows the kernel lays out (h's for a fused op: the last of the tuple)."""
    return _dtype_names(dtype)[-1]


def shapes(op, dtype):
    """The launch shapes ``(R, MAXV)`` of ``op`` for ``dtype``, by growing row capacity.

    Each thread holds at most 16 elements of a row tile (8 for float64), so that the backward's
    four register arrays fit without spills; a warp per row for short rows, then 64, 128, ...
    threads per row (1024 for the forward, 512 for the backward, whose threads hold more). A
    fused op (``dtype`` a tuple) has the shapes of the unfused op on h's dtype.
    """
    itemsize = ITEMSIZE[_layout(dtype)]
    vec = 16 // itemsize
    maxv = 4 if itemsize == 8 else 16 // vec
    rmax = 1024 if op.endswith("fwd") else 512
    small = [(32, s) for s in (1, 2, 4, 8) if s < maxv]
    return small + [(r, maxv) for r in (32, 64, 128, 256, 512, 1024) if r <= rmax]


def launch_shape(op, dtype, d):
    """``(R, MAXV, tiles)`` for rows of ``d`` elements: the first shape whose tile holds the
    row, else the largest one, looping over ``tiles`` tiles. Depends on ``d`` and the dtype only."""
    vec = 16 // ITEMSIZE[_layout(dtype)]
    chunks = -(-d // vec)
    for r, maxv in shapes(op, dtype):
        if chunks <= r * maxv:
            return r, maxv, 1
    return r, maxv, -(-chunks // (r * maxv))


def long_shape(op, dtype, d):
    """``(R, MAXV, tiles)`` of the long-row kernel ``op + "_long"`` for rows of ``d`` elements
    (launched where :func:`launch_shape` gives more than one tile): LONG_R threads for a
    backward, LONG_FWD_R for a forward, the largest shape's vectors per thread."""
    vec = 16 // ITEMSIZE[_layout(dtype)]
    maxv = shapes(op, dtype)[-1][1]
    chunks = -(-d // vec)
    r = LONG_R if op.endswith("bwd") else LONG_FWD_R
    return r, maxv, -(-chunks // (r * maxv))


def long_units(m, d, sms=None):
    """Units (blocks) of the long-row backward for ``m`` rows of ``d`` elements on a GPU of
    ``sms`` SMs: LONG_BLOCKS_PER_SM per SM, at most one per row, within GRID_THREADS["bwd"]
    (the test hook) and LONG_ROW_PARTIAL."""
    sms = DEFAULT_SMS if sms is None else sms
    cap = max(1, GRID_THREADS["bwd"] // LONG_R)
    return max(1, min(m, LONG_BLOCKS_PER_SM * sms, cap, max(1, LONG_ROW_PARTIAL // d)))


def kernel_name(op, dtype, r, maxv):
    """The NVRTC name expression of one instantiation, e.g. ``layer_norm_fwd<float, 32, 1>``
    or ``add_layer_norm_fwd<__half, float, float, 32, 1>``."""
    types = ", ".join(TYPE_NAMES[n] for n in _dtype_names(dtype))
    return f"{op}<{types}, {r}, {maxv}>"


def sum_name(dtype):
    """Name expression of the second-stage parameter-gradient sum for ``dtype``'s accumulator."""
    return f"param_grad_sum<{'double' if _layout(dtype) == 'float64' else 'float'}>"


def fused(op, dtype):
    """True if the fused ``op`` is compiled for the dtype combination ``dtype`` (a tuple)."""
    return tuple(_dtype_names(dtype)) in FUSED[op[-3:]]


def name_expressions(op, dtype):
    """Every kernel of the module for ``(op, dtype)``."""
    names = [kernel_name(op, dtype, r, v) for r, v in shapes(op, dtype)]
    r, maxv, _tiles = long_shape(op, dtype, 1)
    names.append(kernel_name(op + "_long", dtype, r, maxv))
    if op.endswith("bwd"):
        names.append(sum_name(dtype))
    return names


def modules():
    """Every ``(op, dtype)`` lnlib compiles a module for (a fused op's dtype is a tuple)."""
    plain = [(op, dt) for op in OPS + MOD_OPS for dt in TYPE_NAMES]
    return plain + [(op, dts) for op in ADD_OPS for dts in FUSED[op[-3:]]]


def all_name_expressions():
    """Every kernel lnlib can launch, for every dtype, once (the compile test builds them all)."""
    names = [n for op, dt in modules() for n in name_expressions(op, dt)]
    return list(dict.fromkeys(names))


def module(op, dtype):
    """The compiled ``cupy.RawModule`` for ``(op, dtype)``: built once per process, then reused.
    ``dtype`` is a tuple of dtypes for a fused op (see :data:`FUSED`)."""
    names = _dtype_names(dtype)
    key = (op, names if isinstance(dtype, tuple) else names[0])
    with _lock:
        if key not in _modules:
            import cupy

            _modules[key] = cupy.RawModule(
                code=source(), options=OPTIONS, name_expressions=name_expressions(*key)
            )
        return _modules[key]


def function(op, dtype, r, maxv):
    """The kernel ``op`` for ``dtype`` with launch shape ``(r, maxv)`` (``op`` ending in
    ``_bwd_long``: the long-row backward, in the module of its backward)."""
    return module(op.removesuffix("_long"), dtype).get_function(kernel_name(op, dtype, r, maxv))


def block_threads(r):
    """Threads per block of a kernel with ``r`` threads per row."""
    return max(r, MIN_BLOCK)


def grid(kind, m, r, d=None, tiles=1, sms=None):
    """Blocks to launch for ``m`` rows; each block loops over rows (grid-stride). A backward of
    rows of several ``tiles`` is the long-row kernel, whose second launch has :func:`long_units`
    units (blocks along x), each taking a group of rows a tile of columns at a time (``sms``: the
    GPU's SM count)."""
    if kind == "bwd" and tiles > 1:
        return long_units(m, d, sms)
    block = block_threads(r)
    rows_per_block = block // r
    blocks = min(-(-m // rows_per_block), max(1, GRID_THREADS[kind] // block))
    return max(1, blocks)
