r"""Group normalization (Wu and He, 2018): forward and backward.

GroupNorm splits the C channels of each example into G groups and normalizes each group over its
C/G channels and every spatial position. Laid out as rows, one row per (example, group), that is
exactly LayerNorm without an affine map, followed by a per-channel gain and bias; the public
functions here compute it that way, with the LayerNorm row implementation that the selection
point (:func:`lnlib.use_implementation`) picks, so that GroupNorm inherits its accuracy
(corrected two-pass statistics) and its bitwise batch invariance.
"""

import math

import numpy as np

from . import _validate as check
from ._backend import select
from ._rows import accumulation_dtype
from ._validate import get_array_module

__all__ = ["group_norm", "group_norm_backward", "group_norm_forward"]


def group_norm(x, num_groups, weight=None, bias=None, *, eps=1e-5):
    r"""Group normalization of ``x`` (B, C, ...); returns ``y`` only.

    Each example's channels are split into G groups; a group (its C/G channels at every
    spatial position) is normalized like a LayerNorm row, then each channel :math:`j` gets
    its gain and bias:

    .. math::

        y_{bj\cdot} = (x_{bj\cdot} - \mu_{b\mathcal{G}})\, r_{b\mathcal{G}}\, \gamma_j + \beta_j
        \quad (\text{channel } j \text{ in group } \mathcal{G}).

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(B, C, *spatial)``
        Input; never modified; any strides are accepted.
    num_groups : int
        G, a divisor of C.
    weight, bias : ndarray of shape (C,), optional
        Per-channel gain :math:`\gamma` and bias :math:`\beta` (default 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The normalized input.

    Raises
    ------
    TypeError, ValueError
        As for :func:`group_norm_forward`, before anything is computed.

    Notes
    -----
    Same as ``group_norm_forward(...)[0]``. Covered in :doc:`/book/04_variants`, section
    "The family by axes".
    """
    return group_norm_forward(x, num_groups, weight, bias, eps=eps)[0]


def _check_groups(x, num_groups):
    """Check ``x`` is (B, C, ...) with C divisible by ``num_groups``; return G as an int."""
    if x.ndim < 2:
        raise ValueError(f"x must have shape (N, C, ...) with at least 2 axes, got {x.shape}")
    g = check.num_groups_value(num_groups, x.shape[1], "the number of channels C = x.shape[1]")
    if 0 in x.shape[1:]:
        raise ValueError(f"x has no values to normalize in a group: shape {x.shape}")
    return g


def _channel_param(a, name, x, xp):
    """An optional per-channel parameter (weight, bias): ``None`` or shape (C,)."""
    if a is None:
        return None
    a = check.float_array(a, name, xp)
    if a.shape != (x.shape[1],):
        raise ValueError(
            f"{name} must have shape ({x.shape[1]},) (one value per channel of x), got {a.shape}"
        )
    return a


def _stat(s, name, shape, xp):
    """A saved statistic (mean, rstd) of shape (N, G)."""
    s = check.float_array(s, name, xp)
    if s.shape != shape:
        raise ValueError(f"{name} must have shape (N, G) = {shape}, got {s.shape}")
    return s


def _rows(a, num_groups, dtype):
    """``a`` (B, C, ...) as rows (B * G, C/G * spatial) in ``dtype`` (a view when possible).

    The row length is given, not inferred (-1), so that an empty batch (N = 0) reshapes too.
    """
    d = math.prod(a.shape[1:]) // num_groups
    return a.astype(dtype, copy=False).reshape(a.shape[0] * num_groups, d)


def _channels(a):
    """``a`` (B, C, ...) viewed as (B, C, L), L the spatial positions (1 without spatial axes)."""
    return a.reshape(a.shape[0], a.shape[1], math.prod(a.shape[2:]))


def _group_rows(p, x, num_groups, dtype, xp):
    """A per-channel parameter (C,) as the rows of the groups (G, C/G * L) in ``dtype``: channel
    j's value at each of its L positions, as the CUDA kernels' modulated LayerNorm takes it
    (``None`` stays ``None``)."""
    if p is None:
        return None
    c, g, spatial = x.shape[1], num_groups, math.prod(x.shape[2:])
    laid = xp.broadcast_to(p.reshape(g, c // g, 1), (g, c // g, spatial))
    return xp.ascontiguousarray(laid, dtype=dtype).reshape(g, -1)


def _per_channel(p, x, dtype):
    """A (C,) parameter shaped (C, 1) to broadcast against ``x`` viewed as (B, C, L)."""
    return p.astype(dtype, copy=False).reshape(x.shape[1], 1)


def group_norm_forward(x, num_groups, weight=None, bias=None, *, eps=1e-5):
    r"""GroupNorm forward pass, like ``torch.nn.functional.group_norm``.

    For ``x`` of shape ``(B, C, *spatial)`` and G groups, group :math:`\mathcal{G}` (the
    :math:`k`-th, from 0) of example :math:`b` holds channels :math:`kC/G, \dots, (k+1)C/G - 1`
    at every spatial position, :math:`D = (C/G)\prod \mathrm{spatial}` values; with its mean
    :math:`\mu_{b\mathcal{G}}` and biased variance :math:`\sigma_{b\mathcal{G}}^2`,

    .. math::

        r_{b\mathcal{G}} = (\sigma_{b\mathcal{G}}^2 + \epsilon)^{-1/2}, \qquad
        y_{bj\cdot} = (x_{bj\cdot} - \mu_{b\mathcal{G}})\, r_{b\mathcal{G}}\, \gamma_j + \beta_j
        \quad (\text{channel } j \text{ in group } \mathcal{G}).

    ``num_groups = C`` is InstanceNorm; ``num_groups = 1`` is LayerNorm over ``(C, *spatial)``
    except that the gain and bias are per channel (shape (C,)), not per element.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(B, C, *spatial)``
        Input; never modified; any strides are accepted. An empty batch (N = 0)
        gives empty results, as in torch.
    num_groups : int
        G, a divisor of C.
    weight, bias : ndarray of shape (C,), optional
        Per-channel gain :math:`\gamma` and bias :math:`\beta` (default 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The normalized input.
    mean, rstd : ndarray, shape (N, G)
        :math:`\mu` and :math:`r` of each group, float32 for float16/float32 ``x``, float64
        for float64.

    Raises
    ------
    TypeError
        A non-floating array, ``num_groups`` not an int, or arrays from different array
        libraries.
    ValueError
        ``x`` with fewer than 2 axes or an empty group; ``num_groups`` < 1 or not dividing C;
        ``weight``/``bias`` not of shape (C,); ``eps`` negative or not finite.

    Notes
    -----
    Statistics are computed by the LayerNorm row implementation on the rows (corrected
    two-pass, accumulated in float32 for float16/float32 and float64 for float64), so each
    example's result is bitwise independent of the other examples in the batch. On CuPy
    arrays the CUDA kernels apply the per-channel gain and bias inside the LayerNorm kernel (no
    pass over x or y of their own). Covered in :doc:`/book/04_variants`, section "The family by
    axes".

    References
    ----------
    .. [1] Y. Wu and K. He, "Group Normalization", ECCV 2018.
    """
    xp = get_array_module(x=x, weight=weight, bias=bias)
    x = check.float_array(x, "x", xp)
    g = _check_groups(x, num_groups)
    weight = _channel_param(weight, "weight", x, xp)
    bias = _channel_param(bias, "bias", x, xp)
    eps = check.eps_value(eps)
    n, c = x.shape[:2]
    acc = accumulation_dtype(x.dtype)
    modulated = select("modulated_layer_norm_forward", xp)
    if modulated is not None and x.size:  # CUDA: the affine map inside the LayerNorm kernel
        w, b = (_group_rows(p, x, g, acc, xp) for p in (weight, bias))
        y, mean, rstd = modulated(x.reshape(n * g, -1), w, b, eps, 1, g)  # row i: group i % G
        return y.reshape(x.shape), mean.reshape(n, g), rstd.reshape(n, g)
    forward_rows = select("layer_norm_forward", xp)
    xhat, mean, rstd = forward_rows(_rows(x, g, acc), None, None, eps=eps)  # (N*G, D) in acc
    y = _channels(xhat.reshape(x.shape))  # (B, C, L): a fresh array, scaled in place
    if weight is not None:
        y *= _per_channel(weight, x, acc)
    if bias is not None:
        y += _per_channel(bias, x, acc)
    return y.reshape(x.shape).astype(x.dtype, copy=False), mean.reshape(n, g), rstd.reshape(n, g)


def group_norm_backward(dy, x, mean, rstd, num_groups, weight=None):
    r"""GroupNorm backward pass.

    With :math:`g = dy\,\gamma_j` and
    :math:`\hat{x} = (x - \mu_{b\mathcal{G}})\,r_{b\mathcal{G}}`, each group of each example is
    a LayerNorm row, so

    .. math::

        dx = r_{b\mathcal{G}}\,\big(g - \overline{g} - \hat{x}\;\overline{g \odot \hat{x}}\big),
        \qquad d\gamma_j = \sum_{b,\ \text{spatial}} dy\,\hat{x}, \qquad
        d\beta_j = \sum_{b,\ \text{spatial}} dy,

    where a bar is the mean over the group's :math:`D` values.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(B, C, *spatial)``
        The forward input.
    mean, rstd : ndarray, shape (N, G)
        As returned by :func:`group_norm_forward`; used in the accumulation dtype of ``x``.
    num_groups : int
        G, as in the forward.
    weight : ndarray of shape (C,), optional
        The forward gain; ``None`` means ones.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient of the loss with respect to ``x``.
    dweight, dbias : ndarray, shape (C,)
        Gradients with respect to the per-channel gain and bias; dtype of ``weight``, or of
        ``x`` when ``weight`` is None (then the gradients with respect to a gain of ones and a
        bias of zeros). Zeros for an empty batch (N = 0).

    Raises
    ------
    TypeError, ValueError
        As for :func:`group_norm_forward`; also ``dy`` not shaped like ``x`` and ``mean`` or
        ``rstd`` not of shape (N, G).

    Notes
    -----
    ``dweight`` and ``dbias`` are summed over the examples in float64; on CuPy arrays the CUDA
    kernels compute dx and per-group sums in one LayerNorm backward, in the accumulation dtype.
    Covered in :doc:`/book/04_variants`, section "The family by axes".
    """
    xp = get_array_module(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    x = check.float_array(x, "x", xp)
    dy = check.float_array(dy, "dy", xp)
    check.same_shape(dy, "dy", x)
    g = _check_groups(x, num_groups)
    n, c = x.shape[:2]
    mean, rstd = (_stat(s, name, (n, g), xp) for s, name in ((mean, "mean"), (rstd, "rstd")))
    weight = _channel_param(weight, "weight", x, xp)
    acc = accumulation_dtype(x.dtype)
    # the accumulation dtype is that of x, whatever dtype the statistics were saved in
    mean, rstd = (s.astype(acc, copy=False).reshape(-1) for s in (mean, rstd))
    pdtype = x.dtype if weight is None else weight.dtype
    modulated = select("modulated_layer_norm_backward", xp)
    if modulated is not None and x.size:  # CUDA: one LayerNorm backward, gradients per group row
        rows = dy.reshape(n * g, -1), x.reshape(n * g, -1), mean, rstd
        dx, dw, db = modulated(*rows, _group_rows(weight, x, g, acc, xp), 1, g)  # dw, db: (G, D)
        dweight, dbias = (p.reshape(c, -1).sum(axis=1).astype(pdtype) for p in (dw, db))
        return dx.reshape(x.shape), dweight, dbias
    dya = _channels(dy.astype(acc, copy=False))  # (B, C, L)
    gs = dya if weight is None else dya * _per_channel(weight, x, acc)
    backward_rows = select("layer_norm_backward", xp)
    dx = backward_rows(_rows(gs, g, acc), _rows(x, g, acc), mean, rstd, None)[0]
    xhat = (_rows(x, g, acc) - mean[:, None]) * rstd[:, None]  # (N*G, D)
    # per (example, channel) sums along the contiguous axis, then over examples in float64
    dweight = (dya * _channels(xhat.reshape(x.shape))).sum(axis=2).sum(axis=0, dtype=np.float64)
    dbias = dya.sum(axis=2).sum(axis=0, dtype=np.float64)
    dx = dx.reshape(x.shape).astype(x.dtype, copy=False)
    return dx, dweight.astype(pdtype), dbias.astype(pdtype)
