r"""The backward formulas every path shares, from :math:`\hat{x}`: one copy of each.

The readable reference (:mod:`lnlib.reference`) and production code (BatchNorm, the backwards
that recompute from the output, the sharded LayerNorm) compute their gradients with these, so
the formula the book derives is written once. The fast paths (the NumPy path, the compiled and
CUDA kernels) arrange the same quantities for speed and are tested against the reference.
"""

__all__ = ["layer_norm_dx", "rms_norm_dx"]


def layer_norm_dx(g, xhat, rstd, axes=None, means=None):
    r"""The LayerNorm backward from :math:`\hat{x}`: the one copy of this formula.

    .. math::

        dx = r\,\big(g - \overline{g} - \hat{x}\,\overline{g\hat{x}}\big),
        \qquad g = dy\,\gamma,

    the bars being means over the normalized values (the ``D`` values of a row for LayerNorm,
    the ``m`` values of a channel for BatchNorm). Used by the reference, BatchNorm, the
    recompute-from-output and sharded backwards.

    Parameters
    ----------
    g, xhat : ndarray, same shape
        :math:`g = dy\,\gamma` and :math:`\hat{x}`, in the accumulation dtype.
    rstd : ndarray, broadcastable against ``g`` (size-1 normalized axes)
        :math:`r` of each row (or channel).
    axes : tuple of int, optional
        The normalized axes the means run over, when ``means`` is None.
    means : tuple of two ndarrays, optional
        :math:`(\overline{g}, \overline{g\hat{x}})`, broadcastable against ``g``, when
        they were computed elsewhere (summed over blocks or gathered from shards).

    Returns
    -------
    dx : ndarray, shape and dtype of ``g``
        Gradient of the loss with respect to the input of the normalization.

    Notes
    -----
    Covered in :ref:`sec-ch02-backward`.
    """
    if means is None:
        means = (
            g.mean(axis=axes, keepdims=True),  # (N, 1)
            (g * xhat).mean(axis=axes, keepdims=True),
        )  # (N, 1)
    g_mean, gxhat_mean = means
    return rstd * (g - g_mean - xhat * gxhat_mean)  # (B, D)


def rms_norm_dx(g, xhat, rstd, axes):
    r"""The RMSNorm backward from :math:`\hat{x} = x\,r`: the one copy of this formula.

    .. math::

        dx = r\,\big(g - \hat{x}\,\overline{g\hat{x}}\big), \qquad g = dy\,\gamma .

    Parameters
    ----------
    g, xhat : ndarray, same shape
        :math:`g = dy\,\gamma` and :math:`\hat{x} = x\,r`, in the accumulation dtype.
    rstd : ndarray, broadcastable against ``g`` (size-1 normalized axes)
        :math:`r` of each row.
    axes : tuple of int
        The normalized axes the mean runs over.

    Returns
    -------
    dx : ndarray, shape and dtype of ``g``
        Gradient of the loss with respect to ``x``.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "RMSNorm", "The backward pass".
    """
    gxhat_mean = (g * xhat).mean(axis=axes, keepdims=True)  # (N, 1)
    return rstd * (g - xhat * gxhat_mean)  # (B, D)
