"""The compiled CPU kernel: built where a C compiler exists, and in agreement with the NumPy path."""

import shutil

import numpy as np
import pytest

import lnlib
from lnlib import _cpu_kernels


def test_kernel_is_built_where_a_compiler_exists():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the NumPy fast path is used")
    info = _cpu_kernels.info()
    assert info["kernel"], info["reason"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 768, 4099])
def test_kernel_and_numpy_paths_agree(rng, dtype, n):
    if not _cpu_kernels.info()["kernel"]:
        pytest.skip(_cpu_kernels.info()["reason"])
    x = (rng.standard_normal((50, n)) * 2 + 3).astype(dtype)
    w, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    fast = lnlib.layer_norm_forward(x, w, b)
    fast_b = lnlib.layer_norm_backward(dy, x, *fast[1:], w)
    fast_r = lnlib.rms_norm_forward(x, w)
    fast_rb = lnlib.rms_norm_backward(dy, x, fast_r[1], w)
    with _cpu_kernels.disabled():
        slow = lnlib.layer_norm_forward(x, w, b)
        slow_b = lnlib.layer_norm_backward(dy, x, *slow[1:], w)
        slow_r = lnlib.rms_norm_forward(x, w)
        slow_rb = lnlib.rms_norm_backward(dy, x, slow_r[1], w)
    for a, c in zip((*fast, *fast_b, *fast_r, *fast_rb), (*slow, *slow_b, *slow_r, *slow_rb)):
        assert a.dtype == c.dtype and a.shape == c.shape
        np.testing.assert_allclose(a, c, **{k: v * 50 for k, v in tol.items()})


def test_disabled_context_restores_the_kernel():
    before = _cpu_kernels.function("layer_norm_fwd", np.float32)
    with _cpu_kernels.disabled():
        assert _cpu_kernels.function("layer_norm_fwd", np.float32) is None
    assert _cpu_kernels.function("layer_norm_fwd", np.float32) is before
