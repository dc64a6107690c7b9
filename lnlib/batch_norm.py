r"""Batch normalization (Ioffe and Szegedy, 2015), for comparison with layer normalization."""

import math
import numbers

import numpy as np

from . import _validate as check
from ._backend import accumulation_dtype, get_array_module

__all__ = ["batch_norm", "batch_norm_forward", "batch_norm_backward"]


def batch_norm(x, running_mean, running_var, weight=None, bias=None, *, training,
               momentum=0.1, eps=1e-5):
    r"""Batch normalization of ``x`` (N, C, ...); returns ``y`` only.

    Same as ``batch_norm_forward(...)[0]``; see :func:`batch_norm_forward`.
    """
    return batch_norm_forward(x, running_mean, running_var, weight, bias, training=training,
                              momentum=momentum, eps=eps)[0]


def _channel_view(x):
    """``x`` (N, C, ...) as (N, C, L): channel statistics are then over axes 0 and 2."""
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
        raise ValueError(f"{name} must have shape ({channels},) (one value per channel), got {a.shape}")
    return a


def batch_norm_forward(x, running_mean, running_var, weight=None, bias=None, *, training,
                       momentum=0.1, eps=1e-5):
    r"""Batch normalization forward pass, like ``torch.nn.functional.batch_norm``.

    For ``x`` of shape ``(N, C, ...)`` each channel :math:`c` is normalized with statistics
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
    x : ndarray, float16, float32 or float64, shape ``(N, C, ...)``
    running_mean, running_var : ndarray of shape ``(C,)``, or None
        Updated in place in training (may be None there: no update); required in evaluation.
    weight, bias : ndarray of shape ``(C,)``, optional
    training : bool
        Batch statistics (True) or running statistics (False). Keyword only, required.
    momentum : float, default 0.1
        In [0, 1].
    eps : float, default 1e-5

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
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
        in training (its unbiased variance is undefined); bad ``eps`` or ``momentum``.

    Notes
    -----
    Compared with LayerNorm in the book, chapter "Motivation".

    References
    ----------
    S. Ioffe and C. Szegedy, "Batch Normalization: Accelerating Deep Network Training by
    Reducing Internal Covariate Shift", ICML 2015.
    """
    xp = get_array_module(x=x, running_mean=running_mean, running_var=running_var,
                          weight=weight, bias=bias)
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
    m = x.size // channels
    if training:
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) \
                or not math.isfinite(momentum) or not 0 <= momentum <= 1:
            raise ValueError(f"momentum must be a number in [0, 1], got {momentum!r}")
        if m < 2:
            raise ValueError(
                f"batch_norm in training needs more than one value per channel, got x of shape {x.shape}"
            )
    elif running_mean is None:
        raise ValueError("running_mean and running_var are required when training=False")

    acc = accumulation_dtype(x.dtype)
    x3 = _channel_view(x).astype(acc, copy=False)  # (N, C, L)
    if training:
        mean = x3.mean(axis=(0, 2))
        xc = x3 - mean[:, None]
        var = (xc * xc).mean(axis=(0, 2))
        if running_mean is not None:
            running_mean *= 1 - momentum
            running_mean += (momentum * mean).astype(running_mean.dtype)
            running_var *= 1 - momentum
            running_var += (momentum * var * (m / (m - 1))).astype(running_var.dtype)
    else:
        mean = running_mean.astype(acc)
        var = running_var.astype(acc)
        xc = x3 - mean[:, None]
    rstd = 1 / xp.sqrt(var + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y *= weight.astype(acc)[:, None]
    if bias is not None:
        y += bias.astype(acc)[:, None]
    return y.reshape(x.shape).astype(x.dtype, copy=False), mean, rstd


def batch_norm_backward(dy, x, mean, rstd, weight=None, *, training=True):
    r"""Batch normalization backward pass.

    With :math:`\hat{x} = (x - \mu_c)\,\mathrm{rstd}_c`, :math:`g = dy\,\gamma_c` and bars
    for means over the :math:`m` values of a channel:

    .. math::

        dx = \mathrm{rstd}_c\,\big(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\big)
        \quad\text{(training)}, \qquad dx = \mathrm{rstd}_c\,g \quad\text{(evaluation)},

    and :math:`d\gamma_c = \sum dy\,\hat{x}`, :math:`d\beta_c = \sum dy`.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
    x : ndarray, shape ``(N, C, ...)``
    mean, rstd : ndarray, shape ``(C,)``, as returned by :func:`batch_norm_forward`
    weight : ndarray of shape ``(C,)``, optional
    training : bool, default True
        Whether the forward pass used batch statistics (then the gradient also flows through
        them) or running statistics (constants).

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
    dweight, dbias : ndarray, shape ``(C,)``, dtype of ``weight`` (of ``x`` if None)

    Raises
    ------
    TypeError, ValueError
        Non-floating arrays; ``dy`` not shaped like ``x``; ``mean``/``rstd``/``weight`` not of
        shape ``(C,)``.
    """
    xp = get_array_module(dy=dy, x=x, mean=mean, rstd=rstd, weight=weight)
    x = check.float_array(x, "x", xp)
    _check_channels(x)
    dy = check.float_array(dy, "dy", xp)
    check.same_shape(dy, "dy", x)
    channels = x.shape[1]
    mean = check.float_array(mean, "mean", xp)
    rstd = check.float_array(rstd, "rstd", xp)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.shape != (channels,):
            raise ValueError(f"{name} must have shape ({channels},) (one value per channel of x), got {a.shape}")
    weight = check.optional_param(weight, "weight", (channels,), xp)
    acc = mean.dtype
    x3 = _channel_view(x).astype(acc, copy=False)
    dy3 = _channel_view(dy).astype(acc, copy=False)
    xhat = (x3 - mean[:, None]) * rstd[:, None]
    g = dy3 if weight is None else dy3 * weight.astype(acc)[:, None]
    if training:
        g = g - g.mean(axis=(0, 2), keepdims=True) - xhat * (g * xhat).mean(axis=(0, 2), keepdims=True)
    dx = g * rstd[:, None]
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dy3 * xhat).sum(axis=(0, 2)).astype(pdtype)
    dbias = dy3.sum(axis=(0, 2)).astype(pdtype)
    return dx.reshape(x.shape).astype(x.dtype, copy=False), dweight, dbias
