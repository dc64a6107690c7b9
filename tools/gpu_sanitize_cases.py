"""Every CUDA kernel of lnlib on a few small shapes, for compute-sanitizer (tools/gpu_check.sh).

Covers each launch shape family (a warp per row, several warps per row, a block per row, rows
of several tiles), float32/float16/float64, rows that are not 16-byte aligned, batches that do
not fill the last block, and the backward's two-stage parameter gradients. CuPy's memory pool
is switched off so that every array is its own allocation and an out-of-bounds access is seen.
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


def main():
    rng = np.random.default_rng(0)
    count = 0
    with lnlib.use_implementation("cuda"):
        for dtype in (np.float32, np.float16, np.float64):
            for d in LENGTHS:
                for m in ROWS:
                    run_case(m, d, dtype, rng)
                    count += 1
    cp.cuda.Device().synchronize()
    print(f"ran {count} cases (5 kernel launches and 2 parameter-gradient sums each, twice)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
