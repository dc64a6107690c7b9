"""The introduction's checker passes a right answer and catches the usual mistakes."""

import numpy as np

from lnlib.exercises import intro


def right(x, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=-1, keepdims=True) + eps)


def test_right_answer_passes():
    assert intro.check_standardize(right)


def test_naive_variance_fails_on_float32_with_large_mean():
    def naive(x, eps=1e-5):
        mean = x.mean(axis=-1, keepdims=True)
        var = (x * x).mean(axis=-1, keepdims=True) - mean * mean
        return (x - mean) / np.sqrt(var + eps)

    result = intro.check_standardize(naive)
    assert [f.index for f in result.failures] == [7, 8]


def test_naive_variance_in_float64_fails_on_the_float64_case():
    # E[x^2] - E[x]^2 computed in float64 and cast back survives float32 inputs with mean
    # 1000 (relative error about 1e-10); the float64 case with mean 1e8 catches it.
    def naive64(x, eps=1e-5):
        z = x.astype(np.float64)
        mean = z.mean(axis=-1, keepdims=True)
        var = (z * z).mean(axis=-1, keepdims=True) - mean**2
        return ((z - mean) / np.sqrt(var + eps)).astype(x.dtype)

    result = intro.check_standardize(naive64)
    assert [f.index for f in result.failures] == [8]
    assert "cancels" in result.failures[0].description


def test_unbiased_variance_and_eps_outside_fail():
    assert not intro.check_standardize(
        lambda x, eps=1e-5: (
            (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, ddof=1, keepdims=True) + eps)
        )
    )
    outside = intro.check_standardize(
        lambda x, eps=1e-5: (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + eps)
    )
    assert not outside


def test_in_place_centring_is_caught():
    def in_place(x, eps=1e-5):
        x -= x.mean(axis=-1, keepdims=True)  # changes the caller's array
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)

    result = intro.check_standardize(in_place)
    assert len(result.failures) == 8
    assert all("modified its input in place" in f.reason for f in result.failures)


def test_float64_upcast_fails_on_dtype():
    result = intro.check_standardize(lambda x, eps=1e-5: right(x.astype(np.float64), eps))
    assert "dtype float64, expected float32" in result.failures[0].reason
