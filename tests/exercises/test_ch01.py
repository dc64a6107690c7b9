"""The checkers of chapter 1 pass right answers and catch the usual wrong ones."""

import numpy as np

from lnlib.exercises import ch01


def batch_normalize(x, eps=1e-5):
    mean = x.mean(axis=0)
    var = ((x - mean) ** 2).mean(axis=0)
    return ((x - mean) / np.sqrt(var + eps)).astype(x.dtype)


def pair_output(a, b, eps=1e-5):
    d = (a - b) / 2
    return d / np.sqrt(d * d + eps)


def running_update(running_mean, running_var, x, momentum=0.1):
    n = x.shape[0]
    return (
        (1 - momentum) * running_mean + momentum * x.mean(axis=0),
        (1 - momentum) * running_var + momentum * x.var(axis=0) * n / (n - 1),
    )


def fold(W, b, running_mean, running_var, gamma, beta, eps=1e-5):
    s = gamma / np.sqrt(running_var + eps)
    return W * s[:, None], (b - running_mean) * s + beta


def masked_step_stats(a, lengths):
    mask = (np.arange(a.shape[1])[None, :] < lengths[:, None])[..., None]  # (N, T, 1)
    count = mask.sum(axis=0)  # (T, 1)
    x = np.where(mask, a, 0.0)
    mean = x.sum(axis=0) / count
    var = (np.where(mask, a - mean, 0.0) ** 2).sum(axis=0) / count
    return mean, var


def test_right_answers_pass(capsys):
    assert ch01.check_batch_normalize(batch_normalize)
    assert ch01.check_pair_output(pair_output)
    assert ch01.check_running_update(running_update)
    assert ch01.check_fold_eval_batch_norm(fold)
    assert ch01.check_masked_step_stats(masked_step_stats)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and all(line.startswith("PASS ") for line in out)


def test_statistics_over_the_wrong_axis_fail():
    def per_row(x, eps=1e-5):
        return batch_normalize(x.T, eps).T

    result = ch01.check_batch_normalize(per_row)
    assert not result and len(result.failures) == 7


def test_one_pass_variance_fails_in_float64_too():
    def one_pass(x, eps=1e-5):
        mean = x.mean(axis=0)
        var = (x * x).mean(axis=0) - mean**2
        with np.errstate(invalid="ignore"):
            return ((x - mean) / np.sqrt(var + eps)).astype(x.dtype)

    result = ch01.check_batch_normalize(one_pass)
    assert [f.index for f in result.failures] == [7]
    assert "1e8" in result.failures[0].description

    def one_pass_running(running_mean, running_var, x, momentum=0.1):
        n = x.shape[0]
        mean = x.mean(axis=0)
        var = ((x * x).mean(axis=0) - mean**2) * n / (n - 1)
        return (
            (1 - momentum) * running_mean + momentum * mean,
            (1 - momentum) * running_var + momentum * var,
        )

    result = ch01.check_running_update(one_pass_running)
    assert [f.index for f in result.failures] == [6]
    assert "output[1]" in result.failures[0].reason


def test_sequential_sums_pass_the_large_mean_cases():
    # The float64 cases with mean 1e8 reject the one-pass formula, not a correct two-pass
    # answer whose sums are taken in another order than NumPy's.
    def sequential_mean(x):
        total = np.zeros(x.shape[1:])
        for row in x:
            total = total + row
        return total / x.shape[0]

    def batch_normalize_seq(x, eps=1e-5):
        mean = sequential_mean(x)
        return ((x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=0) + eps)).astype(x.dtype)

    def running_update_seq(running_mean, running_var, x, momentum=0.1):
        mean = sequential_mean(x)
        var = ((x - mean) ** 2).sum(axis=0) / (x.shape[0] - 1)
        return (
            (1 - momentum) * running_mean + momentum * mean,
            (1 - momentum) * running_var + momentum * var,
        )

    assert ch01.check_batch_normalize(batch_normalize_seq)
    assert ch01.check_running_update(running_update_seq)


def test_sign_without_eps_passes_only_for_rows_far_apart():
    result = ch01.check_pair_output(lambda a, b, eps=1e-5: np.sign(a - b))
    assert [f.index for f in result.failures] == [1, 3, 4, 5]


def test_biased_running_variance_fails():
    def biased(running_mean, running_var, x, momentum=0.1):
        return (
            (1 - momentum) * running_mean + momentum * x.mean(axis=0),
            (1 - momentum) * running_var + momentum * x.var(axis=0),
        )

    result = ch01.check_running_update(biased)
    assert [f.index for f in result.failures] == [1, 2, 4, 5, 6]
    assert "output[1]" in result.failures[0].reason


def test_in_place_update_is_caught():
    def in_place(running_mean, running_var, x, momentum=0.1):
        new_mean, new_var = running_update(running_mean, running_var, x, momentum)
        running_mean[...] = new_mean
        running_var[...] = new_var
        return running_mean, running_var

    result = ch01.check_running_update(in_place)
    assert not result and "in place" in result.failures[0].reason


def test_fold_without_eps_fails_on_tiny_variance():
    result = ch01.check_fold_eval_batch_norm(
        lambda W, b, m, v, g, be, eps=1e-5: fold(W, b, m, v, g, be, eps=0.0)
    )
    assert [f.index for f in result.failures] == [1, 2, 3, 4, 5]
    assert "tiny" in result.failures[3].description


def test_mask_multiplication_fails_on_nan_padding():
    # The chapter's solution warns: multiplying by the mask lets NaN padding in (0 * nan is NaN).
    def multiplied(a, lengths):
        mask = (np.arange(a.shape[1])[None, :] < lengths[:, None])[..., None]  # (N, T, 1)
        count = mask.sum(axis=0)
        mean = (a * mask).sum(axis=0) / count
        return mean, (((a - mean) * mask) ** 2).sum(axis=0) / count

    result = ch01.check_masked_step_stats(multiplied)
    assert [f.index for f in result.failures] == [4]
    assert "non-finite" in result.failures[0].reason


def test_unmasked_statistics_fail():
    def unmasked(a, lengths):
        return a.mean(axis=0), a.var(axis=0)

    result = ch01.check_masked_step_stats(unmasked)
    assert [f.index for f in result.failures] == [2, 3, 4, 6]


def test_checkers_are_deterministic(capsys):
    ch01.check_pair_output(lambda a, b, eps=1e-5: np.sign(a - b))
    first = capsys.readouterr().out
    ch01.check_pair_output(lambda a, b, eps=1e-5: np.sign(a - b))
    assert capsys.readouterr().out == first
