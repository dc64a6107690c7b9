r"""Layer normalization (Ba, Kiros and Hinton, 2016): forward and backward."""

import numpy as np

from . import _cpu_kernels as kernels
from . import _validate as check
from . import reference
from ._backend import accumulation_dtype, get_array_module
from ._rows import as_rows, load_block, run_chunks, sum_chunks

__all__ = ["layer_norm", "layer_norm_forward", "layer_norm_backward"]


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, normalized_ndim=1):
    r"""Layer normalization of ``x`` over its last ``normalized_ndim`` axes; returns ``y`` only.

    Same as ``layer_norm_forward(...)[0]``; see :func:`layer_norm_forward` for the details.
    """
    return layer_norm_forward(x, weight, bias, eps=eps, normalized_ndim=normalized_ndim)[0]


def layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5, normalized_ndim=1):
    r"""Layer normalization forward pass, returning what the backward pass needs.

    Each slice of ``x`` over its last ``normalized_ndim`` axes (a "row" of :math:`H` elements)
    is normalized with its own mean and biased variance:

    .. math::

        \mu = \frac{1}{H}\sum_{i=1}^{H} x_i, \qquad
        \sigma^2 = \frac{1}{H}\sum_{i=1}^{H} (x_i - \mu)^2, \qquad
        y_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}\,\gamma_i + \beta_i .

    The variance is computed in two passes (never as :math:`E[x^2] - E[x]^2`), so rows with a
    large mean and a small spread keep full accuracy.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input; ``norm`` is the shape of the last ``normalized_ndim`` axes. Never modified; any
        strides are accepted.
    weight, bias : ndarray of shape ``norm``, optional
        Elementwise affine parameters :math:`\gamma` and :math:`\beta` (default: 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over, like the length of ``normalized_shape`` in
        ``torch.nn.functional.layer_norm``.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
    mean : ndarray, shape ``lead``
        :math:`\mu` of each row, float32 for float16/float32 ``x``, float64 for float64.
    rstd : ndarray, shape ``lead``
        :math:`1/\sqrt{\sigma^2 + \epsilon}` of each row, in the dtype of ``mean``.

    Raises
    ------
    TypeError
        ``x``, ``weight`` or ``bias`` is not a floating array, or they come from different
        array libraries.
    ValueError
        ``weight``/``bias`` do not have shape ``norm``; ``eps`` is negative or not finite;
        ``normalized_ndim`` is not in ``1..x.ndim``; a normalized axis is empty.

    Notes
    -----
    float16 and float32 inputs are accumulated in float32, float64 in float64. Each row is
    computed independently by the same operations, so results are bitwise independent of the
    other rows in the batch. Derived in the book, chapter "The math of LayerNorm".

    References
    ----------
    J. L. Ba, J. R. Kiros and G. E. Hinton, "Layer Normalization", arXiv:1607.06450, 2016.
    """
    xp = get_array_module(x=x, weight=weight, bias=bias)
    x = check.float_array(x, "x", xp)
    eps = check.eps_value(eps)
    k = check.normalized_ndim_value(x, normalized_ndim)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    bias = check.optional_param(bias, "bias", norm, xp)
    if xp is not np:
        return reference.layer_norm_forward(x, weight, bias, eps=eps, normalized_ndim=k)
    lead = x.shape[: x.ndim - k]
    fast = _forward_kernel if kernels.function("layer_norm_fwd", x.dtype) else _forward_numpy
    y, mean, rstd = fast(as_rows(x, k), _flat(weight, x), _flat(bias, x), eps)
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    r"""Layer normalization backward pass.

    With :math:`\hat{x} = (x - \mu)\,\mathrm{rstd}` and :math:`g = dy\,\gamma`, per row

    .. math::

        dx = \mathrm{rstd}\,\Big(g - \overline{g} - \hat{x}\;\overline{g\hat{x}}\Big), \qquad
        d\gamma = \sum_{\text{rows}} dy\,\hat{x}, \qquad d\beta = \sum_{\text{rows}} dy,

    where a bar is the mean over the normalized axes. This is the exact gradient of
    :func:`layer_norm_forward` (``eps`` included).

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64
        The forward input.
    mean, rstd : ndarray, shape ``lead``
        As returned by :func:`layer_norm_forward`; ``x.ndim - mean.ndim`` axes are normalized.
    weight : ndarray of shape ``norm``, optional
        The forward weight; ``None`` means a weight of ones.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
    dweight, dbias : ndarray, shape ``norm``
        Parameter gradients, also when no weight or bias was used (then they are the
        gradients with respect to a weight of ones and a bias of zeros); dtype of ``weight``,
        or of ``x`` when ``weight`` is ``None``.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``dy`` not shaped like ``x``; ``mean``/``rstd`` not the leading axes of ``x`` or not
        of one shape; ``weight`` not of shape ``norm``.

    Notes
    -----
    Derived in the book, chapter "The math of LayerNorm", section on the backward pass.
    """
    xp = get_array_module(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    dy, x, (mean, rstd), k = check.backward_inputs(dy, x, xp, mean=mean, rstd=rstd)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    if xp is not np:
        return reference.layer_norm_backward(dy, x, mean, rstd, weight)
    fast = _backward_numpy
    if kernels.function("layer_norm_bwd", x.dtype) and mean.dtype == rstd.dtype == x.dtype:
        fast = _backward_kernel
    dx, dweight, dbias = fast(
        as_rows(dy, k), as_rows(x, k), mean.reshape(-1), rstd.reshape(-1), _flat(weight, x)
    )
    pdtype = x.dtype if weight is None else weight.dtype
    return dx.reshape(x.shape), dweight.reshape(norm).astype(pdtype), dbias.reshape(norm).astype(pdtype)


def _flat(param, x):
    """A per-feature parameter as a flat vector in the accumulation dtype of ``x``."""
    if param is None:
        return None
    return param.reshape(-1).astype(accumulation_dtype(x.dtype), copy=False)


def _forward_numpy(x, weight, bias, eps, *, block_rows=None, threads=None):
    """Fast forward on a matrix ``x`` (M, N): returns y (M, N), mean (M,), rstd (M,).

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
    """``param`` (N,) repeated to (rows, N): products with it are then contiguous loops."""
    return None if param is None else np.tile(param, (rows, 1))


def _backward_numpy(dy, x, mean, rstd, weight, *, block_rows=None, threads=None):
    """Fast backward on matrices (M, N): returns dx (M, N), dweight (N,), dbias (N,) in acc.

    With ``xc = x - mean``, ``D = dy * xc`` and per-row dot products ``c1 = dy . weight`` and
    ``c2 = D . weight`` (BLAS, one per row), the gradient is

        dx = dy * (rstd outer weight) - xc * (rstd^3 c2 / N) - rstd c1 / N,

    the same quantity as ``rstd * (g - mean(g) - xhat * mean(g xhat))`` with ``g = dy * weight``,
    arranged so that each pass over the block does as much as one NumPy call can. The column
    sums ``dweight += rstd @ D`` and ``dbias += 1 @ dy`` are matrix-vector products.
    """
    m, n = x.shape
    acc = mean.dtype
    dx = np.empty((m, n), dtype=x.dtype)
    w = np.ones(n, dtype=acc) if weight is None else weight

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xc, prod, xbuf, dybuf = (np.empty((rows, n), dtype=acc) for _ in range(4))
        ones = np.ones(rows, dtype=acc)
        c1, c2 = np.empty(rows, dtype=acc), np.empty(rows, dtype=acc)
        colsum = np.empty(n, dtype=acc)
        dweight, dbias = np.zeros(n, dtype=acc), np.zeros(n, dtype=acc)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r, k = slice(0, j - i), rstd[i:j], j - i
            c = xc[b]
            np.subtract(load_block(x[i:j], xbuf, acc), mean[i:j, None], out=c)
            g = load_block(dy[i:j], dybuf, acc)
            d = prod[b]
            np.multiply(g, c, out=d)
            dweight += np.matmul(r, d, out=colsum)
            dbias += np.matmul(ones[:k], g, out=colsum)
            np.matmul(g[:, None, :], w[:, None], out=c1[b].reshape(-1, 1, 1))
            np.matmul(d[:, None, :], w[:, None], out=c2[b].reshape(-1, 1, 1))
            alpha, beta = c2[b], c1[b]
            alpha *= r
            alpha *= r
            alpha *= r / n  # rstd^3 c2 / N
            beta *= r / n  # rstd c1 / N
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
    return (dx, *sum_chunks(parts))


def _forward_kernel(x, weight, bias, eps, *, threads=None):
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


def _backward_kernel(dy, x, mean, rstd, weight, *, threads=None):
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
