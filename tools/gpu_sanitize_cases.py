"""Every CUDA kernel of lnlib on a few small shapes, for compute-sanitizer (tools/gpu_check.sh).

Covers the norms and the fused residual add, each launch shape family (a warp per row, several
warps per row, a block per row, rows of several tiles), float32/float16/float64, rows that are
not 16-byte aligned, batches that do not fill the last block, the backward's two-stage
parameter gradients, and the long-row backward's two launches with one unit and with many.
CuPy's memory pool is switched off so that every array is its own allocation and an
out-of-bounds access is seen.
"""

import sys

import cupy as cp
import numpy as np

import lnlib

cp.cuda.set_allocator(None)  # one cudaMalloc per array: memcheck sees every overrun

LENGTHS = (1, 5, 33, 768, 1001, 4099, 20000)
ROWS = (1, 3, 5)


def run_case(m, d, dtype, rng):
    x = cp.asarray(rng.standard_normal((m, d)).astype(dtype))
    dy = cp.asarray(rng.standard_normal((m, d)).astype(dtype))
    w = cp.asarray(rng.standard_normal(d).astype(dtype))
    wide = cp.zeros((m, d + 1), dtype=dtype)
    wide[:, 1:] = x
    for xs in (x, wide[:, 1:]):  # aligned rows (vector loads) and misaligned (element-wise)
        _y, mean, rstd = lnlib.layer_norm_forward(xs, w, w)
        lnlib.layer_norm_backward(dy, xs, mean, rstd, w)
        lnlib.layer_norm_backward(dy, xs, mean, rstd)
        _y, rstd = lnlib.rms_norm_forward(xs, w)
        lnlib.rms_norm_backward(dy, xs, rstd, w)
        run_fused(xs, dy, w, dtype, rng)


def run_fused(x, dy, w, dtype, rng):
    """The fused residual add: a new h, h written over the residual, dh given and absent, and
    for float16 the float32 stream."""
    streams = [dtype] + ([np.float32] if dtype == np.float16 else [])
    for h_dtype in streams:
        res = cp.asarray(rng.standard_normal(x.shape).astype(h_dtype))
        dh = cp.asarray(rng.standard_normal(x.shape).astype(h_dtype))
        wa = w.astype(np.float32) if h_dtype != dtype else w
        _y, h, mean, rstd = lnlib.add_layer_norm_forward(x, res, wa, wa)
        lnlib.add_layer_norm_backward(dy, dh, h, mean, rstd, wa)
        lnlib.add_layer_norm_backward(dy, None, h, mean, rstd)
        lnlib.add_rms_norm_forward(x, res, wa, out=(None, res, None))  # h over the residual
        _y, h, rstd = lnlib.add_rms_norm_forward(x, res, wa)
        lnlib.add_rms_norm_backward(dy, dh, h, rstd, wa)


def run_long_units(m, d, dtype, rng):
    """The long-row backward (the rows' sums, then dx and the partial sums tile by tile of
    columns) with one unit taking every row, and with the units the device gives."""
    from lnlib._cuda import build

    x = cp.asarray(rng.standard_normal((m, d)).astype(dtype))
    dy = cp.asarray(rng.standard_normal((m, d)).astype(dtype))
    w = cp.asarray(rng.standard_normal(d).astype(dtype))
    saved = dict(build.GRID_THREADS)
    try:
        for grid in (build.LONG_R, None):  # one unit, then as shipped
            if grid:
                build.GRID_THREADS["bwd"] = grid
            else:
                build.GRID_THREADS.update(saved)
            _y, mean, rstd = lnlib.layer_norm_forward(x, w, w)
            lnlib.layer_norm_backward(dy, x, mean, rstd, w)
            _y, rstd = lnlib.rms_norm_forward(x, w)
            lnlib.rms_norm_backward(dy, x, rstd, w)
    finally:
        build.GRID_THREADS.update(saved)


def run_modulated(dtype, rng):
    """AdaLN and GroupNorm (the modulated LayerNorm: parameters per row, the backward's runs),
    with short and long rows, and one block a run (each unit taking every row of its run)."""
    from lnlib._cuda import build

    def arr(*shape):
        return cp.asarray(rng.standard_normal(shape).astype(dtype))

    saved = dict(build.GRID_THREADS)
    try:
        for grid in (None, build.LONG_R):
            if grid:
                build.GRID_THREADS["bwd"] = grid
            for d in (33, 1001, 20000):
                x, dy, mod = arr(2, 3, d), arr(2, 3, d), arr(2, 1, d)
                _y, mean, rstd = lnlib.ada_layer_norm_forward(x, mod, mod)
                lnlib.ada_layer_norm_backward(dy, x, mean, rstd, mod)
            for shape, g in (((3, 4, 5, 7), 2), ((2, 4, 100, 60), 2)):
                x, dy, w = arr(*shape), arr(*shape), arr(shape[1])
                _y, mean, rstd = lnlib.group_norm_forward(x, g, w, w)
                lnlib.group_norm_backward(dy, x, mean, rstd, g, w)
    finally:
        build.GRID_THREADS.update(saved)


def main():
    rng = np.random.default_rng(0)
    count = 0
    with lnlib.use_implementation("cuda"):
        for dtype in (np.float32, np.float16, np.float64):
            for d in LENGTHS:
                for m in ROWS:
                    run_case(m, d, dtype, rng)
                    count += 1
            run_long_units(5, 20001, dtype, rng)
            run_modulated(dtype, rng)
            count += 2
    cp.cuda.Device().synchronize()
    print(
        f"ran {count} cases (the norms', the fused add's and the modulated LayerNorm's kernels, "
        "aligned and misaligned rows)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
