r"""Layer normalization (Ba, Kiros and Hinton, 2016): forward and backward."""

import numpy as np

from . import _validate as check
from . import reference
from ._backend import accumulation_dtype, get_array_module
from ._rows import as_rows, load_block, run_chunks

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
        :func:`torch.nn.functional.layer_norm`.

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
    y, mean, rstd = _forward_numpy(as_rows(x, k), _flat(weight, x), _flat(bias, x), eps)
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
    x = check.float_array(x, "x", xp)
    dy = check.float_array(dy, "dy", xp)
    check.same_shape(dy, "dy", x)
    mean = check.float_array(mean, "mean", xp)
    rstd = check.float_array(rstd, "rstd", xp)
    k = check.saved_stats(x, mean=mean, rstd=rstd)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    if xp is not np:
        return reference.layer_norm_backward(dy, x, mean, rstd, weight)
    dx, dweight, dbias = _backward_numpy(
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

    Per block of rows, seven passes over cache-resident data: sum, centre, square, sum, scale
    by rstd, times weight, plus bias. Weight and bias are tiled to the block's shape once per
    chunk, so those two products are plain contiguous loops. Every row reduction is
    ``np.add.reduce`` over one contiguous row (pairwise summation, whose order depends only on
    the row's length); ``np.einsum`` is avoided because its sums depend on the row's
    alignment in memory for long rows, which would break batch invariance.
    """
    m, n = x.shape
    acc = accumulation_dtype(x.dtype)
    y = np.empty((m, n), dtype=x.dtype)
    mean = np.empty(m, dtype=acc)
    rstd = np.empty(m, dtype=acc)

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xc = np.empty((rows, n), dtype=acc)  # centred block
        tmp = np.empty_like(xc)  # input copy, then output in acc dtype
        wt = _tile(weight, rows)
        bt = _tile(bias, rows)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, mu, r = slice(0, j - i), mean[i:j], rstd[i:j]
            xb = load_block(x[i:j], tmp, acc)
            np.add.reduce(xb, axis=1, out=mu)
            mu /= n
            np.subtract(xb, mu[:, None], out=xc[b])
            np.multiply(xc[b], xc[b], out=tmp[b])
            np.add.reduce(tmp[b], axis=1, out=r)
            r /= n
            r += eps
            np.sqrt(r, out=r)
            np.divide(1, r, out=r)
            out = y[i:j] if y.dtype == acc else tmp[b]
            np.multiply(xc[b], r[:, None], out=out)
            if wt is not None:
                np.multiply(out, wt[b], out=out)
            if bt is not None:
                np.add(out, bt[b], out=out)
            if y.dtype != acc:
                np.copyto(y[i:j], out, casting="same_kind")

    run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    return y, mean, rstd


def _tile(param, rows):
    """``param`` (N,) repeated to (rows, N): products with it are then contiguous loops."""
    return None if param is None else np.tile(param, (rows, 1))


def _backward_numpy(dy, x, mean, rstd, weight, *, block_rows=None, threads=None):
    """Fast backward on matrices (M, N): returns dx (M, N), dweight (N,), dbias (N,) in acc.

    Per block: recompute xhat, accumulate the column sums for dweight and dbias, then the two
    row reductions mean(g) and mean(g * xhat) and dx = rstd * (g - mean(g) - xhat * mean(g xhat)).
    """
    m, n = x.shape
    acc = mean.dtype
    dx = np.empty((m, n), dtype=x.dtype)

    def chunk(start, stop, rows):
        rows = max(1, min(rows, stop - start))
        xhat, tmp, gbuf, dybuf = (np.empty((rows, n), dtype=acc) for _ in range(4))
        wt = _tile(weight, rows)
        c1, c2 = np.empty(rows, dtype=acc), np.empty(rows, dtype=acc)
        colsum = np.empty(n, dtype=acc)
        dweight, dbias = np.zeros(n, dtype=acc), np.zeros(n, dtype=acc)
        for i in range(start, stop, rows):
            j = min(i + rows, stop)
            b, r = slice(0, j - i), rstd[i:j, None]
            xb = load_block(x[i:j], tmp, acc)
            np.subtract(xb, mean[i:j, None], out=xhat[b])
            np.multiply(xhat[b], r, out=xhat[b])
            g = dyb = load_block(dy[i:j], dybuf, acc)
            np.multiply(dyb, xhat[b], out=tmp[b])
            dweight += np.add.reduce(tmp[b], axis=0, out=colsum)
            dbias += np.add.reduce(dyb, axis=0, out=colsum)
            if wt is not None:
                g = np.multiply(dyb, wt[b], out=gbuf[b])
            np.add.reduce(g, axis=1, out=c1[b])
            c1[b] /= n
            np.multiply(g, xhat[b], out=tmp[b])
            np.add.reduce(tmp[b], axis=1, out=c2[b])
            c2[b] /= n
            np.multiply(xhat[b], c2[b, None], out=xhat[b])
            np.subtract(g, xhat[b], out=xhat[b])
            np.subtract(xhat[b], c1[b, None], out=xhat[b])
            np.multiply(xhat[b], r, out=dx[i:j], casting="same_kind")
        return dweight, dbias

    parts = run_chunks(m, n, chunk, block_rows=block_rows, threads=threads, itemsize=acc.itemsize)
    dweight, dbias = parts[0]
    for dw, db in parts[1:]:
        dweight += dw
        dbias += db
    return dx, dweight, dbias
