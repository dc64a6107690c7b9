"""The compiled C kernel behind the row signature of :mod:`lnlib._backend` (float32, float64).

:func:`available` and :func:`info` say whether the kernel can run here and why; the four
``*_rows`` functions call it, one C call per chunk of rows, the chunks in threads.
"""

import numpy as np

from .. import _cpu_kernels as kernels
from .._rows import run_chunks, sum_chunks

__all__ = ["available", "info", "layer_norm_forward_rows", "layer_norm_backward_rows",
           "rms_norm_forward_rows", "rms_norm_backward_rows"]


def info():
    """Whether the kernel is built and loaded: ``{"kernel": bool, "reason": str, "path": str}``."""
    return kernels.info()


def available():
    """``(usable, reason)``: whether the compiled kernel can run on this machine."""
    state = info()
    return state["kernel"], state["reason"]


def layer_norm_forward_rows(x, weight, bias, eps, *, threads=None):
    """Forward with the compiled kernel (float32/float64): one C call per chunk of rows."""
    m, n = x.shape
    fn = kernels.function("layer_norm_fwd", x.dtype)
    x = kernels.rows_for_kernel(x, x.dtype)
    weight, bias = (None if p is None else np.ascontiguousarray(p) for p in (weight, bias))
    y = np.empty((m, n), dtype=x.dtype)
    mean = np.empty(m, dtype=x.dtype)
    rstd = np.empty(m, dtype=x.dtype)

    def chunk(start, stop, _rows):
        if stop > start:
            fn(kernels.ptr(x, start), kernels.ld(x), kernels.ptr(y, start), n, kernels.ptr(mean, start),
               kernels.ptr(rstd, start), kernels.ptr(weight), kernels.ptr(bias), stop - start, n, eps)

    run_chunks(m, n, chunk, block_rows=1, threads=threads)
    return y, mean, rstd


def layer_norm_backward_rows(dy, x, mean, rstd, weight, *, threads=None):
    """Backward with the compiled kernel; parameter gradients summed chunk by chunk, in order."""
    m, n = x.shape
    fn = kernels.function("layer_norm_bwd", x.dtype)
    x = kernels.rows_for_kernel(x, x.dtype)
    dy = kernels.rows_for_kernel(dy, x.dtype)
    mean, rstd = np.ascontiguousarray(mean), np.ascontiguousarray(rstd)
    weight = None if weight is None else np.ascontiguousarray(weight)
    dx = np.empty((m, n), dtype=x.dtype)

    def chunk(start, stop, _rows):
        dweight, dbias = np.zeros(n, dtype=x.dtype), np.zeros(n, dtype=x.dtype)
        if stop > start:
            fn(kernels.ptr(dy, start), kernels.ld(dy), kernels.ptr(x, start), kernels.ld(x),
               kernels.ptr(mean, start), kernels.ptr(rstd, start), kernels.ptr(weight),
               kernels.ptr(dx, start), n, kernels.ptr(dweight), kernels.ptr(dbias), stop - start, n)
        return dweight, dbias

    parts = run_chunks(m, n, chunk, block_rows=1, threads=threads)
    return (dx, *sum_chunks(parts))

def rms_norm_forward_rows(x, weight, eps, *, threads=None):
    """Forward with the compiled kernel (float32/float64): one C call per chunk of rows."""
    m, n = x.shape
    fn = kernels.function("rms_norm_fwd", x.dtype)
    x = kernels.rows_for_kernel(x, x.dtype)
    weight = None if weight is None else np.ascontiguousarray(weight)
    y = np.empty((m, n), dtype=x.dtype)
    rstd = np.empty(m, dtype=x.dtype)

    def chunk(start, stop, _rows):
        if stop > start:
            fn(kernels.ptr(x, start), kernels.ld(x), kernels.ptr(y, start), n, kernels.ptr(rstd, start),
               kernels.ptr(weight), stop - start, n, eps)

    run_chunks(m, n, chunk, block_rows=1, threads=threads)
    return y, rstd


def rms_norm_backward_rows(dy, x, rstd, weight, *, threads=None):
    """Backward with the compiled kernel; dweight summed chunk by chunk, in order."""
    m, n = x.shape
    fn = kernels.function("rms_norm_bwd", x.dtype)
    x = kernels.rows_for_kernel(x, x.dtype)
    dy = kernels.rows_for_kernel(dy, x.dtype)
    rstd = np.ascontiguousarray(rstd)
    weight = None if weight is None else np.ascontiguousarray(weight)
    dx = np.empty((m, n), dtype=x.dtype)

    def chunk(start, stop, _rows):
        dweight = np.zeros(n, dtype=x.dtype)
        if stop > start:
            fn(kernels.ptr(dy, start), kernels.ld(dy), kernels.ptr(x, start), kernels.ld(x),
               kernels.ptr(rstd, start), kernels.ptr(weight), kernels.ptr(dx, start), n,
               kernels.ptr(dweight), stop - start, n)
        return (dweight,)

    parts = run_chunks(m, n, chunk, block_rows=1, threads=threads)
    return (dx, *sum_chunks(parts))
