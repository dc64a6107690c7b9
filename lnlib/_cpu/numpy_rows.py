"""The NumPy fast path of the row operations: blocked, multi-threaded, every float dtype.

Each function takes rows ``(M, D)`` (any row stride) with the signature listed in
:mod:`lnlib._backend`; ``weight``/``bias`` are flat ``(D,)`` vectors in the accumulation dtype
or None. See :mod:`lnlib._rows` for the blocking and threading, and the book, chapter 5, for
how each step was chosen.
"""

import numpy as np

from .._backend import accumulation_dtype
from .._rows import add_in_order, column_group_sums, load_block, run_chunks

__all__ = [
    "layer_norm_forward_rows",
    "layer_norm_backward_rows",
    "rms_norm_forward_rows",
    "rms_norm_backward_rows",
]


def layer_norm_forward_rows(x, weight, bias, eps, *, block_rows=None, threads=None):
    """Fast forward on a matrix ``x`` (M, D): returns y (M, D), mean (M,), rstd (M,).

    Per block of rows, all on cache-resident data: the row sums, the sums of the deviations
    from that first mean (which correct it: the corrected two-pass algorithm) and the sums of
    squared deviations from the corrected mean, each one BLAS dot product per row through a
    stacked ``matmul`` (vectorised, with many partial sums); then
    ``y = xc * (rstd outer weight) + bias``, computed in place in the output block: the outer
    product folds the two scalings into one pass, and the bias is tiled once per chunk so
    that its addition is a plain contiguous loop.

    Batch invariance: each row's sums are computed by the same routine on a contiguous row of
    the same length, wherever the row sits (``np.einsum`` is avoided: its sums depend on the
    row's alignment in memory for long rows).
    """
    m, n = x.shape
    acc = accumulation_dtype(x.dtype)
    y = np.empty((m, n), dtype=x.dtype)
    mean = np.empty(m, dtype=acc)
    rstd = np.empty(m, dtype=acc)

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        # The centred block is built in the output block itself when y is in the accumulation
        # dtype (one array less in cache); float16 output goes through scratch blocks.
        xc = None if y.dtype == acc else np.empty((rows, n), dtype=acc)
        xbuf = np.empty((rows, n), dtype=acc)  # copy of a strided or float16 input block
        scale = None if weight is None else np.empty((rows, n), dtype=acc)  # rstd outer weight
        bt = _tile(bias, rows)
        ones = np.ones((n, 1), dtype=acc)
        delta = np.empty(rows, dtype=acc)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, mu, r = slice(0, j - i), mean[i:j], rstd[i:j]
            xb = load_block(x[i:j], xbuf, acc)
            np.matmul(xb[:, None, :], ones, out=mu.reshape(-1, 1, 1))
            mu /= n
            c = y[i:j] if xc is None else xc[b]
            np.subtract(xb, mu[:, None], out=c)
            # Corrected two-pass: the deviations' own mean corrects the first mean's rounding.
            np.matmul(c[:, None, :], ones, out=delta[b].reshape(-1, 1, 1))
            delta[b] /= n
            mu += delta[b]
            np.subtract(xb, mu[:, None], out=c)
            np.matmul(c[:, None, :], c[:, :, None], out=r.reshape(-1, 1, 1))
            r /= n
            r += eps
            np.sqrt(r, out=r)
            np.divide(1, r, out=r)
            if scale is None:
                np.multiply(c, r[:, None], out=c)
            else:
                np.multiply(r[:, None], weight, out=scale[b])
                np.multiply(c, scale[b], out=c)
            if bt is not None:
                np.add(c, bt[b], out=c)
            if xc is not None:
                np.copyto(y[i:j], c, casting="same_kind")

    run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return y, mean, rstd


def _tile(param, rows):
    """``param`` (D,) repeated to (rows, D): products with it are then contiguous loops."""
    return None if param is None else np.tile(param, (rows, 1))


def layer_norm_backward_rows(dy, x, mean, rstd, weight, *, block_rows=None, threads=None):
    """Fast backward on matrices (M, D): returns dx (M, D), dweight (D,), dbias (D,).

    With ``xc = x - mean``, ``D = dy * xc`` and per-row dot products ``c1 = dy . weight`` and
    ``c2 = D . weight`` (BLAS, one per row), the gradient is

        dx = dy * (rstd outer weight) - xc * (rstd^3 c2 / D) - rstd c1 / D,

    the same quantity as ``rstd * (g - mean(g) - xhat * mean(g xhat))`` with ``g = dy * weight``,
    arranged so that each pass over the block does as much as one NumPy call can. The column
    sums ``dweight += rstd @ D`` and ``dbias += 1 @ dy`` are matrix-vector products over
    groups of rows, added in row order in float64 (:func:`lnlib._rows.column_group_sums`), so
    their bits do not depend on the number of threads.
    """
    m, n = x.shape
    acc = mean.dtype
    dx = np.empty((m, n), dtype=x.dtype)
    w = np.ones(n, dtype=acc) if weight is None else weight

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xc, prod, xbuf, dybuf = (np.empty((rows, n), dtype=acc) for _ in range(4))
        c1, c2 = np.empty(rows, dtype=acc), np.empty(rows, dtype=acc)
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
            np.matmul(g[:, None, :], w[:, None], out=c1[b].reshape(-1, 1, 1))
            np.matmul(d[:, None, :], w[:, None], out=c2[b].reshape(-1, 1, 1))
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

    parts = run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return (
        dx,
        add_in_order((g for p in parts for g in p[0]), n),
        add_in_order((g for p in parts for g in p[1]), n),
    )


def rms_norm_forward_rows(x, weight, eps, *, block_rows=None, threads=None):
    """Fast forward on a matrix ``x`` (M, D): returns y (M, D) and rstd (M,).

    Per block: the sums of squares as one BLAS dot product per row (stacked ``matmul``), then
    ``y = x * (rstd outer weight)`` in one pass; see :func:`layer_norm_forward_rows`.
    """
    m, n = x.shape
    acc = accumulation_dtype(x.dtype)
    y = np.empty((m, n), dtype=x.dtype)
    rstd = np.empty(m, dtype=acc)

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xbuf = np.empty((rows, n), dtype=acc)
        tmp = np.empty_like(xbuf)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j]
            xb = load_block(x[i:j], xbuf, acc)
            np.matmul(xb[:, None, :], xb[:, :, None], out=r.reshape(-1, 1, 1))
            r /= n
            r += eps
            np.sqrt(r, out=r)
            np.divide(1, r, out=r)
            out = y[i:j] if y.dtype == acc else tmp[b]
            if weight is None:
                np.multiply(xb, r[:, None], out=out)
            else:
                np.multiply(r[:, None], weight, out=tmp[b])
                np.multiply(xb, tmp[b], out=out)
            if y.dtype != acc:
                np.copyto(y[i:j], out, casting="same_kind")

    run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return y, rstd


def rms_norm_backward_rows(dy, x, rstd, weight, *, block_rows=None, threads=None):
    """Fast backward on matrices (M, D): returns dx (M, D) and dweight (D,).

    With ``D = dy * x`` and the per-row dot product ``c = D . weight``,
    ``dx = dy * (rstd outer weight) - x * (rstd^3 c / D)`` and ``dweight += rstd @ D``.
    """
    m, n = x.shape
    acc = rstd.dtype
    dx = np.empty((m, n), dtype=x.dtype)
    w = np.ones(n, dtype=acc) if weight is None else weight

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        prod, xbuf, dybuf, scaled = (np.empty((rows, n), dtype=acc) for _ in range(4))
        c = np.empty(rows, dtype=acc)
        dweight = []  # group sums, in row order
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j]
            xb = load_block(x[i:j], xbuf, acc)
            g = load_block(dy[i:j], dybuf, acc)
            d = prod[b]
            np.multiply(g, xb, out=d)
            dweight += column_group_sums(d, r)
            np.matmul(d[:, None, :], w[:, None], out=c[b].reshape(-1, 1, 1))
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

    parts = run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return dx, add_in_order((g for p in parts for g in p), n)
