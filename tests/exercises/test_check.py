"""The exercise checker must pass right answers and catch, precisely, wrong ones."""

import numpy as np
import pytest

from lnlib.exercises import Case, CheckResult, check


def ref_standardize(x, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


def ref_stats(x):
    return x.mean(axis=-1), x.var(axis=-1)


@pytest.fixture
def cases():
    rng = np.random.default_rng(0)
    return [
        Case("a random batch", (rng.normal(size=(4, 8)),)),
        Case("a constant row", (np.full((1, 5), 3.0),)),
        Case("float32 with a large mean", (1000 + rng.normal(size=(2, 16)).astype(np.float32),)),
        Case("keyword eps", (rng.normal(size=(3, 4)),), {"eps": 0.5}),
    ]


def test_right_answer_passes(cases, capsys):
    result = check(ref_standardize, ref_standardize, cases, name="standardize")
    assert isinstance(result, CheckResult)
    assert result and result.passed and result.failures == []
    assert result.n_cases == 4
    assert capsys.readouterr().out.strip() == "PASS standardize: all 4 cases pass."


def test_an_equivalent_answer_passes(cases):
    def mine(x, eps=1e-5):
        centred = x - x.mean(axis=-1, keepdims=True)
        return centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + eps)

    assert check(mine, ref_standardize, cases, rtol=1e-4, atol=1e-5, verbose=False)


def test_wrong_values_are_caught_with_index_and_values(cases, capsys):
    def forgot_eps(x, eps=1e-5):
        return (x - x.mean(axis=-1, keepdims=True)) / (x.std(axis=-1, keepdims=True) + 1.0)

    result = check(forgot_eps, ref_standardize, cases, name="standardize")
    assert not result
    assert [f.index for f in result.failures] == [1, 3, 4]
    out = capsys.readouterr().out
    assert out.startswith("FAIL standardize: 3 of 4 cases fail. First, case 1 (a random batch)")
    assert "at index (0, 0)" in out and "expected" in out and "got" in out
    assert "max abs error" in out
    assert out.count("\n") == 1  # one line


def test_expected_and_got_values_are_the_real_ones():
    x = np.array([[1.0, 2.0, 3.0]])
    result = check(
        lambda x: x * 2 + np.array([0, 0, 1.0]),
        lambda x: x * 2,
        [Case("three numbers", (x,))],
        verbose=False,
    )
    reason = result.failures[0].reason
    assert "1 of 3 entries" in reason
    assert "at index (0, 2): expected 6, got 7" in reason


def test_wrong_shape_and_dtype_are_caught(cases):
    wrong_shape = check(
        lambda x, eps=1e-5: ref_standardize(x, eps).ravel(), ref_standardize, cases, verbose=False
    )
    assert len(wrong_shape.failures) == 4
    assert "has shape (32,), expected (4, 8)" in wrong_shape.failures[0].reason

    wrong_dtype = check(
        lambda x, eps=1e-5: ref_standardize(x.astype(np.float64), eps),
        ref_standardize,
        cases,
        verbose=False,
    )
    assert [f.index for f in wrong_dtype.failures] == [3]
    assert "dtype float64, expected float32" in wrong_dtype.failures[0].reason
    assert check(
        lambda x, eps=1e-5: ref_standardize(x.astype(np.float64), eps),
        ref_standardize,
        cases,
        check_dtype=False,
        rtol=1e-3,
        atol=1e-4,
        verbose=False,
    )


def test_tuple_outputs_are_compared_item_by_item():
    x = np.arange(12.0).reshape(3, 4)
    cases = [Case("a ramp", (x,))]
    assert check(ref_stats, ref_stats, cases, verbose=False)

    swapped = check(lambda x: ref_stats(x)[::-1], ref_stats, cases, verbose=False)
    assert "the output[0]" in swapped.failures[0].reason

    one_item = check(lambda x: x.mean(axis=-1), ref_stats, cases, verbose=False)
    assert "expected a tuple of length 2" in one_item.failures[0].reason

    unbiased = check(lambda x: (x.mean(-1), x.var(-1, ddof=1)), ref_stats, cases, verbose=False)
    assert "the output[1]" in unbiased.failures[0].reason


def test_dict_outputs_and_missing_keys():
    ref = lambda x: {"mean": x.mean(), "var": x.var()}  # noqa: E731
    cases = [Case("a vector", (np.arange(4.0),))]
    assert check(ref, ref, cases, verbose=False)
    result = check(lambda x: {"mean": x.mean()}, ref, cases, verbose=False)
    assert "has keys ['mean'], expected ['mean', 'var']" in result.failures[0].reason


def test_exceptions_of_the_readers_function_are_reported_not_raised(cases):
    def broken(x, eps=1e-5):
        raise ZeroDivisionError("oops")

    result = check(broken, ref_standardize, cases, verbose=False)
    assert len(result.failures) == 4
    assert result.failures[0].reason == "raised ZeroDivisionError: oops"


def test_missing_return_is_reported(cases):
    def no_return(x, eps=1e-5):
        ref_standardize(x, eps)

    result = check(no_return, ref_standardize, cases, verbose=False)
    assert "the output is None, expected an array of shape (4, 8)" in result.failures[0].reason


def test_in_place_modification_is_caught(cases):
    def in_place(x, eps=1e-5):
        x -= x.mean(axis=-1, keepdims=True)
        x /= np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps)
        return x

    result = check(in_place, ref_standardize, cases, verbose=False)
    # The constant row of threes is changed in place too (to zeros).
    assert len(result.failures) == 4
    assert "modified its input in place: argument 1 changed" in result.failures[0].reason


def test_the_reference_sees_pristine_inputs(cases):
    # A reader's function that changes its input must not change what the reference
    # computes: the reference runs on its own copy.
    x = np.ones((2, 3))
    check(lambda x: x.__imul__(5), lambda x: x * 1, [Case("ones", (x,))], verbose=False)
    assert np.array_equal(x, np.ones((2, 3)))


def test_nan_positions_must_match():
    x = np.array([[1.0, np.nan], [1.0, 2.0]])
    ref = lambda x: x * 2  # noqa: E731
    cases = [Case("a row with NaN", (x,))]
    assert check(ref, ref, cases, verbose=False)
    result = check(lambda x: np.nan_to_num(x * 2), ref, cases, verbose=False)
    assert "non-finite values differ" in result.failures[0].reason


def test_expected_exceptions():
    def strict(x):
        if x.dtype.kind != "f":
            raise TypeError("x must be floating")
        return x

    cases = [Case("an integer array must be refused", (np.arange(3),), raises=TypeError)]
    assert check(strict, strict, cases, verbose=False)
    lax = check(lambda x: x, strict, cases, verbose=False)
    assert "expected it to raise TypeError" in lax.failures[0].reason
    wrong = check(lambda x: 1 / 0, strict, cases, verbose=False)
    assert "raised ZeroDivisionError" in wrong.failures[0].reason


def test_per_case_tolerance_and_scalars():
    cases = [Case("loose", (1.0,), atol=0.2), Case("tight", (1.0,))]
    result = check(lambda x: x + 0.1, lambda x: x, cases, rtol=0, atol=1e-9, verbose=False)
    assert [f.index for f in result.failures] == [2]
    assert "expected 1, got 1.1" in result.failures[0].reason


def test_torch_outputs_are_accepted():
    torch = pytest.importorskip("torch")
    x = np.linspace(-1, 1, 6).reshape(2, 3)
    ok = check(lambda x: torch.from_numpy(x) * 2, lambda x: x * 2, [Case("t", (x,))], verbose=False)
    assert ok


def test_a_torch_dtype_numpy_cannot_hold_is_a_failing_case_not_an_error():
    torch = pytest.importorskip("torch")
    x = np.linspace(-1, 1, 6).reshape(2, 3).astype(np.float32)
    result = check(
        lambda x: torch.from_numpy(x).to(torch.bfloat16),
        lambda x: x,
        [Case("bf16", (x,))],
        verbose=False,
    )
    assert not result
    reason = result.failures[0].reason
    assert "torch array of shape (2, 3) and dtype torch.bfloat16" in reason, reason
    assert "dtype float32" in reason, reason


def test_no_cases_is_an_error():
    with pytest.raises(ValueError):
        check(lambda x: x, lambda x: x, [])
