"""The Chapter 5 checkers pass correct solutions and catch typical mistakes."""

import numpy as np
import pytest

import lnlib
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


def sharded_rms_gathers_rows(shards, eps):
    x = np.concatenate(shards, axis=-1)  # the right number, but every rank needs whole rows
    return 1 / np.sqrt((x * x).mean(axis=-1) + eps)


def lane_sum(x, lanes=16):
    n = x.shape[-1]
    acc = np.zeros(x.shape[:-1] + (lanes,), x.dtype)
    for i in range(0, n, lanes):
        group = x[..., i : i + lanes]
        acc[..., : group.shape[-1]] += group
    acc = acc.astype(np.float64)
    w = lanes // 2
    while w:
        acc[..., :w] += acc[..., w : 2 * w]
        w //= 2
    return acc[..., 0]


def lane_sum_old_exercise(x, lanes=16):
    """The exercise's first version: a separate tail, every operation in the dtype of x."""
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
    acc = np.zeros(x.shape[:-1] + (lanes,), x.dtype)
    for i in range(0, x.shape[-1], lanes):
        group = x[..., i : i + lanes]
        acc[..., : group.shape[-1]] += group
    total = np.zeros(x.shape[:-1])
    for k in range(lanes):
        total += acc[..., k]
    return total


def lane_sum_lanes_in_dtype(x, lanes=16):
    """Right lanes, but the pairwise combination in the dtype of x."""
    acc = np.zeros(x.shape[:-1] + (lanes,), x.dtype)
    for i in range(0, x.shape[-1], lanes):
        group = x[..., i : i + lanes]
        acc[..., : group.shape[-1]] += group
    w = lanes // 2
    while w:
        acc[..., :w] += acc[..., w : 2 * w]
        w //= 2
    return acc[..., 0].astype(np.float64)


_SHIM = """
#include "norms.c"
double lane_block_sum_f32(const float *x, ptrdiff_t n)
{
    double s[2];
    row_sum_f32(x, x, n, s);
    return s[0];
}
double lane_block_sum_f64(const double *x, ptrdiff_t n)
{
    double s[2];
    row_sum_f64(x, x, n, s);
    return s[0];
}
"""


@pytest.fixture(scope="module")
def kernel_block_sum(tmp_path_factory):
    """The kernel's own row sum (static in norms.c), built once into a small library."""
    import importlib.util
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    import cffi

    kernel_dir = Path(ch05.__file__).resolve().parents[1] / "_cpu"
    spec = importlib.util.spec_from_file_location("lnlib_cpu_build", kernel_dir / "build.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        pytest.skip(f"no C compiler ({cc}) to build the kernel's row sum")
    tmp_path = tmp_path_factory.mktemp("lane_shim")
    src, lib = tmp_path / "lane_shim.c", tmp_path / "lane_shim.so"
    src.write_text(_SHIM)
    cmd = [cc, *builder.FLAGS, "-DNORMS_NO_CLONES", "-shared", "-fPIC", f"-I{kernel_dir}"]
    subprocess.run([*cmd, "-o", str(lib), str(src), "-lm"], check=True)
    ffi = cffi.FFI()
    ffi.cdef(
        "double lane_block_sum_f32(const float *x, ptrdiff_t n);"
        "double lane_block_sum_f64(const double *x, ptrdiff_t n);"
    )
    so = ffi.dlopen(str(lib))

    def sums(x):
        ctype, f = ("float", so.lane_block_sum_f32)
        if x.dtype == np.float64:
            ctype, f = ("double", so.lane_block_sum_f64)
        return np.array([f(ffi.from_buffer(ctype + "[]", row), row.size) for row in x])

    return sums


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lane_sum_is_the_kernels_block_sum(kernel_block_sum, dtype):
    """The exercise's order is the kernel's, bit for bit, on rows of 1 to 256 values (one
    block), and the exercise's first version (separate tail, lanes added in the dtype of x)
    is not."""
    kernel_sum = kernel_block_sum
    rng = np.random.default_rng(0)
    old_differs = rows = 0
    for n in range(1, 257):
        x = (1000 + rng.normal(size=(16, n))).astype(dtype)
        expected = kernel_sum(x)
        np.testing.assert_array_equal(ch05._ref_lane_sum(x), expected, err_msg=f"n = {n}")
        np.testing.assert_array_equal(lane_sum(x), expected, err_msg=f"n = {n}")
        old_differs += int(np.sum(lane_sum_old_exercise(x) != expected))
        rows += x.shape[0]
    assert old_differs > rows // 10


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
    gathered = ch05.check_sharded_rms_rstd(sharded_rms_gathers_rows)
    assert [f.index for f in gathered.failures] == [6]
    assert "np.concatenate gathers whole rows" in gathered.failures[0].reason
    assert not ch05.check_lane_sum(lambda x, lanes=16: x.sum(axis=-1))
    assert not ch05.check_lane_sum(lane_sum_lanes_added_in_order)
    assert not ch05.check_lane_sum(lane_sum_old_exercise)
    assert not ch05.check_lane_sum(lane_sum_lanes_in_dtype)

    def in_float64(x, lanes=16):
        return lane_sum(x.astype(np.float64))

    assert not ch05.check_lane_sum(in_float64)
    out = capsys.readouterr().out
    assert out.count("FAIL") == 11
    assert "a mean of 1e8" in out


# ------------------------------------------------------------- the fused residual add


def add_layer_norm(x, residual, weight, bias, eps, residual_dtype):
    h_dtype = residual.dtype if residual_dtype is None else np.dtype(residual_dtype)
    wide = np.result_type(x.dtype, residual.dtype, h_dtype)
    h = (residual.astype(wide) + x.astype(wide)).astype(h_dtype)
    return lnlib.layer_norm(h, weight, bias, eps=eps).astype(x.dtype), h


def add_layer_norm_rounds_twice(x, residual, weight, bias, eps, residual_dtype):
    # rounds x and residual to the stream's dtype before the add: two roundings, not one
    h_dtype = residual.dtype if residual_dtype is None else np.dtype(residual_dtype)
    h = residual.astype(h_dtype) + x.astype(h_dtype)
    return lnlib.layer_norm(h, weight, bias, eps=eps).astype(x.dtype), h


def add_layer_norm_normalizes_x(x, residual, weight, bias, eps, residual_dtype):
    y, h = add_layer_norm(x, residual, weight, bias, eps, residual_dtype)
    return lnlib.layer_norm(x.astype(h.dtype), weight, bias, eps=eps).astype(x.dtype), h


def add_layer_norm_h_in_x_dtype(x, residual, weight, bias, eps, residual_dtype):
    # rounds the stream to the dtype of x, then widens it again: loses float32's bits
    h_dtype = residual.dtype if residual_dtype is None else np.dtype(residual_dtype)
    h = (residual + x).astype(x.dtype).astype(h_dtype)
    return lnlib.layer_norm(h, weight, bias, eps=eps).astype(x.dtype), h


def add_layer_norm_two_pass_stats_of_unrounded(x, residual, weight, bias, eps, residual_dtype):
    # the statistics of the sum in float64, not of h as stored
    h_dtype = residual.dtype if residual_dtype is None else np.dtype(residual_dtype)
    s = residual.astype(np.float64) + x.astype(np.float64)
    y = lnlib.layer_norm(
        s,
        None if weight is None else weight.astype(np.float64),
        None if bias is None else bias.astype(np.float64),
        eps=eps,
    )
    return y.astype(x.dtype), s.astype(h_dtype)


def add_backward(dy, dh, h, mean, rstd, weight):
    dx = lnlib.layer_norm_backward(dy, h, mean, rstd, weight)[0]
    return dx if dh is None else dh + dx


def add_backward_forgets_dh(dy, dh, h, mean, rstd, weight):
    return lnlib.layer_norm_backward(dy, h, mean, rstd, weight)[0]


def add_backward_dh_only(dy, dh, h, mean, rstd, weight):
    return np.zeros_like(h) if dh is None else dh.copy()


def fused_bytes(B, D, x_itemsize, h_itemsize, fused, backward=False):
    n = B * D
    fwd = n * (2 * x_itemsize + (2 if fused else 3) * h_itemsize)
    bwd = n * (x_itemsize + (3 if fused else 5) * h_itemsize)
    return fwd + bwd if backward else fwd


def fused_bytes_all_in_x_dtype(B, D, x_itemsize, h_itemsize, fused, backward=False):
    return fused_bytes(B, D, x_itemsize, x_itemsize, fused, backward)


def fused_bytes_backward_unchanged(B, D, x_itemsize, h_itemsize, fused, backward=False):
    # counts the fused forward's saving but forgets that the backward's add is fused too
    n = B * D
    fwd = n * (2 * x_itemsize + (2 if fused else 3) * h_itemsize)
    return fwd + n * (x_itemsize + 5 * h_itemsize) if backward else fwd


def test_fused_add_solutions_pass(capsys):
    assert ch05.check_add_layer_norm(add_layer_norm)
    assert ch05.check_add_backward(add_backward)
    assert ch05.check_fused_bytes(fused_bytes)
    assert capsys.readouterr().out.count("PASS") == 3


def test_fused_add_mistakes_are_caught(capsys):
    assert not ch05.check_add_layer_norm(add_layer_norm_normalizes_x)
    assert not ch05.check_add_layer_norm(add_layer_norm_h_in_x_dtype)
    assert not ch05.check_add_layer_norm(add_layer_norm_two_pass_stats_of_unrounded)
    assert not ch05.check_add_layer_norm(add_layer_norm_rounds_twice)
    assert not ch05.check_add_backward(add_backward_forgets_dh)
    assert not ch05.check_add_backward(add_backward_dh_only)
    assert not ch05.check_fused_bytes(fused_bytes_all_in_x_dtype)
    assert not ch05.check_fused_bytes(fused_bytes_backward_unchanged)
    out = capsys.readouterr().out
    assert out.count("FAIL") == 8
    assert "residual float32" in out


def test_fused_add_checker_agrees_with_the_library_when_present():
    if not hasattr(lnlib, "add_layer_norm"):
        pytest.skip("lnlib.add_layer_norm is not in this tree yet (issue 24)")

    def via_library(x, residual, weight, bias, eps, residual_dtype):
        return lnlib.add_layer_norm(
            x, residual, weight, bias, eps=eps, residual_dtype=residual_dtype
        )

    def backward_via_library(dy, dh, h, mean, rstd, weight):
        return lnlib.add_layer_norm_backward(dy, dh, h, mean, rstd, weight)[0]

    assert ch05.check_add_layer_norm(via_library)
    assert ch05.check_add_backward(backward_via_library)
