r"""Dynamic Tanh (Zhu, Chen, He, LeCun and Liu, 2025): a normalization-free replacement for
LayerNorm, ``y = weight * tanh(alpha * x) + bias``, forward and backward.

DyT has no statistics: every element is mapped on its own, so a row's result never depends on
the other rows, and it has nothing to accumulate except the parameter gradients.
"""

import math
import numbers

import numpy as np

from . import _validate as check
from ._rows import accumulation_dtype
from ._validate import get_array_module

__all__ = ["dynamic_tanh", "dynamic_tanh_backward"]


def _alpha(alpha, xp):
    """``alpha`` as a finite Python float (from a real number, or a floating array of shape ()
    or (1,): the DyT authors' code stores it with shape (1,))."""
    if isinstance(alpha, bool):
        raise TypeError("alpha must be a real number or a 0-d floating array, got bool")
    if not isinstance(alpha, numbers.Real):
        if not isinstance(alpha, xp.ndarray):
            raise TypeError(
                f"alpha must be a real number or a 0-d floating array, got {type(alpha).__name__}"
            )
        alpha = check.float_array(alpha, "alpha", xp)
        if alpha.shape not in ((), (1,)):
            raise ValueError(
                f"alpha must be a scalar (an array of shape () or (1,)), got shape {alpha.shape}"
            )
        alpha = alpha.reshape(())
    value = float(alpha)
    if not math.isfinite(value):
        raise ValueError(f"alpha must be finite, got {value}")
    return value


def _inputs(x, alpha, weight, bias=None, **arrays):
    """Validate the arguments shared by the forward and the backward."""
    xp = get_array_module(x=x, alpha=alpha, weight=weight, bias=bias, **arrays)
    x = check.float_array(x, "x", xp)
    if x.ndim == 0:
        raise ValueError(
            "x must have at least one axis (weight and bias follow the last), got a 0-d array"
        )
    a = _alpha(alpha, xp)
    weight = check.optional_param(weight, "weight", x.shape[-1:], xp)
    bias = check.optional_param(bias, "bias", x.shape[-1:], xp)
    return xp, x, a, weight, bias


def dynamic_tanh(x, alpha, weight=None, bias=None):
    r"""Dynamic Tanh: :math:`y = \gamma \odot \tanh(\alpha x) + \beta` elementwise.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(..., D)``
        Input; never modified.
    alpha : float or floating ndarray of shape () or (1,)
        The learned scalar :math:`\alpha` (DyT initialises it at 0.5; the authors' code
        stores it with shape (1,)); finite.
    weight, bias : ndarray of shape (D,), optional
        Gain :math:`\gamma` and bias :math:`\beta` along the last axis (default 1 and 0).

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        Computed in float32 for float16/float32 ``x``, float64 for float64.

    Raises
    ------
    TypeError
        A non-floating ``x``/``weight``/``bias``, ``alpha`` not a real number or a floating
        0-d array, or arrays from different array libraries.
    ValueError
        ``x`` 0-d; ``alpha`` of another shape than () or (1,), or not finite;
        ``weight``/``bias`` not of shape (D,).

    Notes
    -----
    Elementwise, so bitwise batch invariant. Covered in :doc:`/book/04_variants`, section
    "Without normalization: Dynamic Tanh".

    References
    ----------
    .. [1] J. Zhu, X. Chen, K. He, Y. LeCun and Z. Liu, "Transformers without Normalization",
           CVPR 2025.
    """
    xp, x, a, weight, bias = _inputs(x, alpha, weight, bias)
    acc = accumulation_dtype(x.dtype)
    y = xp.tanh(x.astype(acc) * acc.type(a))  # a fresh array, finished in place
    if weight is not None:
        y *= weight.astype(acc, copy=False)
    if bias is not None:
        y += bias.astype(acc, copy=False)
    return y.astype(x.dtype, copy=False)


def dynamic_tanh_backward(dy, x, alpha, weight=None):
    r"""Backward of :func:`dynamic_tanh`.

    With :math:`t = \tanh(\alpha x)` and :math:`g = dy \odot \gamma`,

    .. math::

        dx = \alpha\, g\,(1 - t^2), \qquad
        d\alpha = \sum g\, x\,(1 - t^2), \qquad
        d\gamma = \sum_{\text{rows}} dy\, t, \qquad
        d\beta = \sum_{\text{rows}} dy .

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(..., D)``
        The forward input.
    alpha : float or floating ndarray of shape () or (1,)
        The forward :math:`\alpha`.
    weight : ndarray of shape (D,), optional
        The forward gain; ``None`` means ones.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient of the loss with respect to ``x``.
    dalpha : ndarray, shape of ``alpha`` (0-d for a number)
        Gradient with respect to :math:`\alpha`.
        Dtype of ``alpha`` when it is an array, else of ``x``.
    dweight, dbias : ndarray, shape (D,)
        Dtype of ``weight``, or of ``x`` when ``weight`` is None (then the gradients with
        respect to a gain of ones and a bias of zeros).

    Raises
    ------
    TypeError, ValueError
        As for :func:`dynamic_tanh`; also ``dy`` not shaped like ``x``.

    Notes
    -----
    The sums over rows are taken per row along the last axis, then over rows in float64.
    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh".
    """
    xp, x, a, weight, _ = _inputs(x, alpha, weight, dy=dy)
    dy = check.float_array(dy, "dy", xp)
    check.same_shape(dy, "dy", x)
    acc = accumulation_dtype(x.dtype)
    d = x.shape[-1]
    m = math.prod(x.shape[:-1])
    xa = x.astype(acc).reshape(m, d)  # (M, D), a fresh array
    dya = dy.astype(acc, copy=False).reshape(m, d)  # (M, D)
    t = xp.tanh(xa * acc.type(a))  # (M, D)
    dweight = (dya * t).sum(axis=0, dtype=np.float64)
    dbias = dya.sum(axis=0, dtype=np.float64)
    t *= t
    xp.subtract(1, t, out=t)  # 1 - t^2
    t *= dya if weight is None else dya * weight.astype(acc, copy=False)  # g (1 - t^2)
    xa *= t
    dalpha = xa.sum(axis=1).sum(dtype=np.float64)
    t *= acc.type(a)
    pdtype = x.dtype if weight is None else weight.dtype
    is_array = isinstance(alpha, xp.ndarray)
    adtype, ashape = (alpha.dtype, alpha.shape) if is_array else (x.dtype, ())
    return (
        t.reshape(x.shape).astype(x.dtype, copy=False),
        xp.asarray(dalpha, dtype=adtype).reshape(ashape),
        dweight.astype(pdtype),
        dbias.astype(pdtype),
    )
