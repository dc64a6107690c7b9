"""The Chapter 3 checkers pass correct solutions and catch typical mistakes."""

import numpy as np
import pytest

from lnlib.exercises import ch03


def spectrum(x, eps=1e-5):
    d = x.shape[-1]
    rstd = 1 / np.sqrt(x.var() + eps)
    return np.sort(np.concatenate([[0.0, eps * rstd**3], np.full(d - 2, rstd)]))


def spectrum_forgets_eps(x, eps=1e-5):
    d = x.shape[-1]
    rstd = 1 / np.sqrt(x.var() + eps)
    return np.sort(np.concatenate([[0.0, 0.0], np.full(d - 2, rstd)]))


def weight_grad(W, x, dy, eps=1e-6):
    h = x @ W.T
    rstd = 1 / np.sqrt((h * h).mean(axis=-1, keepdims=True) + eps)
    yhat = h * rstd
    dh = rstd * (dy - yhat * (dy * yhat).mean(-1, keepdims=True))
    return dh.T @ x


def weight_grad_layer_norm(W, x, dy, eps=1e-6):
    h = x @ W.T
    mean = h.mean(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt(((h - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (h - mean) * rstd
    dh = rstd * (dy - dy.mean(-1, keepdims=True) - xhat * (dy * xhat).mean(-1, keepdims=True))
    return dh.T @ x


def weight_grad_without_norm(W, x, dy, eps=1e-6):
    return dy.T @ x


def next_sq_norm(sq_norm, grad_sq_norm, lr, wd):
    return (1 - lr * wd) ** 2 * sq_norm + lr**2 * grad_sq_norm


def next_sq_norm_first_order(sq_norm, grad_sq_norm, lr, wd):
    return (1 - 2 * lr * wd) * sq_norm


def selectable(keys):
    """Key i wins for some query iff the LP max t s.t. q.(k_i - k_j) >= t, |q| <= 1 has t > 0."""
    from scipy.optimize import linprog

    n = keys.shape[0]
    mask = np.ones(n, dtype=bool)
    for i in range(n):
        others = np.delete(keys, i, axis=0)
        if others.size == 0:
            continue
        a_ub = np.hstack([-(keys[i] - others), np.ones((n - 1, 1))])
        res = linprog(
            [0, 0, -1], A_ub=a_ub, b_ub=np.zeros(n - 1), bounds=[(-1, 1), (-1, 1), (None, 1)]
        )
        mask[i] = -res.fun > 1e-9
    return mask


def selectable_by_norm(keys):
    norms = np.linalg.norm(keys, axis=1)
    return norms >= np.median(norms)


def selectable_by_own_query(keys):
    """The query q = k_i of the proposition, used where the keys' lengths differ: wrong."""
    scores = keys @ keys.T
    return np.array([np.all(scores[i, i] > np.delete(scores[i], i)) for i in range(len(keys))])


def selectable_with_edge_midpoints(keys):
    """Every key on the hull's boundary, a key in the middle of an edge included: wrong."""
    from scipy.spatial import ConvexHull

    if len(keys) < 3:
        return np.ones(len(keys), dtype=bool)
    planes = ConvexHull(keys).equations  # (faces, 3): normal . k + offset = 0 on a face
    return np.abs(keys @ planes[:, :2].T + planes[:, 2]).min(axis=1) < 1e-12


def fixed_order_sum(x):
    total = np.zeros(x.shape[0], dtype=x.dtype)
    for k in range(x.shape[1]):
        total = total + x[:, k]
    return total


def test_invariant_shift_accepts_a_multiple_of_the_centred_x():
    x = ch03.SHIFT_EXAMPLE
    assert ch03.check_invariant_shift(0.5 * (x - x.mean()) + 3.0).passed
    # a small theta is still an answer, once it is far above what the test can resolve
    assert ch03.check_invariant_shift(1e-5 * (x - x.mean()) + 3.0).passed


@pytest.mark.parametrize(
    "v, words",
    [
        (None, "expected a NumPy array"),
        (np.ones(3), "shape (4,)"),
        (np.full(4, 2.0), "constant"),
        # a constant up to 3e-9: it passes the invariance test (to 1e-9) but is no answer
        (np.array([1.0 + 3e-9, 1.0, 1.0, 1.0]), "v is constant up to a non-constant part"),
        (np.array([1e6, 1e6, 1e6, 1e6 + 1e-9]), "v is constant up to a non-constant part"),
        (np.array([1.0, 0.0, 0.0, 0.0]), "differs from LN(x)"),
        (-2 * ch03.SHIFT_EXAMPLE, "negative multiple"),
        (np.array([np.nan, 0, 0, 0]), "NaN"),
    ],
)
def test_invariant_shift_explains_what_is_wrong(v, words):
    result = ch03.check_invariant_shift(v)
    assert not result.passed and words in result.message


def test_jacobian_spectrum():
    assert ch03.check_jacobian_spectrum(spectrum).passed
    result = ch03.check_jacobian_spectrum(spectrum_forgets_eps)
    assert not result.passed and "case 1" in result.message


def test_weight_grad():
    assert ch03.check_weight_grad(weight_grad).passed
    assert not ch03.check_weight_grad(weight_grad_without_norm).passed
    assert not ch03.check_weight_grad(weight_grad_layer_norm).passed


def test_next_sq_norm():
    assert ch03.check_next_sq_norm(next_sq_norm).passed
    assert not ch03.check_next_sq_norm(next_sq_norm_first_order).passed


def test_selectable_keys_reference_agrees_with_a_linear_program():
    pytest.importorskip("scipy")
    assert ch03.check_selectable_keys(selectable).passed
    assert not ch03.check_selectable_keys(selectable_by_norm).passed


def test_selectable_keys_rejects_the_own_query_and_edge_midpoints():
    """Two wrong readings of the chapter: q = k_i wins only for keys of one length (a short
    key beside a long one can win for another query), and a key in the middle of an edge
    only ties."""
    pytest.importorskip("scipy")
    failed = [f.description for f in ch03.check_selectable_keys(selectable_by_own_query).failures]
    assert "one large key and small ones near it" in failed
    failed = [
        f.description for f in ch03.check_selectable_keys(selectable_with_edge_midpoints).failures
    ]
    assert failed == ["a key in the middle of an edge"]


def test_batch_invariant_sum():
    assert ch03.check_batch_invariant_sum(fixed_order_sum).passed
    result = ch03.check_batch_invariant_sum(ch03.split_row_sum)
    assert not result.passed and "order of the additions" in result.message
    result = ch03.check_batch_invariant_sum(lambda x: x.sum(axis=1, dtype=np.float64))
    assert not result.passed and "float32" in result.message
    result = ch03.check_batch_invariant_sum(lambda x: x[:, :100].sum(axis=1))
    assert not result.passed and "relative error" in result.message


def _split_below(threshold):
    """split_row_sum with its threshold moved: a choice made from B that few sizes reveal."""

    def row_sum(x):
        if x.shape[0] >= threshold:
            return fixed_order_sum(x)
        n, d = x.shape
        return fixed_order_sum(fixed_order_sum(x.reshape(n, 4, d // 4)))

    return row_sum


def _reversed_for_three_rows(x):
    """Left to right, except right to left for a batch of exactly 3 rows."""
    return fixed_order_sum(x[:, ::-1] if x.shape[0] == 3 else x)


@pytest.mark.parametrize(
    "fn", [_split_below(256), _split_below(1025), _split_below(3), _reversed_for_three_rows]
)
def test_batch_invariant_sum_rejects_orders_chosen_from_the_batch_size(fn):
    """The chapter warns against any choice made from B, also at sizes a few tests miss."""
    result = ch03.check_batch_invariant_sum(fn)
    assert not result.passed and "order of the additions" in result.message


def test_split_row_sum_is_exact_ieee_and_depends_on_the_batch_size():
    """The demonstration reduction differs between small and large batches on some rows, and
    each of its two orders is the plain sequential float32 sum of its pieces."""
    rng = np.random.default_rng(0)
    x = (1 + rng.standard_normal((64, 1024))).astype(np.float32)
    large = ch03.split_row_sum(x)
    small = np.concatenate([ch03.split_row_sum(x[i : i + 8]) for i in range(0, 64, 8)])
    np.testing.assert_array_equal(large, fixed_order_sum(x))
    parts = np.stack([fixed_order_sum(c) for c in np.split(x, 4, axis=1)], axis=1)
    np.testing.assert_array_equal(small, fixed_order_sum(parts))
    assert np.count_nonzero(small != large) > 10
    np.testing.assert_allclose(small, large, rtol=1e-5)
