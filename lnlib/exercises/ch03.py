r"""Checkers for the exercises of the chapter "Properties of layer normalization".

Each checker takes the reader's function (or, for :func:`check_invariant_shift`, the reader's
vector), runs it on ordinary and edge-case inputs against :mod:`lnlib.reference`, prints one
line that says PASS or what is wrong, and returns a :class:`~lnlib.exercises.CheckResult`.

=================================  =====================================================
checker                            the reader writes
=================================  =====================================================
:func:`check_invariant_shift`      a non-constant vector ``v`` with LN(x + v) = LN(x)
:func:`check_jacobian_spectrum`    ``fn(x, eps=1e-5) -> eigenvalues`` of J, without J
:func:`check_weight_grad`          ``fn(W, x, dy, eps=1e-6) -> dW`` for y = RMSNorm(x W^T)
:func:`check_next_sq_norm`         ``fn(sq_norm, grad_sq_norm, lr, wd) -> sq_norm``
:func:`check_selectable_keys`      ``fn(keys) -> mask`` of the 2-d keys that can win
:func:`check_batch_invariant_sum`  ``fn(x) -> row sums``, bitwise independent of the batch
=================================  =====================================================

LayerNorm here is over the last axis of ``x`` (of length D), without ``weight`` and ``bias``
unless said otherwise. The chapter derives each answer; its notebook
``notebooks/03_properties.ipynb`` holds the exercises. :func:`split_row_sum` is the
batch-dependent reduction the chapter's section on batch invariance starts from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import reference
from ._core import Case, CheckResult, Failure, check

__all__ = [
    "SHIFT_EXAMPLE",
    "check_batch_invariant_sum",
    "check_invariant_shift",
    "check_jacobian_spectrum",
    "check_next_sq_norm",
    "check_selectable_keys",
    "check_weight_grad",
    "split_row_sum",
]

#: The vector x of the shift exercise: the first vector of chapter 2's worked example.
SHIFT_EXAMPLE = np.array([3.0, 5.0, 2.0, 8.0])


def _rng() -> np.random.Generator:
    # A fixed seed: the checkers print the same message every time they are run.
    return np.random.default_rng(3)


def _result(name: str, reason: str | None, pass_message: str) -> CheckResult:
    """Print and return the result of a checker that judges one answer."""
    if reason is None:
        message, failures = f"PASS {name}: {pass_message}", []
    else:
        message, failures = f"FAIL {name}: {reason}.", [Failure(1, "your answer", reason)]
    print(message)
    return CheckResult(name=name, n_cases=1, failures=failures, message=message)


# ------------------------------------------------- exercise: a shift that LayerNorm does not see


def check_invariant_shift(v: Any) -> CheckResult:
    """Check that ``v`` (the chapter's vector :math:`v`) is non-constant with LN(x + v) = LN(x).

    ``x`` is :data:`SHIFT_EXAMPLE` and eps = 0. ``v`` passes when it is a finite float64 array
    of shape (4,) whose non-constant part ``v - mean(v)`` is at least 1e-6 times as long as
    ``x - mean(x)`` (far above what the invariance test can resolve, so that a constant plus
    noise does not pass) and LN(x + v) equals LN(x) to 1e-9.
    """
    return _result("invariant shift", _shift_reason(v), "v is not constant and LN(x + v) = LN(x).")


# The shortest non-constant part v - mean(v) that check_invariant_shift accepts, relative to
# |x - mean(x)|. LN(x + v) = LN(x) is tested to 1e-9, so a non-constant part below about
# 1e-9 |x - mean(x)| would pass in any direction; one of 1e-6 |x - mean(x)| passes only along
# x - mean(x), which is what the exercise asks for.
_MIN_NONCONSTANT = 1e-6


def _shift_reason(v: Any) -> str | None:
    x = SHIFT_EXAMPLE
    if not isinstance(v, np.ndarray):
        return f"expected a NumPy array, got {type(v).__name__}"
    if v.shape != x.shape or v.dtype != np.float64:
        return f"expected a float64 array of shape {x.shape}, got {v.dtype} of shape {v.shape}"
    if not np.all(np.isfinite(v)):
        return "v contains NaN or inf"
    nonconstant = float(np.linalg.norm(v - v.mean()))
    if nonconstant < _MIN_NONCONSTANT * float(np.linalg.norm(x - x.mean())):
        shown = (
            "" if nonconstant == 0.0 else f" up to a non-constant part of length {nonconstant:.1g}"
        )
        return (
            f"v is constant{shown}: adding the same number to every feature leaves LN unchanged "
            "for every eps, but the exercise asks for a v that is not constant"
        )
    want = reference.layer_norm_forward(x, eps=0.0)[0]
    with np.errstate(all="ignore"):
        got = reference.layer_norm_forward(x + v, eps=0.0)[0]
    if np.ptp(x + v) == 0.0:
        return "x + v is constant, so LN(x + v) is 0/0 at eps = 0"
    err = float(np.max(np.abs(got - want)))
    if err > 1e-9:
        hint = (
            "LN(x + v) = -LN(x): x + v is a negative multiple of x, up to a constant"
            if np.allclose(got, -want, atol=1e-9)
            else "which directions of x does LN ignore? Think of x + v = rho x + nu 1"
        )
        return f"LN(x + v) differs from LN(x) by up to {err:.3g}; {hint}"
    return None


# ---------------------------------------------------------- exercise: the Jacobian's spectrum


def _jacobian(x, eps):
    xhat, _, rstd = reference.layer_norm_forward(x, eps=eps)  # xhat: (D,), rstd: ()
    d = x.shape[-1]
    return rstd / d * (d * np.eye(d) - np.ones((d, d)) - np.outer(xhat, xhat))


def _ref_spectrum(x, eps=1e-5):
    return np.linalg.eigvalsh(_jacobian(x, eps))  # ascending


def check_jacobian_spectrum(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x, eps=1e-5) -> eigenvalues``, the spectrum of J = d xhat / d x.

    ``x`` has shape (D,); the result must be the D eigenvalues of the Jacobian of LayerNorm
    (no weight or bias) in ascending order, float64, elementwise to rtol = atol = 1e-9. Cases
    include eps = 0, where two eigenvalues are 0, and a constant vector.
    """
    rng = _rng()
    cases = [
        Case("the first vector of the worked example", (SHIFT_EXAMPLE.copy(),)),
        Case("a random vector, D = 8", (rng.normal(size=8),)),
        Case(
            "eps = 0 passed as a keyword (two zero eigenvalues)",
            (rng.normal(size=6),),
            {"eps": 0.0},
        ),
        Case("a small spread, variance about eps", (1.0 + 3e-3 * rng.normal(size=5),)),
        Case("eps = 1.0 passed as a keyword", (rng.normal(size=4),), {"eps": 1.0}),
        Case("a constant vector", (np.full(5, 2.0),)),
        Case("D = 2", (np.array([1.0, 4.0]),)),
    ]
    return check(
        fn, _ref_spectrum, cases, rtol=1e-9, atol=1e-9, name=getattr(fn, "__name__", "spectrum")
    )


# ------------------------------------------------ exercise: the gradient of a weight matrix


def _ref_weight_grad(W, x, dy, eps=1e-6):
    h = x @ W.T  # (B, D)
    _, rstd = reference.rms_norm_forward(h, eps=eps)
    dh = reference.rms_norm_backward(dy, h, rstd)[0]
    return dh.T @ x  # (D, D_in)


def check_weight_grad(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(W, x, dy, eps=1e-6) -> dW`` for y = RMSNorm(x W^T) (no weight).

    ``W`` has shape (D, D_in), ``x`` (B, D_in) and ``dy`` (B, D); ``dW`` has the shape of
    ``W``. Cases include a single row, a rescaled ``W`` (whose gradient shrinks by the same
    factor, exactly at eps = 0 and up to a relative eps / mean(h^2) otherwise) and eps = 0.
    """
    rng = _rng()
    w = rng.normal(size=(6, 5))
    x, dy = rng.normal(size=(7, 5)), rng.normal(size=(7, 6))
    cases = [
        Case("a random (6, 5) W and 7 rows", (w, x, dy)),
        Case(
            "one row, B = 1",
            (rng.normal(size=(4, 3)), rng.normal(size=(1, 3)), rng.normal(size=(1, 4))),
        ),
        Case("the same W times 10 (the gradient about 10 times smaller)", (10 * w, x, dy)),
        Case("eps = 0 passed as a keyword", (w, x, dy), {"eps": 0.0}),
        Case(
            "dy = y: a gradient along the output itself (dW is zero at eps = 0)",
            (w, x, reference.rms_norm_forward(x @ w.T, eps=0.0)[0]),
            {"eps": 0.0},
            atol=1e-12,
        ),
    ]
    return check(
        fn,
        _ref_weight_grad,
        cases,
        rtol=1e-7,
        atol=1e-10,
        name=getattr(fn, "__name__", "weight_grad"),
    )


# ----------------------------------------- exercise: the squared norm after one SGD step


def _ref_next_sq_norm(sq_norm, grad_sq_norm, lr, wd):
    return (1 - lr * wd) ** 2 * sq_norm + lr**2 * grad_sq_norm


def check_next_sq_norm(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(sq_norm, grad_sq_norm, lr, wd) -> sq_norm_next``.

    One step of gradient descent with weight decay, W <- W - lr (g + wd W), on a weight that
    LayerNorm makes scale-invariant (so W . g = 0), given ||W||^2, ||g||^2, the learning rate
    and the weight decay. Arguments are floats or float64 arrays of one shape.
    """
    rng = _rng()
    cases = [
        Case("no weight decay", (4.0, 9.0, 0.1, 0.0)),
        Case("weight decay 0.01", (4.0, 9.0, 0.1, 0.01)),
        Case("a zero gradient: only the decay acts", (2.5, 0.0, 0.5, 0.1)),
        Case(
            "arrays of 5 settings",
            (
                rng.uniform(1, 3, 5),
                rng.uniform(0, 1, 5),
                rng.uniform(0.01, 1, 5),
                rng.uniform(0, 0.1, 5),
            ),
        ),
    ]
    return check(
        fn,
        _ref_next_sq_norm,
        cases,
        rtol=1e-12,
        atol=1e-12,
        check_dtype=False,
        name=getattr(fn, "__name__", "next_sq_norm"),
    )


# ------------------------------------------------- exercise: keys that can win an argmax


def _cross(o, a, b):
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _ref_selectable(keys):
    """Strict vertices of the convex hull of 2-d points (Andrew's monotone chain)."""
    n = keys.shape[0]
    if n <= 2:
        return np.ones(n, dtype=bool)
    order = sorted(range(n), key=lambda i: (keys[i, 0], keys[i, 1]))
    hull = []
    for seq in (order, order[::-1]):
        chain: list[int] = []
        for i in seq:
            # pop while the turn is not strictly counter-clockwise: collinear points drop out
            while len(chain) >= 2 and _cross(keys[chain[-2]], keys[chain[-1]], keys[i]) <= 0:
                chain.pop()
            chain.append(i)
        hull += chain[:-1]
    mask = np.zeros(n, dtype=bool)
    mask[hull] = True
    return mask


def check_selectable_keys(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(keys) -> mask``: which 2-d keys win ``argmax(keys @ q)`` for some query q.

    ``keys`` is a float64 array of shape (n, 2) without repeated rows; ``mask`` is a boolean
    array of shape (n,), true for the keys that get a strictly larger score than every other
    key for at least one query. A key in the middle of a hull edge never wins strictly.
    """
    rng = _rng()
    angles = np.sort(rng.uniform(0, 2 * np.pi, 12))
    cases = [
        Case(
            "the corners of a square and its centre",
            (np.array([[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0], [0.0, 0.0]]),),
        ),
        Case("30 Gaussian keys", (rng.normal(size=(30, 2)),)),
        Case(
            "12 keys on a circle, as after LayerNorm",
            (np.stack([np.cos(angles), np.sin(angles)], axis=1),),
        ),
        Case(
            "a key in the middle of an edge",
            (np.array([[0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [1.0, 3.0]]),),
        ),
        Case(
            "one large key and small ones near it",
            (np.vstack([[10.0, 0.0], [1.0, 0.2], [1.0, -0.2], [-1.0, 0.0]]),),
        ),
        Case("a single key", (np.array([[0.5, -2.0]]),)),
    ]
    return check(fn, _ref_selectable, cases, name=getattr(fn, "__name__", "selectable"))


# ------------------------------------------------- exercise: a batch-invariant row sum


def _sequential_sum(x):
    """Sum the last axis strictly left to right, in x's dtype (vectorized over the rest)."""
    total = np.zeros(x.shape[:-1], dtype=x.dtype)
    for k in range(x.shape[-1]):
        total = total + x[..., k]
    return total


def split_row_sum(x: np.ndarray) -> np.ndarray:
    """Row sums of a float32 (B, D) array in an order that depends on B, as some kernels do.

    A batch of fewer than 32 rows gives each row's sum to 4 workers (a "split reduction": the
    row is cut into 4 chunks, each summed left to right, then the 4 partial sums are added);
    a larger batch has enough rows to keep every worker busy and sums each row left to right
    in one piece. Both orders are exact IEEE float32 additions, the same on every machine, and
    they round differently: the same row gets a different sum in a small and in a large batch.
    The chapter's section on batch invariance uses it; D must be a multiple of 4.
    """
    n, d = x.shape
    if n >= 32:
        return _sequential_sum(x)
    parts = _sequential_sum(x.reshape(n, 4, d // 4))  # (B, 4) partial sums
    return _sequential_sum(parts)


def check_batch_invariant_sum(fn: Callable[..., Any]) -> CheckResult:
    """Check ``fn(x) -> sums``: float32 row sums whose bits do not depend on the batch.

    ``x`` is a float32 array of shape (B, D); the result must be float32 of shape (B,), each
    entry within 1e-4 (relative to the sum of absolute values) of the exact row sum, and
    bitwise the same as in one batch of 2100 rows for a row alone, in every batch of 2 to 64
    rows, in batches on both sides of every power of two up to 2048 (127, 128, 129, ...),
    and at several positions. A checker can only sample batch sizes: a function that changes
    its order at a size not tried here (say 1700 rows) still passes, and is still wrong.
    """
    name = getattr(fn, "__name__", "batch-invariant sum")
    rng = np.random.default_rng(7)
    x = (1.0 + rng.standard_normal((2100, 512))).astype(np.float32)  # (2100, 512)
    return _result(
        name,
        _invariance_reason(fn, x),
        "accurate, and every row's bits are the same in every batch.",
    )


def _call_sum(fn, x):
    try:
        got = fn(x.copy())
    except Exception as exc:  # noqa: BLE001  the reader's error is reported, never raised
        return None, f"raised {type(exc).__name__}: {exc}"
    if not isinstance(got, np.ndarray) or got.shape != x.shape[:1] or got.dtype != np.float32:
        what = (
            f"{got.dtype} of shape {got.shape}"
            if isinstance(got, np.ndarray)
            else type(got).__name__
        )
        return None, f"expected a float32 array of shape {x.shape[:1]}, got {what}"
    return got, None


#: (start, size) of the batches compared with the full batch: a row alone at two positions,
#: every size from 2 to 64, and the sizes on both sides of each power of two up to 2048.
_BATCHES = (
    [(0, 1), (5, 1), (1999, 1)]
    + [(3 * size % 50, size) for size in range(2, 65)]
    + [(7, n) for k in range(7, 12) for n in (2**k - 1, 2**k, 2**k + 1)]
    + [(11, 1000), (2, 1500)]
)


def _invariance_reason(fn, x) -> str | None:
    full, reason = _call_sum(fn, x)
    if reason:
        return f"on a batch of {x.shape[0]} rows: {reason}"
    exact = x.astype(np.float64).sum(axis=1)
    err = np.abs(full - exact) / np.abs(x.astype(np.float64)).sum(axis=1)
    if err.max() > 1e-4:
        i = int(err.argmax())
        return f"row {i}: sum {full[i]:.7g}, exact {exact[i]:.7g} (relative error {err[i]:.2g})"
    for start, size in _BATCHES:
        part, reason = _call_sum(fn, x[start : start + size])
        if reason:
            return f"on {size} rows: {reason}"
        diff = np.flatnonzero(part.view(np.int32) != full[start : start + size].view(np.int32))
        if diff.size:
            i = start + int(diff[0])
            return (
                f"row {i} sums to {part[diff[0]]!r} in a batch of {size} rows and to "
                f"{full[i]!r} in the batch of {x.shape[0]}: the order of the additions "
                "must not depend on the batch size"
            )
    return None
