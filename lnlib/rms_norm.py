r"""Root-mean-square layer normalization (Zhang and Sennrich, 2019): forward and backward."""

import math

from . import _validate as check
from ._backend import select
from ._rows import accumulation_dtype, as_rows, param_row, rows_out, written
from ._validate import get_array_module

__all__ = ["rms_norm", "rms_norm_forward", "rms_norm_backward"]


def rms_norm(x, weight=None, *, eps=1e-6, normalized_ndim=1, weight_offset=0.0, out=None):
    r"""RMS normalization of ``x`` over its last ``normalized_ndim`` axes; returns ``y`` only.

    .. math::

        y_i = \frac{x_i}{\sqrt{\frac{1}{D}\sum_{j=1}^{D} x_j^2 + \epsilon}}\,\gamma_i .

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input; ``norm`` is the shape of the last ``normalized_ndim`` axes. Never modified.
    weight : ndarray of shape ``norm``, optional
        Gain :math:`\gamma` (default 1).
    eps : float, default 1e-6
        Added to the mean square inside the square root, in float64; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight`` (Gemma's zero-centred gain with
        1.0); 0 when ``weight`` is None.
    out : ndarray, optional
        Keyword only. An array of the shape and dtype of ``x`` to write ``y`` into (returned).

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The rescaled input; use :func:`rms_norm_forward` when the backward needs ``rstd``.

    Raises
    ------
    TypeError, ValueError
        As for :func:`rms_norm_forward`, before anything is computed.

    Notes
    -----
    Same as ``rms_norm_forward(...)[0]``. Covered in :doc:`/book/04_variants`, section
    "RMSNorm".
    """
    if out is not None:
        xp = get_array_module(x=x, weight=weight)
        x = check.float_array(x, "x", xp)
        check.out_arrays(out, xp, [("y", x.shape, x.dtype)], single=True)
        out = (out, None)
    return rms_norm_forward(
        x,
        weight,
        eps=eps,
        normalized_ndim=normalized_ndim,
        weight_offset=weight_offset,
        out=out,
    )[0]


def rms_norm_forward(x, weight=None, *, eps=1e-6, normalized_ndim=1, weight_offset=0.0, out=None):
    r"""RMSNorm forward pass: rescale each row by its root mean square, without centring.

    .. math::

        r = \Big(\frac{1}{D}\sum_{i=1}^{D} x_i^2 + \epsilon\Big)^{-1/2}, \qquad
        y_i = x_i\,r\,\gamma_i ,

    with :math:`r` returned as ``rstd``.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input; never modified; any strides are accepted.
    weight : ndarray of shape ``norm``, optional
        Elementwise gain :math:`\gamma` (default 1).
    eps : float, default 1e-6
        Added to the mean square inside the square root, in float64; finite and >= 0.
    normalized_ndim : int, default 1
        Number of trailing axes normalized over.
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight``: ``1.0`` with a weight
        initialised at zero is Gemma's RMSNorm (zero-centred gain). Must be 0 when
        ``weight`` is None.
    out : tuple of 2 (ndarray or None), optional
        Keyword only. Arrays to write ``y`` and ``rstd`` into, each of exactly the shape and
        dtype of its result (a None entry is allocated); they are returned. An array that
        overlaps an input receives the result computed from the unmodified input.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The rescaled input.
    rstd : ndarray, shape ``lead``
        The reciprocal root mean square of each row, float32 for float16/float32 ``x``,
        float64 for float64.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``weight`` not of shape ``norm``; ``eps`` negative or not finite; ``normalized_ndim``
        outside ``1..x.ndim``; an empty normalized axis; ``weight_offset`` not finite, or
        nonzero without a ``weight``; an ``out`` array of another shape or dtype than its
        result, read-only, or sharing memory with another.

    Notes
    -----
    Matches ``torch.nn.functional.rms_norm`` with the same ``eps``. ``eps`` is added to the mean
    square in float64 and ``rstd`` rounded once to its dtype, so any positive ``eps`` counts (in
    float32 one below about 1e-45 would be 0). NaN or inf in a row make that row's results NaN
    or inf (where float64 arithmetic puts them), with no floating-point warning. Every CPU
    implementation (:func:`lnlib.use_implementation`) does both the same way. Covered in
    :doc:`/book/04_variants`, section "RMSNorm".

    References
    ----------
    .. [1] B. Zhang and R. Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019.
    """
    xp = get_array_module(x=x, weight=weight)
    x = check.float_array(x, "x", xp)
    eps = check.eps_value(eps)
    k = check.normalized_ndim_value(x, normalized_ndim)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    offset = check.weight_offset_value(weight_offset, weight)
    acc, lead = accumulation_dtype(x.dtype), x.shape[: x.ndim - k]
    out = check.out_arrays(out, xp, [("y", x.shape, x.dtype), ("rstd", lead, acc)])
    forward_rows = select("rms_norm_forward", xp)
    m, n = math.prod(lead), math.prod(norm)
    rows = None  # the out= arrays the row function writes into
    if out is not None:
        rows = rows_out(out, (((m, n), x.dtype), ((m,), acc)), (x, weight), xp)
    y, rstd = forward_rows(as_rows(x, k), param_row(weight, acc, offset), eps=eps, out=rows)
    return written(out, (y.reshape(x.shape), rstd.reshape(lead)), rows)


def rms_norm_backward(dy, x, rstd, weight=None, *, weight_offset=0.0, out=None):
    r"""RMSNorm backward pass.

    With :math:`\hat{x} = x\,r` (:math:`r` is ``rstd``) and :math:`g = dy\,\gamma`, per row

    .. math::

        dx = r\,\big(g - \hat{x}\;\overline{g\hat{x}}\big), \qquad
        d\gamma = \sum_{\text{rows}} dy\,\hat{x},

    where the bar is the mean over the normalized axes (exact, ``eps`` included).

    Parameters
    ----------
    dy : ndarray, shape of ``x``, float16, float32 or float64
        Gradient of the loss with respect to ``y``, of any float dtype: it is used in the
        accumulation dtype (float32 for float16/float32 ``x``, float64 for float64), so a
        float32 ``dy`` for float16 ``x`` is neither rounded to float16 nor clipped to its
        range, on every implementation.
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        The forward input.
    rstd : ndarray, shape ``lead``
        As returned by :func:`rms_norm_forward`; ``x.ndim - rstd.ndim`` axes are normalized.
    weight : ndarray of shape ``norm``, optional
        The forward gain; ``None`` means ones.
    weight_offset : float, default 0.0
        Keyword only; the forward's ``weight_offset``. ``dweight`` has the same form for any
        offset.
    out : tuple of 2 (ndarray or None), optional
        Keyword only. Arrays to write ``dx`` and ``dweight`` into, as in
        :func:`lnlib.layer_norm_backward`.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient of the loss with respect to ``x``.
    dweight : ndarray, shape ``norm``, dtype of ``weight`` (of ``x`` when ``weight`` is None)
        Gradient with respect to the gain (a gain of ones when ``weight`` is None).

    Raises
    ------
    TypeError, ValueError
        As for :func:`lnlib.layer_norm_backward`.

    Notes
    -----
    Accumulated in float32 for float16/float32 ``x``, float64 for float64 ``x``, whatever the
    dtype of ``rstd`` (cast to it). NaN or inf in the inputs give NaN or inf in the results,
    with no floating-point warning, on every implementation. Covered in
    :doc:`/book/04_variants`, section "RMSNorm", "The backward pass".
    """
    xp = get_array_module(dy=dy, x=x, rstd=rstd, weight=weight)
    dy, x, (rstd,), k = check.backward_inputs(dy, x, xp, rstd=rstd)
    norm = x.shape[x.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    offset = check.weight_offset_value(weight_offset, weight)
    pdtype = x.dtype if weight is None else weight.dtype
    out = check.out_arrays(out, xp, [("dx", x.shape, x.dtype), ("dweight", norm, pdtype)])
    backward_rows = select("rms_norm_backward", xp)
    acc = accumulation_dtype(x.dtype)
    m, n = rstd.size, math.prod(norm)
    rows = None  # the out= arrays the row function writes into
    if out is not None:
        rows = rows_out(out, (((m, n), x.dtype), ((n,), acc)), (dy, x, rstd, weight), xp)
    dx, dweight = backward_rows(
        as_rows(dy, k),
        as_rows(x, k),
        rstd.reshape(-1).astype(acc, copy=False),
        param_row(weight, acc, offset),
        out=rows,
    )
    dweight = dweight.reshape(norm).astype(pdtype, copy=False)
    return written(out, (dx.reshape(x.shape), dweight), rows)
