r"""Adaptive layer normalization (AdaLN) as used in diffusion transformers (Peebles and Xie, 2023).

The normalization has no parameters of its own; a conditioning vector ``c`` (a time step or
class embedding) is mapped by a small layer to a shift, a scale and a gate per feature:

.. math::

    (\delta, s, \kappa) = W_c\,\mathrm{SiLU}(c) + \beta_c, \qquad
    y = \mathrm{LN}(x) \odot (1 + s) + \delta ,

the shift, scale and gate of the book's notation (``weight`` holds :math:`W_c^\top`, so the code
computes ``SiLU(c) @ weight + bias`` on rows). With the adaLN-Zero initialisation
(:math:`W_c = 0`, :math:`\beta_c = 0`) every block starts as the
identity on its residual branch, because the gate that multiplies the branch is zero.
"""

import math

import numpy as np

from . import _validate as check
from ._backend import select
from ._rows import accumulation_dtype, as_rows, expand_stat, sum_to_shape
from ._validate import get_array_module

__all__ = [
    "ada_layer_norm",
    "ada_layer_norm_forward",
    "ada_layer_norm_backward",
    "adaln_modulation",
    "adaln_modulation_backward",
    "adaln_zero_init",
]


def ada_layer_norm(x, shift, scale, *, eps=1e-6, normalized_ndim=1):
    r"""AdaLN of ``x``: ``LN(x) * (1 + scale) + shift``; returns ``y`` only.

    .. math::

        y = \hat{x}\,(1 + \mathrm{scale}) + \mathrm{shift}, \qquad
        \hat{x} = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} .

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input, normalized over its last ``normalized_ndim`` axes; never modified.
    shift, scale : ndarray, floating
        Broadcast against ``x`` without enlarging it, e.g. ``(B, 1, D)`` for ``x`` of shape
        ``(B, T, D)``; usually from :func:`adaln_modulation`.
    eps : float, default 1e-6
        Added to the variance inside the square root; finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The modulated, normalized input.

    Raises
    ------
    TypeError, ValueError
        As for :func:`ada_layer_norm_forward`, before anything is computed.

    Notes
    -----
    Same as ``ada_layer_norm_forward(...)[0]``. Covered in :doc:`/book/04_variants`, section
    "Conditioning through the norm".
    """
    return ada_layer_norm_forward(x, shift, scale, eps=eps, normalized_ndim=normalized_ndim)[0]


def _inputs(x, shift, scale, xp):
    x = check.float_array(x, "x", xp)
    shift = check.float_array(shift, "shift", xp)
    scale = check.float_array(scale, "scale", xp)
    check.broadcast_modulation(shift, "shift", x)
    check.broadcast_modulation(scale, "scale", x)
    return x, shift, scale


def ada_layer_norm_forward(x, shift, scale, *, eps=1e-6, normalized_ndim=1):
    r"""AdaLN forward pass (the DiT modulation of a parameter-free LayerNorm).

    .. math::

        \hat{x} = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}}, \qquad
        y = \hat{x}\,(1 + \mathrm{scale}) + \mathrm{shift},

    with :math:`\mu, \sigma^2` over the last ``normalized_ndim`` axes as in
    :func:`lnlib.layer_norm_forward`.

    Parameters
    ----------
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        Input, normalized over its last ``normalized_ndim`` axes; never modified.
    shift, scale : ndarray, floating
        Broadcast against ``x`` without enlarging it: ``(B, D)`` for ``x`` of shape
        ``(B, D)``, ``(B, 1, D)`` for ``(B, T, D)`` (one modulation per sample), or anything
        else that broadcasts. Usually the output of :func:`adaln_modulation`.
    eps : float, default 1e-6
        Added to the variance inside the square root (1e-6 as in DiT); finite and >= 0.
    normalized_ndim : int, default 1
        How many trailing axes to normalize over.

    Returns
    -------
    y : ndarray, shape and dtype of ``x``
        The modulated, normalized input.
    mean, rstd : ndarray, shape ``lead``, float32 (float64 for float64 ``x``)
        :math:`\mu` and :math:`r` of each row, for :func:`ada_layer_norm_backward`.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``shift``/``scale`` that do not broadcast against ``x``; bad ``eps`` or
        ``normalized_ndim``; an empty normalized axis.

    Notes
    -----
    On CuPy arrays the CUDA kernels apply the modulation inside the LayerNorm kernel (no pass
    over x or y of its own), with ``1 + scale`` and ``shift`` in the accumulation dtype; the
    other paths compute the LayerNorm, then the modulation. Covered in
    :doc:`/book/04_variants`, section "Conditioning through the norm".

    References
    ----------
    .. [1] W. Peebles and S. Xie, "Scalable Diffusion Models with Transformers", ICCV 2023.
    """
    xp = get_array_module(x=x, shift=shift, scale=scale)
    x, shift, scale = _inputs(x, shift, scale, xp)
    eps = check.eps_value(eps)
    k = check.normalized_ndim_value(x, normalized_ndim)
    acc, lead = accumulation_dtype(x.dtype), x.shape[: x.ndim - k]
    modulated = select("modulated_layer_norm_forward", xp)
    if modulated is not None and x.size:  # CUDA: the modulation inside the LayerNorm kernel
        pshape, group, mods = _param_layout(x.shape, k, shift.shape, scale.shape)
        weight = 1 + _param_rows(scale, pshape, mods, acc, xp)  # 1 + scale as on the CPU paths
        bias = _param_rows(shift, pshape, mods, acc, xp)
        y, mean, rstd = modulated(as_rows(x, k), weight, bias, eps, group, mods)
        return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)
    forward_rows = select("layer_norm_forward", xp)
    xhat, mean, rstd = forward_rows(as_rows(x, k), None, None, eps=eps)
    y = xhat.reshape(x.shape)  # modulated in place, in the accumulation dtype per element
    xp.multiply(y, 1 + scale.astype(acc, copy=False), out=y, casting="same_kind")
    xp.add(y, shift.astype(acc, copy=False), out=y, casting="same_kind")
    return y, mean.reshape(lead), rstd.reshape(lead)


def ada_layer_norm_backward(dy, x, mean, rstd, scale, *, shift_shape=None):
    r"""AdaLN backward pass.

    .. math::

        d\,\mathrm{shift} = \textstyle\sum dy, \qquad
        d\,\mathrm{scale} = \textstyle\sum dy\,\hat{x}, \qquad
        dx = \mathrm{LN\ backward}\big(dy\,(1 + \mathrm{scale})\big),

    the sums running over the axes along which ``shift`` and ``scale`` were broadcast.

    Parameters
    ----------
    dy : ndarray, shape of ``x``
        Gradient of the loss with respect to ``y``.
    x : ndarray, float16, float32 or float64, shape ``(*lead, *norm)``
        The forward input.
    mean, rstd : ndarray, shape ``lead``
        As returned by :func:`ada_layer_norm_forward`; ``x.ndim - mean.ndim`` axes are
        normalized.
    scale : ndarray
        The forward ``scale`` (broadcast against ``x``).
    shift_shape : tuple, optional
        Shape of the forward ``shift`` if it differs from that of ``scale``.

    Returns
    -------
    dx : ndarray, shape and dtype of ``x``
        Gradient of the loss with respect to ``x``.
    dshift : ndarray, shape ``shift_shape`` (default ``scale.shape``), dtype of ``scale``
        Gradient with respect to ``shift``, summed over the broadcast axes.
    dscale : ndarray, shape and dtype of ``scale``
        Gradient with respect to ``scale``, summed over the broadcast axes.

    Raises
    ------
    TypeError, ValueError
        As for :func:`lnlib.layer_norm_backward`, and for a ``scale`` or ``shift_shape``
        that does not broadcast against ``x``.

    Notes
    -----
    Runs on the LayerNorm row implementation chosen by :func:`lnlib.use_implementation`,
    block by block, so the temporaries stay small; accumulated in float32 for float16/float32
    ``x`` (float64 for float64), whatever the dtype of ``mean`` and ``rstd``; ``dshift`` and
    ``dscale`` are summed in float64. On CuPy arrays the CUDA kernels compute dx, dshift and
    dscale in one LayerNorm backward with per-row weight ``1 + scale``, the sums in the
    accumulation dtype. Covered in :doc:`/book/04_variants`, section "Conditioning through the
    norm".
    """
    xp = get_array_module(dy=dy, x=x, mean=mean, rstd=rstd, scale=scale)
    dy, x, (mean, rstd), k = check.backward_inputs(dy, x, xp, mean=mean, rstd=rstd)
    scale = check.float_array(scale, "scale", xp)
    check.broadcast_modulation(scale, "scale", x)
    shift_shape = (
        scale.shape if shift_shape is None else check.shape_value(shift_shape, "shift_shape")
    )
    check.broadcast_modulation(np.empty(shift_shape, dtype=np.int8), "shift_shape", x)
    acc = accumulation_dtype(x.dtype)
    mean, rstd = mean.astype(acc, copy=False), rstd.astype(acc, copy=False)  # (N,), (N,)
    modulated = select("modulated_layer_norm_backward", xp)
    if modulated is not None and x.size:  # CUDA: dscale, dshift summed per parameter row
        pshape, group, mods = _param_layout(x.shape, k, shift_shape, scale.shape)
        weight = 1 + _param_rows(scale, pshape, mods, acc, xp)
        rows = as_rows(dy, k), as_rows(x, k), mean.reshape(-1), rstd.reshape(-1), weight
        dx, dw, db = modulated(*rows, group, mods)  # dw, db: (mods, D)
        dshift = sum_to_shape(db.reshape(pshape), shift_shape).astype(scale.dtype)
        dscale = sum_to_shape(dw.reshape(pshape), scale.shape).astype(scale.dtype)
        return dx.reshape(x.shape), dshift, dscale
    backward_rows = select("layer_norm_backward", xp)
    scale_shape = scale.shape
    scale = scale.reshape((1,) * (x.ndim - scale.ndim) + scale.shape)  # padded to x.ndim
    dx = xp.empty_like(x)  # (N, D)
    dscale = xp.zeros(scale.shape, dtype=np.float64)
    for idx in _blocks(mean.shape, x.size // max(1, mean.size)):
        x_b, dy_b, s_idx = x[idx], dy[idx], _broadcast_index(idx, scale.shape)
        g = dy_b * (1 + scale[s_idx].astype(acc))  # (n, D): the LayerNorm dy
        dx[idx] = backward_rows(
            as_rows(g, k), as_rows(x_b, k), mean[idx].reshape(-1), rstd[idx].reshape(-1), None
        )[0].reshape(x_b.shape)
        xhat = x_b.astype(acc)  # (n, D)
        xhat -= expand_stat(mean[idx], k)
        xhat *= expand_stat(rstd[idx], k)
        xhat *= dy_b
        dscale[s_idx] += sum_to_shape(xhat, dscale[s_idx].shape, np.float64)
    dshift = sum_to_shape(dy, shift_shape, np.float64).astype(scale.dtype)
    return dx, dshift, dscale.reshape(scale_shape).astype(scale.dtype)


#: Elements of one block of the AdaLN backward (its temporaries are this size).
_BLOCK = 1 << 18


def _blocks(lead, row_size):
    """Index tuples over the leading axes ``lead`` selecting blocks of at most ``_BLOCK``
    elements (or one row): slices of the first axis, or single indices and then slices of
    the next axes when one index of the first axis is already too large."""
    if not lead:
        yield ()
        return
    inner = row_size * int(np.prod(lead[1:]))
    if inner > _BLOCK and len(lead) > 1:
        for i in range(lead[0]):
            for rest in _blocks(lead[1:], row_size):
                yield (i,) + rest
        return
    step = max(1, _BLOCK // inner)
    for i in range(0, lead[0], step):
        yield (slice(i, min(i + step, lead[0])),)


def _param_layout(shape, k, *param_shapes):
    """How the CUDA kernels' modulated LayerNorm takes parameters that broadcast against ``x``
    of ``shape`` (``k`` normalized axes): ``(pshape, group, mods)``. The parameters are laid out
    as ``pshape`` (their lead axes as broadcast together, x's normalized axes in full), that is
    ``mods`` rows of D values, and row i of x takes parameter row ``(i // group) % mods``, with
    ``group`` 1 or ``mods * group`` the rows of x (the layouts the kernels take). So (B, 1, D)
    for (B, T, D) x gives group T and mods B, (1, T, D) group 1 and mods T; parameters that
    vary along lead axes that are not the first ones and are followed by others are laid out
    over those too, and any that vary along axes that are not consecutive, per row of x."""
    lead, norm = shape[: len(shape) - k], shape[len(shape) - k :]
    padded = [(1,) * (len(shape) - len(p)) + tuple(p) for p in param_shapes]
    plead = tuple(max(p[i] for p in padded) for i in range(len(lead)))
    varies = [i for i, n in enumerate(plead) if n != 1]
    if varies and plead[varies[0] : varies[-1] + 1] != lead[varies[0] : varies[-1] + 1]:
        plead = lead  # not consecutive: one parameter row per row of x
        varies = [i for i, n in enumerate(lead) if n != 1]
    if not varies:
        return plead + norm, 1, 1
    first, last = varies[0], varies[-1]
    group, mods = math.prod(lead[last + 1 :]), math.prod(lead[first : last + 1])
    if group > 1 and group * mods < math.prod(lead):  # e.g. (1, T, 1, D) for (B, T, S, D) x
        return plead[: last + 1] + lead[last + 1 :] + norm, 1, group * mods
    return plead + norm, group, mods


def _param_rows(p, pshape, mods, dtype, xp):
    """Parameter ``p`` broadcast to ``pshape`` as (mods, D) rows in ``dtype`` (may be ``p``)."""
    p = p.reshape((1,) * (len(pshape) - p.ndim) + p.shape)
    return xp.ascontiguousarray(xp.broadcast_to(p, pshape), dtype=dtype).reshape(mods, -1)


def _broadcast_index(idx, shape):
    """The index into an array of ``shape`` (broadcast against x) matching ``idx`` into x."""
    return tuple(
        (0 if isinstance(i, int) else slice(None)) if n == 1 else i for i, n in zip(idx, shape)
    )


def _silu(c):
    return c / (1 + np.exp(-c))


def adaln_modulation(c, weight, bias, *, chunks=3):
    r"""The adaLN conditioning layer: ``SiLU(c) @ weight + bias``, split into ``chunks`` parts.

    Parameters
    ----------
    c : ndarray, shape ``(B, D_c)``
        Conditioning vectors (e.g. time-step plus class embedding), floating.
    weight : ndarray, shape ``(D_c, chunks * D)``
        :math:`W_c^\top`, the transpose of the book's :math:`W_c` (zeros for adaLN-Zero).
    bias : ndarray, shape ``(chunks * D,)``
        Its bias :math:`\beta_c`.
    chunks : int, default 3
        3 gives ``(shift, scale, gate)``; DiT uses 6 (two sets, for attention and MLP).

    Returns
    -------
    tuple of ``chunks`` ndarrays, each ``(B, D)``
        In the order shift, scale, gate (then again for a second set).

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``c`` not 2-d; ``weight`` not ``(D_c, chunks * D)``; ``bias`` not ``(chunks * D,)``;
        ``chunks`` not a positive int.

    Notes
    -----
    .. math::

        (\delta, s, \kappa) = W_c\,\mathrm{SiLU}(c) + \beta_c .

    Covered in :doc:`/book/04_variants`, section "Conditioning through the norm".
    """
    xp = get_array_module(c=c, weight=weight, bias=bias)
    c, weight, bias = _modulation_inputs(c, weight, bias, chunks, xp)
    out = _silu(c) @ weight + bias
    return tuple(xp.split(out, chunks, axis=-1))


def adaln_modulation_backward(doutputs, c, weight):
    r"""Backward of :func:`adaln_modulation`.

    Parameters
    ----------
    doutputs : sequence of ndarrays, each ``(B, D)``
        Gradients with respect to each output (e.g. ``(dshift, dscale, dgate)``); ``None``
        entries count as zero.
    c, weight : ndarray
        The forward inputs.

    Returns
    -------
    dc : ndarray, shape ``(B, D_c)``
        Gradient with respect to ``c``.
    dweight : ndarray, shape ``(D_c, chunks * D)``
        Gradient with respect to ``weight``.
    dbias : ndarray, shape ``(chunks * D,)``
        Gradient with respect to the bias.

    Raises
    ------
    TypeError
        A non-floating array, or arrays from different array libraries.
    ValueError
        ``doutputs`` empty or not a sequence; an entry not of shape ``(B, D)``; ``c`` or
        ``weight`` of the wrong shape.

    Notes
    -----
    With ``S = SiLU(c)`` (rows, ``(B, D_c)``) and ``G`` the concatenated ``doutputs``
    (``(B, chunks * D)``): ``dweight = S.T @ G``, ``dbias = G.sum(axis=0)`` (the sum over the
    examples) and ``dc = (G @ weight.T) * SiLU'(c)``. Covered in :doc:`/book/04_variants`,
    section "Conditioning through the norm".
    """
    xp = get_array_module(c=c, weight=weight)
    c = check.float_array(c, "c", xp)
    weight = check.float_array(weight, "weight", xp)
    if isinstance(doutputs, (str, bytes)) or not hasattr(doutputs, "__len__") or len(doutputs) == 0:
        raise ValueError(
            "doutputs must be a non-empty sequence of gradients, one per chunk "
            f"(e.g. [dshift, dscale, dgate]), got {doutputs!r}"
        )
    chunks = len(doutputs)
    d = weight.shape[-1] // chunks if weight.ndim == 2 else 0
    no_bias = xp.zeros(weight.shape[-1:], weight.dtype)
    c, weight, _ = _modulation_inputs(c, weight, no_bias, chunks, xp)
    parts = []
    for i, g in enumerate(doutputs):
        if g is None:
            g = xp.zeros((c.shape[0], d), dtype=weight.dtype)
        g = check.float_array(g, f"doutputs[{i}]", xp)
        if g.shape != (c.shape[0], d):
            raise ValueError(f"doutputs[{i}] must have shape {(c.shape[0], d)}, got {g.shape}")
        parts.append(g)
    dout = xp.concatenate(parts, axis=-1)
    sig = 1 / (1 + xp.exp(-c))
    h = c * sig
    dh = dout @ weight.T
    dc = dh * sig * (1 + c * (1 - sig))  # d SiLU(c)/dc = sig + c sig (1 - sig)
    return dc, h.T @ dout, dout.sum(axis=0)


def adaln_zero_init(cond_dim, dim, *, chunks=3, dtype=np.float32):
    r"""The adaLN-Zero initialisation of :func:`adaln_modulation`: a weight and a bias of zeros.

    With both zero, shift, scale and gate are zero for any ``c``: the block's LayerNorm has
    no affine map and its gated residual branch is switched off, so every block starts as
    the identity.

    Parameters
    ----------
    cond_dim : int
        C, the size of the conditioning vector.
    dim : int
        D, the number of features modulated.
    chunks : int, default 3
        Keyword only; the number of modulation outputs (3: shift, scale, gate; DiT uses 6).
    dtype : dtype, default float32
        Keyword only; dtype of both arrays.

    Returns
    -------
    weight : numpy.ndarray, shape ``(cond_dim, chunks * dim)``
        Zeros.
    bias : numpy.ndarray, shape ``(chunks * dim,)``
        Zeros.

    Raises
    ------
    ValueError, TypeError
        From NumPy, for a negative size or a dtype it does not know.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "Conditioning through the norm", and
    trained in :doc:`/book/06_applications`, section "Conditioning through the norm:
    diffusion".

    References
    ----------
    .. [1] W. Peebles and S. Xie, "Scalable Diffusion Models with Transformers", ICCV 2023.
    """
    return np.zeros((cond_dim, chunks * dim), dtype=dtype), np.zeros(chunks * dim, dtype=dtype)


def _modulation_inputs(c, weight, bias, chunks, xp):
    c = check.float_array(c, "c", xp)
    weight = check.float_array(weight, "weight", xp)
    bias = check.float_array(bias, "bias", xp)
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if c.ndim != 2:
        raise ValueError(f"c must be 2-d (batch, cond_dim), got shape {c.shape}")
    if weight.ndim != 2 or weight.shape[0] != c.shape[1] or weight.shape[1] % chunks:
        raise ValueError(
            f"weight must have shape (cond_dim={c.shape[1]}, chunks*D) with chunks={chunks}, "
            f"got {weight.shape}"
        )
    if bias.shape != (weight.shape[1],):
        raise ValueError(f"bias must have shape ({weight.shape[1]},), got {bias.shape}")
    return c, weight, bias
