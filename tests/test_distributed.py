"""Sharded LayerNorm across gloo processes equals the single-process LayerNorm."""

import multiprocessing
import time

import numpy as np
import pytest
from distributed_harness import problem, run_mismatched, run_sharded

from lnlib import reference
from lnlib.distributed import merge_moments, partial_moments, shard_bounds

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


# ---- merge_moments in NumPy -----------------------------------------------------------


@pytest.mark.parametrize("splits", [[10], [5, 5], [1, 9], [3, 3, 2, 2], [1, 1, 1, 7]])
def test_merge_moments_matches_two_pass(splits):
    rng = np.random.default_rng(1)
    x = rng.normal(1000.0, 1.0, size=(6, sum(splits)))  # (6, D): large mean, small spread
    pieces = np.split(x, np.cumsum(splits)[:-1], axis=1)
    moments = [partial_moments(p) for p in pieces]
    n, mean, m2 = merge_moments(*zip(*moments))
    assert n == x.shape[1]
    np.testing.assert_allclose(mean, x.mean(axis=1), rtol=1e-15, atol=0)
    var = ((x - x.mean(axis=1, keepdims=True)) ** 2).mean(axis=1)
    np.testing.assert_allclose(m2 / n, var, rtol=1e-12)


def test_merge_moments_float32_large_mean_is_accurate():
    rng = np.random.default_rng(2)
    x = (1000.0 + rng.normal(size=(4, 4096))).astype(np.float32)  # (4, 4096)
    pieces = np.array_split(x, 8, axis=1)
    n, mean, m2 = merge_moments(*zip(*[partial_moments(p) for p in pieces]))
    exact = x.astype(np.float64).var(axis=1)
    np.testing.assert_allclose(m2 / n, exact, rtol=1e-4)


def test_merge_moments_bad_input():
    with pytest.raises(ValueError, match="counts"):
        merge_moments([], [], [])
    with pytest.raises(ValueError, match="means, m2s"):
        merge_moments([1, 2], [np.zeros(3)], [np.zeros(3)])
    with pytest.raises(ValueError, match="counts"):
        merge_moments([0, 2], [np.zeros(3)] * 2, [np.zeros(3)] * 2)


def test_shard_bounds_cover_the_row():
    for D, P in [(10, 4), (8, 2), (7, 3), (3, 3)]:
        bounds = [shard_bounds(D, P, r) for r in range(P)]
        assert bounds[0][0] == 0 and bounds[-1][1] == D
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        widths = [b - a for a, b in bounds]
        assert widths == [len(s) for s in np.array_split(np.arange(D), P)]


# ---- real processes on gloo -----------------------------------------------------------


@pytest.mark.parametrize("world_size, D", [(2, 12), (4, 10)])
def test_sharded_equals_single_process(world_size, D, tmp_path):
    N, seed = 7, world_size
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    results = run_sharded(world_size, N, D, seed, tmp_path, timeout_s=60.0)
    elapsed = time.monotonic() - start
    assert set(multiprocessing.active_children()) <= before, "a worker outlived the test"
    assert elapsed < 60.0

    x, weight, bias, dy = problem(N, D, seed)
    y, mean, rstd = reference.layer_norm_forward(x, weight, bias, eps=1e-5)
    dx, dweight, dbias = reference.layer_norm_backward(dy, x, mean, rstd, weight)

    got = {
        k: np.concatenate([r[k] for r in results], axis=-1) for k in ("y", "dx", "dweight", "dbias")
    }
    np.testing.assert_allclose(got["y"], y, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["dx"], dx, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["dweight"], dweight, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["dbias"], dbias, rtol=0, atol=1e-12)
    for r in results:
        # Every rank merged the same numbers in the same order: identical bits.
        np.testing.assert_array_equal(r["mean"], results[0]["mean"])
        np.testing.assert_array_equal(r["rstd"], results[0]["rstd"])
    for r in results:
        # The autograd wrapper runs the same functions: identical bits.
        for k in ("y", "dx", "dweight", "dbias"):
            np.testing.assert_array_equal(r[f"{k}_autograd"], r[k])
    np.testing.assert_allclose(results[0]["mean"], mean, rtol=1e-14)
    np.testing.assert_allclose(results[0]["rstd"], rstd, rtol=1e-12)


def test_mismatched_ranks_raise_clear_errors_on_every_rank(tmp_path):
    """Issue 8: different row counts or dtypes aborted one rank (SIGABRT in gloo) and gave
    another wrong statistics; now every rank raises a ValueError naming the mismatch (also
    when only one rank has a bad shape, which left the others waiting)."""
    results = run_mismatched(2, tmp_path, timeout_s=60.0)
    assert len(results) == 2
    for errors in results:
        for call in ("forward", "backward"):
            assert "different numbers of rows (rank 0: 4, rank 1: 5)" in errors[f"rows-{call}"]
            assert "different dtypes (rank 0: float64, rank 1: float32)" in errors[f"dtype-{call}"]
            assert (
                "2-D (N, D_k) tensor; dimensions (rank 0: 2, rank 1: 1)" in errors[f"ndim-{call}"]
            )
