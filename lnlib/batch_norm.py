r"""Batch normalization (Ioffe and Szegedy, 2015), for comparison with layer normalization."""

import math
import numbers

import numpy as np

from . import _validate as check
from ._rows import accumulation_dtype
from ._validate import get_array_module
from .formulas import layer_norm_dx

__all__ = ["batch_norm", "batch_norm_forward", "batch_norm_backward"]


def batch_norm(
    x, running_mean, running_var, weight=None, bias=None, *, training, momentum=0.1, eps=1e-5
):
    r"""Batch normalization of ``x`` (B, C, ...); returns ``y`` only.

    .. math::

        y = \frac{x - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}}\,\gamma_c + \beta_c,

    with the batch statistics of channel :math:`c` in training (and the running statistics
    updated in place) or the running statistics in evaluation.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(B, C, ...)``
        Input; each channel is normalized over every axis but axis 1. Never modified.
    running_mean, running_var : ndarray of shape ``(C,)``, or None
        Running statistics, updated in place in training; required in evaluation.
    weight, bias : ndarray of shape ``(C,)``, optional
        Per-channel gain :math:`\gamma` and bias :math:`\beta` (default 1 and 0).
    training : bool
        Keyword only, required: batch statistics (True) or running statistics (False).
    momentum : float, default 0.1
        Weight :math:`m` of the batch statistics in the running average, in [0, 1].
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The normalized input.

    Raises
    ------
    TypeError, ValueError
        As for :func:`batch_norm_forward`, before anything is computed or updated.

    Notes
    -----
    Same as ``batch_norm_forward(...)[0]``. Covered in :ref:`sec-ch01-batch-norm` and
    :ref:`sec-ch01-train-eval`.
    """
    return batch_norm_forward(
        x, running_mean, running_var, weight, bias, training=training, momentum=momentum, eps=eps
    )[0]


def _channel_view(x):
    """``x`` (B, C, ...) as (B, C, L): channel statistics are then over axes 0 and 2."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def _check_channels(x):
    if x.ndim < 2:
        raise ValueError(f"x must have shape (N, C, ...) with at least 2 axes, got {x.shape}")
    if x.shape[1] == 0:
        raise ValueError(f"x must have at least one channel (axis 1), got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"x has no values to normalize per channel: shape {x.shape}")


def _running(a, name, channels, xp):
    if a is None:
        return None
    if not isinstance(a, xp.ndarray):
        raise TypeError(f"{name} must be an array (it is updated in place), got {type(a).__name__}")
    a = check.float_array(a, name, xp)
    if a.shape != (channels,):
        raise ValueError(
            f"{name} must have shape ({channels},) (one value per channel), got {a.shape}"
        )
    return a


def _writeable(a, name):
    """Running statistics are updated in place: refuse a read-only one before any update."""
    flags = getattr(a, "flags", None)
    if a is not None and not getattr(flags, "writeable", True):
        raise ValueError(
            f"{name} is read-only, but training=True updates it in place; pass a "
            f"writeable array (e.g. {name}.copy()) or None"
        )


def _forward_args(x, running_mean, running_var, weight, bias, training, momentum, eps, xp):
    """Every check of :func:`batch_norm_forward`, before anything is computed or updated."""
    x = check.float_array(x, "x", xp)
    _check_channels(x)
    channels = x.shape[1]
    running_mean = _running(running_mean, "running_mean", channels, xp)
    running_var = _running(running_var, "running_var", channels, xp)
    weight = check.optional_param(weight, "weight", (channels,), xp)
    bias = check.optional_param(bias, "bias", (channels,), xp)
    eps = check.eps_value(eps)
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"training must be True or False, got {training!r}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be arrays or both be None")
    if training:
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, numbers.Real)
            or not 0 <= momentum <= 1
            or not math.isfinite(momentum)
        ):
            raise ValueError(f"momentum must be a number in [0, 1], got {momentum!r:.40}")
        if x.size // channels < 2:
            raise ValueError(
                "batch_norm in training needs more than one value per channel, "
                f"got x of shape {x.shape}"
            )
        _writeable(running_mean, "running_mean")
        _writeable(running_var, "running_var")
    elif running_mean is None:
        raise ValueError("running_mean and running_var are required when training=False")
    return x, running_mean, running_var, weight, bias, eps


def _backward_args(dy, x, mean, rstd, weight, xp):
    """Every check of :func:`batch_norm_backward`."""
    x = check.float_array(x, "x", xp)
    _check_channels(x)
    dy = check.float_array(dy, "dy", xp)
    check.same_shape(dy, "dy", x)
    channels = x.shape[1]
    mean = check.float_array(mean, "mean", xp)
    rstd = check.float_array(rstd, "rstd", xp)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.shape != (channels,):
            raise ValueError(
                f"{name} must have shape ({channels},) (one value per channel of x), got {a.shape}"
            )
    weight = check.optional_param(weight, "weight", (channels,), xp)
    return dy, x, mean, rstd, weight


def batch_norm_forward(
    x, running_mean, running_var, weight=None, bias=None, *, training, momentum=0.1, eps=1e-5
):
    r"""Batch normalization forward pass, like ``torch.nn.functional.batch_norm``.

    For ``x`` of shape ``(B, C, ...)`` each channel :math:`c` is normalized with statistics
    over every other axis (the batch and any spatial axes), :math:`m` values in all:

    .. math::

        \mu_c = \frac{1}{m}\sum x_{\cdot c \cdot}, \qquad
        \sigma_c^2 = \frac{1}{m}\sum (x_{\cdot c \cdot} - \mu_c)^2, \qquad
        y = \frac{x - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}}\,\gamma_c + \beta_c .

    In training the batch statistics are used and the running statistics are updated in
    place: ``running_mean = (1 - momentum) * running_mean + momentum * mu`` and the same for
    ``running_var`` with the unbiased variance :math:`\sigma_c^2\,m/(m-1)`. In evaluation the
    running statistics are used instead of the batch's.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(B, C, ...)``
        Input; each channel is normalized over every axis but axis 1. Never modified.
    running_mean, running_var : ndarray of shape ``(C,)``, or None
        Running statistics, updated in place in training (None there: no update);
        required in evaluation.
    weight, bias : ndarray of shape ``(C,)``, optional
        Per-channel gain :math:`\gamma` and bias :math:`\beta` (default 1 and 0).
    training : bool
        Keyword only, required: batch statistics (True) or running statistics (False).
    momentum : float, default 0.1
        Weight :math:`m` of the batch statistics in the running average, in [0, 1].
    eps : float, default 1e-5
        Added to the variance inside the square root; finite and >= 0.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The normalized input.
    mean, rstd : ndarray, shape ``(C,)``
        The statistics used (batch or running), float32 (float64 for float64 ``x``).

    Raises
    ------
    TypeError
        Non-floating arrays, running statistics that are not arrays, or arrays from different
        array libraries.
    ValueError
        ``x`` with fewer than 2 axes or no values; parameters or running statistics not of
        shape ``(C,)``; running statistics missing in evaluation; a single value per channel
        in training (its unbiased variance is undefined); bad ``eps`` or ``momentum``; a
        read-only running statistic in training (checked before anything is updated).

    Notes
    -----
    The statistics are a corrected two-pass over fixed blocks of the input, each block summed
    in float64: as accurate for ``(N, C)`` as for ``(1, C, N)`` input, and the temporaries stay
    a few blocks in size. Covered in :ref:`sec-ch01-batch-norm` and
    :ref:`sec-ch01-train-eval`, where it is compared with LayerNorm.

    References
    ----------
    .. [1] S. Ioffe and C. Szegedy, "Batch Normalization: Accelerating Deep Network Training by
           Reducing Internal Covariate Shift", ICML 2015.
    """
    xp = get_array_module(
        x=x, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias
    )
    x, running_mean, running_var, weight, bias, eps = _forward_args(
        x, running_mean, running_var, weight, bias, training, momentum, eps, xp
    )
    acc = accumulation_dtype(x.dtype)
    x3 = _channel_view(x)  # (B, C, L)
    if training:
        mean, var = _channel_stats(x3, acc, xp)  # (C,), (C,)
    else:
        mean, var = running_mean.astype(acc), running_var.astype(acc)  # (C,), (C,)
    rstd = 1 / xp.sqrt(var + acc.type(eps))  # (C,)
    scale = rstd if weight is None else rstd * weight.astype(acc)  # (C,)
    y3 = xp.empty(x3.shape, dtype=x.dtype)  # (B, C, L)
    for b in _blocks(x3.shape):
        t = x3[b].astype(acc)  # one block, (n, C, l)
        t -= mean[:, None]
        t *= scale[:, None]
        if bias is not None:
            t += bias.astype(acc)[:, None]
        y3[b] = t
    if training and running_mean is not None:  # last: nothing above can fail half-way
        m = x3.shape[0] * x3.shape[2]
        running_mean *= 1 - momentum
        running_mean += (momentum * mean).astype(running_mean.dtype)
        running_var *= 1 - momentum
        running_var += (momentum * var * (m / (m - 1))).astype(running_var.dtype)
    return y3.reshape(x.shape), mean, rstd


def batch_norm_backward(dy, x, mean, rstd, weight=None, *, training=True):
    r"""Batch normalization backward pass.

    With :math:`\hat{x} = (x - \mu_c)\,r_c` (:math:`r_c` is channel :math:`c`'s ``rstd``),
    :math:`g = dy\,\gamma_c` and bars
    for means over the :math:`m` values of a channel:

    .. math::

        dx = r_c\,\big(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\big)
        \quad\text{(training)}, \qquad dx = r_c\,g \quad\text{(evaluation)},

    and :math:`d\gamma_c = \sum dy\,\hat{x}`, :math:`d\beta_c = \sum dy`.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(B, C, ...)``
        The forward input.
    mean, rstd : ndarray, shape ``(C,)``
        As returned by :func:`batch_norm_forward`.
    weight : ndarray of shape ``(C,)``, optional
        The forward gain; ``None`` means ones.
    training : bool, default True
        Whether the forward pass used batch statistics (then the gradient also flows through
        them) or running statistics (constants).

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient of the loss with respect to ``x``.
    dweight, dbias : ndarray, shape ``(C,)``, dtype of ``weight`` (of ``x`` if None)
        Gradients with respect to the per-channel gain and bias.

    Raises
    ------
    TypeError, ValueError
        Non-floating arrays; ``dy`` not shaped like ``x``; ``mean``/``rstd``/``weight`` not of
        shape ``(C,)``.

    Notes
    -----
    Accumulated in float32 for float16/float32 ``x`` (float64 for float64), whatever the dtype
    of ``mean`` and ``rstd``; the parameter gradients are summed per block in float64.
    Covered in :ref:`sec-ch01-batch-norm`; the training formula is LayerNorm's backward
    (:ref:`sec-ch02-backward`) with the means taken over a channel instead of a row.
    """
    xp = get_array_module(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    dy, x, mean, rstd, weight = _backward_args(dy, x, mean, rstd, weight, xp)
    acc = accumulation_dtype(x.dtype)  # also for statistics saved in another dtype
    mean, rstd = mean.astype(acc, copy=False), rstd.astype(acc, copy=False)  # (C,), (C,)
    w = xp.ones_like(mean) if weight is None else weight.astype(acc)  # (C,)
    x3, dy3 = _channel_view(x), _channel_view(dy)  # (B, C, L)
    sum_dy = xp.zeros(x3.shape[1], dtype=np.float64)  # (C,)
    sum_dy_xhat = xp.zeros(x3.shape[1], dtype=np.float64)  # (C,)
    for b in _blocks(x3.shape):
        t = _xhat(x3[b], mean, rstd, acc)  # (n, C, l)
        t *= dy3[b]
        sum_dy_xhat += t.sum(axis=(0, 2), dtype=np.float64)
        sum_dy += dy3[b].sum(axis=(0, 2), dtype=np.float64)
    m = x3.shape[0] * x3.shape[2]
    means = ((w * (sum_dy / m))[:, None], (w * (sum_dy_xhat / m))[:, None])  # (C, 1) each
    dx3 = xp.empty(x3.shape, dtype=x.dtype)  # (B, C, L)
    for b in _blocks(x3.shape):
        g = dy3[b].astype(acc) * w[:, None]  # (n, C, l)
        if training:
            dx3[b] = layer_norm_dx(
                g,
                _xhat(x3[b], mean, rstd, acc),
                rstd[:, None],
                means=tuple(v.astype(acc) for v in means),
            )
        else:  # the running statistics are constants
            g *= rstd[:, None]
            dx3[b] = g
    pdtype = x.dtype if weight is None else weight.dtype
    return dx3.reshape(x.shape), sum_dy_xhat.astype(pdtype), sum_dy.astype(pdtype)


#: Elements of one temporary block: the passes over a block run in cache.
_BLOCK = 1 << 16


def _blocks(shape):
    """Index tuples of blocks of about ``_BLOCK`` elements covering an (B, C, L) array.

    Fixed by the shape alone, so every sum over blocks is added in the same order each time.
    """
    n, c, length = shape
    if c * length <= _BLOCK:
        step = _BLOCK // (c * length)
        for i in range(0, n, step):
            yield slice(i, min(i + step, n)), slice(None), slice(None)
        return
    step = max(1, _BLOCK // c)
    for i in range(n):
        for j in range(0, length, step):
            yield slice(i, i + 1), slice(None), slice(j, min(j + step, length))


def _xhat(x_block, mean, rstd, acc):
    """``(x - mean) * rstd`` of a block (n, C, l), as a new array in ``acc``."""
    t = x_block.astype(acc)  # (n, C, l)
    t -= mean[:, None]
    t *= rstd[:, None]
    return t


def _channel_stats(x3, acc, xp):
    """Mean and biased variance per channel of ``x3`` (B, C, L): a corrected two-pass.

    Each block is summed in float64 and the block totals added in float64, in a fixed order;
    the second pass sums the deviations from the first mean (which corrects its rounding)
    and their squares. Accurate whatever the layout or the mean (Chan, Golub and LeVeque).
    """
    m = x3.shape[0] * x3.shape[2]
    total = xp.zeros(x3.shape[1], dtype=np.float64)  # (C,)
    for b in _blocks(x3.shape):
        total += x3[b].sum(axis=(0, 2), dtype=np.float64)
    mean0 = (total / m).astype(acc)  # (C,)
    dev = xp.zeros(x3.shape[1], dtype=np.float64)  # (C,)
    sq = xp.zeros(x3.shape[1], dtype=np.float64)  # (C,)
    for b in _blocks(x3.shape):
        t = x3[b].astype(acc)  # (n, C, l)
        t -= mean0[:, None]
        dev += t.sum(axis=(0, 2), dtype=np.float64)
        t *= t
        sq += t.sum(axis=(0, 2), dtype=np.float64)
    delta = dev / m  # (C,)
    var = xp.maximum(sq / m - delta * delta, 0.0)  # (C,)
    return (mean0 + delta).astype(acc), var.astype(acc)
