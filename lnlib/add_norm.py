r"""The residual add fused with the norm that follows it: ``h = residual + x; y = norm(h)``.

In a Pre-LN Transformer block every norm follows a residual add. Done as two operations the add
reads two arrays and writes one, and the norm reads that one again and writes ``y``: five
passes over memory. Fused, one pass reads ``x`` and ``residual`` and writes ``h`` and ``y``:
four. In the backward the gradient arriving along the residual stream, ``dh``, is added in the
same pass as the norm's own. Covered in :ref:`sec-ch05-fused-add`.
"""

import math

import numpy as np

from . import _validate as check
from ._backend import select
from ._rows import accumulation_dtype, as_rows, param_row, rows_out, written
from ._validate import get_array_module

__all__ = [
    "add_layer_norm",
    "add_layer_norm_forward",
    "add_layer_norm_backward",
    "add_rms_norm",
    "add_rms_norm_forward",
    "add_rms_norm_backward",
]

_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _residual_dtype(residual_dtype, residual):
    """The dtype ``h`` is stored in: ``residual_dtype``, or that of ``residual``."""
    if residual_dtype is None:
        return residual.dtype
    try:
        dtype = np.dtype(residual_dtype)
    except TypeError as exc:
        raise TypeError(
            f"residual_dtype must be None or a float dtype (float16, float32 or float64), "
            f"got {residual_dtype!r}"
        ) from exc
    if dtype not in _FLOATS:
        raise TypeError(
            "residual_dtype must be None or a float dtype (float16, float32 or float64), "
            f"got {dtype}"
        )
    return dtype


def _forward(op, x, residual, params, eps, normalized_ndim, weight_offset, residual_dtype, out):
    """Check the arguments of a fused forward, then run ``op``'s row function."""
    arrays = dict(zip(("weight", "bias"), params))
    xp = get_array_module(x=x, residual=residual, **arrays)
    x = check.float_array(x, "x", xp)
    residual = check.float_array(residual, "residual", xp)
    check.same_shape(residual, "residual", x)
    h_dtype = _residual_dtype(residual_dtype, residual)
    eps = check.eps_value(eps)
    k = check.normalized_ndim_value(x, normalized_ndim)
    norm = x.shape[x.ndim - k :]
    params = [check.optional_param(p, name, norm, xp) for name, p in arrays.items()]
    offset = check.weight_offset_value(weight_offset, params[0])
    acc, lead = accumulation_dtype(h_dtype), x.shape[: x.ndim - k]
    stats = ("mean", "rstd") if len(params) == 2 else ("rstd",)
    specs = [("y", x.shape, x.dtype), ("h", x.shape, h_dtype)]
    out = check.out_arrays(out, xp, specs + [(s, lead, acc) for s in stats])
    rows_fn = select(op, xp)
    m, n = math.prod(lead), math.prod(norm)
    rows = None  # the out= arrays the row function writes into
    if out is not None:
        shapes = (((m, n), x.dtype), ((m, n), h_dtype)) + (((m,), acc),) * len(stats)
        inputs = (x, residual, *params)
        rows = rows_out(out, shapes, inputs, xp)
        h_out = out[1]
        if _over_residual(h_out, residual, h_dtype, (x, *params), xp):
            # h written over residual (as vLLM does): each element of residual is read before
            # its h is written, so the row function may write there directly.
            rows = list(rows or (None,) * len(out))
            rows[1] = h_out.reshape(m, n)
            rows = tuple(rows)
    rowed = [param_row(params[0], acc, offset)] + [param_row(p, acc) for p in params[1:]]
    results = rows_fn(as_rows(x, k), as_rows(residual, k), *rowed, eps, h_dtype, out=rows)
    y, h, *st = results
    return written(
        out, (y.reshape(x.shape), h.reshape(x.shape), *(s.reshape(lead) for s in st)), rows
    )


def _over_residual(h_out, residual, h_dtype, others, xp):
    """True if ``h_out`` is ``residual`` itself, C-contiguous, in h's dtype and overlapping
    nothing else the row function reads."""
    return (
        h_out is not None
        and h_out is residual
        and h_out.dtype == h_dtype
        and h_out.flags.c_contiguous
        and not any(a is not None and xp.may_share_memory(h_out, a) for a in others)
    )


def _backward(op, dy, dh, h, stats, weight, weight_offset, nparams, out):
    """Check the arguments of a fused backward, then run ``op``'s row function."""
    xp = get_array_module(dy=dy, dh=dh, h=h, weight=weight, **stats)
    dy, h, stats, k = check.backward_inputs(dy, h, xp, x_name="h", **stats)
    if dh is not None:
        dh = check.float_array(dh, "dh", xp)
        check.same_shape(dh, "dh", h, "h")
    norm = h.shape[h.ndim - k :]
    weight = check.optional_param(weight, "weight", norm, xp)
    offset = check.weight_offset_value(weight_offset, weight)
    pdtype = h.dtype if weight is None else weight.dtype
    labels = ("dweight", "dbias")[:nparams]
    out = check.out_arrays(
        out, xp, [("dsum", h.shape, h.dtype)] + [(g, norm, pdtype) for g in labels]
    )
    rows_fn = select(op, xp)
    acc = accumulation_dtype(h.dtype)  # also for statistics saved in another dtype
    m, n = stats[0].size, math.prod(norm)
    rows = None  # the out= arrays the row function writes into
    if out is not None:
        shapes = (((m, n), h.dtype),) + (((n,), acc),) * nparams
        rows = rows_out(out, shapes, (dy, dh, h, *stats, weight), xp)
    dsum, *grads = rows_fn(
        as_rows(dy, k),
        None if dh is None else as_rows(dh, k),
        as_rows(h, k),
        *(s.reshape(-1).astype(acc, copy=False) for s in stats),
        param_row(weight, acc, offset),
        out=rows,
    )
    grads = [g.reshape(norm).astype(pdtype, copy=False) for g in grads]
    return written(out, (dsum.reshape(h.shape), *grads), rows)


def add_layer_norm(
    x,
    residual,
    weight=None,
    bias=None,
    *,
    eps=1e-5,
    normalized_ndim=1,
    weight_offset=0.0,
    residual_dtype=None,
):
    r"""The residual add and layer normalization in one pass; returns ``y, h``.

    .. math::

        h = h_\ell + x, \qquad y = \mathrm{LN}(h) = \frac{h - \mu}{\sqrt{\sigma^2 + \epsilon}}\,
        \gamma + \beta ,

    with :math:`h_\ell` (``residual``) the residual stream and :math:`\mu`, :math:`\sigma^2` the
    statistics of each row of :math:`h` as stored.

    Parameters
    ----------
    x, residual : ndarray, float16, float32 or float64, one shape ``(*lead, *norm)``
        The sublayer's output and the residual stream; their dtypes may differ. Never modified.
    weight, bias, eps, normalized_ndim, weight_offset
        As for :func:`lnlib.layer_norm`, applied to ``h``.
    residual_dtype : dtype, optional
        Keyword only. The dtype ``h`` is stored in (default: that of ``residual``); float32 with
        float16 ``x`` keeps the stream in float32 (FlashAttention's ``residual_in_fp32``).

    Returns
    -------
    y : ndarray, shape of ``x``, dtype of ``x``
        Bitwise ``layer_norm(h, ...)`` cast to the dtype of ``x``.
    h : ndarray, shape of ``x``, dtype ``residual_dtype``
        ``residual + x``, added in the widest of the dtypes of ``x``, ``residual`` and ``h`` and
        rounded once: the new residual stream.

    Raises
    ------
    TypeError, ValueError
        As for :func:`add_layer_norm_forward`, before anything is computed.

    Notes
    -----
    Same as ``add_layer_norm_forward(...)[:2]``. Covered in :ref:`sec-ch05-fused-add`.
    """
    return add_layer_norm_forward(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        normalized_ndim=normalized_ndim,
        weight_offset=weight_offset,
        residual_dtype=residual_dtype,
    )[:2]


def add_layer_norm_forward(
    x,
    residual,
    weight=None,
    bias=None,
    *,
    eps=1e-5,
    normalized_ndim=1,
    weight_offset=0.0,
    residual_dtype=None,
    out=None,
):
    r"""The residual add and layer normalization forward, returning what the backward needs.

    :math:`h = h_\ell + x` (:math:`h_\ell`, ``residual``, the residual stream), then
    :func:`lnlib.layer_norm_forward` of :math:`h`: each row of :math:`h` as stored is
    standardized with its own mean and biased variance, scaled by :math:`\gamma` and shifted by
    :math:`\beta`.

    Parameters
    ----------
    x, residual : ndarray, float16, float32 or float64, one shape ``(*lead, *norm)``
        The sublayer's output and the residual stream; their dtypes may differ; ``norm`` is the
        shape of the last ``normalized_ndim`` axes. Never modified, unless ``out`` names
        ``residual`` for ``h``.
    weight, bias : ndarray of shape ``norm``, optional
        :math:`\gamma` and :math:`\beta` (default: 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root, in float64; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight``; 0 when ``weight`` is None.
    residual_dtype : dtype, optional
        Keyword only. The dtype ``h`` is stored in (default: that of ``residual``).
    out : tuple of 4 (ndarray or None), optional
        Keyword only. Arrays for ``y``, ``h``, ``mean`` and ``rstd``, each of exactly the shape
        and dtype of its result (a None entry is allocated); they are returned. ``residual``
        itself may receive ``h`` (``out=(None, residual, None, None)``: the stream updated in
        place, as vLLM's ``fused_add_rms_norm`` does); any other array that overlaps an input
        receives the result computed from the unmodified input.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        Bitwise ``layer_norm(h, ...)`` cast to the dtype of ``x``.
    h : ndarray, shape of ``x``, dtype ``residual_dtype``
        ``residual + x``, added in the widest of the dtypes of ``x``, ``residual`` and ``h`` and
        rounded once.
    mean, rstd : ndarray, shape ``lead``
        :math:`\mu` and :math:`1/\sqrt{\sigma^2+\epsilon}` of each row of ``h``, exactly those of
        ``layer_norm_forward(h, ...)`` (float32 for a float16/float32 ``h``, float64 for
        float64).

    Raises
    ------
    TypeError
        ``x``, ``residual``, ``weight`` or ``bias`` is not a floating array, they come from
        different array libraries, or ``residual_dtype`` is not a float dtype.
    ValueError
        ``residual`` not of the shape of ``x``; the errors of :func:`lnlib.layer_norm_forward`
        for ``weight``, ``bias``, ``eps``, ``normalized_ndim``, ``weight_offset`` and ``out``.

    Notes
    -----
    On the CPU the rows are processed in blocks that stay in the core's cache: the add writes a
    block of ``h``, and the norm reads it back from the cache, so memory sees one read of ``x``
    and ``residual`` and one write of ``h`` and ``y``. Each row is normalized by the same code
    as :func:`lnlib.layer_norm_forward`, which is why ``y`` has its bits, and results are
    bitwise independent of the other rows. Covered in :ref:`sec-ch05-fused-add`.
    """
    return _forward(
        "add_layer_norm_forward",
        x,
        residual,
        (weight, bias),
        eps,
        normalized_ndim,
        weight_offset,
        residual_dtype,
        out,
    )


def add_layer_norm_backward(
    dy, dh, h, mean, rstd, weight=None, *, normalized_ndim=1, weight_offset=0.0, out=None
):
    r"""Backward of :func:`add_layer_norm_forward`: one gradient for ``x`` and ``residual``.

    ``h`` feeds two places: the norm, and the residual stream after the block. Its gradient is
    the sum over both,

    .. math::

        d\!\operatorname{sum} = dh + r\,\Big(g - \overline{g} - \hat{h}\;
        \overline{g\hat{h}}\Big), \qquad g = dy\,\gamma,\quad \hat{h} = (h - \mu)\,r,

    with :math:`r` (``rstd``) the reciprocal standard deviation of the row, and since
    :math:`h = h_\ell + x`, it is the gradient of ``x`` and of ``residual`` alike.

    Parameters
    ----------
    dy : ndarray, shape of ``h``, any float dtype
        Gradient of the loss with respect to ``y``; used in the accumulation dtype.
    dh : ndarray, shape of ``h``, or None
        Gradient arriving along the residual stream (None: zero).
    h : ndarray, float16, float32 or float64
        The forward's ``h``.
    mean, rstd : ndarray, shape ``lead``
        As returned by :func:`add_layer_norm_forward`.
    weight : ndarray of shape ``norm``, optional
        The forward weight; None means a weight of ones.
    normalized_ndim : int, default 1
        Keyword only. How many trailing axes were normalized; must be ``h.ndim - mean.ndim``.
    weight_offset : float, default 0.0
        Keyword only; the forward's ``weight_offset``.
    out : tuple of 3 (ndarray or None), optional
        Keyword only. Arrays for ``dsum``, ``dweight`` and ``dbias`` (a None entry is
        allocated); they are returned. One that overlaps an input receives the result computed
        from the unmodified input.

    Returns
    -------
    dsum : ndarray, shape and dtype of ``h``
        ``dh`` plus the norm's gradient, the first result of :func:`lnlib.layer_norm_backward`
        for ``h`` (in the dtype of ``h``), added in the wider of the two dtypes and rounded
        once.
    dweight, dbias : ndarray, shape ``norm``
        As for :func:`lnlib.layer_norm_backward` of ``h``: dtype of ``weight``, or of ``h``.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``dy`` or ``dh`` not shaped like ``h``; ``normalized_ndim`` not ``h.ndim - mean.ndim``;
        the errors of :func:`lnlib.layer_norm_backward`.

    Notes
    -----
    On the CPU each block of rows gets the norm's backward and then ``dh`` while it is in
    cache; the parameter gradients of the blocks are added in float64, in row order, so their
    bits do not depend on the thread count. Covered in :ref:`sec-ch05-fused-add`.
    """
    _check_ndim(normalized_ndim, h, mean, "mean")
    stats = {"mean": mean, "rstd": rstd}
    return _backward("add_layer_norm_backward", dy, dh, h, stats, weight, weight_offset, 2, out)


def _check_ndim(normalized_ndim, h, stat, name):
    """``normalized_ndim`` must be an int that matches the saved statistics."""
    if type(normalized_ndim) is not int and (
        isinstance(normalized_ndim, bool) or not isinstance(normalized_ndim, int)
    ):
        raise TypeError(f"normalized_ndim must be an int, got {type(normalized_ndim).__name__}")
    ndim_h, ndim_s = getattr(h, "ndim", None), getattr(stat, "ndim", None)
    if ndim_h is not None and ndim_s is not None and normalized_ndim != ndim_h - ndim_s:
        raise ValueError(
            f"normalized_ndim must be h.ndim - {name}.ndim = {ndim_h - ndim_s} (the axes the "
            f"forward normalized), got {normalized_ndim}"
        )


def add_rms_norm(
    x, residual, weight=None, *, eps=1e-6, normalized_ndim=1, weight_offset=0.0, residual_dtype=None
):
    r"""The residual add and RMS normalization in one pass; returns ``y, h``.

    .. math::

        h = h_\ell + x, \qquad y = \frac{h}{\sqrt{\overline{h^2} + \epsilon}}\,\gamma .

    Parameters
    ----------
    x, residual : ndarray, float16, float32 or float64, one shape ``(*lead, *norm)``
        The sublayer's output and the residual stream; their dtypes may differ. Never modified.
    weight, eps, normalized_ndim, weight_offset
        As for :func:`lnlib.rms_norm`, applied to ``h``.
    residual_dtype : dtype, optional
        Keyword only. The dtype ``h`` is stored in (default: that of ``residual``).

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        Bitwise ``rms_norm(h, ...)`` cast to the dtype of ``x``.
    h : ndarray, shape of ``x``, dtype ``residual_dtype``
        ``residual + x``, added in the widest of the three dtypes and rounded once.

    Raises
    ------
    TypeError, ValueError
        As for :func:`add_rms_norm_forward`, before anything is computed.

    Notes
    -----
    Same as ``add_rms_norm_forward(...)[:2]``. Covered in :ref:`sec-ch05-fused-add`.
    """
    return add_rms_norm_forward(
        x,
        residual,
        weight,
        eps=eps,
        normalized_ndim=normalized_ndim,
        weight_offset=weight_offset,
        residual_dtype=residual_dtype,
    )[:2]


def add_rms_norm_forward(
    x,
    residual,
    weight=None,
    *,
    eps=1e-6,
    normalized_ndim=1,
    weight_offset=0.0,
    residual_dtype=None,
    out=None,
):
    r"""The residual add and RMS normalization forward, returning what the backward needs.

    :math:`h = h_\ell + x` (:math:`h_\ell`, ``residual``), then :func:`lnlib.rms_norm_forward`
    of :math:`h` as stored.

    Parameters
    ----------
    x, residual : ndarray, float16, float32 or float64, one shape ``(*lead, *norm)``
        The sublayer's output and the residual stream; their dtypes may differ. Never modified,
        unless ``out`` names ``residual`` for ``h``.
    weight : ndarray of shape ``norm``, optional
        The gain :math:`\gamma` (default: 1).
    eps : float, default 1e-6
        Added to the mean square inside the square root, in float64; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight``; 0 when ``weight`` is None.
    residual_dtype : dtype, optional
        Keyword only. The dtype ``h`` is stored in (default: that of ``residual``).
    out : tuple of 3 (ndarray or None), optional
        Keyword only. Arrays for ``y``, ``h`` and ``rstd``, as in
        :func:`add_layer_norm_forward` (``residual`` itself may receive ``h``).

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        Bitwise ``rms_norm(h, ...)`` cast to the dtype of ``x``.
    h : ndarray, shape of ``x``, dtype ``residual_dtype``
        ``residual + x``, added in the widest of the three dtypes and rounded once.
    rstd : ndarray, shape ``lead``
        :math:`1/\sqrt{\overline{h^2}+\epsilon}` of each row, exactly that of
        ``rms_norm_forward(h, ...)``.

    Raises
    ------
    TypeError
        ``x``, ``residual`` or ``weight`` is not a floating array, they come from different
        array libraries, or ``residual_dtype`` is not a float dtype.
    ValueError
        ``residual`` not of the shape of ``x``; the errors of :func:`lnlib.rms_norm_forward`.

    Notes
    -----
    Computed as :func:`add_layer_norm_forward` is: blocks of rows in cache on the CPU, each
    row normalized by the code of :func:`lnlib.rms_norm_forward`. Covered in
    :ref:`sec-ch05-fused-add`.
    """
    return _forward(
        "add_rms_norm_forward",
        x,
        residual,
        (weight,),
        eps,
        normalized_ndim,
        weight_offset,
        residual_dtype,
        out,
    )


def add_rms_norm_backward(
    dy, dh, h, rstd, weight=None, *, normalized_ndim=1, weight_offset=0.0, out=None
):
    r"""Backward of :func:`add_rms_norm_forward`: one gradient for ``x`` and ``residual``.

    .. math::

        d\!\operatorname{sum} = dh + r\,\big(g - \hat{h}\;\overline{g\hat{h}}\big),
        \qquad g = dy\,\gamma,\quad \hat{h} = h\,r,

    with :math:`r` (``rstd``) the reciprocal root mean square of the row.

    Parameters
    ----------
    dy : ndarray, shape of ``h``, any float dtype
        Gradient of the loss with respect to ``y``.
    dh : ndarray, shape of ``h``, or None
        Gradient arriving along the residual stream (None: zero).
    h : ndarray, float16, float32 or float64
        The forward's ``h``.
    rstd : ndarray, shape ``lead``
        As returned by :func:`add_rms_norm_forward`.
    weight : ndarray of shape ``norm``, optional
        The forward weight; None means a weight of ones.
    normalized_ndim : int, default 1
        Keyword only; must be ``h.ndim - rstd.ndim``.
    weight_offset : float, default 0.0
        Keyword only; the forward's ``weight_offset``.
    out : tuple of 2 (ndarray or None), optional
        Keyword only. Arrays for ``dsum`` and ``dweight``; they are returned.

    Returns
    -------
    dsum : ndarray, shape and dtype of ``h``
        ``dh`` plus the norm's gradient, the first result of :func:`lnlib.rms_norm_backward`
        for ``h``, added in the wider of the two dtypes and rounded once.
    dweight : ndarray, shape ``norm``
        As for :func:`lnlib.rms_norm_backward` of ``h``.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``dy`` or ``dh`` not shaped like ``h``; ``normalized_ndim`` not ``h.ndim - rstd.ndim``;
        the errors of :func:`lnlib.rms_norm_backward`.

    Notes
    -----
    Covered in :ref:`sec-ch05-fused-add`.
    """
    _check_ndim(normalized_ndim, h, rstd, "rstd")
    return _backward(
        "add_rms_norm_backward", dy, dh, h, {"rstd": rstd}, weight, weight_offset, 1, out
    )
