r"""Readable reference implementations: the formulas of the book, a few lines each.

These are the versions derived in the chapter "The math of LayerNorm"; the public functions in
:mod:`lnlib` compute the same quantities faster and are tested against these. Arguments are
the same as those of the public functions, but nothing is validated here. The
:mod:`lnlib._backend` selection point also runs them as the ``"reference"`` implementation
(on NumPy or CuPy arrays), through the row functions at the end of this module. The backward
formulas from :math:`\hat{x}` are those of :mod:`lnlib.formulas`, which production code uses
too.

Notation of the book: a row is one slice over the normalized axes, of ``D`` values; ``B``
rows; ``mean`` is :math:`\mu`, ``rstd`` is :math:`r = 1/\sqrt{\sigma^2 + \epsilon}`,
``xhat`` is :math:`\hat{x} = (x - \mu)\,r`. Shapes in the comments: ``(B, D)`` stands for
``(*lead, *norm)`` and ``(B,)`` for ``lead``.

Statistics are accumulated in float32 for float16/float32 inputs and in float64 for float64;
results come back in the dtype of ``x`` (parameter gradients in the dtype of the parameter).
"""

import functools

import numpy as np

from ._rows import accumulation_dtype, sum_to_shape, written
from ._rows import expand_stat as _expand
from ._validate import get_array_module
from .formulas import layer_norm_dx, rms_norm_dx

__all__ = [
    "layer_norm_forward",
    "layer_norm_backward",
    "rms_norm_forward",
    "rms_norm_backward",
    "ada_layer_norm_forward",
    "ada_layer_norm_backward",
    "batch_norm_forward",
    "batch_norm_backward",
    "group_norm_forward",
    "group_norm_backward",
    "dynamic_tanh",
    "dynamic_tanh_backward",
]


def _quiet(fn):
    """``fn`` run without floating-point warnings: NaN and inf in a row give NaN and inf in
    its results silently, as on every other path (the compiled kernel raises none)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return run


def _last_axes(ndim, k):
    return tuple(range(ndim - k, ndim))


def _rstd(var, eps):
    r"""``1 / sqrt(var + eps)`` computed in float64 and returned in the dtype of ``var``.

    ``eps`` is added in float64 on every path (as the compiled kernel does), so an ``eps``
    too small for float32 (below about 1e-45) still counts.
    """
    return (1 / (var.astype("float64") + eps) ** 0.5).astype(var.dtype)


@_quiet
def layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5, normalized_ndim=1):
    r"""LayerNorm forward, :math:`y = (x - \mu)\,r\,\gamma + \beta`, in a few lines.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input, normalized over its last ``normalized_ndim`` axes.
    weight, bias : ndarray of shape ``norm``, optional
        Gain :math:`\gamma` and bias :math:`\beta` (default 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The output.
    mean, rstd : ndarray, shape ``lead``, float32 (float64 for float64 ``x``)
        :math:`\mu` and :math:`r` of each row.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :ref:`sec-ch02-one-vector`.
    """
    k = normalized_ndim
    xa = x.astype(accumulation_dtype(x.dtype))  # (B, D)
    mean = xa.mean(axis=_last_axes(x.ndim, k))  # (B,)
    xc = xa - _expand(mean, k)  # (B, D)
    var = (xc * xc).mean(axis=_last_axes(x.ndim, k))  # (B,) biased variance, two passes
    rstd = _rstd(var, eps)  # (B,)
    y = xc * _expand(rstd, k)  # (B, D) xhat
    if weight is not None:
        y = y * weight.astype(xa.dtype)  # (B, D) weight (D,)
    if bias is not None:
        y = y + bias.astype(xa.dtype)  # (B, D) bias (D,)
    return y.astype(x.dtype), mean, rstd


@_quiet
def layer_norm_backward(dy, x, mean, rstd, weight=None):
    r"""LayerNorm backward: :math:`dx = r\,(g - \overline{g} - \hat{x}\,\overline{g\hat{x}})`.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        The forward input.
    mean, rstd : ndarray, shape ``lead``
        From :func:`layer_norm_forward`; their dtype is the accumulation dtype.
    weight : ndarray of shape ``norm``, optional
        The forward gain :math:`\gamma` (default ones); :math:`g = dy\,\gamma`.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient with respect to ``x``.
    dweight, dbias : ndarray, shape ``norm``, dtype of ``weight`` (of ``x`` when None)
        Gradients with respect to :math:`\gamma` and :math:`\beta`.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :ref:`sec-ch02-backward`.
    """
    k = x.ndim - mean.ndim
    axes, rows = _last_axes(x.ndim, k), tuple(range(mean.ndim))
    acc = mean.dtype
    xhat = (x.astype(acc) - _expand(mean, k)) * _expand(rstd, k)  # (B, D)
    dya = dy.astype(acc)  # (B, D)
    g = dya if weight is None else dya * weight.astype(acc)  # (B, D)
    dx = layer_norm_dx(g, xhat, _expand(rstd, k), axes)  # (B, D)
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dya * xhat).sum(axis=rows).astype(pdtype)  # (D,)
    dbias = dya.sum(axis=rows).astype(pdtype)  # (D,)
    return dx.astype(x.dtype), dweight, dbias


@_quiet
def rms_norm_forward(x, weight=None, *, eps=1e-6, normalized_ndim=1):
    r"""RMSNorm forward: :math:`y = x\,r\,\gamma`, :math:`r = (\overline{x^2} + \epsilon)^{-1/2}`.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input, normalized over its last ``normalized_ndim`` axes.
    weight : ndarray of shape ``norm``, optional
        Gain :math:`\gamma` (default 1).
    eps : float, default 1e-6
        Added to the mean square inside the square root.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The output.
    rstd : ndarray, shape ``lead``, float32 (float64 for float64 ``x``)
        :math:`r` of each row.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "RMSNorm".
    """
    k = normalized_ndim
    xa = x.astype(accumulation_dtype(x.dtype))  # (B, D)
    rstd = _rstd((xa * xa).mean(axis=_last_axes(x.ndim, k)), eps)  # (B,)
    y = xa * _expand(rstd, k)  # (B, D) xhat
    if weight is not None:
        y = y * weight.astype(xa.dtype)  # (B, D) weight (D,)
    return y.astype(x.dtype), rstd


@_quiet
def rms_norm_backward(dy, x, rstd, weight=None):
    r"""RMSNorm backward: :math:`dx = r\,(g - \hat{x}\,\overline{g\hat{x}})`, :math:`\hat{x} = xr`.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        The forward input.
    rstd : ndarray, shape ``lead``
        From :func:`rms_norm_forward`; its dtype is the accumulation dtype.
    weight : ndarray of shape ``norm``, optional
        The forward gain (default ones).

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient with respect to ``x``.
    dweight : ndarray, shape ``norm``, dtype of ``weight`` (of ``x`` when None)
        Gradient with respect to the gain.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "RMSNorm", "The backward pass".
    """
    k = x.ndim - rstd.ndim
    axes, rows = _last_axes(x.ndim, k), tuple(range(rstd.ndim))
    acc = rstd.dtype
    xhat = x.astype(acc) * _expand(rstd, k)  # (B, D)
    dya = dy.astype(acc)  # (B, D)
    g = dya if weight is None else dya * weight.astype(acc)  # (B, D)
    dx = rms_norm_dx(g, xhat, _expand(rstd, k), axes)  # (B, D)
    pdtype = x.dtype if weight is None else weight.dtype
    return dx.astype(x.dtype), (dya * xhat).sum(axis=rows).astype(pdtype)  # (B, D), (D,)


def ada_layer_norm_forward(x, shift, scale, *, eps=1e-6, normalized_ndim=1):
    r"""AdaLN forward (DiT modulation): :math:`y = \hat{x}\,(1 + \mathrm{scale}) + \mathrm{shift}`.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input, normalized over its last ``normalized_ndim`` axes.
    shift, scale : ndarray
        Broadcast against ``x``.
    eps : float, default 1e-6
        Added to the variance inside the square root.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The output.
    mean, rstd : ndarray, shape ``lead``
        :math:`\mu` and :math:`r` of each row, in the accumulation dtype.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "Conditioning through the norm".
    """
    xhat, mean, rstd = layer_norm_forward(  # (B, D), (B,), (B,)
        x.astype(accumulation_dtype(x.dtype)), eps=eps, normalized_ndim=normalized_ndim
    )
    y = xhat * (1 + scale.astype(xhat.dtype)) + shift.astype(xhat.dtype)  # (B, D)
    return y.astype(x.dtype), mean, rstd


def ada_layer_norm_backward(dy, x, mean, rstd, scale, *, shift_shape=None):
    r"""AdaLN backward: :math:`d\mathrm{shift} = \sum dy`, :math:`d\mathrm{scale} = \sum dy\hat{x}`.

    And :math:`dx` is the LayerNorm backward of :math:`dy\,(1 + \mathrm{scale})`; the sums
    run over the axes along which ``shift`` and ``scale`` were broadcast.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        The forward input.
    mean, rstd : ndarray, shape ``lead``
        From :func:`ada_layer_norm_forward`, in the accumulation dtype.
    scale : ndarray
        The forward ``scale``.
    shift_shape : tuple, optional
        Shape of the forward ``shift`` when it differs from that of ``scale``.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient with respect to ``x``.
    dshift : ndarray, shape ``shift_shape`` (default ``scale.shape``), dtype of ``scale``
        Gradient with respect to ``shift``.
    dscale : ndarray, shape and dtype of ``scale``
        Gradient with respect to ``scale``.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "Conditioning through the norm".
    """
    k = x.ndim - mean.ndim
    acc = mean.dtype
    xhat = (x.astype(acc) - _expand(mean, k)) * _expand(rstd, k)  # (B, D)
    dya = dy.astype(acc)  # (B, D)
    g = dya * (1 + scale.astype(acc))  # (B, D)
    dx, _, _ = layer_norm_backward(g, x.astype(acc), mean, rstd)  # (B, D)
    dshift = sum_to_shape(dya, scale.shape if shift_shape is None else shift_shape)
    dscale = sum_to_shape(dya * xhat, scale.shape)  # shape of scale
    return dx.astype(x.dtype), dshift.astype(scale.dtype), dscale.astype(scale.dtype)


def batch_norm_forward(
    x, running_mean, running_var, weight=None, bias=None, *, training, momentum=0.1, eps=1e-5
):
    r"""BatchNorm forward over (B, C, ...): statistics per channel over every other axis.

    In training the batch statistics are used and the running ones updated in place (unbiased
    variance); in evaluation the running statistics are used.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(B, C, ...)``
        Input.
    running_mean, running_var : ndarray of shape ``(C,)``, or None
        Running statistics (updated in place in training; required in evaluation).
    weight, bias : ndarray of shape ``(C,)``, optional
        Per-channel gain and bias (default 1 and 0).
    training : bool
        Batch statistics (True) or running statistics (False).
    momentum : float, default 0.1
        Weight of the batch statistics in the running averages.
    eps : float, default 1e-5
        Added to the variance inside the square root.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The output.
    mean, rstd : ndarray, shape ``(C,)``
        The statistics used, in the accumulation dtype.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :ref:`sec-ch01-batch-norm`.
    """
    xp = get_array_module(x=x)
    acc = accumulation_dtype(x.dtype)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    xa = x.astype(acc)  # (B, C, ...)
    if training:
        mean = xa.mean(axis=axes)  # (C,)
        var = ((xa - mean.reshape(shape)) ** 2).mean(axis=axes)  # (C,)
        if running_mean is not None:
            m = x.size // x.shape[1]
            running_mean[...] = (1 - momentum) * running_mean + momentum * mean
            running_var[...] = (1 - momentum) * running_var + momentum * var * m / (m - 1)
    else:
        mean, var = xp.asarray(running_mean, dtype=acc), xp.asarray(running_var, dtype=acc)
    rstd = 1 / (var + eps) ** 0.5  # (C,)
    y = (xa - mean.reshape(shape)) * rstd.reshape(shape)  # (B, C, ...)
    if weight is not None:
        y = y * weight.astype(acc).reshape(shape)  # (B, C, ...)
    if bias is not None:
        y = y + bias.astype(acc).reshape(shape)  # (B, C, ...)
    return y.astype(x.dtype), mean, rstd


def batch_norm_backward(dy, x, mean, rstd, weight=None, *, training=True):
    r"""BatchNorm backward; with batch statistics the gradient flows through mean and rstd too.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(B, C, ...)``
        The forward input.
    mean, rstd : ndarray, shape ``(C,)``
        From :func:`batch_norm_forward`, in the accumulation dtype.
    weight : ndarray of shape ``(C,)``, optional
        The forward gain (default ones).
    training : bool, default True
        Whether the forward used batch statistics (else they are constants).

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient with respect to ``x``.
    dweight, dbias : ndarray, shape ``(C,)``, dtype of ``weight`` (of ``x`` when None)
        Gradients with respect to the gain and bias.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :ref:`sec-ch01-batch-norm`.
    """
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    acc = mean.dtype
    xhat = (x.astype(acc) - mean.reshape(shape)) * rstd.reshape(shape)  # (B, C, ...)
    dya = dy.astype(acc)  # (B, C, ...)
    g = dya if weight is None else dya * weight.astype(acc).reshape(shape)  # (B, C, ...)
    if training:
        dx = layer_norm_dx(g, xhat, rstd.reshape(shape), axes)  # (B, C, ...)
    else:
        dx = g * rstd.reshape(shape)  # (B, C, ...): the statistics are constants
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dya * xhat).sum(axis=axes).astype(pdtype)  # (C,)
    dbias = dya.sum(axis=axes).astype(pdtype)  # (C,)
    return dx.astype(x.dtype), dweight, dbias


def group_norm_forward(x, num_groups, weight=None, bias=None, *, eps=1e-5):
    r"""GroupNorm forward over (B, C, ...): a LayerNorm of each group, then per-channel affine.

    A group is C/G channels at every spatial position, :math:`D = (C/G)\prod\mathrm{spatial}`
    values.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(B, C, *spatial)``
        Input.
    num_groups : int
        G, a divisor of C.
    weight, bias : ndarray of shape ``(C,)``, optional
        Per-channel gain and bias (default 1 and 0).
    eps : float, default 1e-5
        Added to the variance inside the square root.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The output.
    mean, rstd : ndarray, shape ``(N, G)``
        :math:`\mu` and :math:`r` of each group, in the accumulation dtype.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "The family by axes".
    """
    n, c, g = x.shape[0], x.shape[1], num_groups
    xa = x.astype(accumulation_dtype(x.dtype)).reshape(n, g, -1)  # (N, G, D)
    mean = xa.mean(axis=2)  # (N, G)
    xc = xa - mean[:, :, None]  # (N, G, D)
    rstd = 1 / ((xc * xc).mean(axis=2) + eps) ** 0.5  # (N, G): biased variance, two passes
    y = (xc * rstd[:, :, None]).reshape(n, c, -1)  # (B, C, L), L spatial positions
    if weight is not None:
        y = y * weight.astype(xa.dtype)[:, None]  # (B, C, L)
    if bias is not None:
        y = y + bias.astype(xa.dtype)[:, None]  # (B, C, L)
    return y.reshape(x.shape).astype(x.dtype), mean, rstd


def group_norm_backward(dy, x, mean, rstd, num_groups, weight=None):
    r"""GroupNorm backward: the LayerNorm backward on each group, with :math:`g = dy\,\gamma_c`.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(B, C, *spatial)``
        The forward input.
    mean, rstd : ndarray, shape ``(N, G)``
        From :func:`group_norm_forward`.
    num_groups : int
        G, as in the forward.
    weight : ndarray of shape ``(C,)``, optional
        The forward gain (default ones).

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient with respect to ``x``.
    dweight, dbias : ndarray, shape ``(C,)``, dtype of ``weight`` (of ``x`` when None)
        Gradients with respect to the gain and bias.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "The family by axes".
    """
    n, c, g = x.shape[0], x.shape[1], num_groups
    acc = accumulation_dtype(x.dtype)
    mean, rstd = mean.astype(acc)[:, :, None], rstd.astype(acc)[:, :, None]
    xhat = (x.astype(acc).reshape(n, g, -1) - mean) * rstd  # (N, G, D)
    dya = dy.astype(acc).reshape(n, c, -1)  # (B, C, L)
    gs = dya if weight is None else dya * weight.astype(acc)[:, None]  # (B, C, L)
    gs = gs.reshape(n, g, -1)  # (N, G, D)
    dx = layer_norm_dx(gs, xhat, rstd, axes=(2,))  # (N, G, D)
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dya * xhat.reshape(n, c, -1)).sum(axis=(0, 2)).astype(pdtype)  # (C,)
    dbias = dya.sum(axis=(0, 2)).astype(pdtype)  # (C,)
    return dx.reshape(x.shape).astype(x.dtype), dweight, dbias


def dynamic_tanh(x, alpha, weight=None, bias=None):
    r"""Dynamic Tanh (DyT): :math:`y = \gamma \odot \tanh(\alpha x) + \beta`, elementwise.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(..., D)``
        Input.
    alpha : float or floating ndarray of shape () or (1,)
        The scalar :math:`\alpha`.
    weight, bias : ndarray of shape ``(D,)``, optional
        Gain and bias along the last axis (default 1 and 0).

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The output.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh".
    """
    xp = get_array_module(x=x)
    acc = accumulation_dtype(x.dtype)
    a = float(xp.asarray(alpha).reshape(()))  # alpha of shape () or (1,) as a number
    y = xp.tanh(x.astype(acc) * acc.type(a))  # (..., D)
    if weight is not None:
        y = y * weight.astype(acc)  # (..., D)
    if bias is not None:
        y = y + bias.astype(acc)  # (..., D)
    return y.astype(x.dtype)


def dynamic_tanh_backward(dy, x, alpha, weight=None):
    r"""DyT backward, with :math:`t = \tanh(\alpha x)` and :math:`g = dy \odot \gamma`.

    .. math::

        dx = \alpha\, g\,(1 - t^2), \qquad d\alpha = \sum g\, x\,(1 - t^2), \qquad
        d\gamma = \sum_{\text{rows}} dy\, t, \qquad d\beta = \sum_{\text{rows}} dy .

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(..., D)``
        The forward input.
    alpha : float or floating ndarray of shape () or (1,)
        The forward :math:`\alpha`.
    weight : ndarray of shape ``(D,)``, optional
        The forward gain (default ones).

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient with respect to ``x``.
    dalpha : ndarray, shape and dtype of ``alpha`` (0-d of the dtype of ``x`` for a float)
        Gradient with respect to :math:`\alpha`.
    dweight, dbias : ndarray, shape ``(D,)``, dtype of ``weight`` (of ``x`` when None)
        Gradients with respect to the gain and bias.

    Notes
    -----
    Nothing is validated (see the public function for the checks).
    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh".
    """
    xp = get_array_module(x=x)
    acc = accumulation_dtype(x.dtype)
    xa, dya = x.astype(acc), dy.astype(acc)  # (..., D)
    a = float(xp.asarray(alpha).reshape(()))  # alpha of shape () or (1,) as a number
    t = xp.tanh(xa * acc.type(a))  # (..., D)
    g = dya if weight is None else dya * weight.astype(acc)  # (..., D)
    rows = tuple(range(x.ndim - 1))
    pdtype = x.dtype if weight is None else weight.dtype
    adtype = alpha.dtype if isinstance(alpha, xp.ndarray) else x.dtype
    dalpha = xp.asarray((g * xa * (1 - t * t)).sum(), dtype=adtype)  # ()
    dalpha = dalpha.reshape(getattr(alpha, "shape", ()))  # the shape of alpha: () or (1,)
    dx = (a * g * (1 - t * t)).astype(x.dtype)  # (..., D)
    dweight = (dya * t).sum(axis=rows).astype(pdtype)  # (D,)
    dbias = dya.sum(axis=rows).astype(pdtype)  # (D,)
    return dx, dalpha, dweight, dbias


# The "reference" implementation of lnlib._backend: the row contract (lnlib._rows) on the
# functions above.


def available():
    """The reference runs wherever NumPy (or CuPy) does: ``(True, reason)``."""
    return True, "always available"


def layer_norm_forward_rows(x, weight, bias, eps, *, out=None):
    """:func:`layer_norm_forward` on rows, with the ``out`` of the row contract."""
    return written(out, layer_norm_forward(x, weight, bias, eps=eps))


def layer_norm_backward_rows(dy, x, mean, rstd, weight, *, out=None):
    """:func:`layer_norm_backward` on rows, with the ``out`` of the row contract."""
    return written(out, layer_norm_backward(dy, x, mean, rstd, weight))


def rms_norm_forward_rows(x, weight, eps, *, out=None):
    """:func:`rms_norm_forward` on rows, with the ``out`` of the row contract."""
    return written(out, rms_norm_forward(x, weight, eps=eps))


def rms_norm_backward_rows(dy, x, rstd, weight, *, out=None):
    """:func:`rms_norm_backward` on rows, with the ``out`` of the row contract."""
    return written(out, rms_norm_backward(dy, x, rstd, weight))


def _add(a, b, dtype):
    """``a + b`` added in the widest of the three dtypes and rounded once to ``dtype``."""
    wide = np.result_type(a.dtype, b.dtype, dtype)
    return (a.astype(wide) + b.astype(wide)).astype(dtype)


def add_layer_norm_forward_rows(x, residual, weight, bias, eps, h_dtype, *, out=None):
    """The fused add and LayerNorm: the add, then :func:`layer_norm_forward` of h."""
    h = _add(residual, x, h_dtype)
    y, mean, rstd = layer_norm_forward(h, weight, bias, eps=eps)
    return written(out, (y.astype(x.dtype), h, mean, rstd))


def add_layer_norm_backward_rows(dy, dh, h, mean, rstd, weight, *, out=None):
    """Its backward: the gradient of h along both of its paths, dh + dx."""
    dx, dweight, dbias = layer_norm_backward(dy, h, mean, rstd, weight)
    return written(out, (dx if dh is None else _add(dx, dh, h.dtype), dweight, dbias))


def add_rms_norm_forward_rows(x, residual, weight, eps, h_dtype, *, out=None):
    """The fused add and RMSNorm: the add, then :func:`rms_norm_forward` of h."""
    h = _add(residual, x, h_dtype)
    y, rstd = rms_norm_forward(h, weight, eps=eps)
    return written(out, (y.astype(x.dtype), h, rstd))


def add_rms_norm_backward_rows(dy, dh, h, rstd, weight, *, out=None):
    """Its backward: dh + dx."""
    dx, dweight = rms_norm_backward(dy, h, rstd, weight)
    return written(out, (dx if dh is None else _add(dx, dh, h.dtype), dweight))
