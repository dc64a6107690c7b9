"""LayerNorm: against PyTorch, the reference, finite differences, and the numerical guarantees."""

import numpy as np
import pytest
import torch.nn.functional as F
from conftest import assert_close, host, on, torch_tensor

import lnlib
from lnlib import reference

# Every test here runs with the compiled CPU kernel and with the NumPy fast path.
pytestmark = pytest.mark.usefixtures("cpu_path")

SHAPES = [
    ((7, 16), 1),
    ((3, 5, 8), 1),
    ((4, 6, 5), 2),
    ((2, 3, 4, 5), 3),
    ((9,), 1),
    ((2, 3, 1), 1),
]
DTYPES = [np.float64, np.float32, np.float16]


def _data(rng, shape, k, dtype, affine=True):
    norm = shape[len(shape) - k :]
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(norm)).astype(dtype) if affine else None
    b = rng.standard_normal(norm).astype(dtype) if affine else None
    dy = rng.standard_normal(shape).astype(dtype)
    return x, w, b, dy


def _torch_layer_norm(x, w, b, dy, k, eps):
    """PyTorch forward and backward; float16 is run in torch's float16 too."""
    tx = torch_tensor(x, True)
    tw = torch_tensor(w, True) if w is not None else None
    tb = torch_tensor(b, True) if b is not None else None
    ty = F.layer_norm(tx, x.shape[x.ndim - k :], tw, tb, eps)
    ty.backward(torch_tensor(dy))
    grads = [t.grad.numpy() if t is not None else None for t in (tx, tw, tb)]
    return ty.detach().numpy(), grads


@pytest.mark.parametrize("shape,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch(rng, xp, shape, k, dtype, affine):
    x, w, b, dy = _data(rng, shape, k, dtype, affine)
    y, mean, rstd = lnlib.layer_norm_forward(*on(xp, x, w, b), eps=1e-5, normalized_ndim=k)
    dx, dw, db = lnlib.layer_norm_backward(*on(xp, dy, x), mean, rstd, on(xp, w))
    y, mean, rstd, dx, dw, db = map(host, (y, mean, rstd, dx, dw, db))
    ty, (tdx, tdw, tdb) = _torch_layer_norm(x, w, b, dy, k, 1e-5)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    assert mean.shape == rstd.shape == shape[: len(shape) - k]
    assert mean.dtype == (np.float64 if dtype == np.float64 else np.float32)
    factor = 2.0 if dtype == np.float16 else 1.0  # torch's own float16 output is rounded too
    assert_close(y, ty, dtype, factor=factor)
    assert_close(dx, tdx, dtype, factor=factor * 4)
    if affine:
        n_rows = int(np.prod(shape[: len(shape) - k]))
        assert dw.dtype == w.dtype
        assert_close(dw, tdw, dtype, factor=factor * n_rows)
        assert_close(db, tdb, dtype, factor=factor * n_rows)


@pytest.mark.parametrize("shape,k", SHAPES)
def test_float64_matches_torch_to_1e_10(rng, shape, k):
    x, w, b, dy = _data(rng, shape, k, np.float64)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b, normalized_ndim=k)
    ty, tgrads = _torch_layer_norm(x, w, b, dy, k, 1e-5)
    np.testing.assert_allclose(y, ty, rtol=1e-10, atol=1e-10)
    for got, want in zip(lnlib.layer_norm_backward(dy, x, mean, rstd, w), tgrads):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(rng, xp, shape, k, dtype):
    x, w, b, dy = _data(rng, shape, k, dtype)
    fast = lnlib.layer_norm_forward(*on(xp, x, w, b), normalized_ndim=k)
    ref = reference.layer_norm_forward(x, w, b, normalized_ndim=k)
    for got, want in zip(fast, ref):
        assert isinstance(got, xp.ndarray)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(host(got), want, dtype)
    fast = lnlib.layer_norm_backward(*on(xp, dy, x, *ref[1:], w))
    refb = reference.layer_norm_backward(dy, x, *ref[1:], w)
    for got, want in zip(fast, refb):
        assert got.dtype == want.dtype
        assert_close(host(got), want, dtype, factor=x.size)


@pytest.mark.parametrize("shape,k", [((3, 6), 1), ((2, 3, 4), 2), ((2, 2, 2, 3), 3)])
def test_finite_differences(rng, xp, shape, k):
    x, w, b, dy = _data(rng, shape, k, np.float64)
    y, mean, rstd = lnlib.layer_norm_forward(*on(xp, x, w, b), normalized_ndim=k)
    dx, dw, db = map(host, lnlib.layer_norm_backward(*on(xp, dy, x), mean, rstd, on(xp, w)))

    def f(x, w, b):
        return host(lnlib.layer_norm(*on(xp, x, w, b), normalized_ndim=k))

    lnlib.check_grad(lambda v: f(v, w, b), x, dy, dx)
    lnlib.check_grad(lambda v: f(x, v, b), w, dy, dw, name="dweight")
    lnlib.check_grad(lambda v: f(x, w, v), b, dy, db, name="dbias")


def test_gradients_without_affine_are_those_of_unit_weight_zero_bias(rng):
    x, w, b, dy = _data(rng, (5, 7), 1, np.float64)
    ones, zeros = np.ones(7), np.zeros(7)
    y, mean, rstd = lnlib.layer_norm_forward(x)
    dx, dw, db = lnlib.layer_norm_backward(dy, x, mean, rstd)
    lnlib.check_grad(lambda v: lnlib.layer_norm(x, v, zeros), ones, dy, dw)
    lnlib.check_grad(lambda v: lnlib.layer_norm(x, ones, v), zeros, dy, db)


def test_seed_worked_example():
    """The seed tutorial's example: three 4-vectors, eps 1e-5, gamma 1.5, beta 0.5.

    The seed states variances 8.3125 and 3.6875 for x2 and x3; the correct ones are 6.6875 and
    8.1875. Its normalized values and outputs are right (to its 4 decimals).
    """
    x = np.array([[3.0, 5.0, 2.0, 8.0], [1.0, 3.0, 5.0, 8.0], [3.0, 2.0, 7.0, 9.0]])
    y, mean, rstd = lnlib.layer_norm_forward(x, np.full(4, 1.5), np.full(4, 0.5), eps=1e-5)
    var = 1 / rstd**2 - 1e-5
    np.testing.assert_allclose(mean, [4.5, 4.25, 5.25], rtol=0, atol=1e-15)
    np.testing.assert_allclose(var, [5.25, 6.6875, 8.1875], rtol=1e-12)
    assert not np.isclose(var[1], 8.3125) and not np.isclose(var[2], 3.6875)
    xhat = lnlib.layer_norm(x, eps=1e-5)
    seed_xhat = [
        [-0.6547, 0.2182, -1.0911, 1.5275],
        [-1.2568, -0.4834, 0.2900, 1.4501],
        [-0.7863, -1.1358, 0.6116, 1.3106],
    ]
    seed_y = [
        [-0.4820, 0.8273, -1.1366, 2.7913],
        [-1.3851, -0.2250, 0.9350, 2.6751],
        [-0.6795, -1.2037, 1.4174, 2.4658],
    ]
    np.testing.assert_allclose(xhat, seed_xhat, atol=1e-4)
    np.testing.assert_allclose(y, seed_y, atol=1.5e-4)


def test_large_mean_small_spread_float32(rng):
    """1000 + N(0, 1) in float32: two-pass statistics keep the accuracy the input allows."""
    x = (1000 + rng.standard_normal((64, 4096))).astype(np.float32)
    y, mean, rstd = lnlib.layer_norm_forward(x)
    want, wmean, wrstd = reference.layer_norm_forward(x.astype(np.float64))
    # The float32 input is exact. The corrected two-pass mean is the true mean rounded to
    # float32, so xhat can be off by about half the float32 spacing at 1000 (plus the rounding
    # of y itself), and no more; one-pass E[x^2]-E[x]^2 is off by far more.
    half_spacing = float(np.spacing(np.float32(1000))) / 2
    assert np.max(np.abs(y - want)) < 1.5 * half_spacing
    np.testing.assert_allclose(rstd, wrstd, rtol=1e-4)
    onepass_var = (x * x).mean(axis=1) - x.mean(axis=1) ** 2
    assert np.max(np.abs(onepass_var * wrstd**2 - 1)) > 1e-2  # the failure the two-pass avoids


def test_float16_values_in_the_hundreds_do_not_overflow(rng):
    x = (300 + 80 * rng.standard_normal((16, 512))).astype(np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(x.max()) * np.float16(x.max()))  # squares overflow in float16
    w = np.full(512, 2.0, np.float16)
    y, mean, rstd = lnlib.layer_norm_forward(x, w)
    dx, dw, db = lnlib.layer_norm_backward(x, x, mean, rstd, w)
    for a in (y, mean, rstd, dx, dw, db):
        assert np.all(np.isfinite(a))
    want = reference.layer_norm_forward(x.astype(np.float64), w.astype(np.float64))[0]
    assert_close(y, want, np.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_row_gives_bias_with_finite_gradients(rng, dtype):
    x = rng.standard_normal((4, 32)).astype(dtype)
    x[2] = 7.25
    w = rng.standard_normal(32).astype(dtype)
    b = rng.standard_normal(32).astype(dtype)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b)
    np.testing.assert_array_equal(y[2], b)
    grads = lnlib.layer_norm_backward(rng.standard_normal(x.shape).astype(dtype), x, mean, rstd, w)
    for g in grads:
        assert np.all(np.isfinite(g))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_value_stays_in_its_row(rng, bad):
    x = rng.standard_normal((300, 257)).astype(np.float32)  # big enough to use several threads
    clean = lnlib.layer_norm_forward(x)
    x_bad = x.copy()
    x_bad[123, 45] = bad
    y, mean, rstd = lnlib.layer_norm_forward(x_bad)
    assert not np.all(np.isfinite(y[123]))
    others = np.arange(300) != 123
    for got, want in zip((y, mean, rstd), clean):
        np.testing.assert_array_equal(got[others], want[others])
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx = lnlib.layer_norm_backward(dy, x_bad, mean, rstd)[0]
    np.testing.assert_array_equal(
        dx[others], lnlib.layer_norm_backward(dy, x, *clean[1:])[0][others]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_are_not_modified(rng, dtype):
    x, w, b, dy = _data(rng, (40, 3000), 1, dtype)
    copies = [a.copy() for a in (x, w, b, dy)]
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b)
    stats = (mean.copy(), rstd.copy())
    lnlib.layer_norm_backward(dy, x, mean, rstd, w)
    for a, c in zip((x, w, b, dy), copies):
        np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(mean, stats[0])
    np.testing.assert_array_equal(rstd, stats[1])


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[:, ::-1],
        lambda a: a[::-1],
        lambda a: a[::2, 1::3],
        lambda a: a.T.copy().T,
        lambda a: np.asfortranarray(a),
        lambda a: a[:, :50],
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_strided_inputs_give_the_contiguous_result_bitwise(rng, view, dtype):
    base = rng.standard_normal((400, 120)).astype(dtype)
    x = view(base)
    xc = np.ascontiguousarray(x)
    w = rng.standard_normal(x.shape[1]).astype(dtype)
    dy = view(rng.standard_normal(base.shape).astype(dtype))
    got, want = lnlib.layer_norm_forward(x, w), lnlib.layer_norm_forward(xc, w)
    for g, v in zip(got, want):
        np.testing.assert_array_equal(g, v)
    for g, v in zip(
        lnlib.layer_norm_backward(dy, x, *got[1:], w),
        lnlib.layer_norm_backward(np.ascontiguousarray(dy), xc, *want[1:], w),
    ):
        np.testing.assert_array_equal(g, v)


def test_3d_strided_input_with_two_normalized_axes(rng):
    base = rng.standard_normal((6, 10, 12))
    x = base[:, ::-2, 1::2]
    got = lnlib.layer_norm_forward(x, normalized_ndim=2)
    want = reference.layer_norm_forward(np.ascontiguousarray(x), normalized_ndim=2)
    for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance_is_bitwise(rng, dtype):
    """A row's result does not depend on the other rows or on its position in the batch."""
    x = rng.standard_normal((517, 300)).astype(dtype)
    w, b = rng.standard_normal(300).astype(dtype), rng.standard_normal(300).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b)
    dx = lnlib.layer_norm_backward(dy, x, mean, rstd, w)[0]
    perm = rng.permutation(517)
    yp, meanp, rstdp = lnlib.layer_norm_forward(x[perm], w, b)
    np.testing.assert_array_equal(yp, y[perm])
    np.testing.assert_array_equal(
        lnlib.layer_norm_backward(dy[perm], x[perm], meanp, rstdp, w)[0], dx[perm]
    )
    for i in (0, 1, 255, 516):
        y1, m1, r1 = lnlib.layer_norm_forward(x[i : i + 1], w, b)
        np.testing.assert_array_equal(y1[0], y[i])
        np.testing.assert_array_equal(
            lnlib.layer_norm_backward(dy[i : i + 1], x[i : i + 1], m1, r1, w)[0][0], dx[i]
        )
    sub = lnlib.layer_norm_forward(x[100:117], w, b)[0]
    np.testing.assert_array_equal(sub, y[100:117])


def test_deterministic_across_calls(rng):
    x = rng.standard_normal((2000, 256)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    runs = []
    for _ in range(3):
        y, mean, rstd = lnlib.layer_norm_forward(x)
        runs.append((y, *lnlib.layer_norm_backward(dy, x, mean, rstd)))
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            np.testing.assert_array_equal(a, b)


def test_empty_batch_is_fine():
    y, mean, rstd = lnlib.layer_norm_forward(np.zeros((0, 5)))
    assert y.shape == (0, 5) and mean.shape == (0,)
    dx, dw, db = lnlib.layer_norm_backward(np.zeros((0, 5)), np.zeros((0, 5)), mean, rstd)
    assert dx.shape == (0, 5) and dx.dtype == dw.dtype == db.dtype == np.float64
    np.testing.assert_array_equal(dw, np.zeros(5))
    np.testing.assert_array_equal(db, np.zeros(5))


def test_layer_norm_is_forward_output(rng):
    x, w, b, _ = _data(rng, (3, 4, 5), 2, np.float32)
    np.testing.assert_array_equal(
        lnlib.layer_norm(x, w, b, normalized_ndim=2),
        lnlib.layer_norm_forward(x, w, b, normalized_ndim=2)[0],
    )


def test_thread_and_block_settings_do_not_change_forward_bits(rng):
    from lnlib._cpu.numpy_path import layer_norm_forward_rows as _forward_numpy

    x = rng.standard_normal((1000, 384)).astype(np.float32)
    base = _forward_numpy(x, None, None, 1e-5, block_rows=1, threads=1)
    for rows, threads in ((7, 2), (64, 2), (1000, 1), (3, 5)):
        for a, b in zip(
            _forward_numpy(x, None, None, 1e-5, block_rows=rows, threads=threads), base
        ):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", [1, 3, 17, 3000, 8193, 12000])
def test_batch_invariance_for_long_and_odd_rows(rng, n):
    """Rows longer than NumPy's iterator buffer (8192) and of odd length are still summed the
    same way wherever they sit in the batch."""
    m = max(4, 200_000 // n)
    x = rng.standard_normal((m, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, w)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx = lnlib.layer_norm_backward(dy, x, mean, rstd, w)[0]
    for i in (0, m // 2 + 1, m - 1):
        y1, m1, r1 = lnlib.layer_norm_forward(x[i : i + 1], w, w)
        np.testing.assert_array_equal(y1[0], y[i])
        np.testing.assert_array_equal(m1[0], mean[i])
        np.testing.assert_array_equal(
            lnlib.layer_norm_backward(dy[i : i + 1], x[i : i + 1], m1, r1, w)[0][0], dx[i]
        )
    shifted = lnlib.layer_norm_forward(x[3:], w, w)[0]
    np.testing.assert_array_equal(shifted, y[3:])
    r = lnlib.rms_norm_forward(x, w)[0]
    np.testing.assert_array_equal(lnlib.rms_norm_forward(x[5:], w)[0], r[5:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_results_do_not_depend_on_memory_alignment(rng, dtype):
    """The same values at different byte offsets (and after unrelated allocations that move
    the scratch buffers) give the same bits: reductions must not depend on alignment."""
    m, n = 300, 1030
    x = rng.standard_normal((m, n)).astype(dtype) * 3 + 2
    dy = rng.standard_normal((m, n)).astype(dtype)
    want = lnlib.layer_norm_forward(x)
    want_dx = lnlib.layer_norm_backward(dy, x, *want[1:])
    want_rms = lnlib.rms_norm_forward(x)
    for offset in range(1, 8):
        junk = [np.empty(k * 3 + offset) for k in range(offset * 5)]  # noqa: F841 - shifts the heap
        buf = np.empty(m * n + 8, dtype)
        xo = buf[offset : offset + m * n].reshape(m, n)
        xo[...] = x
        got = lnlib.layer_norm_forward(xo)
        for g, v in zip(got, want):
            np.testing.assert_array_equal(g, v)
        for g, v in zip(lnlib.layer_norm_backward(dy, xo, *got[1:]), want_dx):
            np.testing.assert_array_equal(g, v)
        for g, v in zip(lnlib.rms_norm_forward(xo), want_rms):
            np.testing.assert_array_equal(g, v)


def _threaded_rows(x):
    """The NumPy row forward split over two threads (the pool is used even on one core)."""
    from lnlib._cpu.numpy_path import layer_norm_forward_rows

    return layer_norm_forward_rows(x, None, None, 1e-5, block_rows=16, threads=2)


def test_fork_after_a_threaded_call_does_not_hang(rng):
    """Issue 8: the child of os.fork() inherited a pool whose threads do not exist, and hung."""
    import os
    import time
    import warnings

    x = rng.standard_normal((512, 256)).astype(np.float32)
    parent = _threaded_rows(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: compare, report by exit code, never return into pytest
        code = 1
        try:
            child = _threaded_rows(x)
            same = all(np.array_equal(a, b) for a, b in zip(child, parent))
            same = same and np.array_equal(lnlib.layer_norm(x), lnlib.layer_norm(x[:]))
            code = 0 if same else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("layer_norm in a forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0, "the child's result differs from the parent's"


def test_call_during_interpreter_shutdown():
    """Issue 8: an atexit call failed with 'cannot schedule new futures after shutdown'."""
    import subprocess
    import sys

    code = (
        "import atexit, numpy as np\n"
        "from lnlib._cpu.numpy_path import layer_norm_forward_rows as f\n"
        "x = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)\n"
        "want = f(x, None, None, 1e-5, block_rows=16, threads=1)[0]\n"
        "def late():\n"
        "    y = f(x, None, None, 1e-5, block_rows=16, threads=2)[0]\n"
        "    print('equal' if np.array_equal(y, want) else 'differs')\n"
        "atexit.register(late)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "equal", out.stderr[-2000:]


def test_float16_statistics_do_not_lower_the_backward_precision(rng):
    """Issue 8: float16 mean/rstd with float32 x made the backward accumulate in float16.
    Every result (dx, dweight, dbias; RMSNorm's dx, dweight) is bitwise that of the
    statistics cast to float32 by the caller, and the float64 computation with the float16
    statistics' values to float32 accuracy."""
    x = rng.standard_normal((4096, 8)).astype(np.float32)
    dy = (np.abs(rng.standard_normal(x.shape)) * 30).astype(np.float32)  # dbias ~ 1e5
    w = (1 + 0.5 * rng.standard_normal(8)).astype(np.float32)
    _, mean, rstd = lnlib.layer_norm_forward(x, w)
    m16, r16 = mean.astype(np.float16), rstd.astype(np.float16)
    rr16 = lnlib.rms_norm_forward(x, w)[1].astype(np.float16)
    f32, f64 = (lambda a: a.astype(np.float32)), (lambda a: a.astype(np.float64))
    cases = [
        (lnlib.layer_norm_backward, reference.layer_norm_backward, (m16, r16)),
        (lnlib.rms_norm_backward, reference.rms_norm_backward, (rr16,)),
    ]
    for fn, ref, stats in cases:
        got = fn(dy, x, *stats, w)
        cast = fn(dy, x, *map(f32, stats), w)
        want = ref(f64(dy), f64(x), *map(f64, stats), f64(w))
        for i, (g, c, e) in enumerate(zip(got, cast, want)):
            assert g.dtype == np.float32, f"{fn.__name__} result {i}"
            np.testing.assert_array_equal(g, c, err_msg=f"{fn.__name__} result {i}")
            assert_close(g, e, np.float32)


def test_parameter_gradient_column_sums_do_not_drift():
    """Issue 8: dweight/dbias summed block by block in float32 drift with the row count."""
    from lnlib._cpu.numpy_path import layer_norm_backward_rows, layer_norm_forward_rows

    x = np.random.default_rng(0).standard_normal((1 << 16, 2)).astype(np.float32)
    dy = np.full(x.shape, 0.1, np.float32)
    _, mean, rstd = layer_norm_forward_rows(x, None, None, 1e-5)
    db = layer_norm_backward_rows(dy, x, mean, rstd, None, block_rows=1, threads=1)[2]
    np.testing.assert_allclose(db, dy.astype(np.float64).sum(0), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1.0, -0.25])
def test_weight_offset_matches_torch_composition(rng, dtype, offset):
    """Issue 12: the scale is weight_offset + weight; dweight keeps its form."""
    x, w, b, dy = _data(rng, (6, 4, 16), 1, dtype)
    w = (0.1 * rng.standard_normal(16)).astype(dtype)  # zero-centred gain near 0
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b, weight_offset=offset)
    dx, dw, db = lnlib.layer_norm_backward(dy, x, mean, rstd, w, weight_offset=offset)
    t64 = [torch_tensor(a.astype(np.float64), True) for a in (x, w, b)]
    ty = F.layer_norm(t64[0], (16,), offset + t64[1], t64[2], 1e-5)
    ty.backward(torch_tensor(dy.astype(np.float64)))
    assert dw.dtype == w.dtype
    assert_close(y, ty.detach().numpy(), dtype, factor=2)
    assert_close(dx, t64[0].grad.numpy(), dtype, factor=8)
    assert_close(dw, t64[1].grad.numpy(), dtype, factor=24)
    assert_close(db, t64[2].grad.numpy(), dtype, factor=24)


def test_weight_offset_finite_differences_and_default(rng):
    x, w, b, dy = _data(rng, (3, 5), 1, np.float64)
    y, mean, rstd = lnlib.layer_norm_forward(x, w, b, weight_offset=1.0)
    dx, dw, db = lnlib.layer_norm_backward(dy, x, mean, rstd, w, weight_offset=1.0)
    lnlib.check_grad(lambda v: lnlib.layer_norm(v, w, b, weight_offset=1.0), x, dy, dx)
    lnlib.check_grad(
        lambda v: lnlib.layer_norm(x, v, b, weight_offset=1.0), w, dy, dw, name="dweight"
    )
    np.testing.assert_array_equal(y, lnlib.layer_norm(x, 1.0 + w, b))
    np.testing.assert_array_equal(
        lnlib.layer_norm(x, w, b), lnlib.layer_norm(x, w, b, weight_offset=0.0)
    )
    with pytest.raises(ValueError, match="weight_offset=1.0 needs a weight"):
        lnlib.layer_norm(x, None, b, weight_offset=1.0)
    with pytest.raises(ValueError, match="weight_offset must be finite"):
        lnlib.layer_norm(x, w, b, weight_offset=float("nan"))


def test_numpy_path_parameter_gradients_do_not_depend_on_threads(rng):
    """The group sums are added in row order, whatever the split into threads."""
    from lnlib._cpu import numpy_path

    x = rng.standard_normal((3000, 24)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w = rng.standard_normal(24).astype(np.float32)
    _, mean, rstd = numpy_path.layer_norm_forward_rows(x, w, None, 1e-5)
    _, r = numpy_path.rms_norm_forward_rows(x, w, 1e-5)
    want = numpy_path.layer_norm_backward_rows(dy, x, mean, rstd, w, block_rows=64, threads=1)
    want_r = numpy_path.rms_norm_backward_rows(dy, x, r, w, block_rows=64, threads=1)
    for threads in (2, 3, 5):
        got = numpy_path.layer_norm_backward_rows(
            dy, x, mean, rstd, w, block_rows=64, threads=threads
        )
        got_r = numpy_path.rms_norm_backward_rows(dy, x, r, w, block_rows=64, threads=threads)
        for a, b in zip((*got, *got_r), (*want, *want_r)):
            np.testing.assert_array_equal(a, b)
