r"""Root-mean-square layer normalization (Zhang and Sennrich, 2019): forward and backward."""

import numpy as np

from . import _cpu_kernels as kernels
from . import _validate as check
from . import reference
from ._backend import accumulation_dtype, get_array_module
from ._rows import as_rows, load_block, run_chunks, sum_chunks
from .layer_norm import _flat

__all__ = ["rms_norm", "rms_norm_forward", "rms_norm_backward"]


def rms_norm(x, weight=None, *, eps=1e-6, normalized_ndim=1):
    r"""RMS normalization of ``x`` over its last ``normalized_ndim`` axes; returns ``y`` only.

    Same as ``rms_norm_forward(...)[0]``; see :func:`rms_norm_forward`.
    """
    return rms_norm_forward(x, weight, eps=eps, normalized_ndim=normalized_ndim)[0]


def rms_norm_forward(x, weight=None, *, eps=1e-6, normalized_ndim=1):
    r"""RMSNorm forward pass: rescale each row by its root mean square, without centring.

    .. math::

        \mathrm{rstd} = \Big(\frac{1}{H}\sum_{i=1}^{H} x_i^2 + \epsilon\Big)^{-1/2}, \qquad
        y_i = x_i\,\mathrm{rstd}\,\gamma_i .

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input; never modified; any strides are accepted.
    weight : ndarray of shape ``norm``, optional
        Elementwise gain :math:`\gamma` (default 1).
    eps : float, default 1e-6
        Added to the mean square inside the square root; finite and >= 0.
    normalized_ndim : int, default 1
        Number of trailing axes normalized over.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
    rstd : ndarray, shape ``lead``
        float32 for float16/float32 ``x``, float64 for float64.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``weight`` not of shape ``norm``; ``eps`` negative or not finite; ``normalized_ndim``
        outside ``1..x.ndim``; an empty normalized axis.

    Notes
    -----
    Covered in the book, chapter "Variants". Matches ``torch.nn.functional.rms_norm``
    with the same ``eps``.

    References
    ----------
    B. Zhang and R. Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.
    """
    xp = get_array_module(x=x, weight=weight)
    x = check.float_array(x, "x", xp)
    eps = check.eps_value(eps)
    k = check.normalized_ndim_value(x, normalized_ndim)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    if xp is not np:
        return reference.rms_norm_forward(x, weight, eps=eps, normalized_ndim=k)
    fast = _forward_kernel if kernels.function("rms_norm_fwd", x.dtype) else _forward_numpy
    y, rstd = fast(as_rows(x, k), _flat(weight, x), eps)
    return y.reshape(x.shape), rstd.reshape(x.shape[: x.ndim - k])


def rms_norm_backward(dy, x, rstd, weight=None):
    r"""RMSNorm backward pass.

    With :math:`\hat{x} = x\,\mathrm{rstd}` and :math:`g = dy\,\gamma`, per row

    .. math::

        dx = \mathrm{rstd}\,\big(g - \hat{x}\;\overline{g\hat{x}}\big), \qquad
        d\gamma = \sum_{\text{rows}} dy\,\hat{x},

    where the bar is the mean over the normalized axes (exact, ``eps`` included).

    Parameters
    ----------
    dy : ndarray, shape of ``x``
    x : ndarray, float16, float32 or float64
    rstd : ndarray, shape ``lead``
        As returned by :func:`rms_norm_forward`; ``x.ndim - rstd.ndim`` axes are normalized.
    weight : ndarray of shape ``norm``, optional

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
    dweight : ndarray, shape ``norm``, dtype of ``weight`` (of ``x`` when ``weight`` is None)

    Raises
    ------
    TypeError, ValueError
        As for :func:`lnlib.layer_norm_backward`.
    """
    xp = get_array_module(dy=dy, x=x, rstd=rstd, weight=weight)
    dy, x, (rstd,), k = check.backward_inputs(dy, x, xp, rstd=rstd)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    if xp is not np:
        return reference.rms_norm_backward(dy, x, rstd, weight)
    fast = _backward_numpy
    if kernels.function("rms_norm_bwd", x.dtype) and rstd.dtype == x.dtype:
        fast = _backward_kernel
    dx, dweight = fast(as_rows(dy, k), as_rows(x, k), rstd.reshape(-1), _flat(weight, x))
    pdtype = x.dtype if weight is None else weight.dtype
    return dx.reshape(x.shape), dweight.reshape(norm).astype(pdtype)


def _forward_numpy(x, weight, eps, *, block_rows=None, threads=None):
    """Fast forward on a matrix ``x`` (M, N): returns y (M, N) and rstd (M,).

    Per block: the sums of squares as one BLAS dot product per row (stacked ``matmul``), then
    ``y = x * (rstd outer weight)`` in one pass; see :func:`lnlib.layer_norm._forward_numpy`.
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


def _backward_numpy(dy, x, rstd, weight, *, block_rows=None, threads=None):
    """Fast backward on matrices (M, N): returns dx (M, N) and dweight (N,) in acc dtype.

    With ``D = dy * x`` and the per-row dot product ``c = D . weight``,
    ``dx = dy * (rstd outer weight) - x * (rstd^3 c / N)`` and ``dweight += rstd @ D``.
    """
    m, n = x.shape
    acc = rstd.dtype
    dx = np.empty((m, n), dtype=x.dtype)
    w = np.ones(n, dtype=acc) if weight is None else weight

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        prod, xbuf, dybuf, scaled = (np.empty((rows, n), dtype=acc) for _ in range(4))
        c = np.empty(rows, dtype=acc)
        colsum = np.empty(n, dtype=acc)
        dweight = np.zeros(n, dtype=acc)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j]
            xb = load_block(x[i:j], xbuf, acc)
            g = load_block(dy[i:j], dybuf, acc)
            d = prod[b]
            np.multiply(g, xb, out=d)
            dweight += np.matmul(r, d, out=colsum)
            np.matmul(d[:, None, :], w[:, None], out=c[b].reshape(-1, 1, 1))
            alpha = c[b]
            alpha *= r
            alpha *= r
            alpha *= r / n  # rstd^3 c / N
            out = dx[i:j] if dx.dtype == acc else scaled[b]
            np.multiply(r[:, None], w, out=d)  # rstd outer weight
            np.multiply(g, d, out=out)
            np.multiply(xb, alpha[:, None], out=d)
            np.subtract(out, d, out=out)
            if dx.dtype != acc:
                np.copyto(dx[i:j], out, casting="same_kind")
        return (dweight,)

    parts = run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return (dx, *sum_chunks(parts))


def _forward_kernel(x, weight, eps, *, threads=None):
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


def _backward_kernel(dy, x, rstd, weight, *, threads=None):
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
