"""The chapter 4 checkers pass right answers and catch the usual mistakes."""

import math

import numpy as np
import pytest

from lnlib.exercises import ch04


def rms_norm(x, weight, eps=1e-6):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


def rms_norm_backward(dy, x, weight, eps=1e-6):
    rstd = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat, g = x * rstd, dy * weight
    return rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))


def partial_rms_norm(x, p, eps=1e-8):
    k = max(1, math.ceil(p * x.shape[-1]))
    return x / np.sqrt((x[..., :k] ** 2).mean(axis=-1, keepdims=True) + eps)


def scale_norm(x, g, eps=1e-5):
    return g * x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def group_norm(x, num_groups, weight, bias, eps=1e-5):
    n, c = x.shape[:2]
    xg = x.reshape(n, num_groups, -1)
    xhat = (xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + eps)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return xhat.reshape(x.shape) * weight.reshape(shape) + bias.reshape(shape)


def dyt_backward(dy, x, alpha, weight):
    t = np.tanh(alpha * x)
    g = dy * weight
    rows = tuple(range(x.ndim - 1))
    return (
        g * alpha * (1 - t * t),
        np.sum(g * x * (1 - t * t)),
        (dy * t).sum(axis=rows),
        dy.sum(axis=rows),
    )


@pytest.mark.parametrize(
    "checker, fn",
    [
        (ch04.check_rms_norm, rms_norm),
        (ch04.check_rms_norm_backward, rms_norm_backward),
        (ch04.check_partial_rms_norm, partial_rms_norm),
        (ch04.check_scale_norm, scale_norm),
        (ch04.check_group_norm, group_norm),
        (ch04.check_dynamic_tanh_backward, dyt_backward),
    ],
)
def test_right_answers_pass(checker, fn, capsys):
    result = checker(fn)
    assert result.passed, result.message
    assert capsys.readouterr().out.startswith("PASS ")


def test_rms_norm_that_centres_fails_only_where_the_mean_matters():
    def centred(x, weight, eps=1e-6):
        xc = x - x.mean(axis=-1, keepdims=True)
        return rms_norm(xc, weight, eps)

    result = ch04.check_rms_norm(centred)
    assert not result.passed
    failing = [f.description for f in result.failures]
    assert "a zero-mean row" not in failing and any("mean 100" in d for d in failing)


def test_rms_backward_without_the_projection_fails():
    def no_projection(dy, x, weight, eps=1e-6):
        return dy * weight / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)

    result = ch04.check_rms_norm_backward(no_projection)
    assert not result.passed and len(result.failures) >= 3


def test_partial_rms_with_floor_instead_of_ceil_fails_on_d10():
    def floor(x, p, eps=1e-8):
        k = max(1, int(p * x.shape[-1]))
        return x / np.sqrt((x[..., :k] ** 2).mean(axis=-1, keepdims=True) + eps)

    result = ch04.check_partial_rms_norm(floor)
    assert [f.description for f in result.failures] == [
        "p = 0.25 on D = 10: ceil(2.5) = 3 features",
        "p = 0.2 on D = 16: ceil(3.2) = 4 features (rounding gives 3)",
    ]


def test_partial_rms_with_round_half_up_fails_on_p02():
    def half_up(x, p, eps=1e-8):
        k = max(1, int(p * x.shape[-1] + 0.5))
        return x / np.sqrt((x[..., :k] ** 2).mean(axis=-1, keepdims=True) + eps)

    result = ch04.check_partial_rms_norm(half_up)
    assert [f.index for f in result.failures] == [7]


def test_scale_norm_with_eps_added_fails_on_the_short_row():
    def eps_added(x, g, eps=1e-5):
        return g * x / (np.linalg.norm(x, axis=-1, keepdims=True) + eps)

    result = ch04.check_scale_norm(eps_added)
    assert any("shorter than eps" in f.description for f in result.failures)


def test_group_norm_with_groups_taken_across_the_wrong_axis_fails():
    def wrong_groups(x, num_groups, weight, bias, eps=1e-5):
        n, c = x.shape[:2]
        xg = np.moveaxis(x, 1, -1).reshape(n, -1, num_groups)  # interleaved channels
        xhat = (xg - xg.mean(1, keepdims=True)) / np.sqrt(xg.var(1, keepdims=True) + eps)
        xhat = np.moveaxis(xhat.reshape(np.moveaxis(x, 1, -1).shape), -1, 1)
        shape = (1, c) + (1,) * (x.ndim - 2)
        return xhat * weight.reshape(shape) + bias.reshape(shape)

    assert not ch04.check_group_norm(wrong_groups).passed


def test_group_norm_with_batch_statistics_fails():
    def batch_stats(x, num_groups, weight, bias, eps=1e-5):
        axes = (0,) + tuple(range(2, x.ndim))  # BatchNorm's axes, not GroupNorm's
        xhat = (x - x.mean(axes, keepdims=True)) / np.sqrt(x.var(axes, keepdims=True) + eps)
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        return xhat * weight.reshape(shape) + bias.reshape(shape)

    assert not ch04.check_group_norm(batch_stats).passed


def test_group_norm_with_the_one_pass_variance_fails_only_on_the_large_mean():
    def one_pass(x, num_groups, weight, bias, eps=1e-5):
        n, c = x.shape[:2]
        xg = x.reshape(n, num_groups, -1)
        mean = xg.mean(-1, keepdims=True)
        var = (xg * xg).mean(-1, keepdims=True) - mean * mean  # chapter 2 forbids this
        xhat = ((xg - mean) / np.sqrt(var + eps)).reshape(x.shape)
        shape = (1, c) + (1,) * (x.ndim - 2)
        return xhat * weight.reshape(shape) + bias.reshape(shape)

    result = ch04.check_group_norm(one_pass)
    assert [f.index for f in result.failures] == [8]


def test_dyt_backward_without_the_sum_over_rows_fails():
    def per_row(dy, x, alpha, weight):
        dx, dalpha, _, _ = dyt_backward(dy, x, alpha, weight)
        return dx, dalpha, dy * np.tanh(alpha * x), dy

    result = ch04.check_dynamic_tanh_backward(per_row)
    assert not result.passed and "shape" in result.failures[0].reason


def test_dyt_backward_forgetting_alpha_in_dx_fails():
    def no_alpha(dy, x, alpha, weight):
        dx, *rest = dyt_backward(dy, x, alpha, weight)
        return (dx / alpha, *rest)

    assert not ch04.check_dynamic_tanh_backward(no_alpha).passed


def test_the_stub_fails_without_raising(capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError("your code here")

    result = ch04.check_group_norm(stub)
    assert not result.passed and "NotImplementedError" in result.message
