"""Shared fixtures and helpers for the lnlib tests."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "lnlib",
    deadline=None,
    max_examples=60,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "lnlib"))

#: Tolerances against a float64 result, relative to the scale of the compared values.
TOL = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 4e-3}


def _skip_without_kernel():
    import lnlib

    kernel = lnlib.show_config(file=False)["implementations"]["kernel"]
    if not kernel["available"]:
        pytest.skip(f"compiled kernel not available: {kernel['reason']}")


@pytest.fixture(params=["kernel", "numpy"])
def cpu_path(request):
    """Run a test once with the compiled CPU kernel and once with the NumPy fast path.

    Both take float16, float32 and float64 input (the kernel computes float16 rows with its
    float32 code, on the rows converted to float32).
    """
    import lnlib

    if request.param == "kernel":
        _skip_without_kernel()
        yield "kernel"
    else:
        with lnlib.use_implementation("numpy"):
            yield "numpy"


@pytest.fixture(params=["kernel", "numpy", "reference"])
def any_path(request):
    """Every call of the test under one CPU implementation, forced: the compiled kernel, the
    NumPy path, the reference."""
    import lnlib

    if request.param == "kernel":
        _skip_without_kernel()
    with lnlib.use_implementation(request.param):
        yield request.param


def run_json(code, *, python=sys.executable, env=None, cwd=None, timeout=300):
    """Run the Python source ``code`` in a fresh process; return the JSON of its last line.

    Fails the test, with the end of its stderr, when the process exits with an error.
    """
    done = subprocess.run(
        [str(python), "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"the process failed ({done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout.splitlines()[-1])


def _cupy_with_gpu():
    """``(cupy, "")`` where CuPy and a CUDA GPU are present, else ``(None, reason)``."""
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    try:
        if cupy.cuda.is_available():
            return cupy, ""
        return None, "CuPy finds no CUDA GPU"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install means no GPU here
        return None, f"CUDA is not usable ({exc})"


def skip_or_fail(reason):
    """Skip the test with ``reason`` (no GPU here); under ``LNLIB_REQUIRE_GPU=1`` (``make
    gpu-check`` sets it) fail instead, so that a GPU machine cannot pass a GPU test unrun."""
    if os.environ.get("LNLIB_REQUIRE_GPU") == "1":
        pytest.fail(f"LNLIB_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module of a test: NumPy always, CuPy where a CUDA GPU is present.

    A missing GPU skips the CuPy run, with the reason; with ``LNLIB_REQUIRE_GPU=1`` it fails
    instead, so a run on a GPU machine cannot pass without running on the GPU. Inside a
    module that also uses ``cpu_path``, the CuPy run selects as "auto" (the CPU paths do not
    apply to CuPy arrays).
    """
    if request.param == "numpy":
        yield np
        return
    cupy, reason = _cupy_with_gpu()
    if cupy is None:
        skip_or_fail(reason)
    import lnlib

    if "cpu_path" in request.fixturenames:
        request.getfixturevalue("cpu_path")  # entered first, so that "auto" below wins
    with lnlib.use_implementation("auto"):
        yield cupy


def on(xp, *arrays):
    """The arrays (NumPy or None) moved to the array module ``xp``."""
    out = tuple(None if a is None else xp.asarray(a) for a in arrays)
    return out if len(out) != 1 else out[0]


def host(a):
    """An array of NumPy or CuPy (or None) as a NumPy array."""
    return None if a is None else (a.get() if hasattr(a, "get") else np.asarray(a))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def assert_close(got, want, dtype, scale=None, factor=1.0):
    """Assert ``got`` equals ``want`` to the precision of ``dtype``, relative to ``scale``.

    ``scale`` defaults to the largest magnitude of ``want`` (at least 1), so errors are judged
    against the size of the values being compared, the way float rounding behaves.
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    if scale is None:
        scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
    tol = TOL[np.dtype(dtype).type] * factor * scale
    err = float(np.max(np.abs(got - want), initial=0.0))
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g} ({np.dtype(dtype).name})"


def peak_bytes(fn, *args, **kwargs):
    """Peak bytes allocated while ``fn(*args, **kwargs)`` runs, results included (NumPy
    reports its array allocations to tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn(*args, **kwargs)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del result
    return peak


def torch_tensor(a, requires_grad=False):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a).copy())
    return t.requires_grad_(requires_grad)
