"""The finite-difference checker must accept right gradients and reject wrong ones."""

import numpy as np
import pytest

import lnlib


def test_numerical_grad_of_a_known_function(rng):
    x = rng.standard_normal((3, 4))
    dy = rng.standard_normal((3, 4))
    np.testing.assert_allclose(lnlib.numerical_grad(np.sin, x, dy), dy * np.cos(x), atol=1e-8)


def test_check_grad_rejects_a_wrong_gradient(rng):
    x = rng.standard_normal(5)
    dy = np.ones(5)
    assert lnlib.check_grad(np.square, x, dy, 2 * x) < 1e-7
    wrong = 2 * x
    wrong[3] += 1e-3
    with pytest.raises(AssertionError, match=r"differ at index \(3,\)"):
        lnlib.check_grad(np.square, x, dy, wrong)
    with pytest.raises(AssertionError, match="shape"):
        lnlib.check_grad(np.square, x, dy, np.zeros(4))


def test_numerical_grad_leaves_its_input_alone(rng):
    x = rng.standard_normal(4)
    before = x.copy()
    lnlib.numerical_grad(np.exp, x, np.ones(4))
    np.testing.assert_array_equal(x, before)
    with pytest.raises(ValueError, match="h must be > 0"):
        lnlib.numerical_grad(np.exp, x, np.ones(4), h=0)
