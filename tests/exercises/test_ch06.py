"""The checkers of chapter 6 pass right answers and catch the usual wrong ones."""

import numpy as np

import lnlib
from lnlib.exercises import ch06


def _ln(x, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


def residual_block(x, f, placement, eps=1e-5):
    if placement == "post":
        return _ln(x + f(x), eps)
    if placement == "pre":
        return x + f(_ln(x, eps))
    if placement == "peri":
        return x + _ln(f(_ln(x, eps)), eps)
    raise ValueError(f"unknown placement {placement!r}")


def scaling_exponent(depths, grad_norms):
    lx, ly = np.log(depths), np.log(grad_norms)
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())


def _silu(c):
    return c / (1 + np.exp(-c))


def adaln_zero_block(x, c, f, weight, bias, eps=1e-6):
    shift, scale, gate = np.split(_silu(c) @ weight + bias, 3, axis=-1)
    return x + gate * f(_ln(x, eps) * (1 + scale) + shift)


def td_targets(rewards, q_next, dones, gamma):
    return rewards + gamma * (1 - dones) * q_next.max(axis=1)


def outlier_features(x, factor=6.0):
    rms = np.sqrt((x.astype(np.float64) ** 2).mean(axis=0))
    return np.nonzero(rms > factor * np.median(rms))[0].astype(np.int64)


def fold_norm_gain(weight, W):
    return W * weight[:, None]


def test_right_answers_pass(capsys):
    assert ch06.check_residual_block(residual_block)
    assert ch06.check_scaling_exponent(scaling_exponent)
    assert ch06.check_adaln_zero_block(adaln_zero_block)
    assert ch06.check_td_targets(td_targets)
    assert ch06.check_outlier_features(outlier_features)
    assert ch06.check_fold_norm_gain(fold_norm_gain)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 6 and all(line.startswith("PASS ") for line in out)


def test_lnlib_answers_pass():
    def with_lnlib(x, f, placement, eps=1e-5):
        if placement == "peri":
            return x + lnlib.layer_norm(f(lnlib.layer_norm(x, eps=eps)), eps=eps)
        return residual_block(x, f, placement, eps)

    assert ch06.check_residual_block(with_lnlib)


def test_swapped_placements_fail():
    def swapped(x, f, placement, eps=1e-5):
        other = {"post": "pre", "pre": "post", "peri": "peri"}.get(placement, placement)
        return residual_block(x, f, other, eps)

    result = ch06.check_residual_block(swapped)
    assert [f.index for f in result.failures] == [1, 2, 4, 5, 6, 7]


def test_eps_ignored_in_post_and_pre_fails():
    def default_eps(x, f, placement, eps=1e-5):
        return residual_block(x, f, placement, eps if placement == "peri" else 1e-5)

    result = ch06.check_residual_block(default_eps)
    assert [f.index for f in result.failures] == [6, 7]


def test_missing_error_for_unknown_placement_is_caught():
    def lenient(x, f, placement, eps=1e-5):
        return residual_block(x, f, placement if placement in ch06.PLACEMENTS else "pre", eps)

    result = ch06.check_residual_block(lenient)
    assert [f.index for f in result.failures] == [9]
    assert "raise ValueError" in result.failures[0].reason


def test_end_point_slope_fails_on_noisy_data():
    def end_points(depths, grad_norms):
        d, g = np.asarray(depths, float), np.asarray(grad_norms, float)
        return float(np.log(g[-1] / g[0]) / np.log(d[-1] / d[0]))

    result = ch06.check_scaling_exponent(end_points)
    assert [f.index for f in result.failures] == [3, 5]


def test_gate_left_out_fails_and_zero_init_is_identity():
    def no_gate(x, c, f, weight, bias, eps=1e-6):
        shift, scale, _ = np.split(_silu(c) @ weight + bias, 3, axis=-1)
        return x + f(_ln(x, eps) * (1 + scale) + shift)

    result = ch06.check_adaln_zero_block(no_gate)
    assert result.failures and result.failures[0].index == 1
    assert "identity" in ch06.check_adaln_zero_block.__doc__


def test_bootstrapping_through_terminal_states_fails():
    result = ch06.check_td_targets(lambda r, q, d, gamma: r + gamma * q.max(axis=1))
    assert [f.index for f in result.failures] == [2]


def test_standard_deviation_instead_of_rms_misses_the_shifted_feature():
    def by_std(x, factor=6.0):
        s = x.astype(np.float64).std(axis=0)
        return np.nonzero(s > factor * np.median(s))[0].astype(np.int64)

    result = ch06.check_outlier_features(by_std)
    assert [f.index for f in result.failures] == [4, 8]


def test_mean_threshold_mean_abs_and_max_abs_fail():
    # The median is the point: one group of large features lifts the mean of the RMS values.
    def mean_threshold(x, factor=6.0):
        rms = np.sqrt((x.astype(np.float64) ** 2).mean(axis=0))
        return np.nonzero(rms > factor * rms.mean())[0].astype(np.int64)

    def by_mean_abs(x, factor=6.0):
        a = np.abs(x.astype(np.float64)).mean(axis=0)
        return np.nonzero(a > factor * np.median(a))[0].astype(np.int64)

    def by_max_abs(x, factor=6.0):
        a = np.abs(x.astype(np.float64)).max(axis=0)
        return np.nonzero(a > factor * np.median(a))[0].astype(np.int64)

    for wrong in (mean_threshold, by_mean_abs, by_max_abs):
        assert not ch06.check_outlier_features(wrong), wrong.__name__
    assert 7 in [f.index for f in ch06.check_outlier_features(mean_threshold).failures]
    assert 8 in [f.index for f in ch06.check_outlier_features(by_mean_abs).failures]
    assert 8 in [f.index for f in ch06.check_outlier_features(by_max_abs).failures]


def test_columns_scaled_instead_of_rows_fail():
    result = ch06.check_fold_norm_gain(lambda weight, W: W * weight[None, : W.shape[1]])
    assert not result
    assert 2 not in [f.index for f in result.failures]  # a gain of ones hides the mistake


def test_in_place_fold_is_caught():
    def in_place(weight, W):
        W *= weight[:, None]
        return W

    result = ch06.check_fold_norm_gain(in_place)
    assert not result and "in place" in result.failures[0].reason


def test_checkers_are_deterministic(capsys):
    ch06.check_td_targets(lambda r, q, d, gamma: r + gamma * q.max(axis=1))
    first = capsys.readouterr().out
    ch06.check_td_targets(lambda r, q, d, gamma: r + gamma * q.max(axis=1))
    assert capsys.readouterr().out == first
