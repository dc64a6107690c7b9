"""The one pattern of the PyTorch bridge's autograd Functions (:mod:`lnlib.torch_bridge`), and
how tensors cross to lnlib and back.

:func:`_function` makes a ``torch.autograd.Function`` of a class whose ``forward`` runs an lnlib
forward and ends in :func:`_finish`, which saves what the backward needs and names the lnlib
backward that the one shared :func:`_backward` runs. Tensors cross without copies: a CPU tensor
as a NumPy array on its memory (``Tensor.numpy()``, ``torch.from_numpy``), a CUDA tensor as a
CuPy array through DLPack (:mod:`lnlib._cuda.dlpack`), with lnlib's CUDA kernels on torch's
current stream, so that they queue behind torch's work with no synchronisation. NumPy has no
bfloat16: such tensors are computed in float32 and cast back.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import numpy as np
import torch

import lnlib
from lnlib import _docs

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
    """View a tensor as a NumPy (CPU) or CuPy (CUDA) array, without a copy; None stays None."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype not in _NATIVE:
        t = t.float()
    if t.is_cpu:
        # .numpy() shares the storage for any non-negative strides (torch has no others).
        return t.numpy()
    if t.is_cuda:
        # Same memory, any strides: no .contiguous() copy (lnlib handles strided rows).
        return _cuda_dlpack(t).to_cupy(t)
    raise TypeError(f"x: expected a CPU or CUDA tensor, got a tensor on {t.device}")


def _to_tensor(a, dtype=None, layout=None):
    """An array from lnlib as a tensor on its memory (NumPy or, through DLPack, CuPy), cast to
    ``dtype`` and given the memory format ``layout`` where these are given."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    t = t if dtype in (None, t.dtype) else t.to(dtype)
    return t if layout is None else t.contiguous(memory_format=layout)


def _stream_of(t):
    """Where lnlib works on ``t``: for a CUDA tensor, CuPy on torch's current stream, so that
    lnlib's kernels queue behind torch's work (and torch's next kernels behind them)."""
    return _cuda_dlpack(t).torch_stream(t) if t.is_cuda else contextlib.nullcontext()


def first_order_only(backward):
    """Decorator for a ``backward`` that torch must not differentiate again: lnlib's backward
    runs outside torch's graph, so a graph built through it (``create_graph=True``, hessians,
    ``gradgradcheck``) would hold zeros or nothing. It refuses to run with grad mode on, which
    is exactly when torch builds that graph."""

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


def _finish(ctx, outputs, stats, saved, backward, layout=None):
    """The end of every forward: save for ``backward``; return the outputs, then the statistics.

    ``outputs`` are ``(array, dtype)`` pairs of the differentiable results, ``stats`` lnlib's
    statistics (returned, not differentiable), ``saved`` the input tensors ``backward`` reads:
    ``backward(*doutputs, *saved, *outputs[1:], *stats)`` takes arrays and returns the
    gradients of the inputs of ``apply`` in their order (None for one that has none).
    ``layout``: the memory format of ``y`` and ``dx``.
    """
    stats = [_to_tensor(s) for s in stats]
    layouts = [layout] + [None] * (len(outputs) - 1)
    results = [_to_tensor(a, dtype, f) for (a, dtype), f in zip(outputs, layouts)]
    ctx.save_for_backward(*saved, *results[1:], *stats)
    ctx.mark_non_differentiable(*stats)
    ctx.lnlib_backward, ctx.layout, ctx.n_outputs = backward, layout, len(outputs)
    return (*results, *stats) if stats or len(results) > 1 else results[0]


@first_order_only
def _backward(ctx, dy, *grads):
    """Run the lnlib backward the forward named; return the gradients torch asks for.

    Parameters
    ----------
    ctx : torch.autograd.function.FunctionCtx
        The context the forward filled.
    dy : torch.Tensor, shape of ``x``
        Gradient of the loss with respect to ``y``.
    *grads : torch.Tensor or None
        Gradients of the other outputs: that of ``h`` (the fused add) is used, those of the
        statistics are ignored (they are not differentiable).

    Returns
    -------
    tuple
        For each input of the forward, its gradient (in its dtype) where torch asks one, else
        None.

    Raises
    ------
    RuntimeError
        Called with grad mode on (``create_graph=True``): there is no double backward.
    """
    douts = (dy, *grads[: ctx.n_outputs - 1])
    with _stream_of(dy):
        results = ctx.lnlib_backward(*(_to_array(t) for t in (*douts, *ctx.saved_tensors)))
        grads = [None] * len(ctx.needs_input_grad)
        for i, (g, dtype) in enumerate(zip(results, ctx.dtypes)):
            if ctx.needs_input_grad[i]:
                grads[i] = _to_tensor(g, dtype, ctx.layout if i == 0 else None)
    return tuple(grads)


def _function(name, results):
    """Class decorator, the one pattern of every Function here: its ``forward(ctx, x, ...)``
    runs where lnlib works on ``x`` and returns through :func:`_finish`; the tensors among the
    inputs of ``apply`` are those torch may ask gradients of (each in its dtype), and the one
    :func:`_backward` gives them. ``name`` is the function of this module that applies it and
    of lnlib (``name_forward`` where lnlib has one) that it runs, ``results`` what it returns;
    the class docstring says the rest (and where the book covers it)."""
    lnlib_forward = f"{name}_forward" if hasattr(lnlib, f"{name}_forward") else name

    def make(cls):
        forward = cls.forward

        @functools.wraps(forward)
        def run(ctx, x, *args):
            ctx.dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in (x, *args)]
            with _stream_of(x):
                return forward(ctx, x, *args)

        _docs.autograd_function(cls, run, name, lnlib_forward, results)
        cls.forward, cls.backward = staticmethod(run), staticmethod(_backward)
        return cls

    return make
