r"""Backward passes that recompute the normalized input from the *output*.

The usual LayerNorm backward keeps the input ``x`` (plus ``mean`` and ``rstd``) from the
forward. But the output ``y`` is usually kept anyway, by the next layer (a linear layer needs
its input for its weight gradient). Since

.. math::

    y = \hat{x}\,\gamma + \beta \quad\Longrightarrow\quad \hat{x} = \frac{y - \beta}{\gamma},

the backward can recover :math:`\hat{x}` from ``y`` and never keep ``x``: one activation of
``N x D`` elements less per normalization layer, paid for with one division per element and
a condition, :math:`\gamma_j \ne 0` for every feature (where :math:`\gamma_j = 0` the output
carries no information about :math:`\hat{x}_j`, which the gradient still needs). Fused GPU
kernels such as Apex's "memory-efficient" LayerNorm make the same trade.

The accuracy cost: :math:`\hat{x}` is rebuilt from ``y`` rounded to the output dtype, an
error of about :math:`u\,(|\hat{x}| + |\beta|/|\gamma|)` with :math:`u` that dtype's unit
roundoff. With :math:`\beta = 0` that is :math:`u|\hat{x}|`, no more than rounding ``dx`` to
the same dtype costs; with a bias it grows like :math:`|\beta|/|\gamma|`.

Covered in :ref:`sec-ch05-recompute`.
"""

import numpy as np

from ._rows import expand_stat
from ._validate import get_array_module
from .formulas import layer_norm_dx, rms_norm_dx

__all__ = [
    "layer_norm_backward_from_output",
    "rms_norm_backward_from_output",
    "saved_bytes",
]


def _xhat_from_output(y, rstd, weight, bias, name):
    xp = get_array_module(y=y, rstd=rstd, weight=weight, bias=bias)
    k = y.ndim - rstd.ndim
    if k < 1 or y.shape[: rstd.ndim] != rstd.shape:
        raise ValueError(f"rstd: expected the leading axes of y {y.shape}, got shape {rstd.shape}")
    norm = y.shape[rstd.ndim :]
    acc = rstd.dtype
    xhat = y.astype(acc)
    for pname, p in (("bias", bias), ("weight", weight)):
        if p is not None and p.shape != norm:
            raise ValueError(f"{pname}: expected shape {norm}, got {p.shape}")
    if bias is not None:
        xhat = xhat - bias.astype(acc)
    if weight is not None:
        if bool(xp.any(weight == 0)):
            raise ValueError(
                f"weight: every entry must be nonzero to recompute {name} from the output "
                "(where weight is 0, y says nothing about xhat); keep x instead"
            )
        xhat = xhat / weight.astype(acc)
    return xhat, k, acc


def layer_norm_backward_from_output(dy, y, rstd, weight=None, bias=None):
    r"""LayerNorm backward from the output ``y`` instead of the input ``x``.

    With :math:`\hat{x} = (y - \beta)/\gamma`, :math:`g = dy\,\gamma` and :math:`r` the row's
    ``rstd``,

    .. math::

        dx = r\,\bigl(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\bigr),\quad
        d\gamma = \sum_{\text{rows}} dy\,\hat{x},\quad d\beta = \sum_{\text{rows}} dy .

    The mean is not needed at all.

    Parameters
    ----------
    dy, y : ndarray, shape ``(*lead, *norm)``
        Output gradient and the forward's output.
    rstd : ndarray, shape ``lead``
        From :func:`lnlib.layer_norm_forward`; its dtype is the accumulation dtype.
    weight, bias : ndarray of shape ``norm`` or None
        The forward's parameters; ``weight`` must have no zero entry.

    Returns
    -------
    dx : ndarray, shape and dtype of ``y``
        Gradient of the loss with respect to the forward's input ``x``.
    dweight, dbias : ndarray, shape ``norm``, dtype of ``weight`` (of ``y`` when None)
        Gradients with respect to the gain and bias.

    Raises
    ------
    ValueError
        ``weight`` has a zero entry; shapes that do not fit ``y``.

    Notes
    -----
    Covered in :ref:`sec-ch05-recompute`.
    """
    if dy.shape != y.shape:
        raise ValueError(f"dy: expected the shape of y {y.shape}, got {dy.shape}")
    xhat, k, acc = _xhat_from_output(y, rstd, weight, bias, "LayerNorm")
    axes = tuple(range(y.ndim - k, y.ndim))
    rows = tuple(range(y.ndim - k))
    dya = dy.astype(acc)
    g = dya if weight is None else dya * weight.astype(acc)
    dx = layer_norm_dx(g, xhat, expand_stat(rstd, k), axes)
    pdtype = y.dtype if weight is None else weight.dtype
    return (
        dx.astype(y.dtype),
        (dya * xhat).sum(axis=rows).astype(pdtype),
        dya.sum(axis=rows).astype(pdtype),
    )


def rms_norm_backward_from_output(dy, y, rstd, weight=None):
    r"""RMSNorm backward from the output: :math:`\hat{x} = y / \gamma`, then as usual
    (:math:`r` the row's ``rstd``),

    .. math::

        dx = r\,\bigl(g - \hat{x}\,\overline{g\hat{x}}\bigr),\quad
        d\gamma = \sum_{\text{rows}} dy\,\hat{x}.

    Parameters
    ----------
    dy, y : ndarray, shape ``(*lead, *norm)``
        Output gradient and the forward's output.
    rstd : ndarray, shape ``lead``
        From :func:`lnlib.rms_norm_forward`; its dtype is the accumulation dtype.
    weight : ndarray of shape ``norm`` or None
        The forward's gain; must have no zero entry.

    Returns
    -------
    dx : ndarray, shape and dtype of ``y``
        Gradient of the loss with respect to the forward's input ``x``.
    dweight : ndarray, shape ``norm``, dtype of ``weight`` (of ``y`` when None)
        Gradient with respect to the gain.

    Raises
    ------
    ValueError
        ``weight`` has a zero entry; shapes that do not fit ``y``.

    Notes
    -----
    Covered in :ref:`sec-ch05-recompute`.
    """
    if dy.shape != y.shape:
        raise ValueError(f"dy: expected the shape of y {y.shape}, got {dy.shape}")
    xhat, k, acc = _xhat_from_output(y, rstd, weight, None, "RMSNorm")
    axes = tuple(range(y.ndim - k, y.ndim))
    rows = tuple(range(y.ndim - k))
    dya = dy.astype(acc)
    g = dya if weight is None else dya * weight.astype(acc)
    dx = rms_norm_dx(g, xhat, expand_stat(rstd, k), axes)
    pdtype = y.dtype if weight is None else weight.dtype
    return dx.astype(y.dtype), (dya * xhat).sum(axis=rows).astype(pdtype)


def saved_bytes(*arrays):
    """Bytes of memory held by ``arrays``, counting a buffer shared by several only once.

    Views are traced to the array that owns their memory, so keeping ``y`` for the next layer
    and for the backward costs its bytes once.

    Parameters
    ----------
    *arrays : ndarray or None
        The arrays a backward pass keeps; ``None`` entries are skipped.

    Returns
    -------
    int
        Total bytes of the distinct buffers behind ``arrays``.

    Notes
    -----
    Covered in :ref:`sec-ch05-recompute`, which compares what each backward keeps.
    """
    owners = {}
    for a in arrays:
        if a is None:
            continue
        base = a
        while getattr(base, "base", None) is not None and isinstance(base.base, np.ndarray):
            base = base.base
        owners[id(base)] = base.nbytes
    return sum(owners.values())
