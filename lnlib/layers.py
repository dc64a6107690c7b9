r"""Small layer objects for building NumPy networks in the exercises.

Each layer holds its parameters (``weight``, ``bias``, ...) and, after :meth:`backward`, their
gradients (``dweight``, ``dbias``, ...; None for a parameter the layer does not hold), and
remembers what its last :meth:`forward` saved. A forward/backward pair is one step: call
``backward`` after the ``forward`` whose gradient you want. Calling a layer calls its
``forward``.
"""

import numpy as np

from . import _docs, ada_norm, add_norm
from . import _validate as check
from ._docs import DYT, ENTRIES, RMS, parameters
from .batch_norm import batch_norm_backward, batch_norm_forward
from .dynamic_tanh import dynamic_tanh, dynamic_tanh_backward
from .group_norm import group_norm_backward, group_norm_forward
from .layer_norm import layer_norm_backward, layer_norm_forward
from .rms_norm import rms_norm_backward, rms_norm_forward

__all__ = ["LayerNorm", "RMSNorm", "AdaLN", "BatchNorm", "GroupNorm", "DynamicTanh"]
__all__ += ["AddLayerNorm", "AddRMSNorm"]


class _Layer:
    """What the layers share: parameters held by :meth:`_hold`, a ``backward`` that takes what
    the last ``forward`` saved, the gradients it stores; calling a layer calls ``forward``."""

    _saved, _params = None, ()

    def __call__(self, *args):
        return self.forward(*args)

    def _hold(self, shape, dtype, **fills):
        """Hold the parameters named in ``fills``, a ``shape`` filled with the value (None: not
        held), in that order; their gradients (``d`` + name) are None until a backward."""
        self._params = (*self._params, *fills)
        for name, value in fills.items():
            setattr(self, name, None if value is None else np.full(shape, value, dtype))
            setattr(self, "d" + name, None)

    def _take(self):
        if self._saved is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        return self._saved

    def _keep(self, dx, *grads):
        """Store the gradients of the parameters, in the order held (None for one the layer
        does not hold); return ``dx``."""
        for name, grad in zip(self._params, grads):
            setattr(self, "d" + name, None if getattr(self, name) is None else grad)
        return dx


class _Norm(_Layer):
    """What LayerNorm and RMSNorm (and their fused forms) share: ``norm_setup`` (of
    ``lnlib/_validate.py``), then the parameters held; a forward that runs an lnlib forward on
    ``x`` (fused: ``x`` and ``residual``) with them, for the steps of :func:`_norm_steps` and
    :func:`_add_norm_steps`."""

    def _setup(self, normalized_shape, eps, affine, dtype, weight_offset, bias=None):
        fills = check.norm_setup(self, normalized_shape, eps, affine, weight_offset, bias)
        self._hold(self.normalized_shape, dtype, **fills)

    def _forward(self, forward, *inputs, **kw):
        """``forward(*inputs, weight[, bias], eps=..., ...)``; save what its backward takes after
        the gradients (``x`` or ``h``, then the statistics) and keywords; return ``y`` (``y, h``
        fused)."""
        params = [getattr(self, name) for name in self._params]
        back = {"normalized_ndim": len(self.normalized_shape), "weight_offset": self.weight_offset}
        y, *saved = forward(*inputs, *params, eps=self.eps, **back, **kw)
        if len(inputs) == 1:  # y, *stats from x; the unfused backward reads no normalized_ndim
            self._saved = (inputs[0], *saved), {"weight_offset": self.weight_offset}
            return y
        self._saved = saved, back  # h, *stats
        return y, saved[0]


def _own(cls, *steps):
    """Make ``steps`` the class's own methods (for help() and the docstring gates)."""
    for step in steps:
        step.__qualname__ = f"{cls.__qualname__}.{step.__name__}"
        setattr(cls, step.__name__, step)
    return cls


def _norm_steps(lnlib_forward, lnlib_backward, stored, result):
    """Class decorator: the steps of a :class:`_Norm` layer, ``x`` to ``y`` (which is ``result``)
    through ``lnlib_forward``, back through ``lnlib_backward``, which gives the gradients
    ``stored``."""

    @_docs.layer_forward(lnlib_forward.__name__, "(*lead, *normalized_shape)", result)
    def forward(self, x):
        return self._forward(lnlib_forward, x)

    @_docs.layer_backward(lnlib_backward.__name__, stored)
    def backward(self, dy):
        saved, kw = self._take()
        return self._keep(*lnlib_backward(dy, *saved, self.weight, **kw))

    return lambda cls: _own(cls, forward, backward)


def _add_norm_steps(lnlib_forward, lnlib_backward, stored):
    """The same for a fused form: ``x, residual`` to ``y, h``; ``dy`` and ``dh`` back."""

    @_docs.layer_forward(lnlib_forward.__name__, *_docs.ADD_FORWARD)
    def forward(self, x, residual):
        return self._forward(lnlib_forward, x, residual, residual_dtype=self.residual_dtype)

    @_docs.layer_backward(lnlib_backward.__name__, stored, *_docs.ADD_BACKWARD)
    def backward(self, dy, dh=None):
        saved, kw = self._take()
        return self._keep(*lnlib_backward(dy, dh, *saved, self.weight, **kw))

    return lambda cls: _own(cls, forward, backward)


@parameters(ENTRIES)
@_norm_steps(
    layer_norm_forward, layer_norm_backward, "``dweight`` and ``dbias``", "The normalized input."
)
class LayerNorm(_Norm):
    r"""LayerNorm over the trailing ``normalized_shape`` axes, with weight and bias.

    Covered in :ref:`sec-ch02-one-vector` and :ref:`sec-ch02-backward`.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 dtype=np.float32, *, weight_offset=0.0):  # fmt: skip
        self._setup(normalized_shape, eps, elementwise_affine, dtype, weight_offset, bias)


@parameters({**ENTRIES, **RMS})
@_norm_steps(rms_norm_forward, rms_norm_backward, "``dweight``", "The rescaled input.")
class RMSNorm(_Norm):
    """RMSNorm over the trailing ``normalized_shape`` axes, with a weight (gain).

    Covered in :doc:`/book/04_variants`, section "RMSNorm".
    """

    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True, dtype=np.float32,
                 *, weight_offset=0.0):  # fmt: skip
        self._setup(normalized_shape, eps, elementwise_affine, dtype, weight_offset)


@parameters(ENTRIES)
class AdaLN(_Layer):
    r"""Adaptive LayerNorm with its conditioning layer (adaLN-Zero by default), as in DiT.

    ``forward(x, c)`` maps the conditioning ``c`` (B, cond_dim) to the shift :math:`\delta`,
    scale :math:`s` and gate :math:`\kappa` (``shift``, ``scale``, ``gate``, each (B, dim)) with
    :func:`lnlib.adaln_modulation`, and returns ``(y, gate)`` where
    :math:`y = \hat{x} \odot (1 + s) + \delta` (``LN(x) * (1 + scale) + shift``); for ``x`` of
    shape (B, T, dim) the modulation is broadcast over T and ``gate`` comes back as (B, 1, dim).
    The gate multiplies the residual branch that follows, outside this layer.

    Covered in :doc:`/book/04_variants`, section "Conditioning through the norm".

    Attributes
    ----------
    weight, bias : ndarray (cond_dim, 3 * dim) and (3 * dim,)
        Weight and bias of the conditioning layer; ``dweight``, ``dbias`` their gradients.
    """

    def __init__(self, dim, cond_dim, eps=1e-6, zero_init=True, rng=None, dtype=np.float32):
        self.dim, self.eps = check.size_value(dim, "dim"), eps
        self.cond_dim = check.size_value(cond_dim, "cond_dim")
        self.weight, self.bias = ada_norm.adaln_zero_init(self.cond_dim, self.dim, dtype=dtype)
        if not zero_init:
            rng = np.random.default_rng() if rng is None else rng
            self.weight[...] = rng.normal(0.0, self.cond_dim**-0.5, self.weight.shape)
        self.dweight = self.dbias = None

    @_docs.step(*_docs.ADALN_FORWARD)
    def forward(self, x, c):
        expand = (slice(None),) + (None,) * (np.ndim(x) - 2)  # (B, dim) over the T of (B, T, dim)
        modulation = ada_norm.adaln_modulation(c, self.weight, self.bias)
        shift, scale, gate = (m[expand] for m in modulation)
        y, mean, rstd = ada_norm.ada_layer_norm_forward(x, shift, scale, eps=self.eps)
        self._saved = (x, c, mean, rstd, scale)
        return y, gate

    @_docs.step(*_docs.ADALN_BACKWARD)
    def backward(self, dy, dgate=None):
        x, c, mean, rstd, scale = self._take()
        dx, dshift, dscale = ada_norm.ada_layer_norm_backward(dy, x, mean, rstd, scale)
        over = tuple(range(1, np.ndim(x) - 1))  # the axes the modulation was broadcast over
        dmod = [None if d is None else np.sum(d, axis=over) for d in (dshift, dscale, dgate)]
        dc, self.dweight, self.dbias = ada_norm.adaln_modulation_backward(dmod, c, self.weight)
        return dx, dc


@parameters(ENTRIES)
class BatchNorm(_Layer):
    """BatchNorm over (N, C, ...) with running statistics, for comparison with LayerNorm.

    Covered in :ref:`sec-ch01-batch-norm` and :ref:`sec-ch01-train-eval`.

    Parameters
    ----------
    dtype : dtype, default float32
        Dtype of the parameters and running statistics.

    Attributes
    ----------
    training : bool
        True (the default) uses batch statistics and updates the running ones; set with
        :meth:`train` and :meth:`eval`. A backward runs in the mode its forward ran in.
    running_mean, running_var : ndarray (C,)
        Running statistics (zeros and ones at the start).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, dtype=np.float32):
        self.eps, self.momentum, self.training = eps, momentum, True
        num_features = check.size_value(num_features, "num_features")
        self._hold(num_features, dtype, **check.affine_fills(affine))
        self.running_mean = np.zeros(num_features, dtype)
        self.running_var = np.ones(num_features, dtype)

    def train(self, mode=True):
        """Set training mode (batch statistics) or evaluation mode (running statistics).

        Parameters
        ----------
        mode : bool, default True
            True for training, False for evaluation.

        Returns
        -------
        BatchNorm
            The layer itself, as in PyTorch.
        """
        self.training = bool(mode)
        return self

    def eval(self):
        """Set evaluation mode: normalize with the running statistics, update nothing.

        Returns
        -------
        BatchNorm
            The layer itself; same as ``train(False)``.
        """
        return self.train(False)

    @_docs.layer_forward("batch_norm_forward", "(N, C, ...)", "The normalized input.")
    def forward(self, x):
        state = (self.running_mean, self.running_var, self.weight, self.bias)
        y, mean, rstd = batch_norm_forward(
            x, *state, training=self.training, momentum=self.momentum, eps=self.eps
        )
        self._saved = (x, mean, rstd, self.training)
        return y

    @_docs.layer_backward("batch_norm_backward", "``dweight`` and ``dbias``")
    def backward(self, dy):
        x, mean, rstd, training = self._take()
        return self._keep(*batch_norm_backward(dy, x, mean, rstd, self.weight, training=training))


@parameters(ENTRIES)
class GroupNorm(_Layer):
    """GroupNorm over (N, C, ...) with a per-channel weight and bias, like ``torch.nn.GroupNorm``.

    Covered in :doc:`/book/04_variants`, section "The family by axes".
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, dtype=np.float32):
        self.num_channels, self.eps = check.size_value(num_channels, "num_channels"), eps
        self.num_groups = check.num_groups_value(num_groups, self.num_channels, "num_channels")
        self._hold(self.num_channels, dtype, **check.affine_fills(affine))

    @_docs.layer_forward("group_norm_forward", "(N, C, ...)", "The normalized input.")
    def forward(self, x):
        y, mean, rstd = group_norm_forward(x, self.num_groups, self.weight, self.bias, eps=self.eps)
        self._saved = (x, mean, rstd)
        return y

    @_docs.layer_backward("group_norm_backward", "``dweight`` and ``dbias``")
    def backward(self, dy):
        x, mean, rstd = self._take()
        return self._keep(*group_norm_backward(dy, x, mean, rstd, self.num_groups, self.weight))


@parameters({**ENTRIES, **DYT})
class DynamicTanh(_Layer):
    """Dynamic Tanh, ``y = weight * tanh(alpha * x) + bias`` over the last axis (DyT).

    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh".

    Parameters
    ----------
    dtype : dtype, default float32
        Dtype of ``alpha`` and the parameters.

    Attributes
    ----------
    alpha : ndarray of shape ()
        The learned scalar. An array of shape (1,), as the DyT authors' checkpoints store it,
        may be assigned instead; ``dalpha`` then has that shape.
    """

    def __init__(self, normalized_shape, alpha_init=0.5, elementwise_affine=True, dtype=np.float32):
        self.normalized_shape = check.last_axis_shape_value(normalized_shape)
        self._hold((), dtype, alpha=alpha_init)
        self._hold(self.normalized_shape, dtype, **check.affine_fills(elementwise_affine))

    @_docs.layer_forward("dynamic_tanh", "(..., D)", "``weight * tanh(alpha * x) + bias``.")
    def forward(self, x):
        y = dynamic_tanh(x, self.alpha, self.weight, self.bias)
        self._saved = (x,)
        return y

    @_docs.layer_backward("dynamic_tanh_backward", "``dalpha``, ``dweight``, ``dbias``")
    def backward(self, dy):
        (x,) = self._take()
        return self._keep(*dynamic_tanh_backward(dy, x, self.alpha, self.weight))


@parameters(ENTRIES)
@_add_norm_steps(
    add_norm.add_layer_norm_forward, add_norm.add_layer_norm_backward, "``dweight`` and ``dbias``"
)
class AddLayerNorm(LayerNorm):
    r"""The residual add fused with :class:`LayerNorm`: ``forward(x, residual)`` gives
    ``(y, h)`` with ``h = residual + x`` and ``y`` the LayerNorm of ``h``.

    Covered in :ref:`sec-ch05-fused-add`.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 dtype=np.float32, *, weight_offset=0.0, residual_dtype=None):  # fmt: skip
        self._setup(normalized_shape, eps, elementwise_affine, dtype, weight_offset, bias)
        self.residual_dtype = residual_dtype


@parameters({**ENTRIES, **RMS})
@_add_norm_steps(add_norm.add_rms_norm_forward, add_norm.add_rms_norm_backward, "``dweight``")
class AddRMSNorm(RMSNorm):
    r"""The residual add fused with :class:`RMSNorm`, as :class:`AddLayerNorm` fuses it with
    :class:`LayerNorm`: ``y`` is the RMSNorm of ``h``. Covered in :ref:`sec-ch05-fused-add`.
    """

    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True,
                 dtype=np.float32, *, weight_offset=0.0, residual_dtype=None):  # fmt: skip
        self._setup(normalized_shape, eps, elementwise_affine, dtype, weight_offset)
        self.residual_dtype = residual_dtype
