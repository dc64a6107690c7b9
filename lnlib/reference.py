r"""Readable reference implementations: the formulas of the book, a few lines each.

These are the versions derived in the chapter "The math of LayerNorm"; the public functions in
:mod:`lnlib` compute the same quantities faster and are tested against these. Arguments are
the same as those of the public functions, but nothing is validated here.

Statistics are accumulated in float32 for float16/float32 inputs and in float64 for float64;
results come back in the dtype of ``x`` (parameter gradients in the dtype of the parameter).
"""

from ._backend import accumulation_dtype, get_array_module
from ._rows import sum_to_shape


def _last_axes(ndim, k):
    return tuple(range(ndim - k, ndim))


def _expand(stat, k):
    """Append ``k`` axes of length one so that a per-row statistic broadcasts against x."""
    return stat.reshape(stat.shape + (1,) * k)


def layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5, normalized_ndim=1):
    """LayerNorm forward: y = (x - mean) * rstd * weight + bias; returns (y, mean, rstd)."""
    k = normalized_ndim
    xa = x.astype(accumulation_dtype(x.dtype))
    mean = xa.mean(axis=_last_axes(x.ndim, k))
    xc = xa - _expand(mean, k)
    var = (xc * xc).mean(axis=_last_axes(x.ndim, k))  # biased variance, two passes
    rstd = 1 / (var + eps) ** 0.5
    y = xc * _expand(rstd, k)
    if weight is not None:
        y = y * weight.astype(xa.dtype)
    if bias is not None:
        y = y + bias.astype(xa.dtype)
    return y.astype(x.dtype), mean, rstd


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    """LayerNorm backward: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight."""
    k = x.ndim - mean.ndim
    axes, rows = _last_axes(x.ndim, k), tuple(range(mean.ndim))
    acc = mean.dtype
    xhat = (x.astype(acc) - _expand(mean, k)) * _expand(rstd, k)
    dya = dy.astype(acc)
    g = dya if weight is None else dya * weight.astype(acc)
    dx = _expand(rstd, k) * (
        g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True)
    )
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dya * xhat).sum(axis=rows).astype(pdtype)
    dbias = dya.sum(axis=rows).astype(pdtype)
    return dx.astype(x.dtype), dweight, dbias


def rms_norm_forward(x, weight=None, *, eps=1e-6, normalized_ndim=1):
    """RMSNorm forward: y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps)."""
    k = normalized_ndim
    xa = x.astype(accumulation_dtype(x.dtype))
    rstd = 1 / ((xa * xa).mean(axis=_last_axes(x.ndim, k)) + eps) ** 0.5
    y = xa * _expand(rstd, k)
    if weight is not None:
        y = y * weight.astype(xa.dtype)
    return y.astype(x.dtype), rstd


def rms_norm_backward(dy, x, rstd, weight=None):
    """RMSNorm backward: dx = rstd * (g - xhat * mean(g * xhat)), xhat = x * rstd."""
    k = x.ndim - rstd.ndim
    axes, rows = _last_axes(x.ndim, k), tuple(range(rstd.ndim))
    acc = rstd.dtype
    xhat = x.astype(acc) * _expand(rstd, k)
    dya = dy.astype(acc)
    g = dya if weight is None else dya * weight.astype(acc)
    dx = _expand(rstd, k) * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    pdtype = x.dtype if weight is None else weight.dtype
    return dx.astype(x.dtype), (dya * xhat).sum(axis=rows).astype(pdtype)


def ada_layer_norm_forward(x, shift, scale, *, eps=1e-6, normalized_ndim=1):
    """AdaLN forward (DiT modulation): y = LN(x) * (1 + scale) + shift; returns (y, mean, rstd)."""
    xhat, mean, rstd = layer_norm_forward(
        x.astype(accumulation_dtype(x.dtype)), eps=eps, normalized_ndim=normalized_ndim
    )
    y = xhat * (1 + scale.astype(xhat.dtype)) + shift.astype(xhat.dtype)
    return y.astype(x.dtype), mean, rstd


def ada_layer_norm_backward(dy, x, mean, rstd, scale, *, shift_shape=None):
    """AdaLN backward: dshift = sum dy, dscale = sum dy * xhat, dx = LN backward of dy * (1 + scale)."""
    k = x.ndim - mean.ndim
    acc = mean.dtype
    xhat = (x.astype(acc) - _expand(mean, k)) * _expand(rstd, k)
    dya = dy.astype(acc)
    g = dya * (1 + scale.astype(acc))
    dx, _, _ = layer_norm_backward(g, x.astype(acc), mean, rstd)
    dshift = sum_to_shape(dya, scale.shape if shift_shape is None else shift_shape)
    dscale = sum_to_shape(dya * xhat, scale.shape)
    return dx.astype(x.dtype), dshift.astype(scale.dtype), dscale.astype(scale.dtype)


def batch_norm_forward(x, running_mean, running_var, weight=None, bias=None, *,
                       training, momentum=0.1, eps=1e-5):
    """BatchNorm forward over (N, C, ...): statistics per channel over every other axis.

    In training the batch statistics are used and the running ones updated in place (unbiased
    variance); in evaluation the running statistics are used. Returns (y, mean, rstd).
    """
    xp = get_array_module(x=x)
    acc = accumulation_dtype(x.dtype)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    xa = x.astype(acc)
    if training:
        mean = xa.mean(axis=axes)
        var = ((xa - mean.reshape(shape)) ** 2).mean(axis=axes)
        if running_mean is not None:
            n = x.size // x.shape[1]
            running_mean[...] = (1 - momentum) * running_mean + momentum * mean
            running_var[...] = (1 - momentum) * running_var + momentum * var * n / (n - 1)
    else:
        mean, var = xp.asarray(running_mean, dtype=acc), xp.asarray(running_var, dtype=acc)
    rstd = 1 / (var + eps) ** 0.5
    y = (xa - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        y = y * weight.astype(acc).reshape(shape)
    if bias is not None:
        y = y + bias.astype(acc).reshape(shape)
    return y.astype(x.dtype), mean, rstd


def batch_norm_backward(dy, x, mean, rstd, weight=None, *, training=True):
    """BatchNorm backward; with batch statistics the gradient flows through mean and rstd too."""
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    acc = mean.dtype
    xhat = (x.astype(acc) - mean.reshape(shape)) * rstd.reshape(shape)
    dya = dy.astype(acc)
    g = dya if weight is None else dya * weight.astype(acc).reshape(shape)
    if training:
        g = g - g.mean(axis=axes, keepdims=True) - xhat * (g * xhat).mean(axis=axes, keepdims=True)
    dx = g * rstd.reshape(shape)
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dya * xhat).sum(axis=axes).astype(pdtype)
    dbias = dya.sum(axis=axes).astype(pdtype)
    return dx.astype(x.dtype), dweight, dbias


def group_norm_forward(x, num_groups, weight=None, bias=None, *, eps=1e-5):
    """GroupNorm forward over (N, C, ...): LayerNorm of each group of C/G channels (and every
    spatial position), then a per-channel gain and bias; returns (y, mean, rstd), (N, G) each."""
    n, c, g = x.shape[0], x.shape[1], num_groups
    xa = x.astype(accumulation_dtype(x.dtype)).reshape(n, g, -1)  # (N, G, D)
    mean = xa.mean(axis=2)
    xc = xa - mean[:, :, None]
    rstd = 1 / ((xc * xc).mean(axis=2) + eps) ** 0.5  # biased variance, two passes
    y = (xc * rstd[:, :, None]).reshape(n, c, -1)  # (N, C, L)
    if weight is not None:
        y = y * weight.astype(xa.dtype)[:, None]
    if bias is not None:
        y = y + bias.astype(xa.dtype)[:, None]
    return y.reshape(x.shape).astype(x.dtype), mean, rstd


def group_norm_backward(dy, x, mean, rstd, num_groups, weight=None):
    """GroupNorm backward: the LayerNorm backward on each group, with g = dy * weight[c]."""
    n, c, g = x.shape[0], x.shape[1], num_groups
    acc = accumulation_dtype(x.dtype)
    mean, rstd = mean.astype(acc)[:, :, None], rstd.astype(acc)[:, :, None]
    xhat = (x.astype(acc).reshape(n, g, -1) - mean) * rstd  # (N, G, D)
    dya = dy.astype(acc).reshape(n, c, -1)  # (N, C, L)
    gs = dya if weight is None else dya * weight.astype(acc)[:, None]
    gs = gs.reshape(n, g, -1)
    dx = rstd * (gs - gs.mean(axis=2, keepdims=True)
                 - xhat * (gs * xhat).mean(axis=2, keepdims=True))
    pdtype = x.dtype if weight is None else weight.dtype
    dweight = (dya * xhat.reshape(n, c, -1)).sum(axis=(0, 2)).astype(pdtype)
    dbias = dya.sum(axis=(0, 2)).astype(pdtype)
    return dx.reshape(x.shape).astype(x.dtype), dweight, dbias


def dynamic_tanh(x, alpha, weight=None, bias=None):
    """Dynamic Tanh (DyT): y = weight * tanh(alpha * x) + bias, elementwise."""
    xp = get_array_module(x=x)
    acc = accumulation_dtype(x.dtype)
    y = xp.tanh(x.astype(acc) * acc.type(float(alpha)))
    if weight is not None:
        y = y * weight.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype)


def dynamic_tanh_backward(dy, x, alpha, weight=None):
    """DyT backward: with t = tanh(alpha x) and g = dy * weight, dx = alpha g (1 - t^2),
    dalpha = sum g x (1 - t^2), dweight = sum over rows dy t, dbias = sum over rows dy."""
    xp = get_array_module(x=x)
    acc = accumulation_dtype(x.dtype)
    xa, dya = x.astype(acc), dy.astype(acc)
    t = xp.tanh(xa * acc.type(float(alpha)))
    g = dya if weight is None else dya * weight.astype(acc)
    rows = tuple(range(x.ndim - 1))
    pdtype = x.dtype if weight is None else weight.dtype
    adtype = alpha.dtype if isinstance(alpha, xp.ndarray) else x.dtype
    dalpha = xp.asarray((g * xa * (1 - t * t)).sum(), dtype=adtype)
    return ((float(alpha) * g * (1 - t * t)).astype(x.dtype), dalpha,
            (dya * t).sum(axis=rows).astype(pdtype), dya.sum(axis=rows).astype(pdtype))
