"""The NumPy fast path of the row operations: blocked, multi-threaded, every float dtype.

Each function takes rows ``(M, D)`` (any row stride) with the row contract of
:mod:`lnlib._rows` (``out`` included); ``weight``/``bias`` are flat ``(D,)`` vectors in the
accumulation dtype or None. See :mod:`lnlib._rows` for the blocking and threading, and the
book, chapter 5, for how each step was chosen.

As on the kernel path: every sum over a row is one BLAS dot per block of :data:`ROW_BLOCK`
elements with the blocks' sums added in float64 (:func:`row_dots`), so its rounding error does
not grow with the row length; the variance (or mean square) plus ``eps``, its square root and
reciprocal are computed in float64 and rounded once to ``rstd``; NaN and inf give NaN and inf
in their rows' results without floating-point warnings.
"""

import numpy as np

from .._rows import (
    accumulation_dtype,
    add_in_order,
    add_norm_backward_blocks,
    add_norm_forward_blocks,
    column_group_sums,
    load_block,
    out_array,
    run_chunks,
    written,
)

__all__ = [
    "add_layer_norm_forward_rows",
    "add_layer_norm_backward_rows",
    "add_rms_norm_forward_rows",
    "add_rms_norm_backward_rows",
    "available",
    "layer_norm_forward_rows",
    "layer_norm_backward_rows",
    "rms_norm_forward_rows",
    "rms_norm_backward_rows",
    "row_dots",
]

#: Elements per partial sum of a row in :func:`row_dots`: shorter rows are one dot each.
ROW_BLOCK = 4096


def available():
    """The NumPy path runs wherever NumPy does: ``(True, reason)``."""
    return True, "always available"


def row_dots(a, b, out):
    """``out[i] = sum_j a[i, j] b[i, j]`` (or ``b[j]`` for a vector ``b``), in float64.

    ``a`` (k, D) has contiguous rows (any row stride), ``b`` is of its shape or a ``(D,)``
    vector, both of one dtype; ``out`` is a float64 ``(k,)`` array. A row is cut into blocks
    of :data:`ROW_BLOCK` elements (the last one shorter), each block's sum is one BLAS dot
    product in the dtype of ``a`` (a stacked ``np.matmul``, the same for a row wherever it
    sits), and the blocks' sums are converted to float64 and added by one more dot, so the
    order depends on the row length only. Within a block the dot's few partial sums hold
    about a hundred elements each: one dot over a whole row of 2^24 float32 values put rstd
    700 ulp off, these blocks under 1.
    """
    k, n = a.shape
    vector = b.ndim == 1
    nb, tail = divmod(n, ROW_BLOCK) if n > ROW_BLOCK else (0, n)
    parts = np.empty((k, nb + (tail > 0)), dtype=a.dtype)  # (k, blocks)
    if nb:
        cut = nb * ROW_BLOCK
        bb = b[:cut].reshape(nb, ROW_BLOCK, 1) if vector else b[:, :cut].reshape(k, nb, -1, 1)
        np.matmul(
            a[:, :cut].reshape(k, nb, 1, ROW_BLOCK), bb, out=parts[:, :nb].reshape(k, nb, 1, 1)
        )
    if tail:
        bt = b[n - tail :, None] if vector else b[:, n - tail :, None]
        np.matmul(a[:, None, n - tail :], bt, out=parts[:, nb:].reshape(k, 1, 1))
    if parts.shape[1] == 1:
        out[...] = parts[:, 0]
    else:
        wide = parts.astype(np.float64)  # (k, blocks)
        np.matmul(wide[:, None, :], np.ones((wide.shape[1], 1)), out=out.reshape(-1, 1, 1))
    return out


def _rstd(sums, n, eps, rstd):
    """``rstd = 1 / sqrt(sums / n + eps)`` in float64 (``sums`` is overwritten), rounded once
    into ``rstd``: ``eps`` counts however small it is, as on the kernel path."""
    sums /= n
    sums += eps
    np.sqrt(sums, out=sums)
    np.divide(1, sums, out=rstd)


def _quiet(chunk):
    """``chunk`` run without floating-point warnings: NaN or inf in a row give NaN or inf in
    its results, silently, as on the kernel path (the error state is per thread, so it is set
    inside each chunk)."""

    def run(start, stop, rows):
        with np.errstate(all="ignore"):
            return chunk(start, stop, rows)

    return run


def layer_norm_forward_rows(x, weight, bias, eps, *, block_rows=None, threads=None, out=None):
    """Fast forward on a matrix ``x`` (M, D): returns y (M, D), mean (M,), rstd (M,).

    Per block of rows, all on cache-resident data: the row sums, the sums of the deviations
    from that first mean (which correct it: the corrected two-pass algorithm) and the sums of
    squared deviations from the corrected mean, each by :func:`row_dots` (BLAS dot products
    through a stacked ``matmul``, one per block of a row, the blocks added in float64); then
    ``y = xc * (rstd outer weight) + bias``, computed in place in the output block: the outer
    product folds the two scalings into one pass, and the bias is tiled once per chunk so
    that its addition is a plain contiguous loop.

    Batch invariance: each row's sums are computed by the same routine on a contiguous row of
    the same length, wherever the row sits (``np.einsum`` is avoided: its sums depend on the
    row's alignment in memory for long rows).
    """
    m, n = x.shape
    acc = accumulation_dtype(x.dtype)
    y = out_array(out, 0, (m, n), x.dtype)
    mean, rstd = out_array(out, 1, m, acc), out_array(out, 2, m, acc)

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        # The centred block is built in the output block itself when y is in the accumulation
        # dtype (one array less in cache); float16 output goes through scratch blocks.
        xc = None if y.dtype == acc else np.empty((rows, n), dtype=acc)
        xbuf = np.empty((rows, n), dtype=acc)  # copy of a strided or float16 input block
        scale = None if weight is None else np.empty((rows, n), dtype=acc)  # rstd outer weight
        bt = _tile(bias, rows)
        ones = np.ones(n, dtype=acc)
        sums = np.empty(rows, dtype=np.float64)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, mu, r = slice(0, j - i), mean[i:j], rstd[i:j]
            s = sums[b]
            xb = load_block(x[i:j], xbuf, acc)
            np.divide(row_dots(xb, ones, s), n, out=mu)
            c = y[i:j] if xc is None else xc[b]
            np.subtract(xb, mu[:, None], out=c)
            # Corrected two-pass: the deviations' own mean corrects the first mean's rounding.
            row_dots(c, ones, s)
            s /= n
            s += mu
            mu[...] = s
            np.subtract(xb, mu[:, None], out=c)
            _rstd(row_dots(c, c, s), n, eps, r)
            if scale is None:
                np.multiply(c, r[:, None], out=c)
            else:
                np.multiply(r[:, None], weight, out=scale[b])
                np.multiply(c, scale[b], out=c)
            if bt is not None:
                np.add(c, bt[b], out=c)
            if xc is not None:
                np.copyto(y[i:j], c, casting="same_kind")

    run_chunks(m, n, _quiet(chunk), block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return y, mean, rstd


def _tile(param, rows):
    """``param`` (D,) repeated to (rows, D): products with it are then contiguous loops."""
    return None if param is None else np.tile(param, (rows, 1))


def layer_norm_backward_rows(dy, x, mean, rstd, weight, *, block_rows=None, threads=None, out=None):
    """Fast backward on matrices (M, D): returns dx (M, D), dweight (D,), dbias (D,).

    With ``xc = x - mean``, ``D = dy * xc`` and per-row dot products ``c1 = dy . weight`` and
    ``c2 = D . weight`` (:func:`row_dots`), the gradient is

        dx = dy * (rstd outer weight) - xc * (rstd^3 c2 / D) - rstd c1 / D,

    the same quantity as ``rstd * (g - mean(g) - xhat * mean(g xhat))`` with ``g = dy * weight``,
    arranged so that each pass over the block does as much as one NumPy call can. The column
    sums ``dweight += rstd @ D`` and ``dbias += 1 @ dy`` are matrix-vector products over
    groups of rows, added in row order in float64 (:func:`lnlib._rows.column_group_sums`), so
    their bits do not depend on the number of threads.
    """
    m, n = x.shape
    acc = mean.dtype
    dx = out_array(out, 0, (m, n), x.dtype)
    w = np.ones(n, dtype=acc) if weight is None else weight

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xc, prod, xbuf, dybuf = (np.empty((rows, n), dtype=acc) for _ in range(4))
        c1, c2 = np.empty(rows, dtype=acc), np.empty(rows, dtype=acc)
        sums = np.empty(rows, dtype=np.float64)
        dweight, dbias = [], []  # group sums, in row order
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j]
            c = xc[b]
            np.subtract(load_block(x[i:j], xbuf, acc), mean[i:j, None], out=c)
            g = load_block(dy[i:j], dybuf, acc)
            d = prod[b]
            np.multiply(g, c, out=d)
            dweight += column_group_sums(d, r)
            dbias += column_group_sums(g)
            c1[b] = row_dots(g, w, sums[b])
            c2[b] = row_dots(d, w, sums[b])
            alpha, beta = c2[b], c1[b]
            alpha *= r
            alpha *= r
            alpha *= r / n  # rstd^3 c2 / D
            beta *= r / n  # rstd c1 / D
            out = dx[i:j] if dx.dtype == acc else xbuf[b]
            np.multiply(r[:, None], w, out=d)  # rstd outer weight
            np.multiply(g, d, out=out)
            np.multiply(c, alpha[:, None], out=c)
            np.subtract(out, c, out=out)
            np.subtract(out, beta[:, None], out=out)
            if dx.dtype != acc:
                np.copyto(dx[i:j], out, casting="same_kind")
        return dweight, dbias

    parts = run_chunks(
        m, n, _quiet(chunk), block_rows=block_rows, threads=threads, itemsize=acc.itemsize
    )
    dweight = add_in_order((g for p in parts for g in p[0]), n)
    return written(out, (dx, dweight, add_in_order((g for p in parts for g in p[1]), n)))


def rms_norm_forward_rows(x, weight, eps, *, block_rows=None, threads=None, out=None):
    """Fast forward on a matrix ``x`` (M, D): returns y (M, D) and rstd (M,).

    Per block: the sums of squares by :func:`row_dots`, then ``y = x * (rstd outer weight)``
    in one pass; see :func:`layer_norm_forward_rows`.
    """
    m, n = x.shape
    acc = accumulation_dtype(x.dtype)
    y, rstd = out_array(out, 0, (m, n), x.dtype), out_array(out, 1, m, acc)

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xbuf = np.empty((rows, n), dtype=acc)
        tmp = np.empty_like(xbuf)
        sums = np.empty(rows, dtype=np.float64)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j]
            xb = load_block(x[i:j], xbuf, acc)
            _rstd(row_dots(xb, xb, sums[b]), n, eps, r)
            out = y[i:j] if y.dtype == acc else tmp[b]
            if weight is None:
                np.multiply(xb, r[:, None], out=out)
            else:
                np.multiply(r[:, None], weight, out=tmp[b])
                np.multiply(xb, tmp[b], out=out)
            if y.dtype != acc:
                np.copyto(y[i:j], out, casting="same_kind")

    run_chunks(m, n, _quiet(chunk), block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return y, rstd


def rms_norm_backward_rows(dy, x, rstd, weight, *, block_rows=None, threads=None, out=None):
    """Fast backward on matrices (M, D): returns dx (M, D) and dweight (D,).

    With ``D = dy * x`` and the per-row dot product ``c = D . weight``,
    ``dx = dy * (rstd outer weight) - x * (rstd^3 c / D)`` and ``dweight += rstd @ D``.
    """
    m, n = x.shape
    acc = rstd.dtype
    dx = out_array(out, 0, (m, n), x.dtype)
    w = np.ones(n, dtype=acc) if weight is None else weight

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        prod, xbuf, dybuf, scaled = (np.empty((rows, n), dtype=acc) for _ in range(4))
        c = np.empty(rows, dtype=acc)
        sums = np.empty(rows, dtype=np.float64)
        dweight = []  # group sums, in row order
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j]
            xb = load_block(x[i:j], xbuf, acc)
            g = load_block(dy[i:j], dybuf, acc)
            d = prod[b]
            np.multiply(g, xb, out=d)
            dweight += column_group_sums(d, r)
            c[b] = row_dots(d, w, sums[b])
            alpha = c[b]
            alpha *= r
            alpha *= r
            alpha *= r / n  # rstd^3 c / D
            out = dx[i:j] if dx.dtype == acc else scaled[b]
            np.multiply(r[:, None], w, out=d)  # rstd outer weight
            np.multiply(g, d, out=out)
            np.multiply(xb, alpha[:, None], out=d)
            np.subtract(out, d, out=out)
            if dx.dtype != acc:
                np.copyto(dx[i:j], out, casting="same_kind")
        return dweight

    parts = run_chunks(
        m, n, _quiet(chunk), block_rows=block_rows, threads=threads, itemsize=acc.itemsize
    )
    return written(out, (dx, add_in_order((g for p in parts for g in p), n)))


# The fused residual add (the row contract in lnlib._rows): blocks of rows, the add into h,
# then this module's norm on the block while it is in cache.


def add_layer_norm_forward_rows(x, residual, weight, bias, eps, h_dtype, *, out=None):
    """``y, h, mean, rstd``: h = residual + x, then :func:`layer_norm_forward_rows` of h."""
    return add_norm_forward_blocks(
        layer_norm_forward_rows, x, residual, (weight, bias), eps, h_dtype, 2, out
    )


def add_layer_norm_backward_rows(dy, dh, h, mean, rstd, weight, *, out=None):
    """``dsum, dweight, dbias``: :func:`layer_norm_backward_rows` of h, plus dh."""
    return add_norm_backward_blocks(
        layer_norm_backward_rows, dy, dh, h, (mean, rstd), weight, 2, out
    )


def add_rms_norm_forward_rows(x, residual, weight, eps, h_dtype, *, out=None):
    """``y, h, rstd``: h = residual + x, then :func:`rms_norm_forward_rows` of h."""
    return add_norm_forward_blocks(
        rms_norm_forward_rows, x, residual, (weight,), eps, h_dtype, 1, out
    )


def add_rms_norm_backward_rows(dy, dh, h, rstd, weight, *, out=None):
    """``dsum, dweight``: :func:`rms_norm_backward_rows` of h, plus dh."""
    return add_norm_backward_blocks(rms_norm_backward_rows, dy, dh, h, (rstd,), weight, 1, out)
