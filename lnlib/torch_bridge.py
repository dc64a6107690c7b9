r"""PyTorch bridge: lnlib's LayerNorm and RMSNorm inside a torch model.

The forward and the backward of :class:`LayerNormFunction` and
:class:`RMSNormFunction` are lnlib's own NumPy functions
(:func:`lnlib.layer_norm_forward`, :func:`lnlib.layer_norm_backward`,
:func:`lnlib.rms_norm_forward`, :func:`lnlib.rms_norm_backward`). Tensors cross
the boundary without copies: a CPU tensor is viewed as a NumPy array with
``Tensor.numpy()`` and the results come back with ``torch.from_numpy``, which
share memory. CUDA tensors cross through DLPack into CuPy, also without a copy
(:mod:`lnlib._cuda.dlpack`), and lnlib's CUDA kernels run on torch's current
stream, so they queue behind torch's own work with no synchronisation.

:class:`LayerNorm` and :class:`RMSNorm` are drop-in replacements for
``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` with the same constructor
arguments, parameter names and initialisation, so a state dict moves between
them unchanged.

This module is the only place in lnlib that imports torch; ``import lnlib``
does not import it.

Covered in :ref:`sec-ch05-torch-bridge`.

References
----------
Ba, Kiros and Hinton (2016), *Layer Normalization*, arXiv:1607.06450.
Zhang and Sennrich (2019), *Root Mean Square Layer Normalization*, NeurIPS.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import numpy as np
import torch
from torch import nn

import lnlib
from lnlib import _validate

__all__ = [
    "LayerNormFunction",
    "RMSNormFunction",
    "layer_norm",
    "rms_norm",
    "LayerNorm",
    "RMSNorm",
]

# NumPy has no bfloat16: such tensors are computed in float32 and cast back.
_NATIVE = (torch.float16, torch.float32, torch.float64)


def _cuda_dlpack(t):
    """lnlib's zero-copy DLPack helpers for the CUDA tensor ``t``; a clear error without CuPy."""
    if importlib.util.find_spec("cupy") is None:
        raise TypeError(
            f"x: CUDA tensors need CuPy (pip install lnlib[gpu]); got a tensor on {t.device}"
        )
    from lnlib._cuda import dlpack

    return dlpack


def _to_array(t):
    """View a tensor as a NumPy (CPU) or CuPy (CUDA) array, without a copy."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype not in _NATIVE:
        t = t.float()
    if t.device.type == "cpu":
        # .numpy() shares the storage for any non-negative strides (torch has no others).
        return t.numpy()
    if t.device.type == "cuda":
        # Same memory, any strides: no .contiguous() copy (lnlib handles strided rows).
        return _cuda_dlpack(t).to_cupy(t)
    raise TypeError(f"x: expected a CPU or CUDA tensor, got a tensor on {t.device}")


def _on_device(x):
    """Where lnlib works on ``x``: for a CUDA tensor, CuPy on torch's current stream.

    lnlib's kernels then queue behind the work torch has already queued for ``x`` (and
    torch's next kernels behind them), with no synchronisation. On the CPU, nothing to do.
    """
    if x.device.type == "cuda":
        return _cuda_dlpack(x).torch_stream(x)
    return contextlib.nullcontext()


def _stat_tensor(a):
    """An array from lnlib as a tensor on its memory (NumPy or, through DLPack, CuPy)."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


def _to_tensor(a, like):
    """Wrap an array from lnlib as a tensor with the dtype and device of ``like``."""
    t = _stat_tensor(a)
    if t.dtype != like.dtype:
        t = t.to(like.dtype)
    return t


def _on_device_of_first(method):
    """Decorator: run a Function's ``forward(ctx, x, ...)`` or ``backward(ctx, dy, ...)``
    inside :func:`_on_device` of its first tensor (for CUDA tensors, on torch's stream)."""

    @functools.wraps(method)
    def wrapper(ctx, t, *args):
        with _on_device(t):
            return method(ctx, t, *args)

    return wrapper


def first_order_only(backward):
    """Decorator for a ``backward`` that torch must not differentiate again.

    lnlib's backward passes run in NumPy, outside torch's graph: a graph built through them
    (``create_graph=True``, ``torch.autograd.functional.hessian``, ``gradgradcheck``) would
    hold zeros or nothing where second derivatives belong. The backward therefore refuses
    to run with grad mode on, which is exactly when torch builds that graph.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__.removesuffix('Backward')}: lnlib's backward is not "
                "differentiable (no double backward), so create_graph=True, "
                "torch.autograd.functional.hessian and gradgradcheck are not supported; "
                "use the torch.nn.functional version of this operation for second derivatives"
            )
        with torch.no_grad():
            return backward(ctx, *grads)

    return wrapper


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating tensor, got dtype {t.dtype}")


class LayerNormFunction(torch.autograd.Function):
    r"""Autograd function for LayerNorm whose forward and backward are lnlib's.

    ``LayerNormFunction.apply(x, weight, bias, normalized_ndim, eps[, weight_offset])``
    computes

    .. math::

        y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \odot (o + \gamma) + \beta

    (:math:`o` = ``weight_offset``, default 0) over the last ``normalized_ndim`` axes, saving
    ``x``, ``mean`` and ``rstd`` for the backward. ``weight`` and ``bias`` may be ``None``.
    Not twice differentiable: a backward with ``create_graph=True`` raises ``RuntimeError``
    (see ``lnlib.torch_bridge.first_order_only``).

    Notes
    -----
    Covered in :ref:`sec-ch05-torch-bridge`; what the forward saves in :ref:`sec-ch05-saves`.
    """

    @staticmethod
    @_on_device_of_first
    def forward(ctx, x, weight, bias, normalized_ndim, eps, *weight_offset):
        r"""Run :func:`lnlib.layer_norm_forward` on the tensors' memory; save for backward.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            Torch's context object, where the forward saves what the backward needs.
        x : torch.Tensor, shape ``(*lead, *norm)``, floating, CPU or CUDA
            Input (bfloat16 is computed in float32 and cast back).
        weight, bias : torch.Tensor of shape ``norm``, or None
            Gain and bias, on the device of ``x``.
        normalized_ndim : int
            How many trailing axes are normalized.
        eps : float
            Added to the variance inside the square root.
        *weight_offset : float
            Zero or one number: the gain is ``weight_offset + weight``.

        Returns
        -------
        y : torch.Tensor, shape and dtype of ``x``
            The output.
        mean, rstd : torch.Tensor, shape ``lead``, float32 (float64 for float64 ``x``)
            Statistics of each row (marked not differentiable).

        Raises
        ------
        TypeError, ValueError
            As for :func:`lnlib.layer_norm_forward`; a CUDA tensor without CuPy installed.
        """
        y, mean, rstd = lnlib.layer_norm_forward(
            _to_array(x),
            _to_array(weight),
            _to_array(bias),
            eps=eps,
            normalized_ndim=normalized_ndim,
            weight_offset=sum(weight_offset),
        )
        ctx.weight_offset = weight_offset
        mean_t, rstd_t = _stat_tensor(mean), _stat_tensor(rstd)
        ctx.save_for_backward(x, weight, mean_t, rstd_t)
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(mean_t, rstd_t)
        return _to_tensor(y, x), mean_t, rstd_t

    @staticmethod
    @first_order_only
    @_on_device_of_first
    def backward(ctx, dy, _dmean, _drstd):
        r"""Run :func:`lnlib.layer_norm_backward`; return the gradients torch asks for.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            The context the forward filled.
        dy : torch.Tensor, shape of ``x``
            Gradient of the loss with respect to ``y``.
        _dmean, _drstd : torch.Tensor or None
            Gradients with respect to ``mean`` and ``rstd``: ignored (not differentiable).

        Returns
        -------
        tuple
            ``(dx, dweight, dbias, None, None[, None])``: one entry per forward input, None
            where torch needs no gradient.

        Raises
        ------
        RuntimeError
            Called with grad mode on (``create_graph=True``): there is no double backward.
        """
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = lnlib.layer_norm_backward(
            _to_array(dy),
            _to_array(x),
            _to_array(mean),
            _to_array(rstd),
            _to_array(weight),
            weight_offset=sum(ctx.weight_offset),
        )
        grads = [None] * (5 + len(ctx.weight_offset))
        if ctx.needs_input_grad[0]:
            grads[0] = _to_tensor(dx, x)
        if weight is not None and ctx.needs_input_grad[1]:
            grads[1] = _to_tensor(dweight, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grads[2] = _to_tensor(dbias, weight if weight is not None else x)
        return tuple(grads)


class RMSNormFunction(torch.autograd.Function):
    r"""Autograd function for RMSNorm whose forward and backward are lnlib's.

    ``RMSNormFunction.apply(x, weight, normalized_ndim, eps[, weight_offset])`` computes

    .. math::

        y = \frac{x}{\sqrt{\overline{x^2} + \epsilon}} \odot (o + \gamma)

    over the last ``normalized_ndim`` axes, saving ``x`` and ``rstd``.
    ``weight`` may be ``None``. Not twice differentiable (see ``first_order_only``).

    Notes
    -----
    Covered in :ref:`sec-ch05-torch-bridge`.
    """

    @staticmethod
    @_on_device_of_first
    def forward(ctx, x, weight, normalized_ndim, eps, *weight_offset):
        r"""Run :func:`lnlib.rms_norm_forward` on the tensors' memory; save for backward.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            Torch's context object, where the forward saves what the backward needs.
        x : torch.Tensor, shape ``(*lead, *norm)``, floating, CPU or CUDA
            Input (bfloat16 is computed in float32 and cast back).
        weight : torch.Tensor of shape ``norm``, or None
            Gain, on the device of ``x``.
        normalized_ndim : int
            How many trailing axes are normalized.
        eps : float
            Added to the mean square inside the square root.
        *weight_offset : float
            Zero or one number: the gain is ``weight_offset + weight``.

        Returns
        -------
        y : torch.Tensor, shape and dtype of ``x``
            The output.
        rstd : torch.Tensor, shape ``lead``, float32 (float64 for float64 ``x``)
            Reciprocal root mean square of each row (marked not differentiable).

        Raises
        ------
        TypeError, ValueError
            As for :func:`lnlib.rms_norm_forward`; a CUDA tensor without CuPy installed.
        """
        y, rstd = lnlib.rms_norm_forward(
            _to_array(x),
            _to_array(weight),
            eps=eps,
            normalized_ndim=normalized_ndim,
            weight_offset=sum(weight_offset),
        )
        ctx.weight_offset = weight_offset
        rstd_t = _stat_tensor(rstd)
        ctx.save_for_backward(x, weight, rstd_t)
        ctx.mark_non_differentiable(rstd_t)
        return _to_tensor(y, x), rstd_t

    @staticmethod
    @first_order_only
    @_on_device_of_first
    def backward(ctx, dy, _drstd):
        r"""Run :func:`lnlib.rms_norm_backward`; return the gradients torch asks for.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            The context the forward filled.
        dy : torch.Tensor, shape of ``x``
            Gradient of the loss with respect to ``y``.
        _drstd : torch.Tensor or None
            Gradient with respect to ``rstd``: ignored (not differentiable).

        Returns
        -------
        tuple
            ``(dx, dweight, None, None[, None])``: one entry per forward input, None where
            torch needs no gradient.

        Raises
        ------
        RuntimeError
            Called with grad mode on (``create_graph=True``): there is no double backward.
        """
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = lnlib.rms_norm_backward(
            _to_array(dy),
            _to_array(x),
            _to_array(rstd),
            _to_array(weight),
            weight_offset=sum(ctx.weight_offset),
        )
        grads = [None] * (4 + len(ctx.weight_offset))
        if ctx.needs_input_grad[0]:
            grads[0] = _to_tensor(dx, x)
        if weight is not None and ctx.needs_input_grad[1]:
            grads[1] = _to_tensor(dweight, weight)
        return tuple(grads)


def _normalized_shape(normalized_shape):
    return _validate.normalized_shape_value(normalized_shape)


def _trailing_shape(x, normalized_shape):
    """Check that ``x`` ends with ``normalized_shape``; return it as a tuple."""
    _check_tensor("x", x)
    shape = _normalized_shape(normalized_shape)
    if x.ndim < len(shape) or tuple(x.shape[x.ndim - len(shape) :]) != shape:
        raise ValueError(
            f"x: expected trailing axes {shape} (normalized_shape), got shape {tuple(x.shape)}"
        )
    return shape


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, weight_offset=0.0):
    r"""LayerNorm of a tensor through lnlib, like ``torch.nn.functional.layer_norm``.

    Parameters
    ----------
    x : torch.Tensor, shape ``(..., *normalized_shape)``, float16/bfloat16/float32/float64
        Input, on the CPU or a CUDA device.
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    weight, bias : torch.Tensor of shape ``normalized_shape`` or None
        Gain :math:`\gamma` and bias :math:`\beta`, on the device of ``x``.
    eps : float, default 1e-5
        Added to the variance inside the square root.
    weight_offset : float, default 0.0
        Keyword only: the scale is ``weight_offset + weight`` (zero-centred gain with 1.0);
        see :func:`lnlib.layer_norm_forward`.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``; differentiable (once) with respect to ``x``,
        ``weight`` and ``bias``.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        ``x`` does not end with ``normalized_shape``, or lnlib rejects the
        shapes of ``weight``/``bias``.

    Notes
    -----
    Covered in :ref:`sec-ch05-torch-bridge`.
    """
    shape = _trailing_shape(x, normalized_shape)
    y, _, _ = LayerNormFunction.apply(x, weight, bias, len(shape), float(eps), float(weight_offset))
    return y


def rms_norm(x, normalized_shape, weight=None, eps=None, *, weight_offset=0.0):
    r"""RMSNorm of a tensor through lnlib, like ``torch.nn.functional.rms_norm``.

    Parameters
    ----------
    x : torch.Tensor, shape ``(..., *normalized_shape)``, float16/bfloat16/float32/float64
        Input, on the CPU or a CUDA device.
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    weight : torch.Tensor of shape ``normalized_shape`` or None
        Gain :math:`\gamma`, on the device of ``x``.
    eps : float or None, default None
        Added to the mean square inside the square root; ``None`` means
        ``torch.finfo(x.dtype).eps``, as in PyTorch.
    weight_offset : float, default 0.0
        Keyword only: the gain is ``weight_offset + weight`` (Gemma's RMSNorm with 1.0).

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``x``; differentiable (once) with respect to ``x`` and
        ``weight``.

    Raises
    ------
    TypeError
        ``x`` is not a floating tensor.
    ValueError
        ``x`` does not end with ``normalized_shape``, or lnlib rejects the shape of
        ``weight``.

    Notes
    -----
    Covered in :ref:`sec-ch05-torch-bridge`.
    """
    shape = _trailing_shape(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    y, _ = RMSNormFunction.apply(x, weight, len(shape), float(eps), float(weight_offset))
    return y


class LayerNorm(nn.Module):
    r"""Drop-in for ``torch.nn.LayerNorm`` computed by lnlib.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    eps : float, default 1e-5
        Added to the variance inside the square root.
    elementwise_affine : bool, default True
        Learn ``weight`` (initialised to ones) and, if ``bias``, ``bias``
        (initialised to zeros).
    bias : bool, default True
        Whether to learn a bias (with ``elementwise_affine``).
    device, dtype
        As for the parameters of ``torch.nn.LayerNorm``.
    weight_offset : float, default 0.0
        Keyword only. The scale is ``weight_offset + weight``, and ``weight`` starts at
        ``1 - weight_offset`` (zeros for the zero-centred gain, ``weight_offset=1.0``), so the
        layer starts as the identity on normalized input whatever the offset.

    Notes
    -----
    Covered in :ref:`sec-ch05-torch-bridge`.
    """

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        bias=True,
        device=None,
        dtype=None,
        *,
        weight_offset=0.0,
    ):
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight_offset = _validate.weight_offset_value(
            weight_offset, True if elementwise_affine else None
        )
        factory = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(
                torch.full(self.normalized_shape, 1.0 - self.weight_offset, **factory)
            )
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self):
        """Reset the parameters to their initial values, as ``torch.nn`` layers do.

        The weight becomes ``1 - weight_offset`` (ones by default), a bias zeros; in place.

        Returns
        -------
        None
            The parameters are changed in place.
        """
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        r"""Compute the layer on ``x`` with :func:`layer_norm`.

        Parameters
        ----------
        x : torch.Tensor
            Input, floating, on the device of the parameters (CPU or CUDA).

        Returns
        -------
        torch.Tensor
            Shape and dtype of ``x``; differentiable (once).

        Raises
        ------
        TypeError, ValueError
            As for :func:`layer_norm`.
        """
        return layer_norm(
            x,
            self.normalized_shape,
            self.weight,
            self.bias,
            self.eps,
            weight_offset=self.weight_offset,
        )

    def extra_repr(self):
        """The constructor arguments shown by ``repr(module)``, as in ``torch.nn.LayerNorm``.

        Returns
        -------
        str
            E.g. the normalized shape, ``eps`` and whether parameters are learned.
        """
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


class RMSNorm(nn.Module):
    r"""Drop-in for ``torch.nn.RMSNorm`` computed by lnlib.

    Parameters
    ----------
    normalized_shape : int or tuple of int
        The trailing axes to normalize over.
    eps : float or None, default None
        ``None`` means ``torch.finfo(x.dtype).eps``, as in PyTorch.
    elementwise_affine : bool, default True
        Learn ``weight``, initialised to ``1 - weight_offset`` (ones by default).
    device, dtype
        As for the parameters of ``torch.nn.RMSNorm``.
    weight_offset : float, default 0.0
        Keyword only. The gain is ``weight_offset + weight``: with 1.0 the weight starts at
        zero, as in Gemma's RMSNorm.

    Notes
    -----
    Covered in :ref:`sec-ch05-torch-bridge`.
    """

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        *,
        weight_offset=0.0,
    ):
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight_offset = _validate.weight_offset_value(
            weight_offset, True if elementwise_affine else None
        )
        if elementwise_affine:
            self.weight = nn.Parameter(
                torch.full(
                    self.normalized_shape, 1.0 - self.weight_offset, device=device, dtype=dtype
                )
            )
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self):
        """Reset the parameters to their initial values, as ``torch.nn`` layers do.

        The weight becomes ``1 - weight_offset`` (ones by default); in place.

        Returns
        -------
        None
            The parameters are changed in place.
        """
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def forward(self, x):
        r"""Compute the layer on ``x`` with :func:`rms_norm`.

        Parameters
        ----------
        x : torch.Tensor
            Input, floating, on the device of the parameters (CPU or CUDA).

        Returns
        -------
        torch.Tensor
            Shape and dtype of ``x``; differentiable (once).

        Raises
        ------
        TypeError, ValueError
            As for :func:`rms_norm`.
        """
        return rms_norm(
            x, self.normalized_shape, self.weight, self.eps, weight_offset=self.weight_offset
        )

    def extra_repr(self):
        """The constructor arguments shown by ``repr(module)``, as in ``torch.nn.RMSNorm``.

        Returns
        -------
        str
            E.g. the normalized shape, ``eps`` and whether parameters are learned.
        """
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


# ------------------------------------------------------------- GroupNorm and Dynamic Tanh

__all__ += [
    "DynamicTanh",
    "DynamicTanhFunction",
    "GroupNorm",
    "GroupNormFunction",
    "dynamic_tanh",
    "group_norm",
]


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


class GroupNormFunction(torch.autograd.Function):
    r"""Autograd function for GroupNorm whose forward and backward are lnlib's.

    ``GroupNormFunction.apply(x, num_groups, weight, bias, eps)`` computes
    :func:`lnlib.group_norm_forward` and saves ``x``, ``mean`` and ``rstd`` (shape (N, G))
    for :func:`lnlib.group_norm_backward`. ``weight`` and ``bias`` may be ``None``. Not twice
    differentiable.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "The family by axes"; the bridge in
    :ref:`sec-ch05-torch-bridge`.
    """

    @staticmethod
    @_on_device_of_first
    def forward(ctx, x, num_groups, weight, bias, eps):
        r"""Run :func:`lnlib.group_norm_forward` on the tensors' memory; save for backward.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            Torch's context object, where the forward saves what the backward needs.
        x : torch.Tensor, shape ``(N, C, *spatial)``, floating, CPU or CUDA
            Input (bfloat16 is computed in float32 and cast back).
        num_groups : int
            G, a divisor of C.
        weight, bias : torch.Tensor of shape ``(C,)``, or None
            Per-channel gain and bias, on the device of ``x``.
        eps : float
            Added to the variance inside the square root.

        Returns
        -------
        y : torch.Tensor, shape and dtype of ``x``
            The output, in the memory format of ``x`` (channels-last stays channels-last,
            as in torch; the gradient too).
        mean, rstd : torch.Tensor, shape ``(N, G)``
            Statistics of each group (marked not differentiable).

        Raises
        ------
        TypeError, ValueError
            As for :func:`lnlib.group_norm_forward`; a CUDA tensor without CuPy installed.
        """
        y, mean, rstd = lnlib.group_norm_forward(
            _to_array(x), num_groups, _to_array(weight), _to_array(bias), eps=eps
        )
        mean_t, rstd_t = _stat_tensor(mean), _stat_tensor(rstd)
        ctx.save_for_backward(x, weight, mean_t, rstd_t)
        ctx.num_groups, ctx.has_bias = num_groups, bias is not None
        ctx.mark_non_differentiable(mean_t, rstd_t)
        # lnlib returns y contiguous; a channels-last x gets y channels-last, as in torch
        return _to_tensor(y, x).contiguous(memory_format=_memory_format(x)), mean_t, rstd_t

    @staticmethod
    @first_order_only
    @_on_device_of_first
    def backward(ctx, dy, _dmean, _drstd):
        r"""Run :func:`lnlib.group_norm_backward`; return the gradients torch asks for.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            The context the forward filled.
        dy : torch.Tensor, shape of ``x``
            Gradient of the loss with respect to ``y``.
        _dmean, _drstd : torch.Tensor or None
            Gradients with respect to ``mean`` and ``rstd``: ignored (not differentiable).

        Returns
        -------
        tuple
            ``(dx, None, dweight, dbias, None)``: one entry per forward input, None where
            torch needs no gradient.

        Raises
        ------
        RuntimeError
            Called with grad mode on (``create_graph=True``): there is no double backward.
        """
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = lnlib.group_norm_backward(
            _to_array(dy),
            _to_array(x),
            _to_array(mean),
            _to_array(rstd),
            ctx.num_groups,
            _to_array(weight),
        )
        grads = [None] * 5
        if ctx.needs_input_grad[0]:
            grads[0] = _to_tensor(dx, x).contiguous(memory_format=_memory_format(x))
        if weight is not None and ctx.needs_input_grad[2]:
            grads[2] = _to_tensor(dweight, weight)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grads[3] = _to_tensor(dbias, weight if weight is not None else x)
        return tuple(grads)


class DynamicTanhFunction(torch.autograd.Function):
    r"""Autograd function for Dynamic Tanh whose forward and backward are lnlib's.

    ``DynamicTanhFunction.apply(x, alpha, weight, bias)`` computes
    :math:`y = \gamma \odot \tanh(\alpha x) + \beta` with :func:`lnlib.dynamic_tanh`;
    ``alpha`` is a tensor of shape () or (1,) (the DyT authors' layout), or a Python number
    (a constant, used as lnlib uses it: in the accumulation dtype, not rounded to the dtype of
    ``x``); ``weight`` and ``bias`` may be ``None``. Not twice differentiable.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh"; the
    bridge in :ref:`sec-ch05-torch-bridge`.
    """

    @staticmethod
    @_on_device_of_first
    def forward(ctx, x, alpha, weight, bias):
        r"""Run :func:`lnlib.dynamic_tanh` on the tensors' memory; save for the backward.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            Torch's context object, where the forward saves what the backward needs.
        x : torch.Tensor, shape ``(..., D)``, floating, CPU or CUDA
            Input (bfloat16 is computed in float32 and cast back).
        alpha : torch.Tensor of shape () or (1,), or float
            The scalar :math:`\alpha`.
        weight, bias : torch.Tensor of shape ``(D,)``, or None
            Gain and bias, on the device of ``x``.

        Returns
        -------
        y : torch.Tensor, shape and dtype of ``x``
            :math:`\gamma \odot \tanh(\alpha x) + \beta`.

        Raises
        ------
        TypeError, ValueError
            As for :func:`lnlib.dynamic_tanh`; a CUDA tensor without CuPy installed.
        """
        a = _to_array(alpha) if isinstance(alpha, torch.Tensor) else alpha
        y = lnlib.dynamic_tanh(_to_array(x), a, _to_array(weight), _to_array(bias))
        ctx.save_for_backward(x, weight, *([alpha] if isinstance(alpha, torch.Tensor) else []))
        ctx.alpha = None if isinstance(alpha, torch.Tensor) else alpha
        ctx.has_bias = bias is not None
        return _to_tensor(y, x)

    @staticmethod
    @first_order_only
    @_on_device_of_first
    def backward(ctx, dy):
        r"""Run :func:`lnlib.dynamic_tanh_backward`; return the gradients torch asks for.

        Parameters
        ----------
        ctx : torch.autograd.function.FunctionCtx
            The context the forward filled.
        dy : torch.Tensor, shape of ``x``
            Gradient of the loss with respect to ``y``.

        Returns
        -------
        tuple
            ``(dx, dalpha, dweight, dbias)``, None where torch needs no gradient.

        Raises
        ------
        RuntimeError
            Called with grad mode on (``create_graph=True``): there is no double backward.
        """
        x, weight, *alpha = ctx.saved_tensors  # alpha saved when it is a tensor
        a = _to_array(alpha[0]) if alpha else ctx.alpha
        dx, dalpha, dweight, dbias = lnlib.dynamic_tanh_backward(
            _to_array(dy), _to_array(x), a, _to_array(weight)
        )
        grads = [None] * 4
        if ctx.needs_input_grad[0]:
            grads[0] = _to_tensor(dx, x)
        if alpha and ctx.needs_input_grad[1]:
            grads[1] = _to_tensor(dalpha, alpha[0])
        if weight is not None and ctx.needs_input_grad[2]:
            grads[2] = _to_tensor(dweight, weight)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grads[3] = _to_tensor(dbias, weight if weight is not None else x)
        return tuple(grads)


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    r"""GroupNorm of a tensor through lnlib, like ``torch.nn.functional.group_norm``.

    Parameters
    ----------
    x : torch.Tensor, shape ``(N, C, *spatial)``, float16/bfloat16/float32/float64
        Input, on the CPU or a CUDA device.
    num_groups : int
        G, a divisor of C.
    weight, bias : torch.Tensor of shape (C,) or None
        Per-channel gain and bias, on the device of ``x``.
    eps : float, default 1e-5
        Added to the variance inside the square root.

    Returns
    -------
    torch.Tensor
        Shape, dtype and memory format (channels-last or not, as ``torch.nn.functional
        .group_norm`` keeps it) of ``x``; differentiable with respect to ``x``, ``weight``,
        ``bias``; the gradient of ``x`` has its memory format too.

    Raises
    ------
    TypeError, ValueError
        As :func:`lnlib.group_norm_forward`.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "The family by axes"; the bridge in
    :ref:`sec-ch05-torch-bridge`.
    """
    _check_tensor("x", x)
    y, _, _ = GroupNormFunction.apply(x, num_groups, weight, bias, float(eps))
    return y


def dynamic_tanh(x, alpha, weight=None, bias=None):
    r"""Dynamic Tanh of a tensor through lnlib: ``weight * tanh(alpha * x) + bias``.

    Parameters
    ----------
    x : torch.Tensor, shape ``(..., D)``, floating
        Input, on the CPU or a CUDA device.
    alpha : torch.Tensor of shape () or (1,), or float
        The scalar :math:`\alpha`; a float is a constant (no gradient), applied like
        ``torch.tanh(alpha * x)`` applies it: not rounded to the dtype of ``x`` first.
    weight, bias : torch.Tensor of shape (D,) or None
        Gain and bias along the last axis, on the device of ``x``.

    Returns
    -------
    y : torch.Tensor
        Shape and dtype of ``x``; differentiable with respect to ``x``, ``alpha`` (a tensor),
        ``weight`` and ``bias``.

    Raises
    ------
    TypeError, ValueError
        ``x`` not a floating tensor; otherwise as :func:`lnlib.dynamic_tanh`.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "Without normalization: Dynamic Tanh"; the
    bridge in :ref:`sec-ch05-torch-bridge`.
    """
    _check_tensor("x", x)
    return DynamicTanhFunction.apply(x, alpha, weight, bias)


class GroupNorm(nn.Module):
    r"""Drop-in for ``torch.nn.GroupNorm`` computed by lnlib.

    Parameters
    ----------
    num_groups, num_channels : int
        G and C; G must divide C.
    eps : float, default 1e-5
        Added to the variance inside the square root.
    affine : bool, default True
        Learn a per-channel ``weight`` (ones) and ``bias`` (zeros).
    device, dtype
        As for the parameters of ``torch.nn.GroupNorm``.

    Notes
    -----
    Covered in :doc:`/book/04_variants`, section "The family by axes".
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(
                f"num_groups must divide num_channels = {num_channels}, got {num_groups}"
            )
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.affine = affine
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = nn.Parameter(torch.ones(num_channels, **factory))
            self.bias = nn.Parameter(torch.zeros(num_channels, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x):
        r"""Compute the layer on ``x`` with :func:`group_norm`.

        Parameters
        ----------
        x : torch.Tensor
            Input, floating, on the device of the parameters (CPU or CUDA).

        Returns
        -------
        torch.Tensor
            Shape and dtype of ``x``; differentiable (once).

        Raises
        ------
        TypeError, ValueError
            As for :func:`group_norm`.
        """
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        """The constructor arguments shown by ``repr(module)``, as in ``torch.nn.GroupNorm``.

        Returns
        -------
        str
            E.g. the normalized shape, ``eps`` and whether parameters are learned.
        """
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class DynamicTanh(nn.Module):
    r"""Dynamic Tanh layer (DyT), a drop-in for a LayerNorm over the last axis.

    Parameters
    ----------
    normalized_shape : int
        D, the size of the last axis.
    alpha_init_value : float, default 0.5
        Initial value of the learned scalar ``alpha``.
    elementwise_affine : bool, default True
        Learn ``weight`` (ones) and ``bias`` (zeros) of shape (D,).
    device, dtype
        For the parameters.

    Notes
    -----
    ``alpha`` is a parameter of shape (); a state dict from the DyT authors' code, where it
    has shape (1,), loads with ``load_state_dict`` (torch takes a one-element alpha into it),
    and an ``alpha`` of shape (1,) assigned to the module works too (its gradient then has
    that shape). Covered in :doc:`/book/04_variants`, section "Without normalization:
    Dynamic Tanh".
    """

    def __init__(
        self,
        normalized_shape,
        alpha_init_value=0.5,
        elementwise_affine=True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.normalized_shape = _normalized_shape(normalized_shape)
        factory = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init_value), **factory))
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x):
        r"""Compute the layer on ``x`` with :func:`dynamic_tanh`.

        Parameters
        ----------
        x : torch.Tensor
            Input, floating, on the device of the parameters (CPU or CUDA).

        Returns
        -------
        torch.Tensor
            Shape and dtype of ``x``; differentiable (once).

        Raises
        ------
        TypeError, ValueError
            As for :func:`dynamic_tanh`.
        """
        return dynamic_tanh(x, self.alpha, self.weight, self.bias)

    def extra_repr(self):
        """The constructor arguments shown by ``repr(module)``, as in DyT's reference code.

        Returns
        -------
        str
            E.g. the normalized shape, ``eps`` and whether parameters are learned.
        """
        return f"{self.normalized_shape}, elementwise_affine={self.elementwise_affine}"
