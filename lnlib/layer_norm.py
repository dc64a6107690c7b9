r"""Layer normalization (Ba, Kiros and Hinton, 2016): forward and backward."""

import math

from . import _validate as check
from ._backend import select
from ._rows import accumulation_dtype, as_rows, param_row, rows_out, written
from ._validate import get_array_module

__all__ = ["layer_norm", "layer_norm_forward", "layer_norm_backward"]


def layer_norm(
    x, weight=None, bias=None, *, eps=1e-5, normalized_ndim=1, weight_offset=0.0, out=None
):
    r"""Layer normalization of ``x`` over its last ``normalized_ndim`` axes; returns ``y`` only.

    Each row (the :math:`D` values of one slice over the normalized axes) is standardized
    with its own mean and biased variance, then scaled and shifted:

    .. math::

        y_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}\,\gamma_i + \beta_i .

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input; ``norm`` is the shape of the last ``normalized_ndim`` axes. Never modified.
    weight, bias : ndarray of shape ``norm``, optional
        Gain :math:`\gamma` and bias :math:`\beta` (default: 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root, in float64; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight`` (zero-centred gain with 1.0);
        0 when ``weight`` is None.
    out : ndarray, optional
        Keyword only. An array of the shape and dtype of ``x`` to write ``y`` into (returned).

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The normalized input; the statistics are not returned (use
        :func:`layer_norm_forward` when the backward pass needs them).

    Raises
    ------
    TypeError, ValueError
        As for :func:`layer_norm_forward`, before anything is computed.

    Notes
    -----
    Same as ``layer_norm_forward(...)[0]``. Covered in :ref:`sec-ch02-one-vector` (one row)
    and :ref:`sec-ch02-tensors` (which axes are normalized).
    """
    if out is not None:
        xp = get_array_module(x=x, weight=weight, bias=bias)
        x = check.float_array(x, "x", xp)
        check.out_arrays(out, xp, [("y", x.shape, x.dtype)], single=True)
        out = (out, None, None)
    return layer_norm_forward(
        x,
        weight,
        bias,
        eps=eps,
        normalized_ndim=normalized_ndim,
        weight_offset=weight_offset,
        out=out,
    )[0]


def layer_norm_forward(
    x, weight=None, bias=None, *, eps=1e-5, normalized_ndim=1, weight_offset=0.0, out=None
):
    r"""Layer normalization forward pass, returning what the backward pass needs.

    Each slice of ``x`` over its last ``normalized_ndim`` axes (a "row" of :math:`D` elements)
    is normalized with its own mean and biased variance:

    .. math::

        \mu = \frac{1}{D}\sum_{i=1}^{D} x_i, \qquad
        \sigma^2 = \frac{1}{D}\sum_{i=1}^{D} (x_i - \mu)^2, \qquad
        y_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}\,\gamma_i + \beta_i .

    The variance is computed in two passes (never as :math:`\overline{x^2} - \mu^2`), so
    rows with a large mean and a small spread keep full accuracy.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input; ``norm`` is the shape of the last ``normalized_ndim`` axes. Never modified; any
        strides are accepted.
    weight, bias : ndarray of shape ``norm``, optional
        Elementwise affine parameters :math:`\gamma` and :math:`\beta` (default: 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root, in float64; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over, like the length of ``normalized_shape`` in
        ``torch.nn.functional.layer_norm``.
    weight_offset : float, default 0.0
        Keyword only. The scale is ``weight_offset + weight``: ``1.0`` with a weight
        initialised at zero is the zero-centred gain (Transformer Engine's
        ``zero_centered_gamma``). Must be 0 when ``weight`` is None (there is no weight
        to offset).
    out : tuple of 3 (ndarray or None), optional
        Keyword only. Arrays to write ``y``, ``mean`` and ``rstd`` into, each of exactly the
        shape and dtype of its result (a None entry is allocated); they are what is returned.
        Reused across calls, they save the allocation and the first-touch page faults of new
        arrays (chapter 5 measures both). An array that overlaps an input receives the result
        computed from the unmodified input.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The normalized, scaled and shifted input.
    mean : ndarray, shape ``lead``
        :math:`\mu` of each row, float32 for float16/float32 ``x``, float64 for float64.
    rstd : ndarray, shape ``lead``
        :math:`r = 1/\sqrt{\sigma^2 + \epsilon}` of each row, in the dtype of ``mean``.

    Raises
    ------
    TypeError
        ``x``, ``weight`` or ``bias`` is not a floating array, or they come from different
        array libraries.
    ValueError
        ``weight``/``bias`` do not have shape ``norm``; ``eps`` is negative or not finite;
        ``normalized_ndim`` is not in ``1..x.ndim``; a normalized axis is empty;
        ``weight_offset`` not finite, or nonzero without a ``weight``; an ``out`` array of
        another shape or dtype than its result, read-only, or sharing memory with another.

    Notes
    -----
    float16 and float32 inputs are accumulated in float32, float64 in float64; the sums over a row
    are added in float64 per block, so their error does not grow with the row length. Each row
    is computed independently by the same operations, so results are bitwise independent of the
    other rows in the batch. ``eps`` is added to the variance in float64 and ``rstd`` rounded
    once to its dtype, so any positive ``eps`` counts (in float32 one below about 1e-45 would be
    0). NaN or inf in a row make that row's results NaN or inf (where float64 arithmetic puts
    them), with no floating-point warning. Every CPU implementation
    (:func:`lnlib.use_implementation`) does both the same way. Covered in
    :ref:`sec-ch02-one-vector` and :ref:`sec-ch02-tensors`; what is saved for the backward in
    :ref:`sec-ch05-saves`.

    References
    ----------
    .. [1] J. L. Ba, J. R. Kiros and G. E. Hinton, "Layer Normalization", arXiv:1607.06450, 2016.
    """
    xp = get_array_module(x=x, weight=weight, bias=bias)
    x = check.float_array(x, "x", xp)
    eps = check.eps_value(eps)
    k = check.normalized_ndim_value(x, normalized_ndim)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    bias = check.optional_param(bias, "bias", norm, xp)
    offset = check.weight_offset_value(weight_offset, weight)
    acc, lead = accumulation_dtype(x.dtype), x.shape[: x.ndim - k]
    out = check.out_arrays(
        out, xp, [("y", x.shape, x.dtype), ("mean", lead, acc), ("rstd", lead, acc)]
    )
    forward_rows = select("layer_norm_forward", xp)
    m, n = math.prod(lead), math.prod(norm)
    rows = None  # the out= arrays the row function writes into
    if out is not None:
        rows = rows_out(out, (((m, n), x.dtype), ((m,), acc), ((m,), acc)), (x, weight, bias), xp)
    y, mean, rstd = forward_rows(
        as_rows(x, k), param_row(weight, acc, offset), param_row(bias, acc), eps=eps, out=rows
    )
    return written(out, (y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)), rows)


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, weight_offset=0.0, out=None):
    r"""Layer normalization backward pass.

    With :math:`\hat{x} = (x - \mu)\,r` (:math:`r` is ``rstd``) and :math:`g = dy\,\gamma`, per
    row

    .. math::

        dx = r\,\Big(g - \overline{g} - \hat{x}\;\overline{g\hat{x}}\Big), \qquad
        d\gamma = \sum_{\text{rows}} dy\,\hat{x}, \qquad d\beta = \sum_{\text{rows}} dy,

    where a bar is the mean over the normalized axes. This is the exact gradient of
    :func:`layer_norm_forward` (``eps`` included).

    Parameters
    ----------
    dy : ndarray, shape of ``x``, float16, float32 or float64
        Gradient of the loss with respect to ``y``, of any float dtype: it is used in the
        accumulation dtype (float32 for float16/float32 ``x``, float64 for float64), so a
        float32 ``dy`` for float16 ``x`` is neither rounded to float16 nor clipped to its
        range, on every implementation.
    x : ndarray, float16, float32 or float64
        The forward input.
    mean, rstd : ndarray, shape ``lead``
        As returned by :func:`layer_norm_forward`; ``x.ndim - mean.ndim`` axes are normalized.
    weight : ndarray of shape ``norm``, optional
        The forward weight; ``None`` means a weight of ones.
    weight_offset : float, default 0.0
        Keyword only; the forward's ``weight_offset`` (the scale was
        ``weight_offset + weight``). ``dweight`` has the same form for any offset.
    out : tuple of 3 (ndarray or None), optional
        Keyword only. Arrays to write ``dx``, ``dweight`` and ``dbias`` into, each of exactly
        the shape and dtype of its result (a None entry is allocated); they are returned. An
        array that overlaps an input receives the result computed from the unmodified input.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient of the loss with respect to ``x``.
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
        of one shape; ``weight`` not of shape ``norm``; an ``out`` array of another shape or
        dtype than its result, read-only, or sharing memory with another.

    Notes
    -----
    The gradient is accumulated in float32 for float16/float32 ``x`` and in float64 for
    float64 ``x``, whatever the dtype of ``mean`` and ``rstd`` (they are cast to it). NaN or
    inf in the inputs give NaN or inf in the results, with no floating-point warning, on
    every implementation.
    Covered in :ref:`sec-ch02-backward`.
    """
    xp = get_array_module(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    dy, x, (mean, rstd), k = check.backward_inputs(dy, x, xp, mean=mean, rstd=rstd)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    offset = check.weight_offset_value(weight_offset, weight)
    pdtype = x.dtype if weight is None else weight.dtype
    out = check.out_arrays(
        out, xp, [("dx", x.shape, x.dtype), ("dweight", norm, pdtype), ("dbias", norm, pdtype)]
    )
    backward_rows = select("layer_norm_backward", xp)
    acc = accumulation_dtype(x.dtype)  # also for statistics saved in another dtype
    m, n = mean.size, math.prod(norm)
    rows = None  # the out= arrays the row function writes into
    if out is not None:
        rows = rows_out(
            out, (((m, n), x.dtype), ((n,), acc), ((n,), acc)), (dy, x, mean, rstd, weight), xp
        )
    dx, dweight, dbias = backward_rows(
        as_rows(dy, k),
        as_rows(x, k),
        mean.reshape(-1).astype(acc, copy=False),
        rstd.reshape(-1).astype(acc, copy=False),
        param_row(weight, acc, offset),
        out=rows,
    )
    dweight = dweight.reshape(norm).astype(pdtype, copy=False)
    dbias = dbias.reshape(norm).astype(pdtype, copy=False)
    return written(out, (dx.reshape(x.shape), dweight, dbias), rows)
