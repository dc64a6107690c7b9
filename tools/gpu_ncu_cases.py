"""The launches that `ncu` profiles in tools/gpu_check.sh: LayerNorm and RMSNorm forward and
backward at d = 4096 and 65536 (float32) and d = 768 (float16), 64 MiB of x each; and AdaLN
(the modulated LayerNorm kernels) forward and backward at d = 4096 float32, x of shape
(B, T, D) = (16, 256, 4096) (64 MiB) with one shift and scale (B, 1, D) per example, DiT's
layout. Besides lnlib's kernels, the profile holds the small launches around them (the
parameter gradients' column sums; AdaLN's 1 + scale, and its dshift and dscale copies).

The kernels are compiled and run once before the profiler starts (ncu runs with
--profile-from-start off), so that only the timed shapes are read, one launch per kernel.
"""

import sys

import cupy as cp
import cupyx.profiler
import numpy as np

import lnlib

CASES = ((4096, np.float32), (65536, np.float32), (768, np.float16))
#: AdaLN's (B, T, D) and dtype: 64 MiB of x.
ADA_CASE = ((16, 256, 4096), np.float32)


def arrays(d, dtype, rng):
    m = (64 << 20) // (d * np.dtype(dtype).itemsize)
    x = cp.asarray(rng.standard_normal((m, d), dtype=np.float32).astype(dtype))
    dy = cp.asarray(rng.standard_normal((m, d), dtype=np.float32).astype(dtype))
    w = cp.asarray(rng.standard_normal(d, dtype=np.float32).astype(dtype))
    return x, dy, w


def ada_arrays(shape, dtype, rng):
    """x and dy (B, T, D), shift and scale (B, 1, D)."""
    pshape = (shape[0], 1, shape[2])
    x, dy = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(2))
    shift, scale = (rng.standard_normal(pshape, dtype=np.float32).astype(dtype) for _ in range(2))
    return tuple(cp.asarray(a) for a in (x, dy, shift, scale))


def run(x, dy, w):
    _y, mean, rstd = lnlib.layer_norm_forward(x, w, w)
    lnlib.layer_norm_backward(dy, x, mean, rstd, w)
    _y, rstd = lnlib.rms_norm_forward(x, w)
    lnlib.rms_norm_backward(dy, x, rstd, w)


def run_ada(x, dy, shift, scale):
    _y, mean, rstd = lnlib.ada_layer_norm_forward(x, shift, scale)
    lnlib.ada_layer_norm_backward(dy, x, mean, rstd, scale)


def main():
    rng = np.random.default_rng(0)
    data = [arrays(d, dtype, rng) for d, dtype in CASES]
    ada = ada_arrays(*ADA_CASE, rng)
    with lnlib.use_implementation("cuda"):
        for case in data:  # compile and warm up outside the profiled range
            run(*case)
        run_ada(*ada)
        cp.cuda.Device().synchronize()
        with cupyx.profiler.profile():  # cudaProfilerStart/Stop around the profiled launches
            for case in data:
                run(*case)
            run_ada(*ada)
            cp.cuda.Device().synchronize()
    shape, dtype = ADA_CASE
    cases = [f"d={d} {np.dtype(t).name}" for d, t in CASES]
    cases.append(f"AdaLN {'x'.join(map(str, shape))} {np.dtype(dtype).name}")
    print("profiled:", ", ".join(cases), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
