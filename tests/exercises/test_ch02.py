"""The chapter 2 checkers pass right answers and catch the usual mistakes, precisely."""

import numpy as np
import pytest

from lnlib.exercises import ch02


def forward(x, weight, bias, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def jacobian(x, eps=1e-5):
    d = x.shape[-1]
    rstd = 1 / np.sqrt(x.var() + eps)
    xhat = (x - x.mean()) * rstd
    return rstd / d * (d * np.eye(d) - np.ones((d, d)) - np.outer(xhat, xhat))


def affine_grads(dy, x, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    xhat = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    rows = tuple(range(x.ndim - 1))
    return (dy * xhat).sum(axis=rows), dy.sum(axis=rows)


def backward(dy, x, weight, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = dy * weight
    return rstd * (
        g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True)
    )


@pytest.mark.parametrize(
    "checker, fn",
    [
        (ch02.check_forward, forward),
        (ch02.check_jacobian, jacobian),
        (ch02.check_dgamma, affine_grads),
        (ch02.check_backward, backward),
    ],
)
def test_right_answers_pass(checker, fn, capsys):
    result = checker(fn)
    assert result.passed, result.message
    assert capsys.readouterr().out.startswith("PASS ")


@pytest.mark.filterwarnings("ignore:Degrees of freedom:RuntimeWarning")
def test_unbiased_variance_fails_on_the_worked_example():
    def unbiased(x, weight, bias, eps=1e-5):
        mean = x.mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(x.var(axis=-1, ddof=1, keepdims=True) + eps) * weight + bias

    with np.errstate(divide="ignore", invalid="ignore"):  # D = 1 divides by D - 1 = 0
        result = ch02.check_forward(unbiased)
    assert not result.passed
    assert result.failures[0].index == 1
    assert "worked example" in result.failures[0].description


def test_eps_outside_the_square_root_fails_only_where_eps_matters():
    def eps_outside(x, weight, bias, eps=1e-5):
        mean = x.mean(axis=-1, keepdims=True)
        return (x - mean) / (x.std(axis=-1, keepdims=True) + eps) * weight + bias

    result = ch02.check_forward(eps_outside)
    assert not result.passed
    assert any("eps = 0.5" in f.description for f in result.failures)


def test_one_pass_variance_fails_on_the_very_large_mean():
    def one_pass(x, weight, bias, eps=1e-5):
        mean = x.mean(axis=-1, keepdims=True)
        var = (x * x).mean(axis=-1, keepdims=True) - mean**2
        return (x - mean) / np.sqrt(var + eps) * weight + bias

    result = ch02.check_forward(one_pass)
    assert [f.description for f in result.failures] == [
        "a very large mean: 1e6 + N(0, 1), where mean(x*x) - mean(x)**2 cancels"
    ]


def test_normalizing_the_wrong_axis_fails():
    def wrong_axis(x, weight, bias, eps=1e-5):
        mean = x.mean(axis=0, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=0, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * weight + bias

    assert not ch02.check_forward(wrong_axis).passed


def test_dgamma_that_sums_only_the_first_axis_fails_on_three_dimensions():
    def first_axis_only(dy, x, eps=1e-5):
        xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
        return (dy * xhat).sum(axis=0), dy.sum(axis=0)

    result = ch02.check_dgamma(first_axis_only)
    assert [f.description for f in result.failures] == [
        "three dimensions (2, 3, 4): sum over both leading axes"
    ]
    assert "shape" in result.failures[0].reason


def test_backward_without_the_variance_term_fails():
    def no_variance_term(dy, x, weight, eps=1e-5):
        rstd = 1 / np.sqrt(x.var(axis=-1, keepdims=True) + eps)
        g = dy * weight
        return rstd * (g - g.mean(axis=-1, keepdims=True))

    result = ch02.check_backward(no_variance_term)
    assert not result.passed
    # dy constant along the row and D = 1 give zero either way; the others must fail
    assert len(result.failures) >= 4


def test_jacobian_transposed_is_still_right_but_a_wrong_sign_is_not():
    assert ch02.check_jacobian(lambda x, eps=1e-5: jacobian(x, eps).T).passed
    assert not ch02.check_jacobian(lambda x, eps=1e-5: -jacobian(x, eps)).passed


def test_naive_failure_accepts_a_large_mean():
    row = np.array([10000.0, 10001.0], dtype=np.float32)
    assert ch02.check_naive_failure(row).passed


def test_naive_failure_needs_a_rounded_step_not_small_squares():
    # Chapter 2, exercise 2.5: for [a, a + 1] in float32 nothing rounds up to a = 2047 (the
    # mean's square a^2 + a + 1/4 needs quarters, kept below 2**22), so [2000, 2001] is exact;
    # [2500, 2501] fails although its squares and their sum are integers below 2**24.
    exact = np.array([2000.0, 2001.0], dtype=np.float32)
    assert ch02.one_pass_variance(exact) == 0.25
    assert not ch02.check_naive_failure(exact).passed
    rounded = np.array([2500.0, 2501.0], dtype=np.float32)
    assert 2500**2 + 2501**2 < 2**24
    assert ch02.one_pass_variance(rounded) != 0.25
    assert ch02.check_naive_failure(rounded).passed


@pytest.mark.parametrize(
    "row, words",
    [
        (None, "expected a NumPy array"),
        (np.array([1e4, 1e4 + 1]), "dtype float64"),
        (np.array([1.0, 2.0, 3.0], dtype=np.float32), "must be off by at least"),
        (np.full(4, 7.0, dtype=np.float32), "constant"),
        (np.array([1e20, 2e20], dtype=np.float32), "overflow"),
        # finite squares whose sum overflows: mu/sigma = 27, no cancellation to speak of
        (np.array([1.3e19, 1.3e19, 1.2e19], dtype=np.float32), "not cancellation"),
        (np.array([[1e4, 1e4 + 1]], dtype=np.float32), "1-d row"),
        (np.array([1.0, np.nan], dtype=np.float32), "NaN"),
    ],
)
def test_naive_failure_explains_what_is_wrong(row, words, capsys):
    result = ch02.check_naive_failure(row)
    assert not result.passed
    assert words in result.message
    assert capsys.readouterr().out.startswith("FAIL naive variance failure: ")


def test_the_two_variance_formulas_on_the_worked_example():
    x = ch02.WORKED_EXAMPLE
    np.testing.assert_allclose(ch02.two_pass_variance(x), [5.25, 6.6875, 8.1875], rtol=1e-15)
    np.testing.assert_allclose(ch02.one_pass_variance(x), [5.25, 6.6875, 8.1875], rtol=1e-12)
    row = np.array([10000.5, 10001.5, 10002.5, 10003.5], dtype=np.float32)
    assert ch02.one_pass_variance(row) == 0.0 and ch02.two_pass_variance(row) == 1.25
