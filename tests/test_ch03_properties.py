"""The properties chapter 3 states, as property-based tests (hypothesis).

Each test names the statement of book/03_properties.md that it backs. Everything runs with
the compiled CPU kernel and with the NumPy fast path (the ``cpu_path`` fixture).
"""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import lnlib

pytestmark = pytest.mark.usefixtures("cpu_path")

seeds = st.integers(0, 2**32 - 1)
factors = st.floats(0.05, 20).filter(lambda rho: abs(rho - 1) > 0.05)
epsilons = st.sampled_from([0.0, 1e-8, 1e-5, 1e-2, 1.0])


def rows(seed, n=1, d=16, loc=0.0, scale=1.0):
    g = np.random.default_rng(seed)
    return loc + scale * g.standard_normal((n, d))


def maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------- the table of Ba et al.

NORMS = {
    "BatchNorm": lambda h, W: lnlib.batch_norm_forward(h, None, None, training=True, eps=0.0)[0],
    "WeightNorm": lambda h, W: h / np.linalg.norm(W, axis=1),
    "LayerNorm": lambda h, W: lnlib.layer_norm(h, eps=0.0),
    "RMSNorm": lambda h, W: lnlib.rms_norm(h, eps=0.0),
}
# Ba, Kiros and Hinton (2016), Table 1; the RMSNorm row from Zhang and Sennrich (2019).
# Columns: weight matrix re-scaling, weight matrix re-centering, weight vector re-scaling,
# dataset re-scaling, dataset re-centering, single training case re-scaling.
PAPER = {"BatchNorm": "YNYYYN", "WeightNorm": "YNYNNN", "LayerNorm": "YYNYNY", "RMSNorm": "YNNYNY"}


def _transforms(g, rho):
    v = g.standard_normal(8)

    def one_row(m, k):
        m = m.copy()
        m[k] *= rho
        return m

    return [
        lambda W, X: (rho * W, X),
        lambda W, X: (W + v, X),
        lambda W, X: (one_row(W, 1), X),
        lambda W, X: (W, rho * X),
        lambda W, X: (W, X + v),
        lambda W, X: (W, one_row(X, 3)),
    ]


@given(seeds, factors)
def test_invariance_table_of_ba_et_al(seed, rho):
    """Section 'The invariance table': every cell of the computed table is the paper's."""
    g = np.random.default_rng(seed)
    X, W = g.standard_normal((12, 8)), g.standard_normal((6, 8))
    for name, norm in NORMS.items():
        before = norm(X @ W.T, W)
        marks = ""
        for transform in _transforms(g, rho):
            W2, X2 = transform(W, X)
            change = maxdiff(norm(X2 @ W2.T, W2), before)
            assert change < 1e-9 or change > 1e-4, "a near miss: neither clearly Y nor N"
            marks += "Y" if change < 1e-9 else "N"
        assert marks == PAPER[name], name


# ------------------------------------------------------------- one vector: exact invariances


@given(seeds, st.floats(-1e3, 1e3), epsilons, st.floats(1e-3, 1e3))
def test_shift_invariance_holds_for_every_eps(seed, nu, eps, scale):
    """Proposition 'Invariances of one vector' (a): LN(x + nu 1) = LN(x) for every eps."""
    x = rows(seed, 4, 16, scale=scale)
    y = lnlib.layer_norm(x, eps=eps)
    # the only error is the rounding of x + nu (and of the computation), relative to the spread
    tol = 64 * np.finfo(float).eps * (np.abs(x).max() + abs(nu)) / np.sqrt(x.var(1).min() + eps)
    assert maxdiff(lnlib.layer_norm(x + nu, eps=eps), y) <= tol + 1e-13


@given(seeds, factors, epsilons)
def test_rescaling_replaces_eps_by_eps_over_rho_squared(seed, rho, eps):
    """(b): LN(rho x; eps) = LN(x; eps / rho^2); so LN(rho x) = LN(x) at eps = 0 for rho > 0."""
    x = rows(seed, 4, 16)
    np.testing.assert_allclose(
        lnlib.layer_norm(rho * x, eps=eps),
        lnlib.layer_norm(x, eps=eps / rho**2),
        rtol=1e-10,
        atol=1e-12,
    )
    if eps == 0.0:
        np.testing.assert_allclose(
            lnlib.layer_norm(rho * x, eps=0.0), lnlib.layer_norm(x, eps=0.0), rtol=1e-10, atol=1e-12
        )


@given(seeds, factors, st.sampled_from([1e-5, 1e-2, 1.0]), st.floats(1e-3, 10))
def test_rescaling_changes_the_output_by_the_predicted_amount_when_eps_is_positive(
    seed, rho, eps, scale
):
    """(b), the eps effect: the output is multiplied by sqrt((var + eps) / (var + eps / rho^2))."""
    x = rows(seed, 1, 16, scale=scale)[0]
    var = x.var()
    y = lnlib.layer_norm(x, eps=eps)
    change = maxdiff(lnlib.layer_norm(rho * x, eps=eps), y)
    predicted = np.abs(y).max() * abs(np.sqrt((var + eps) / (var + eps / rho**2)) - 1)
    assert change == pytest.approx(predicted, rel=1e-6, abs=1e-14)
    assume(predicted > 1e-9)
    assert change > 0


@given(seeds, st.floats(0.05, 20), epsilons)
def test_negative_scale_flips_the_sign(seed, rho, eps):
    """(c): LN(-rho x; eps rho^2) = -LN(x; eps), which differs from LN(x) unless LN(x) = 0."""
    x = rows(seed, 3, 16)
    y = lnlib.layer_norm(x, eps=eps)
    np.testing.assert_allclose(
        lnlib.layer_norm(-rho * x, eps=eps * rho**2), -y, rtol=1e-10, atol=1e-12
    )
    assert maxdiff(lnlib.layer_norm(-x, eps=eps), y) > 1.0


@given(seeds, st.integers(3, 64), st.floats(-0.9, 5), st.floats(-10, 10))
def test_a_shift_is_invisible_only_along_x_minus_its_mean_and_ones(seed, d, theta, nu):
    """(d): at eps = 0, LN(x + v) = LN(x) for v = theta (x - mu 1) + nu 1 (theta > -1); a
    random (non-constant) v changes the output: the source's "any vector b" is false."""
    g = np.random.default_rng(seed)
    x = g.standard_normal(d)
    y = lnlib.layer_norm(x, eps=0.0)
    v_invisible = theta * (x - x.mean()) + nu
    np.testing.assert_allclose(lnlib.layer_norm(x + v_invisible, eps=0.0), y, atol=1e-9)
    v = g.standard_normal(d)
    # the part of v outside span{1, x - mu} is what LN sees
    basis = np.linalg.qr(np.stack([np.ones(d), x - x.mean()], axis=1))[0]
    seen = v - basis @ (basis.T @ v)
    assume(np.linalg.norm(seen) > 0.1)
    assert maxdiff(lnlib.layer_norm(x + v, eps=0.0), y) > 1e-3


@given(seeds, st.integers(-3, 3), st.sampled_from([1e-6, 1e-4, 1e-2]))
def test_with_eps_the_scale_is_kept_in_the_length_of_xhat(seed, log_ratio, eps):
    """What LayerNorm forgets: with eps > 0, sigma^2 = eps |xhat|^2 / (D - |xhat|^2)
    (float64, variance within 1e-3..1e3 of eps), so a rescaled x has another output."""
    x = rows(seed, 1, 32)[0]
    x = (x - x.mean()) / x.std() * np.sqrt(eps * 10.0**log_ratio)  # variance eps * 10^k
    xhat = lnlib.layer_norm(x, eps=eps)
    sq = float(xhat @ xhat)
    assert eps * sq / (32 - sq) == pytest.approx(x.var(), rel=1e-6)
    assert maxdiff(lnlib.layer_norm(2 * x, eps=eps), xhat) > 1e-10


# ------------------------------------------------------------------------------ geometry


@given(seeds, epsilons, st.integers(-6, 3), st.integers(2, 40))
def test_outputs_lie_on_a_sphere_in_the_hyperplane(seed, eps, log_scale, d):
    """Geometry: sum 0 and |xhat|^2 = D var / (var + eps) <= D, for every eps."""
    x = rows(seed, 8, d, loc=3.0, scale=10.0**log_scale)
    var = x.var(axis=1)
    assume(np.all(var > 1e-10 * 9) or eps > 0)
    y = lnlib.layer_norm(x, eps=eps)
    np.testing.assert_allclose(y.sum(axis=1), 0, atol=1e-9 * d)
    sq = (y * y).sum(axis=1)
    np.testing.assert_allclose(sq, d * var / (var + eps), rtol=1e-7)
    assert np.all(sq <= d * (1 + 1e-12))


@given(seeds, st.integers(3, 16))
def test_after_layer_norm_every_key_wins_for_itself_and_the_ones_query_is_uniform(seed, d):
    """Brody et al.: on the sphere (eps = 0) the query q = k_i scores key i above every other
    key j by |k_i - k_j|^2 / 2 > 0, so every distinct key can win; and q = 1 gives every key
    the score 0, so attention is uniform."""
    keys = rows(seed, 50, d) * np.random.default_rng(seed + 1).lognormal(0, 1, (50, 1))
    k = lnlib.layer_norm(keys, eps=0.0)
    scores = k @ k.T  # (50, 50), row i: query k_i
    margin = np.diag(scores)[:, None] - scores
    dist2 = ((k[:, None, :] - k[None, :, :]) ** 2).sum(axis=2)
    np.testing.assert_allclose(margin, dist2 / 2, atol=1e-9 * d)
    np.testing.assert_allclose(k @ np.ones(d), 0, atol=1e-9)


# ------------------------------------------------------------------------------ Jacobian


def jacobian(x, eps):
    d = x.shape[-1]
    xs = np.broadcast_to(x, (d, d))
    _, mean, rstd = lnlib.layer_norm_forward(xs, eps=eps)
    return lnlib.layer_norm_backward(np.eye(d), xs, mean, rstd)[0]


@given(seeds, st.sampled_from([0.0, 1e-5, 1e-2]), st.integers(-4, 1), st.integers(3, 24))
def test_jacobian_spectrum_and_gain_cap(seed, eps, log_scale, d):
    """Proposition 'The spectrum of J': eigenvalues 0, eps r^3 and r (D - 2 times); the
    largest, r, is at most 1/sqrt(eps)."""
    x = rows(seed, 1, d, loc=1.0, scale=10.0**log_scale)[0]
    r = 1 / np.sqrt(x.var() + eps)
    ev = np.linalg.eigvalsh(jacobian(x, eps))
    want = np.sort(np.r_[0.0, eps * r**3, np.full(d - 2, r)])
    np.testing.assert_allclose(ev, want, rtol=1e-8, atol=1e-8 * r)
    if eps:
        assert ev.max() <= 1 / np.sqrt(eps) * (1 + 1e-12)


@given(seeds, st.integers(0, 12))
def test_not_lipschitz_without_eps(seed, k):
    """Without eps, |LN(x) - LN(-x)| / |2x| = sqrt(D) / |x - mu 1|: unbounded as x -> 0;
    with eps it is at most 1/sqrt(eps)."""
    x = rows(seed, 1, 16)[0]
    x = (x - x.mean()) / np.linalg.norm(x - x.mean()) * 10.0**-k  # |x| = 10^-k, mean 0
    ratio0 = np.linalg.norm(lnlib.layer_norm(x, eps=0.0) - lnlib.layer_norm(-x, eps=0.0))
    assert ratio0 / (2 * 10.0**-k) == pytest.approx(4.0 * 10.0**k, rel=1e-9)
    ratio = np.linalg.norm(lnlib.layer_norm(x, eps=1e-5) - lnlib.layer_norm(-x, eps=1e-5))
    assert ratio / (2 * 10.0**-k) <= 1 / np.sqrt(1e-5) * (1 + 1e-12)


# -------------------------------------------------------- the weights before a normalization


def weight_grad(W, x, dz, eps, norm):
    h = x @ W.T
    if norm == "layer":
        _, mean, rstd = lnlib.layer_norm_forward(h, eps=eps)
        dh = lnlib.layer_norm_backward(dz, h, mean, rstd)[0]
    else:
        _, rstd = lnlib.rms_norm_forward(h, eps=eps)
        dh = lnlib.rms_norm_backward(dz, h, rstd)[0]
    return dh.T @ x


@given(seeds, st.floats(0.05, 20), st.sampled_from(["layer", "rms"]))
def test_weight_gradient_is_orthogonal_to_the_weights_and_scales_as_one_over_rho(seed, rho, norm):
    """Proposition 'Scale-invariant weights': at eps = 0, <W, dL/dW> = 0 and
    dL/dW(rho W) = dL/dW(W) / rho, for LayerNorm and RMSNorm."""
    g = np.random.default_rng(seed)
    W, x, dz = g.standard_normal((6, 8)), g.standard_normal((20, 8)), g.standard_normal((20, 6))
    grad = weight_grad(W, x, dz, 0.0, norm)
    assert abs(np.sum(W * grad)) <= 1e-10 * np.linalg.norm(W) * np.linalg.norm(grad)
    np.testing.assert_allclose(
        weight_grad(rho * W, x, dz, 0.0, norm),
        grad / rho,
        rtol=1e-8,
        atol=1e-12 * np.abs(grad).max() / rho,
    )


@given(seeds, st.floats(1e-3, 10), st.floats(0, 0.1))
def test_one_step_changes_the_squared_norm_as_stated(seed, lr, wd):
    """|W - lr (g + wd W)|^2 = (1 - lr wd)^2 |W|^2 + lr^2 |g|^2 for a scale-invariant W."""
    g = np.random.default_rng(seed)
    W, x, dz = g.standard_normal((6, 8)), g.standard_normal((20, 8)), g.standard_normal((20, 6))
    grad = weight_grad(W, x, dz, 0.0, "layer")
    after = np.sum((W - lr * (grad + wd * W)) ** 2)
    want = (1 - lr * wd) ** 2 * np.sum(W**2) + lr**2 * np.sum(grad**2)
    assert after == pytest.approx(want, rel=1e-10)


# ------------------------------------------------------------------------- the batch


@given(
    seeds,
    st.sampled_from([np.float32, np.float64]),
    st.integers(1, 300),
    st.integers(1, 1100),
    st.data(),
)
def test_a_rows_result_is_bitwise_independent_of_its_batch(seed, dtype, n, d, data):
    """Section 'Independence from the batch': a row's LayerNorm forward and backward, and its
    RMSNorm, are bitwise the same alone and in any batch at any position."""
    g = np.random.default_rng(seed)
    x = (3 + g.standard_normal((n, d))).astype(dtype)
    dy = g.standard_normal((n, d)).astype(dtype)
    y, mean, rstd = lnlib.layer_norm_forward(x)
    dx = lnlib.layer_norm_backward(dy, x, mean, rstd)[0]
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    part = slice(start, stop)
    y2, mean2, rstd2 = lnlib.layer_norm_forward(x[part])
    np.testing.assert_array_equal(y2, y[part])
    np.testing.assert_array_equal(
        lnlib.layer_norm_backward(dy[part], x[part], mean2, rstd2)[0], dx[part]
    )
    np.testing.assert_array_equal(lnlib.rms_norm(x[part]), lnlib.rms_norm(x)[part])


def test_batch_norm_is_not_batch_independent():
    """The contrast: BatchNorm in training gives the same row another output in another batch."""
    x = rows(0, 64, 32)
    small = lnlib.batch_norm_forward(x[:4], None, None, training=True)[0][0]
    large = lnlib.batch_norm_forward(x, None, None, training=True)[0][0]
    assert maxdiff(small, large) > 0.1
