r"""PyTorch bridge: lnlib's norms (and the fused residual add) inside a torch model.

Each autograd Function here is a class whose ``forward`` runs an lnlib forward, made a
``torch.autograd.Function`` by one class decorator, ``_function`` of ``lnlib/_autograd.py``: the
one pattern, with the backward they share and the crossing of tensors to lnlib's arrays and
back, without copies (CUDA tensors through DLPack, on torch's current stream). The backward is
not differentiable again. :class:`LayerNorm`, :class:`RMSNorm` and :class:`GroupNorm` are
drop-ins for their ``torch.nn`` namesakes (same arguments, parameter names and initialisation:
a state dict moves between them unchanged). The bridge (this module and ``lnlib/_autograd.py``)
is the only part of lnlib that imports torch. Covered in :ref:`sec-ch05-torch-bridge`.

References
----------
Ba, Kiros and Hinton (2016), *Layer Normalization*, arXiv:1607.06450.
Zhang and Sennrich (2019), *Root Mean Square Layer Normalization*, NeurIPS.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import lnlib
from lnlib import _docs, _validate
from lnlib._autograd import _finish, _function, _to_array
from lnlib._validate import affine_fills, norm_setup

__all__ = ["layer_norm", "rms_norm", "group_norm", "dynamic_tanh"]
__all__ += ["LayerNormFunction", "RMSNormFunction", "GroupNormFunction", "DynamicTanhFunction"]
__all__ += ["LayerNorm", "RMSNorm", "GroupNorm", "DynamicTanh"]
__all__ += ["add_layer_norm", "add_rms_norm", "AddLayerNormFunction", "AddRMSNormFunction"]
__all__ += ["AddLayerNorm", "AddRMSNorm"]

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def _norm_forward(ctx, name, x, residual, params, ndim, eps, offset, h_dtype=None):
    """The forward of the LayerNorm and RMSNorm Functions (``residual`` None) and of their fused
    forms: lnlib's ``name`` forward over the last ``ndim`` axes with ``params`` (the weight
    first). The fused forms store ``h = residual + x`` in ``h_dtype`` (a torch dtype, None: that
    of ``residual``; bfloat16 is computed in float32) and give ``x`` and ``residual`` one
    gradient, ``dsum``."""
    forward, backward = getattr(lnlib, name + "_forward"), getattr(lnlib, name + "_backward")
    kw = {"normalized_ndim": ndim, "weight_offset": offset}
    if residual is None:
        y, *stats = forward(*map(_to_array, (x, *params)), eps=eps, **kw)

        def norm_backward(dy, x, weight, *stats):
            return backward(dy, x, *stats, weight, weight_offset=offset)

        return _finish(ctx, [(y, x.dtype)], stats, (x, params[0]), norm_backward)
    h_dtype = residual.dtype if h_dtype is None else h_dtype
    h_numpy = _NUMPY.get(h_dtype, np.float32)
    arrays = map(_to_array, (x, residual, *params))
    y, h, *stats = forward(*arrays, eps=eps, residual_dtype=h_numpy, **kw)

    def fused_backward(dy, dh, weight, h, *stats):
        dsum, *dparams = backward(dy, dh, h, *stats, weight, **kw)
        return dsum, dsum, *dparams

    return _finish(ctx, [(y, x.dtype), (h, h_dtype)], stats, (params[0],), fused_backward)


@_function("layer_norm", "y, mean, rstd")
class LayerNormFunction(torch.autograd.Function):
    """The statistics (float32, or float64 for float64 ``x``) are not differentiable; it saves
    ``x``, ``weight``, ``mean`` and ``rstd``. Covered in :ref:`sec-ch05-torch-bridge`; what the
    forward saves in :ref:`sec-ch05-saves`."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_ndim, eps, *weight_offset):
        args = normalized_ndim, eps, sum(weight_offset)
        return _norm_forward(ctx, "layer_norm", x, None, (weight, bias), *args)


@_function("rms_norm", "y, rstd")
class RMSNormFunction(torch.autograd.Function):
    """``rstd`` is not differentiable; it saves ``x``, ``weight`` and ``rstd``. Covered in
    :ref:`sec-ch05-torch-bridge`."""

    @staticmethod
    def forward(ctx, x, weight, normalized_ndim, eps, *weight_offset):
        args = normalized_ndim, eps, sum(weight_offset)
        return _norm_forward(ctx, "rms_norm", x, None, (weight,), *args)


def _memory_format(x):
    """The memory format torch's GroupNorm keeps for ``x``: channels-last (4-D) and
    channels-last-3d (5-D) inputs give outputs and gradients in that layout, others
    contiguous."""
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


@_function("group_norm", "y, mean, rstd")
class GroupNormFunction(torch.autograd.Function):
    """The statistics, of shape ``(N, G)``, are not differentiable; ``y`` and the gradient of
    ``x`` keep the memory format of ``x``; it saves ``x``, ``weight``, ``mean`` and ``rstd``.
    Covered in :doc:`/book/04_variants`, section "The family by axes"; the bridge in
    :ref:`sec-ch05-torch-bridge`."""

    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps):
        arrays = (_to_array(x), num_groups, _to_array(weight), _to_array(bias))
        y, *stats = lnlib.group_norm_forward(*arrays, eps=eps)

        def backward(dy, x, weight, mean, rstd):
            dx, dweight, dbias = lnlib.group_norm_backward(dy, x, mean, rstd, num_groups, weight)
            return dx, None, dweight, dbias

        return _finish(ctx, [(y, x.dtype)], stats, (x, weight), backward, _memory_format(x))


@_function("dynamic_tanh", "y")
class DynamicTanhFunction(torch.autograd.Function):
    """``alpha`` is a tensor of shape () or (1,) (the DyT authors' layout), or a number (a
    constant, used in the accumulation dtype, not rounded to the dtype of ``x``); it saves
    ``x``, ``weight`` and a tensor ``alpha``. Covered in
    :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh"; the bridge in
    :ref:`sec-ch05-torch-bridge`."""

    @staticmethod
    def forward(ctx, x, alpha, weight, bias):
        constant = None if isinstance(alpha, torch.Tensor) else alpha
        a = _to_array(alpha) if constant is None else constant
        y = lnlib.dynamic_tanh(_to_array(x), a, _to_array(weight), _to_array(bias))

        def backward(dy, x, weight, alpha=constant):  # alpha: the saved tensor, or the number
            return lnlib.dynamic_tanh_backward(dy, x, alpha, weight)

        saved = (x, weight) if constant is not None else (x, weight, alpha)
        return _finish(ctx, [(y, x.dtype)], (), saved, backward)


@_function("add_layer_norm", "y, h, mean, rstd")
class AddLayerNormFunction(torch.autograd.Function):
    """``y`` and ``h`` are differentiable, the statistics not; it saves ``weight``, ``h``,
    ``mean`` and ``rstd``, and ``dsum`` of the backward is the gradient of ``x`` and of
    ``residual`` alike. Covered in :ref:`sec-ch05-fused-add`."""

    @staticmethod
    def forward(
        ctx, x, residual, weight, bias, normalized_ndim, eps, weight_offset, residual_dtype
    ):
        args = normalized_ndim, eps, weight_offset, residual_dtype
        return _norm_forward(ctx, "add_layer_norm", x, residual, (weight, bias), *args)


@_function("add_rms_norm", "y, h, rstd")
class AddRMSNormFunction(torch.autograd.Function):
    """``y`` and ``h`` are differentiable, ``rstd`` not; it saves ``weight``, ``h`` and
    ``rstd``, as :class:`AddLayerNormFunction`.
    Covered in :ref:`sec-ch05-fused-add`."""

    @staticmethod
    def forward(ctx, x, residual, weight, normalized_ndim, eps, weight_offset, residual_dtype):
        args = normalized_ndim, eps, weight_offset, residual_dtype
        return _norm_forward(ctx, "add_rms_norm", x, residual, (weight,), *args)


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating tensor, got dtype {t.dtype}")


def _norm(function, x, normalized_shape, params, eps, weight_offset, *fused):
    """Check the arguments of a norm of this module (``x`` a floating tensor ending with
    ``normalized_shape``; for the fused add ``fused = (residual, residual_dtype)``), then apply
    ``function``; return ``y``, or ``(y, h)``. RMSNorm's ``eps`` None is that of PyTorch, the
    machine epsilon of ``x`` (of ``h`` fused)."""
    _check_tensor("x", x)
    shape = _validate.normalized_shape_value(normalized_shape)
    if x.ndim < len(shape) or tuple(x.shape[x.ndim - len(shape) :]) != shape:
        raise ValueError(
            f"x: expected trailing axes {shape} (normalized_shape), got shape {tuple(x.shape)}"
        )
    if fused:
        residual, dtype = fused
        _check_tensor("residual", residual)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"residual_dtype: expected None or a floating torch.dtype, got {dtype!r}"
            )
    if eps is None and len(params) == 1:  # RMSNorm: a weight, no bias
        eps = torch.finfo(fused[1] or fused[0].dtype if fused else x.dtype).eps
    args = (len(shape), float(eps), float(weight_offset), *fused[1:])
    results = function.apply(x, *fused[:1], *params, *args)
    return results[:2] if fused else results[0]


_rms_eps = {"eps": _docs.TORCH_RMS_EPS}


@_docs.torch_function("layer_norm_forward")
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0):
    """LayerNorm of a tensor through lnlib, like ``torch.nn.functional.layer_norm``.

    Covered in :ref:`sec-ch05-torch-bridge`.
    """
    return _norm(LayerNormFunction, x, normalized_shape, (weight, bias), eps, weight_offset)


@_docs.torch_function("rms_norm_forward", **_rms_eps)
def rms_norm(x, normalized_shape, weight=None, eps=None, *, weight_offset=0.0):
    """RMSNorm of a tensor through lnlib, like ``torch.nn.functional.rms_norm``.

    Covered in :ref:`sec-ch05-torch-bridge`.
    """
    return _norm(RMSNormFunction, x, normalized_shape, (weight,), eps, weight_offset)


@_docs.torch_function("group_norm_forward", _docs.TORCH_GROUP, _docs.GROUP_RETURNED)
def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    """GroupNorm of a tensor through lnlib, like ``torch.nn.functional.group_norm``.

    Covered in :doc:`/book/04_variants`, section "The family by axes"; the bridge in
    :ref:`sec-ch05-torch-bridge`.
    """
    _check_tensor("x", x)
    y, _, _ = GroupNormFunction.apply(x, num_groups, weight, bias, float(eps))
    return y


@_docs.torch_function("dynamic_tanh", _docs.TORCH_DYT)
def dynamic_tanh(x, alpha, weight=None, bias=None):
    r"""Dynamic Tanh of a tensor through lnlib: ``weight * tanh(alpha * x) + bias``.

    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh"; the
    bridge in :ref:`sec-ch05-torch-bridge`.
    """
    _check_tensor("x", x)
    return DynamicTanhFunction.apply(x, alpha, weight, bias)


@_docs.torch_function("add_layer_norm_forward")
def add_layer_norm(
    x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0,
    residual_dtype=None,
):  # fmt: skip
    """The residual add and LayerNorm through lnlib: ``h = residual + x; y = layer_norm(h)``.

    Covered in :ref:`sec-ch05-fused-add`.
    """
    params, fused = (weight, bias), (residual, residual_dtype)
    return _norm(AddLayerNormFunction, x, normalized_shape, params, eps, weight_offset, *fused)


@_docs.torch_function("add_rms_norm_forward", **_rms_eps)
def add_rms_norm(
    x, residual, normalized_shape, weight=None, eps=None, *, weight_offset=0.0,
    residual_dtype=None,
):  # fmt: skip
    """The residual add and RMSNorm through lnlib: ``h = residual + x; y = rms_norm(h)``.

    Covered in :ref:`sec-ch05-fused-add`.
    """
    fused = (residual, residual_dtype)
    return _norm(AddRMSNormFunction, x, normalized_shape, (weight,), eps, weight_offset, *fused)


def _learn(module, shape, device, dtype, **fills):
    """Register the parameters named in ``fills``, in that order (the state dict's): a tensor
    of ``shape`` filled with the value, or None where the value is None (not learned)."""
    for name, fill in fills.items():
        value = None if fill is None else torch.full(shape, fill, device=device, dtype=dtype)
        module.register_parameter(name, None if value is None else nn.Parameter(value))


_module = _docs.parameters(_docs.TORCH_MODULE)
_rms_module = _docs.parameters({**_docs.TORCH_MODULE, **_docs.RMS, "eps": _docs.TORCH_RMS_EPS})


class _Norm(nn.Module):
    """What LayerNorm and RMSNorm (and their fused forms) share: check and set the shape,
    ``eps`` and offset, then learn the weight (``1 - weight_offset``) and, unless ``bias`` is
    None (RMSNorm has none), the bias (zeros); reset them; show them in ``repr``; apply the
    function of this module that computes them."""

    def __init__(self, normalized_shape, eps, affine, weight_offset, device, dtype, bias=None):
        super().__init__()
        self.elementwise_affine = affine
        fills = norm_setup(self, normalized_shape, eps, affine, weight_offset, bias)
        _learn(self, self.normalized_shape, device, dtype, **fills)

    @_docs.doc(_docs.RESET)
    def reset_parameters(self):
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)
        if getattr(self, "bias", None) is not None:
            nn.init.zeros_(self.bias)

    @_docs.doc(_docs.EXTRA_REPR, "``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm``")
    def extra_repr(self):
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )

    def _apply_norm(self, fn, *inputs, **kw):
        """``fn(*inputs, normalized_shape, weight[, bias], eps, weight_offset=..., **kw)``."""
        params = (self.weight, self.bias) if "bias" in self._parameters else (self.weight,)
        args = (*inputs, self.normalized_shape, *params, self.eps)
        return fn(*args, weight_offset=self.weight_offset, **kw)


@_module
class LayerNorm(_Norm):
    r"""Drop-in for ``torch.nn.LayerNorm`` computed by lnlib (:func:`layer_norm`).

    Covered in :ref:`sec-ch05-torch-bridge`.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, weight_offset=0.0):  # fmt: skip
        args = (normalized_shape, eps, elementwise_affine, weight_offset, device, dtype)
        super().__init__(*args, bias=bias)

    # named here too, so that the numpydoc gate sees them as this class's own
    reset_parameters, extra_repr = _Norm.reset_parameters, _Norm.extra_repr

    @_docs.module_forward("layer_norm")
    def forward(self, x):
        return self._apply_norm(layer_norm, x)


@_rms_module
class RMSNorm(_Norm):
    r"""Drop-in for ``torch.nn.RMSNorm`` computed by lnlib (:func:`rms_norm`).

    Covered in :ref:`sec-ch05-torch-bridge`.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True,
                 device=None, dtype=None, *, weight_offset=0.0):  # fmt: skip
        super().__init__(normalized_shape, eps, elementwise_affine, weight_offset, device, dtype)

    reset_parameters, extra_repr = _Norm.reset_parameters, _Norm.extra_repr

    @_docs.module_forward("rms_norm")
    def forward(self, x):
        return self._apply_norm(rms_norm, x)


@_module
class GroupNorm(nn.Module):
    r"""Drop-in for ``torch.nn.GroupNorm`` computed by lnlib (:func:`group_norm`).

    Covered in :doc:`/book/04_variants`, section "The family by axes".
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None):
        super().__init__()
        num_channels = _validate.size_value(num_channels, "num_channels")
        _validate.num_groups_value(num_groups, num_channels, "num_channels")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.affine = affine
        _learn(self, (num_channels,), device, dtype, **affine_fills(affine))

    @_docs.module_forward("group_norm")
    def forward(self, x):
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    @_docs.doc(_docs.EXTRA_REPR, "``torch.nn.GroupNorm``")
    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


@_docs.parameters({**_docs.TORCH_MODULE, **_docs.DYT})
class DynamicTanh(nn.Module):
    r"""Dynamic Tanh layer (DyT), a drop-in for a LayerNorm over the last axis.

    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh".

    Notes
    -----
    ``alpha`` is a parameter of shape (); a state dict from the DyT authors' code, where it
    has shape (1,), loads with ``load_state_dict`` (torch takes a one-element alpha into it),
    and an ``alpha`` of shape (1,) assigned to the module works too (its gradient then has
    that shape).
    """

    def __init__(self, normalized_shape, alpha_init_value=0.5, elementwise_affine=True,
                 device=None, dtype=None):  # fmt: skip
        super().__init__()
        self.normalized_shape = _validate.last_axis_shape_value(normalized_shape)
        _learn(self, (), device, dtype, alpha=float(alpha_init_value))
        self.elementwise_affine = elementwise_affine
        _learn(self, self.normalized_shape, device, dtype, **affine_fills(elementwise_affine))

    @_docs.module_forward("dynamic_tanh")
    def forward(self, x):
        return dynamic_tanh(x, self.alpha, self.weight, self.bias)

    @_docs.doc(_docs.EXTRA_REPR, "DyT's reference code")
    def extra_repr(self):
        return f"{self.normalized_shape}, elementwise_affine={self.elementwise_affine}"


@_module
class AddLayerNorm(LayerNorm):
    r"""The residual add fused with :class:`LayerNorm`: ``forward(x, residual)`` gives ``(y, h)``.

    Covered in :ref:`sec-ch05-fused-add`.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, weight_offset=0.0, residual_dtype=None):  # fmt: skip
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype,
                         weight_offset=weight_offset)  # fmt: skip
        self.residual_dtype = residual_dtype

    @_docs.module_forward("add_layer_norm", fused=True)
    def forward(self, x, residual):
        return self._apply_norm(add_layer_norm, x, residual, residual_dtype=self.residual_dtype)


@_rms_module
class AddRMSNorm(RMSNorm):
    r"""The residual add fused with :class:`RMSNorm`: ``forward(x, residual)`` gives ``(y, h)``.

    Covered in :ref:`sec-ch05-fused-add`.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True,
                 device=None, dtype=None, *, weight_offset=0.0, residual_dtype=None):  # fmt: skip
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype,
                         weight_offset=weight_offset)  # fmt: skip
        self.residual_dtype = residual_dtype

    @_docs.module_forward("add_rms_norm", fused=True)
    def forward(self, x, residual):
        return self._apply_norm(add_rms_norm, x, residual, residual_dtype=self.residual_dtype)
