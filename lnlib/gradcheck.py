r"""Finite-difference gradient checks, for tests, notebooks and exercises.

For a function :math:`f` and an upstream gradient :math:`dy`, the gradient of the scalar
:math:`L(x) = \sum dy \cdot f(x)` is estimated by central differences,

.. math::

    \frac{\partial L}{\partial x_i} \approx \frac{L(x + h e_i) - L(x - h e_i)}{2h},

with an error of order :math:`h^2` from truncation and :math:`\varepsilon/h` from rounding, so
``h = 1e-6`` in float64 gives about 1e-9 relative accuracy for smooth functions.
"""

import numpy as np

from ._validate import not_masked

__all__ = ["numerical_grad", "check_grad"]


def numerical_grad(f, x, dy, *, h=1e-6):
    """Central-difference gradient of ``sum(dy * f(x))`` with respect to ``x``, in float64.

    Parameters
    ----------
    f : callable
        Maps an array shaped like ``x`` to an array shaped like ``dy``.
    x : array_like
        Point at which to differentiate (converted to float64; never modified).
    dy : array_like
        Upstream gradient, the weights of the scalar ``sum(dy * f(x))``.
    h : float, default 1e-6
        Step; must be > 0.

    Returns
    -------
    grad : ndarray, float64, shape of ``x``
        :math:`(L(x + h e_i) - L(x - h e_i)) / 2h` for every element :math:`i`.

    Raises
    ------
    TypeError
        ``x`` or ``dy`` a masked array (its mask would be ignored).
    ValueError
        ``h`` not > 0.

    Notes
    -----
    Two calls of ``f`` per element of ``x``: for small arrays. Covered in
    :ref:`sec-ch02-backward`, where the backward pass is checked this way.
    """
    if not h > 0:
        raise ValueError(f"h must be > 0, got {h}")
    not_masked(x, "x")
    not_masked(dy, "dy")
    x = np.array(x, dtype=np.float64)  # a private copy we may perturb (a plain ndarray)
    dy = np.asarray(dy, dtype=np.float64)
    grad = np.empty_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = np.sum(dy * np.asarray(f(x)))  # asarray: * is elementwise even for numpy.matrix
        flat[i] = old - h
        down = np.sum(dy * np.asarray(f(x)))
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return grad


def check_grad(f, x, dy, analytic, *, h=1e-6, rtol=1e-6, atol=1e-9, name="dx"):
    r"""Compare an analytic gradient with :func:`numerical_grad`; raise if they disagree.

    Parameters
    ----------
    f : callable
        Maps an array shaped like ``x`` to an array shaped like ``dy``.
    x : array_like
        Point at which to differentiate (never modified).
    dy : array_like
        Upstream gradient, the weights of the scalar ``sum(dy * f(x))``.
    analytic : array_like, shape of ``x``
        The gradient to check, e.g. ``dx`` from a backward pass.
    h : float, default 1e-6
        Finite-difference step; must be > 0.
    rtol, atol : float, default 1e-6 and 1e-9
        Tolerance: every element must satisfy
        :math:`|a_i - n_i| \le \mathrm{atol} + \mathrm{rtol}\,\max_j |n_j|`.
    name : str, default "dx"
        Name of the gradient in the error message.

    Returns
    -------
    float
        The largest absolute difference between ``analytic`` and the numerical gradient.

    Raises
    ------
    AssertionError
        ``analytic`` not of the shape of ``x``, or an element beyond the tolerance (the
        message names the worst element, its two values and the tolerance).
    TypeError
        ``x``, ``dy`` or ``analytic`` a masked array (its mask would be ignored).
    ValueError
        ``h`` not > 0.

    Notes
    -----
    Covered in :ref:`sec-ch02-backward`, where the backward pass is checked this way.
    """
    numeric = numerical_grad(f, x, dy, h=h)
    not_masked(analytic, name)
    analytic = np.asarray(analytic, dtype=np.float64)
    if analytic.shape != numeric.shape:
        raise AssertionError(
            f"{name}: analytic gradient has shape {analytic.shape}, expected {numeric.shape}"
        )
    err = np.abs(analytic - numeric)
    tol = atol + rtol * np.max(np.abs(numeric), initial=0.0)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    if err.size and not err[worst] <= tol:
        raise AssertionError(
            f"{name}: analytic and finite-difference gradients differ at index "
            f"{tuple(map(int, worst))}: analytic {analytic[worst]!r}, numeric "
            f"{numeric[worst]!r} (|diff| {err[worst]:.3g} > tol {tol:.3g})"
        )
    return float(err.max(initial=0.0))
