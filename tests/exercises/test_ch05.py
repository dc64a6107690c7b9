"""The Chapter 5 checkers pass correct solutions and catch typical mistakes."""

import numpy as np

from lnlib.exercises import ch05


def merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    delta = mean_b - mean_a
    return n, mean_a + delta * n_b / n, m2_a + m2_b + delta**2 * n_a * n_b / n


def merge_forgets_cross_term(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    return n, (n_a * mean_a + n_b * mean_b) / n, m2_a + m2_b


def welford(x):
    mean = np.zeros(x.shape[:-1])
    m2 = np.zeros(x.shape[:-1])
    for k in range(x.shape[-1]):
        delta = x[..., k] - mean
        mean = mean + delta / (k + 1)
        m2 = m2 + delta * (x[..., k] - mean)
    return mean, m2 / x.shape[-1]


def one_pass_naive(x):
    mean = x.mean(axis=-1)
    return mean, (x * x).mean(axis=-1) - mean**2


def backward_from_output(dy, y, rstd, weight, bias):
    xhat = (y - bias) / weight
    g = dy * weight
    c1 = g.mean(axis=-1, keepdims=True)
    c2 = (g * xhat).mean(axis=-1, keepdims=True)
    return rstd[:, None] * (g - c1 - xhat * c2)


def backward_ignores_bias(dy, y, rstd, weight, bias):
    return backward_from_output(dy, y, rstd, weight, np.zeros_like(bias))


def min_time(M, H, itemsize, bandwidth_GBps, backward=False):
    return (5 if backward else 2) * M * H * itemsize / (bandwidth_GBps * 1e9)


def sharded_rms_rstd(shards, eps):
    sumsq = sum((s * s).sum(axis=-1) for s in shards)
    count = sum(s.shape[-1] for s in shards)
    return 1 / np.sqrt(sumsq / count + eps)


def sharded_rms_mean_of_means(shards, eps):
    ms = np.mean([(s * s).mean(axis=-1) for s in shards], axis=0)
    return 1 / np.sqrt(ms + eps)


def lane_sum(x, lanes=16):
    n = x.shape[-1]
    full = n // lanes * lanes
    acc = np.zeros(x.shape[:-1] + (lanes,), x.dtype)
    for i in range(0, full, lanes):
        acc += x[..., i : i + lanes]
    tail = np.zeros(x.shape[:-1], x.dtype)
    for i in range(full, n):
        tail += x[..., i]
    w = lanes // 2
    while w:
        acc[..., :w] += acc[..., w : 2 * w]
        w //= 2
    return acc[..., 0] + tail


def lane_sum_lanes_added_in_order(x, lanes=16):
    n = x.shape[-1]
    full = n // lanes * lanes
    acc = np.zeros(x.shape[:-1] + (lanes,), x.dtype)
    for i in range(0, full, lanes):
        acc += x[..., i : i + lanes]
    total = np.zeros(x.shape[:-1], x.dtype)
    for k in range(lanes):
        total += acc[..., k]
    for i in range(full, n):
        total += x[..., i]
    return total


def test_correct_solutions_pass(capsys):
    assert ch05.check_merge(merge)
    assert ch05.check_welford(welford)
    assert ch05.check_backward_from_output(backward_from_output)
    assert ch05.check_min_time(min_time)
    assert ch05.check_sharded_rms_rstd(sharded_rms_rstd)
    assert ch05.check_lane_sum(lane_sum)
    assert capsys.readouterr().out.count("PASS") == 6


def test_mistakes_are_caught(capsys):
    assert not ch05.check_merge(merge_forgets_cross_term)
    assert not ch05.check_welford(one_pass_naive)
    assert not ch05.check_backward_from_output(backward_ignores_bias)
    assert not ch05.check_min_time(lambda M, H, i, b, backward=False: 2 * M * H * i / b)
    assert not ch05.check_sharded_rms_rstd(sharded_rms_mean_of_means)
    assert not ch05.check_lane_sum(lambda x, lanes=16: x.sum(axis=-1))
    assert not ch05.check_lane_sum(lane_sum_lanes_added_in_order)

    def in_float64(x, lanes=16):
        return lane_sum(x.astype(np.float64)).astype(x.dtype)

    assert not ch05.check_lane_sum(in_float64)
    out = capsys.readouterr().out
    assert out.count("FAIL") == 8
    assert "a mean of 1e8" in out
