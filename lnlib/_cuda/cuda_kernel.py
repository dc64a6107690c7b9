"""The row functions of the CUDA kernels, the ``"cuda"`` row of :data:`lnlib._backend.TABLE`
(the row contract of :mod:`lnlib._rows`, ``out`` included): CuPy arrays in, CuPy arrays out, on
the device of the input, with no host round trip.

Rows are read in place when each row is contiguous and rows are a non-negative, whole number
of elements apart (any row stride, so slices of a larger array cost no copy); any other layout
is copied to contiguous rows first. The kernels move 16-byte vectors when every row is 16-byte
aligned and the row length a multiple of the vector, element by element otherwise; both give
bitwise the same results (see ``lnlib/_cuda/norms.cuh``).

Derived in the book, chapter "Implementation", section "GPU kernels".
"""

import functools
import sys
import warnings

import numpy as np

from .._rows import add_into, add_norm_forward_composed, out_array, written
from . import build

_NULL = np.uintp(0)


@functools.cache
def available():
    """``(usable, reason)``: CuPy importable and a CUDA GPU visible to it (asked once: the
    selection point calls this on every call with CuPy arrays)."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount() if cupy.cuda.is_available() else 0
    except Exception as exc:  # noqa: BLE001 - a broken driver means no GPU here
        return False, f"CuPy cannot reach a CUDA driver ({exc})"
    if not count:
        return False, "CuPy sees no CUDA GPU"
    return True, f"{count} CUDA GPU(s), CuPy {cupy.__version__}"


def _acc(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _rows(a):
    """``(rows, ld)``: ``a`` (M, D) itself if the kernels can read it in place, else a
    contiguous copy; ``ld`` is the distance between rows in elements."""
    cupy = sys.modules["cupy"]
    m, d = a.shape
    item = a.itemsize
    inner_ok = d == 1 or a.strides[1] == item
    outer_ok = m == 1 or (a.strides[0] >= 0 and a.strides[0] % item == 0)
    if not (inner_ok and outer_ok):
        a = cupy.ascontiguousarray(a)
    return a, (a.strides[0] // item if m > 1 else d)


def _vec_ok(d, dtype, *pairs):
    """True if every (array, ld) row start is aligned to a vector and d fills whole vectors.

    A vector is V = 16 / itemsize elements of the row layout's ``dtype`` (16 bytes); an array of
    another dtype (a fused op's float16 x in float32 rows of h) moves V of its own elements."""
    vec = 16 // np.dtype(dtype).itemsize
    if d % vec:
        return np.int32(0)
    return np.int32(all(a.data.ptr % (vec * a.itemsize) == 0 and ld % vec == 0 for a, ld in pairs))


def _param(p, acc):
    cupy = sys.modules["cupy"]
    return _NULL if p is None else cupy.ascontiguousarray(p, dtype=acc)


def _check_width(d):
    if d >= 2**31:
        raise ValueError(f"the CUDA kernels take rows of fewer than 2**31 elements, got {d}")


def _forward(op, x, params, eps, with_mean, out, mod=()):
    """Launch forward kernel ``op`` on rows ``x``; returns y, (mean,) rstd. ``mod``: the
    ``(group, mods)`` of a modulated op, passed after the other arguments."""
    cupy = sys.modules["cupy"]
    m, d = x.shape
    _check_width(d)
    acc = _acc(x.dtype)
    x, ldx = _rows(x)
    y = out_array(out, 0, (m, d), x.dtype, cupy)
    mean = out_array(out, 1, m, acc, cupy) if with_mean else None
    rstd = out_array(out, 2 if with_mean else 1, m, acc, cupy)
    if m:
        op, r, maxv = _forward_shape(op, x.dtype, d)
        vec_ok = _vec_ok(d, x.dtype, (x, ldx), (y, d))
        stats = (mean, rstd) if with_mean else (rstd,)
        args = (
            x,
            np.int64(ldx),
            y,
            np.int64(d),
            *(_param(p, acc) for p in params),
            *stats,
            np.int64(m),
            np.int32(d),
            acc.type(eps),
            vec_ok,
            *(np.int64(v) for v in mod),
        )
        build.function(op, x.dtype, r, maxv)(
            (build.grid("fwd", m, r),), (build.block_threads(r),), args
        )
    return (y, mean, rstd) if with_mean else (y, rstd)


def _forward_shape(op, dtype, d):
    """``(kernel, R, MAXV)`` of a forward: the one-tile kernel ``op``, or for rows of several
    tiles its long-row kernel (``op + "_long"``, build.long_shape)."""
    r, maxv, tiles = build.launch_shape(op, dtype, d)
    if tiles > 1:
        r, maxv, _tiles = build.long_shape(op, dtype, d)
        return op + "_long", r, maxv
    return op, r, maxv


#: The largest y extent of a grid (CUDA's limit).
_MAX_GRID_Y = 65535


def _column_sum(op, dtype, part, runs=None):
    """Second stage of a parameter gradient: the units of ``part`` (units, D) added in order,
    into a (D,) result; with ``runs`` (a modulated backward), ``part`` is that many buffers of
    ``units // runs`` units one after the other, summed separately into a (runs, D) result."""
    cupy = sys.modules["cupy"]
    units, d = part.shape
    out = cupy.empty(d if runs is None else (runs, d), dtype=part.dtype)
    runs = runs or 1
    fn = build.module(op, dtype).get_function(build.sum_name(dtype))
    cols, per_run = build.SUM_COLUMNS, units // runs
    for first in range(0, runs, _MAX_GRID_Y):  # a grid's y extent is at most 65535
        n = min(runs - first, _MAX_GRID_Y)
        args = (part[first * per_run :], np.int64(per_run), np.int32(d), out.reshape(-1, d)[first:])
        fn((-(-d // cols), n), (32 * cols,), args)
    return out


def _launch_backward(op, dtype, m, d, rows, stats, weight, dx, with_bias, mod=()):
    """Launch backward kernel ``op`` (``dtype``: a dtype, or a fused op's tuple) with the row
    arguments ``rows`` (pairs of array and ld, the inputs before the statistics); returns
    dweight (, dbias), the units' partial sums added in order. ``mod``: the ``(group, mods)``
    of a modulated op, whose grid is ``mods`` runs of blocks (norms.cu, ModRows) and whose
    parameter gradients are (mods, D)."""
    cupy = sys.modules["cupy"]
    acc = _acc(dx.dtype)
    runs = mod[1] if mod else 1
    r, maxv, tiles = build.launch_shape(op, dtype, d)
    # rows of several tiles: the cluster kernel (compute capability 9.x, rows that fit) or the
    # two-launch kernel, each with its own shape and units (build.backward_path: from d, the
    # dtype and the compute capability only)
    path = "tile" if tiles == 1 else build.backward_path(op, dtype, d, _compute_capability())
    sms = _sm_count() if tiles > 1 else None
    if path == "cluster":  # runs (one unless modulated) of `blocks` whole clusters each
        blocks = build.cluster_run_units(m, d, runs, sms)
        units = runs * blocks
    else:
        # each run takes m / runs rows: about the blocks of the whole grid shared out, at least 1
        blocks = -(-build.grid("bwd", m, r, d, tiles, sms) // runs)
        blocks = min(blocks, build.grid("bwd", m // runs, r, d, tiles, sms))
        units = runs * min(m // runs, blocks * (build.block_threads(r) // r))
    dw_part = cupy.empty((units, d), dtype=acc)
    db_part = cupy.empty((units, d), dtype=acc) if with_bias else None
    stats = tuple(cupy.ascontiguousarray(s, dtype=acc) for s in stats)
    parts = (dw_part, db_part) if with_bias else (dw_part,)
    arrays = [(a, ld) for a, ld in rows if a is not None] + [(dx, d)]
    args = (
        *(v for a, ld in rows for v in (_NULL if a is None else a, np.int64(ld))),
        *stats,
        _param(weight, acc),
        dx,
        np.int64(d),
        *parts,
        np.int64(m),
        np.int32(d),
        _vec_ok(d, dx.dtype, *arrays),
        *(np.int64(v) for v in mod),
    )
    if path == "cluster":  # norm_bwd_cluster: x and dy read once, by clusters of blocks
        r, maxv, _slice = build.cluster_shape(op, dtype, d)
        fn = build.function(op + "_cluster", dtype, r, maxv)
        shared = build.cluster_shared_bytes(op, dtype, d)
        if fn.max_dynamic_shared_size_bytes < shared:  # the opt-in above the 48 KiB default
            fn.max_dynamic_shared_size_bytes = shared
        try:
            fn((runs * blocks * build.CLUSTER,), (r,), args, shared_mem=shared)
        except cupy.cuda.driver.CUDADriverError as error:
            # the driver refuses the launch itself (no 8 SMs of one GPC to give the cluster: a
            # MIG slice...): this device takes the two-launch kernel from now on, for every d
            # alike; any other error (a fault of an earlier kernel, ...) is raised
            if error.status not in _LAUNCH_REFUSED:
                raise
            device = cupy.cuda.runtime.getDevice()
            _NO_CLUSTERS.add(device)
            warnings.warn(f"lnlib: device {device} refused the cluster backward ({error}); "
                          "its long rows take the two-launch backward", stacklevel=2)  # fmt: skip
            return _launch_backward(op, dtype, m, d, rows, stats, weight, dx, with_bias, mod)
    elif path == "long":  # norm_bwd_long: the rows' two means into c, then dx and partial sums
        r, maxv, tiles = build.long_shape(op, dtype, d)
        fn, c = build.function(op + "_long", dtype, r, maxv), cupy.empty(2 * m, dtype=acc)
        fn((build.grid("fwd", m, r),), (r,), (*args, c, np.int32(0)))
        fn((blocks * runs, min(tiles, _MAX_GRID_Y)), (r,), (*args, c, np.int32(1)))
    else:
        build.function(op, dtype, r, maxv)((blocks * runs,), (build.block_threads(r),), args)
    return tuple(_column_sum(op, dtype, p, mod[1] if mod else None) for p in parts)


#: cudaDevAttrMultiProcessorCount (CUDA runtime enum, stable across versions).
_SM_COUNT = 16


@functools.cache
def _device_sm_count(device):
    return sys.modules["cupy"].cuda.runtime.deviceGetAttribute(_SM_COUNT, device)


def _sm_count():
    """The SM count of the current device: the long-row backward launches LONG_BLOCKS_PER_SM
    units an SM (build.long_units), the cluster kernel CLUSTER_BLOCKS_PER_SM blocks an SM
    (build.cluster_units)."""
    return _device_sm_count(sys.modules["cupy"].cuda.runtime.getDevice())


#: Devices whose driver refused a cluster launch: their long rows take the two-launch kernel.
_NO_CLUSTERS = set()
#: CUresult codes of a launch refused for its configuration (cuda.h): CUDA_ERROR_INVALID_VALUE,
#: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, CUDA_ERROR_INVALID_CLUSTER_SIZE.
_LAUNCH_REFUSED = (1, 701, 912)


def _compute_capability():
    """The compute capability the long-row backward picks its kernel by (build.backward_path):
    the current device's (e.g. 90: the cluster kernel), or 0 once its driver has refused a
    cluster launch (the two-launch kernel)."""
    device = sys.modules["cupy"].cuda.runtime.getDevice()
    return 0 if device in _NO_CLUSTERS else build.device_arch()


def _no_rows(out, dx, d, acc, with_bias):
    """The results of a backward on no rows: dx as it is, zero parameter gradients."""
    cupy = sys.modules["cupy"]
    zeros = cupy.zeros(d, dtype=acc)
    return written(out, (dx, zeros, zeros.copy()) if with_bias else (dx, zeros))


def _backward(op, dy, x, stats, weight, with_bias, out, mod=()):
    """Launch backward kernel ``op``; returns dx, dweight (, dbias) in the accumulation dtype."""
    cupy = sys.modules["cupy"]
    m, d = x.shape
    _check_width(d)
    x, ldx = _rows(x)
    dy, lddy = _rows(dy.astype(x.dtype, copy=False))
    dx = out_array(out, 0, (m, d), x.dtype, cupy)
    if m == 0:
        return _no_rows(out, dx, (*mod[1:], d), _acc(x.dtype), with_bias)
    rows = ((dy, lddy), (x, ldx))
    grads = _launch_backward(op, x.dtype, m, d, rows, stats, weight, dx, with_bias, mod)
    return written(out, (dx, *grads))


def layer_norm_forward_rows(x, weight, bias, eps, *, out=None):
    """LayerNorm forward on rows ``x`` (M, D) with the CUDA kernel: ``y, mean, rstd``."""
    return _forward("layer_norm_fwd", x, (weight, bias), eps, True, out)


def layer_norm_backward_rows(dy, x, mean, rstd, weight, *, out=None):
    """LayerNorm backward on rows with the CUDA kernel: ``dx, dweight, dbias``."""
    return _backward("layer_norm_bwd", dy, x, (mean, rstd), weight, True, out)


def modulated_layer_norm_forward_rows(x, weight, bias, eps, group, mods, *, out=None):
    """LayerNorm forward on rows ``x`` (M, D) whose weight and bias (mods, D) change with the
    row: row i takes their row ``(i // group) % mods`` (``group`` 1 and M a multiple of
    ``mods``, or M = ``mods * group``).
    AdaLN (weight 1 + scale, bias shift) and GroupNorm (per-channel affine laid out per group)
    in one pass: ``y, mean, rstd``."""
    _check_mod(x.shape[0], group, mods)
    mod = (group, mods)
    return _forward("modulated_layer_norm_fwd", x, (weight, bias), eps, True, out, mod)


def modulated_layer_norm_backward_rows(dy, x, mean, rstd, weight, group, mods, *, out=None):
    """The backward of :func:`modulated_layer_norm_forward_rows`: ``dx, dweight, dbias``, the
    parameter gradients (mods, D), row p summing the rows that took parameter row p. Each
    parameter row has at least one unit: the partial sums take at least (mods, D) twice."""
    _check_mod(x.shape[0], group, mods)
    mod = (group, mods)
    return _backward("modulated_layer_norm_bwd", dy, x, (mean, rstd), weight, True, out, mod)


def _check_mod(m, group, mods):
    """The layouts the kernels take (norms.cu, ModRows): group 1, or mods * group rows."""
    if group < 1 or mods < 1 or m % (group * mods) or (group > 1 and group * mods != m):
        raise ValueError(
            f"rows ({m}) must be a multiple of mods ({mods}) with group 1, or mods * group, got "
            f"group {group}"
        )


def rms_norm_forward_rows(x, weight, eps, *, out=None):
    """RMSNorm forward on rows ``x`` (M, D) with the CUDA kernel: ``y, rstd``."""
    return _forward("rms_norm_fwd", x, (weight,), eps, False, out)


def rms_norm_backward_rows(dy, x, rstd, weight, *, out=None):
    """RMSNorm backward on rows with the CUDA kernel: ``dx, dweight``."""
    return _backward("rms_norm_bwd", dy, x, (rstd,), weight, False, out)


# The fused residual add (the row contract in lnlib._rows, "The fused residual add"): the
# add_*_norm kernels of norms.cu for the dtype combinations of build.FUSED. The forward of any
# other combination (float64 mixed with another dtype, or a float32 x with a float16 stream) is
# computed unfused: CuPy's add in the widest dtype, then the norm's kernel on h. A backward is
# always fused: dy is read as the norm's backward reads it (converted to h's dtype unless it is
# the float16 dy of a float32 stream), dh converted to h's dtype when that is exact; a dh wider
# than h is added afterwards, in its dtype, rounded once to h's.


def _add_forward(op, norm_rows, x, residual, params, eps, h_dtype, with_mean, out):
    """Launch the fused forward ``op`` on rows; returns y, h, (mean,) rstd."""
    cupy = sys.modules["cupy"]
    h_dtype = np.dtype(h_dtype)
    dtypes = (x.dtype.name, residual.dtype.name, h_dtype.name)
    if not build.fused(op, dtypes):
        return add_norm_forward_unfused(norm_rows, x, residual, params, eps, h_dtype, out)
    m, d = x.shape
    _check_width(d)
    acc = _acc(h_dtype)
    x, ldx = _rows(x)
    residual, ldr = _rows(residual)  # h over residual: out[1] is residual's memory (ld = d)
    y = out_array(out, 0, (m, d), x.dtype, cupy)
    h = out_array(out, 1, (m, d), h_dtype, cupy)
    mean = out_array(out, 2, m, acc, cupy) if with_mean else None
    rstd = out_array(out, 3 if with_mean else 2, m, acc, cupy)
    if m:
        op, r, maxv = _forward_shape(op, dtypes, d)
        rows = ((x, ldx), (residual, ldr), (h, d), (y, d))
        args = (
            *(v for a, ld in rows for v in (a, np.int64(ld))),
            *(_param(p, acc) for p in params),
            *((mean, rstd) if with_mean else (rstd,)),
            np.int64(m),
            np.int32(d),
            acc.type(eps),
            _vec_ok(d, h_dtype, *rows),
        )
        build.function(op, dtypes, r, maxv)(
            (build.grid("fwd", m, r),), (build.block_threads(r),), args
        )
    return (y, h, mean, rstd) if with_mean else (y, h, rstd)


def add_norm_forward_unfused(norm_rows, x, residual, params, eps, h_dtype, out):
    """The fallback for dtype combinations without a fused kernel: h = residual + x by CuPy
    (added in the widest dtype, rounded once to h's), then ``norm_rows`` on h."""
    cupy = sys.modules["cupy"]
    return add_norm_forward_composed(norm_rows, x, residual, params, eps, h_dtype, out, cupy)


def _add_backward(op, dy, dh, h, stats, weight, with_bias, out):
    """Launch the fused backward ``op`` on rows; returns dsum, dweight (, dbias)."""
    cupy = sys.modules["cupy"]
    m, d = h.shape
    _check_width(d)
    if not build.fused(op, (dy.dtype.name, h.dtype.name)):
        dy = dy.astype(h.dtype)  # as the norm's backward reads it
    late = None  # a dh wider than h, added after the kernel in its own dtype
    if dh is not None and dh.dtype != h.dtype:
        if cupy.can_cast(dh.dtype, h.dtype, "safe"):
            dh = dh.astype(h.dtype)  # exact: the add in h's dtype is the widest
        else:
            dh, late = None, dh
    h, ldh = _rows(h)
    dy, lddy = _rows(dy)
    dh, lddh = (None, 0) if dh is None else _rows(dh)
    dsum = out_array(out, 0, (m, d), h.dtype, cupy)
    if m == 0:
        return _no_rows(out, dsum, d, _acc(h.dtype), with_bias)
    dtypes = (dy.dtype.name, h.dtype.name)
    rows = ((dy, lddy), (dh, lddh), (h, ldh))
    grads = _launch_backward(op, dtypes, m, d, rows, stats, weight, dsum, with_bias)
    if late is not None:
        add_into(late, dsum, dsum, cupy)
    return written(out, (dsum, *grads))


def add_layer_norm_forward_rows(x, residual, weight, bias, eps, h_dtype, *, out=None):
    """``y, h, mean, rstd``: h = residual + x and the LayerNorm of h, in one kernel."""
    return _add_forward(
        "add_layer_norm_fwd",
        layer_norm_forward_rows,
        x,
        residual,
        (weight, bias),
        eps,
        h_dtype,
        True,
        out,
    )


def add_layer_norm_backward_rows(dy, dh, h, mean, rstd, weight, *, out=None):
    """``dsum, dweight, dbias``: the LayerNorm backward on h plus dh, in one kernel."""
    return _add_backward("add_layer_norm_bwd", dy, dh, h, (mean, rstd), weight, True, out)


def add_rms_norm_forward_rows(x, residual, weight, eps, h_dtype, *, out=None):
    """``y, h, rstd``: h = residual + x and the RMSNorm of h, in one kernel."""
    return _add_forward(
        "add_rms_norm_fwd",
        rms_norm_forward_rows,
        x,
        residual,
        (weight,),
        eps,
        h_dtype,
        False,
        out,
    )


def add_rms_norm_backward_rows(dy, dh, h, rstd, weight, *, out=None):
    """``dsum, dweight``: the RMSNorm backward on h plus dh, in one kernel."""
    return _add_backward("add_rms_norm_bwd", dy, dh, h, (rstd,), weight, False, out)
