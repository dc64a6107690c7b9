"""The CUDA kernels of ``lnlib/_cuda/norms.cu``, compiled by CuPy at first use.

The source is the header ``norms.cuh`` followed by ``norms.cu`` (pasted together here,
so that CuPy's compile cache, keyed by the source text and the options, sees an edit of either
file). Each (operation, dtype) pair (a tuple of dtypes for the fused residual add,
:data:`FUSED`) is one ``cupy.RawModule`` with NVRTC name expressions for
every launch shape it may need, compiled once per process on first use and cached on disk by
CuPy. ``import lnlib`` and this module import no CuPy; only :func:`module` does.

The launch shape (threads per row ``R`` and 16-byte vectors per thread ``MAXV``) is chosen from
the row length and the dtype alone (:func:`launch_shape`), and the backward's kernel for rows
longer than one tile from those and the GPU's compute capability (:func:`backward_path`: the
cluster kernel of sm_90 or the two-launch kernel), never from the number of rows, so a row's
reduction order, and therefore its result, does not depend on the batch. The modules of a GPU
of compute capability 9.0 or later also hold the cluster kernels (:func:`name_expressions`).

Derived in the book, chapter "Implementation", section "GPU kernels".
"""

import functools
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
#: The long-row backward of compute capability 9.x (H100, H200: thread-block clusters and 227 KiB
#: of shared memory a block), the ``*_bwd_cluster`` kernels of norms.cu, which read x and dy once:
#: a cluster of CLUSTER blocks (norms.cu LNLIB_CLUSTER, compile-time ``__cluster_dims__``) of
#: CLUSTER_R threads takes a row at a time, each block staging its slice of the row (S =
#: ceil(chunks / CLUSTER) chunks) in shared memory, two rows deep (:func:`cluster_shared_bytes`);
#: each thread keeps the partial parameter gradients of its at most MAXV chunks in registers, so
#: rows of up to CLUSTER * CLUSTER_R * MAXV chunks take it (65536 elements of 16- and 32-bit
#: types, 32768 of float64; :func:`backward_path`). CLUSTER_BLOCKS_PER_SM (one: ``__launch_bounds__
#: (R, 1)``) blocks an SM, CLUSTER_WAVES times as many clusters as the SMs hold at once
#: (:func:`cluster_units`), CLUSTER_MAJORS the compute capabilities (major) that take it, read at
#: every launch (tests set it to () to run the two-launch kernel on an H100 or H200), and
#: CLUSTER_SHARED_CAP the dynamic shared memory a block may take (227 KiB, the opt-in limit of
#: sm_90, less 1 KiB for the kernel's static shared memory). The modulated backward's clusters
#: come in runs, one per parameter row (:func:`cluster_run_units`).
CLUSTER = 8
CLUSTER_R = 512
CLUSTER_BLOCKS_PER_SM = 1
CLUSTER_WAVES = 2
CLUSTER_MAJORS = (9,)
CLUSTER_SHARED_CAP = 227 * 1024 - 1024
#: The backward ops with a cluster kernel (``op + "_cluster"``).
CLUSTER_OPS = (
    "layer_norm_bwd",
    "rms_norm_bwd",
    "add_layer_norm_bwd",
    "add_rms_norm_bwd",
    "modulated_layer_norm_bwd",
)
#: The oldest compute capability whose modules hold the cluster kernels (norms.cu compiles them
#: only where ``__CUDA_ARCH__ >= 900``).
CLUSTER_ARCH = 90
#: The long-row forward (rows longer than one tile of the largest forward shape, the
#: ``*_fwd_long`` kernels): a block of LONG_FWD_R threads per row, two blocks resident on each
#: SM (``__launch_bounds__(R, 2)``: at most 64 registers a thread), tiles of LONG_FWD_R * MAXV
#: vectors; the grid is that of the one-tile forward (:func:`grid`).
LONG_FWD_R = 512
#: Columns a block of the second-stage parameter-gradient sum adds (norms.cu LNLIB_SUM_COLS),
#: with 32 lanes each: blocks of 32 * SUM_COLUMNS threads.
SUM_COLUMNS = 8
#: SM count and compute capability assumed where no device is asked (the CPU model of the
#: kernels in the tests): an H100 or H200.
DEFAULT_SMS = 132
DEFAULT_CC = 90

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


def cluster_shape(op, dtype, d):
    """``(R, MAXV, S)`` of the cluster kernel ``op + "_cluster"`` for rows of ``d`` elements:
    CLUSTER_R threads a block, the largest backward shape's vectors per thread, and S chunks (V
    elements of h's dtype) a block of the cluster stages, ``ceil(chunks / CLUSTER)``."""
    vec = 16 // ITEMSIZE[_layout(dtype)]
    chunks = -(-d // vec)
    return CLUSTER_R, shapes(op, dtype)[-1][1], -(-chunks // CLUSTER)


def cluster_shared_bytes(op, dtype, d):
    """Dynamic shared memory a block of the cluster kernel takes for rows of ``d`` elements: two
    rows (the one it works on and the next, in flight) of its S chunks of x (h) and of dy, each
    chunk V elements of its own dtype (norms.cu, norm_bwd_cluster)."""
    names = _dtype_names(dtype)
    vec = 16 // ITEMSIZE[names[-1]]
    dy, x = (names[0], names[-1]) if len(names) > 1 else (names[0], names[0])
    return 2 * cluster_shape(op, dtype, d)[2] * vec * (ITEMSIZE[dy] + ITEMSIZE[x])


def backward_path(op, dtype, d, cc):
    """Which kernel a backward takes for rows of ``d`` elements on a GPU of compute capability
    ``cc`` (e.g. 90): ``"tile"`` (one tile, ``op``), ``"cluster"`` (``op + "_cluster"``: compute
    capability in CLUSTER_MAJORS, an op of CLUSTER_OPS, and the row's slices within the threads'
    registers and CLUSTER_SHARED_CAP) or ``"long"`` (the two launches of ``op + "_long"``). From
    ``d``, the dtype and ``cc`` alone, never from the number of rows: every row of one ``d``
    takes the same path on one GPU, so its sums are added in the same order."""
    if launch_shape(op, dtype, d)[2] == 1:
        return "tile"
    r, maxv, slice_chunks = cluster_shape(op, dtype, d)
    fits = slice_chunks <= r * maxv and cluster_shared_bytes(op, dtype, d) <= CLUSTER_SHARED_CAP
    if op in CLUSTER_OPS and cc // 10 in CLUSTER_MAJORS and cc >= CLUSTER_ARCH and fits:
        return "cluster"
    return "long"


def cluster_units(m, d, sms=None):
    """Clusters (units) of the cluster kernel for ``m`` rows of ``d`` elements on a GPU of
    ``sms`` SMs: CLUSTER_WAVES times the clusters of CLUSTER_BLOCKS_PER_SM blocks an SM that
    whole clusters fill (32 on 132 SMs: 256 blocks, about twice the SM count), at most one per
    row, within GRID_THREADS["bwd"] // CLUSTER_R (the test hook) and LONG_ROW_PARTIAL. A
    cluster's blocks must share a GPC, and how many clusters of 8 an H100 holds at once depends
    on how its SMs are spread over its GPCs (not measured here): with two waves, a GPU that holds
    one cluster fewer than ``sms // CLUSTER`` loses less to the last wave than with one. Depends
    on the GPU's SM count, as the two-launch kernel's units do."""
    sms = DEFAULT_SMS if sms is None else sms
    resident = max(1, sms // CLUSTER * CLUSTER_BLOCKS_PER_SM) * CLUSTER_WAVES
    cap = max(1, GRID_THREADS["bwd"] // CLUSTER_R)
    return max(1, min(m, resident, cap, max(1, LONG_ROW_PARTIAL // d)))


def cluster_run_units(m, d, runs, sms=None):
    """Clusters a run of the modulated cluster kernel takes for ``m`` rows of ``d`` elements in
    ``runs`` runs (one per parameter row, ``m // runs`` rows each; norms.cu, ModRows): the
    clusters :func:`cluster_units` gives the whole grid shared out among the runs, rounded up,
    but at least one a run and at most :func:`cluster_units` of a run's rows (so at most one
    per row). The grid is ``runs`` times this many clusters and the partial buffers
    ``(runs * units, d)``, as the two-launch kernel's runs of blocks."""
    per_run = m // runs
    return max(1, min(-(-cluster_units(m, d, sms) // runs), cluster_units(per_run, d, sms)))


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


def name_expressions(op, dtype, arch=CLUSTER_ARCH):
    """Every kernel of the module for ``(op, dtype)`` compiled for compute capability ``arch``
    (the cluster kernel from CLUSTER_ARCH on)."""
    names = [kernel_name(op, dtype, r, v) for r, v in shapes(op, dtype)]
    r, maxv, _tiles = long_shape(op, dtype, 1)
    names.append(kernel_name(op + "_long", dtype, r, maxv))
    if op in CLUSTER_OPS and int(arch) >= CLUSTER_ARCH:
        r, maxv, _slice = cluster_shape(op, dtype, 1)
        names.append(kernel_name(op + "_cluster", dtype, r, maxv))
    if op.endswith("bwd"):
        names.append(sum_name(dtype))
    return names


def modules():
    """Every ``(op, dtype)`` lnlib compiles a module for (a fused op's dtype is a tuple)."""
    plain = [(op, dt) for op in OPS + MOD_OPS for dt in TYPE_NAMES]
    return plain + [(op, dts) for op in ADD_OPS for dts in FUSED[op[-3:]]]


def all_name_expressions(arch=CLUSTER_ARCH):
    """Every kernel lnlib can launch on compute capability ``arch``, for every dtype, once (the
    compile test builds them all)."""
    names = [n for op, dt in modules() for n in name_expressions(op, dt, arch)]
    return list(dict.fromkeys(names))


@functools.cache
def _arch_of(device):
    import cupy

    return int(cupy.cuda.Device(device).compute_capability)


def device_arch():
    """The compute capability of CuPy's current device, as an int (e.g. 90), asked once per
    device."""
    import cupy

    return _arch_of(cupy.cuda.runtime.getDevice())


def module(op, dtype):
    """The compiled ``cupy.RawModule`` for ``(op, dtype)`` on the current device's compute
    capability: built once per process, then reused. ``dtype`` is a tuple of dtypes for a fused
    op (see :data:`FUSED`)."""
    names = _dtype_names(dtype)
    arch = device_arch()
    key = (op, names if isinstance(dtype, tuple) else names[0], arch)
    with _lock:
        if key not in _modules:
            import cupy

            _modules[key] = cupy.RawModule(
                code=source(), options=OPTIONS, name_expressions=name_expressions(*key)
            )
        return _modules[key]


def function(op, dtype, r, maxv):
    """The kernel ``op`` for ``dtype`` with launch shape ``(r, maxv)`` (``op`` ending in
    ``_bwd_long`` or ``_bwd_cluster``: a long-row backward, in the module of its backward)."""
    base = op.removesuffix("_long").removesuffix("_cluster")
    return module(base, dtype).get_function(kernel_name(op, dtype, r, maxv))


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
