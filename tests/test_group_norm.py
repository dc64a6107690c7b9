"""GroupNorm: against PyTorch, the reference and finite differences; batch invariance; errors."""

from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, torch_tensor
from hypothesis import given
from hypothesis import strategies as st

import lnlib
from lnlib import reference

# Every test here runs with the compiled CPU kernel and with the NumPy fast path.
pytestmark = pytest.mark.usefixtures("cpu_path")

# (shape, num_groups): spatial axes 0, 1 and 2; InstanceNorm (G = C); one group (G = 1)
SHAPES = [((4, 6), 3), ((3, 6, 5), 2), ((2, 8, 3, 4), 4), ((2, 4, 3, 3), 4), ((3, 6, 2, 5), 1)]
DTYPES = [np.float64, np.float32, np.float16]


def _data(rng, shape, dtype):
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(shape[1])).astype(dtype)
    b = rng.standard_normal(shape[1]).astype(dtype)
    return x, w, b, rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape,g", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_matches_torch(rng, shape, g, dtype, affine):
    x, w, b, dy = _data(rng, shape, dtype)
    w, b = (w, b) if affine else (None, None)
    y, mean, rstd = lnlib.group_norm_forward(x, g, w, b, eps=1e-5)
    dx, dw, db = lnlib.group_norm_backward(dy, x, mean, rstd, g, w)
    # torch's float16 CPU group_norm is computed in float16 in places: compare in float32
    tdtype = np.float32 if dtype == np.float16 else dtype
    tx = torch_tensor(x.astype(tdtype), True)
    tw = torch_tensor(w.astype(tdtype), True) if affine else None
    tb = torch_tensor(b.astype(tdtype), True) if affine else None
    ty = F.group_norm(tx, g, tw, tb, 1e-5)
    ty.backward(torch_tensor(dy.astype(tdtype)))
    assert y.dtype == dx.dtype == x.dtype
    assert mean.shape == rstd.shape == (shape[0], g)
    assert mean.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_close(y, ty.detach().numpy(), dtype, factor=2.0)
    assert_close(dx, tx.grad.numpy(), dtype, factor=8.0)
    if affine:
        n = x.size / x.shape[1]
        assert dw.dtype == db.dtype == w.dtype
        assert_close(dw, tw.grad.numpy(), dtype, factor=n)
        assert_close(db, tb.grad.numpy(), dtype, factor=n)
    if dtype == np.float64:
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape,g", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_reference(rng, shape, g, dtype):
    x, w, b, dy = _data(rng, shape, dtype)
    y, mean, rstd = lnlib.group_norm_forward(x, g, w, b)
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    yr, mr, rr = reference.group_norm_forward(x64, g, w64, b64)
    assert_close(y, yr, dtype)
    assert_close(mean, mr, dtype)
    assert_close(rstd, rr, dtype)
    got = lnlib.group_norm_backward(dy, x, mean, rstd, g, w)
    want = reference.group_norm_backward(dy64, x64, mr, rr, g, w64)
    for a, e in zip(got, want):
        assert a.dtype == (x.dtype if a is got[0] else w.dtype)
        assert_close(a, e, dtype, factor=8.0 * x.size / x.shape[1])


@pytest.mark.parametrize("shape,g", [((2, 4, 3), 2), ((2, 6, 2, 2), 3)])
def test_finite_differences(rng, shape, g):
    x, w, b, dy = _data(rng, shape, np.float64)
    _, mean, rstd = lnlib.group_norm_forward(x, g, w, b)
    dx, dw, db = lnlib.group_norm_backward(dy, x, mean, rstd, g, w)
    lnlib.check_grad(lambda v: lnlib.group_norm(v, g, w, b), x, dy, dx)
    lnlib.check_grad(lambda v: lnlib.group_norm(x, g, v, b), w, dy, dw, name="dweight")
    lnlib.check_grad(lambda v: lnlib.group_norm(x, g, w, v), b, dy, db, name="dbias")
    dx1, dw1, _ = lnlib.group_norm_backward(dy, x, mean, rstd, g)
    ones = np.ones(shape[1])
    lnlib.check_grad(lambda v: lnlib.group_norm(v, g), x, dy, dx1)
    lnlib.check_grad(lambda v: lnlib.group_norm(x, g, v), ones, dy, dw1, name="dweight")


def test_special_cases_instance_norm_and_layer_norm(rng):
    x = rng.standard_normal((3, 4, 5, 2))
    inst = F.instance_norm(torch.from_numpy(x), eps=1e-5).numpy()
    np.testing.assert_allclose(lnlib.group_norm(x, 4), inst, atol=1e-12)
    ln = lnlib.layer_norm(x, normalized_ndim=3)
    np.testing.assert_array_equal(lnlib.group_norm(x, 1), ln)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance_bitwise(rng, dtype):
    x, w, b, dy = _data(rng, (64, 8, 12, 12), dtype)
    y, mean, rstd = lnlib.group_norm_forward(x, 4, w, b)
    dx = lnlib.group_norm_backward(dy, x, mean, rstd, 4, w)[0]
    perm = rng.permutation(64)
    yp, mp, rp = lnlib.group_norm_forward(x[perm], 4, w, b)
    np.testing.assert_array_equal(yp, y[perm])
    np.testing.assert_array_equal(mp, mean[perm])
    np.testing.assert_array_equal(
        lnlib.group_norm_backward(dy[perm], x[perm], mp, rp, 4, w)[0], dx[perm]
    )
    for i in (0, 5, 63):  # one sample alone, and a batch of two
        np.testing.assert_array_equal(lnlib.group_norm(x[i : i + 1], 4, w, b)[0], y[i])
        np.testing.assert_array_equal(lnlib.group_norm(x[[i, 1]], 4, w, b)[0], y[i])
    strided = x[:, :, ::-1, ::2]
    np.testing.assert_array_equal(
        lnlib.group_norm(strided, 4, w, b), lnlib.group_norm(np.ascontiguousarray(strided), 4, w, b)
    )


@given(scale=st.floats(0.01, 100.0), shift=st.floats(-50, 50), seed=st.integers(0, 100))
def test_invariant_to_a_positive_scale_and_shift_of_one_sample(scale, shift, seed):
    """What the book says GroupNorm keeps: each (sample, group) is standardized on its own."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((3, 4, 6))
    moved = x.copy()
    moved[1] = scale * x[1] + shift
    y0, y1 = lnlib.group_norm(x, 2, eps=0.0), lnlib.group_norm(moved, 2, eps=0.0)
    np.testing.assert_array_equal(y1[[0, 2]], y0[[0, 2]])
    np.testing.assert_allclose(y1[1], y0[1], atol=1e-9)


def test_accuracy_with_a_large_mean_float32(rng):
    x = (1000 + rng.standard_normal((2, 4, 4096))).astype(np.float32)
    _, mean, rstd = lnlib.group_norm_forward(x, 2)
    _, mr, rr = reference.group_norm_forward(x.astype(np.float64), 2)
    np.testing.assert_allclose(rstd, rr, rtol=1e-5)
    np.testing.assert_allclose(mean, mr, rtol=1e-7)


def test_inputs_not_modified_and_float16_no_overflow(rng):
    x = (500 * rng.standard_normal((4, 6, 50))).astype(np.float16)
    w = rng.standard_normal(6).astype(np.float16)
    b = rng.standard_normal(6).astype(np.float16)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    copies = [a.copy() for a in (x, w, b, dy)]
    y, mean, rstd = lnlib.group_norm_forward(x, 3, w, b)
    dx, dw, db = lnlib.group_norm_backward(dy, x, mean, rstd, 3, w)
    for a, c in zip((x, w, b, dy), copies):
        np.testing.assert_array_equal(a, c)
    assert all(np.all(np.isfinite(a)) for a in (y, mean, rstd, dx, dw, db))


@pytest.mark.parametrize("rows", ["cpu_path", "reference"])
def test_float16_statistics_are_used_in_float32(rng, rows):
    """Statistics saved in float16 are cast to float32 (the accumulation dtype of float32 x)
    before any arithmetic: bitwise the results of statistics cast by the caller, and the
    float64 computation with those statistics' values to float32 accuracy (computing with
    the float16 values in float16 arithmetic is off by about 6e-4)."""
    x, w, b, dy = _data(rng, (3, 4, 5), np.float32)
    _, mean, rstd = lnlib.group_norm_forward(x, 2, w, b)
    m16, r16 = mean.astype(np.float16), rstd.astype(np.float16)
    with lnlib.use_implementation("reference") if rows == "reference" else nullcontext():
        got = lnlib.group_norm_backward(dy, x, m16, r16, 2, w)
        cast = lnlib.group_norm_backward(
            dy, x, m16.astype(np.float32), r16.astype(np.float32), 2, w
        )
    f64 = [a.astype(np.float64) for a in (dy, x, m16, r16, w)]
    want = reference.group_norm_backward(*f64[:4], 2, f64[4])
    for a, c, e in zip(got, cast, want):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, c)
        assert_close(a, e, np.float32)


@pytest.mark.parametrize("shape", [(0, 6), (0, 6, 7), (0, 6, 2, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ["cpu_path", "reference"])
def test_empty_batch_gives_empty_results_like_torch(shape, dtype, rows):
    """N = 0, as torch: y and dx empty of the shape and dtype of x, mean/rstd (0, G) in the
    accumulation dtype, dweight/dbias zeros (nothing is summed), with every row implementation."""
    x = np.zeros(shape, dtype)
    w, b = np.full(6, 2.0, dtype), np.ones(6, dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    with lnlib.use_implementation("reference") if rows == "reference" else nullcontext():
        for weight, bias in ((w, b), (None, None)):
            y, mean, rstd = lnlib.group_norm_forward(x, 3, weight, bias)
            assert (y.shape, y.dtype) == (shape, dtype)
            assert (mean.shape, mean.dtype) == (rstd.shape, rstd.dtype) == ((0, 3), acc)
            dx, dw, db = lnlib.group_norm_backward(x, x, mean, rstd, 3, weight)
            assert (dx.shape, dx.dtype) == (shape, dtype)
            for d in (dw, db):
                assert d.shape == (6,) and d.dtype == dtype
                np.testing.assert_array_equal(d, np.zeros(6))
        layer = lnlib.GroupNorm(3, 6, dtype=dtype)
        assert layer(x).shape == shape and layer.backward(x).shape == shape
        np.testing.assert_array_equal(layer.dweight, np.zeros(6))
    tx = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    tw, tb = (torch.ones(6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    want = F.group_norm(tx, 3, tw, tb)  # torch's answer for an empty batch: empty, no error
    assert tuple(want.shape) == shape


def test_torch_bridge_empty_batch(rng):
    from lnlib import torch_bridge as tb

    got = {}
    for name, fn in (("lnlib", tb.group_norm), ("torch", F.group_norm)):
        x = torch.zeros((0, 6, 7), requires_grad=True)
        w = torch.from_numpy(rng.standard_normal(6).astype(np.float32)).requires_grad_()
        b = torch.zeros(6, requires_grad=True)
        y = fn(x, 3, w, b)
        y.backward(torch.ones_like(y))
        got[name] = (y, x.grad, w.grad, b.grad)
    for ours, theirs in zip(got["lnlib"], got["torch"]):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x, w: lnlib.group_norm(x, 5), ValueError, "num_groups must divide"),
        (lambda x, w: lnlib.group_norm(x, 0), ValueError, "num_groups must be >= 1"),
        (lambda x, w: lnlib.group_norm(x, 2.0), TypeError, "num_groups must be an int"),
        (lambda x, w: lnlib.group_norm(x, True), TypeError, "num_groups must be an int"),
        (lambda x, w: lnlib.group_norm(x[0, 0], 1), ValueError, "at least 2 axes"),
        (
            lambda x, w: lnlib.group_norm(x[:, :, :0], 2),
            ValueError,
            "no values to normalize in a group",
        ),
        (lambda x, w: lnlib.group_norm(x.astype(int), 2), TypeError, "x must have a floating"),
        (lambda x, w: lnlib.group_norm(x, 2, w[:3]), ValueError, r"weight must have shape \(4,\)"),
        (lambda x, w: lnlib.group_norm(x, 2, None, np.ones((4, 1))), ValueError, "bias must"),
        (lambda x, w: lnlib.group_norm(x, 2, eps=-1.0), ValueError, "eps must be finite"),
        (
            lambda x, w: lnlib.group_norm_backward(x[:1], x, np.zeros((2, 2)), np.ones((2, 2)), 2),
            ValueError,
            "dy must have the shape of x",
        ),
        (
            lambda x, w: lnlib.group_norm_backward(x, x, np.zeros((2, 4)), np.ones((2, 4)), 2),
            ValueError,
            r"mean must have shape \(N, G\)",
        ),
        (
            lambda x, w: lnlib.group_norm_backward(x, x, np.zeros((2, 2)), np.ones(2), 2),
            ValueError,
            r"rstd must have shape \(N, G\)",
        ),
    ],
)
def test_bad_input_names_the_argument(rng, call, error, words):
    x = rng.standard_normal((2, 4, 3))
    w = np.ones(4)
    with pytest.raises(error, match=words):
        call(x, w)


def test_layer_matches_torch_module(rng):
    x = rng.standard_normal((3, 6, 4, 2))
    layer = lnlib.GroupNorm(3, 6, dtype=np.float64)
    layer.weight[...] = rng.standard_normal(6)
    layer.bias[...] = rng.standard_normal(6)
    ref = torch.nn.GroupNorm(3, 6, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(layer.weight))
        ref.bias.copy_(torch.from_numpy(layer.bias))
    tx = torch_tensor(x, True)
    ty = ref(tx)
    dy = rng.standard_normal(x.shape)
    ty.backward(torch_tensor(dy))
    np.testing.assert_allclose(layer(x), ty.detach().numpy(), atol=1e-12)
    np.testing.assert_allclose(layer.backward(dy), tx.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(layer.dweight, ref.weight.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(layer.dbias, ref.bias.grad.numpy(), atol=1e-12)
    with pytest.raises(ValueError, match="num_groups"):
        lnlib.GroupNorm(4, 6)
    with pytest.raises(RuntimeError, match="backward called before forward"):
        lnlib.GroupNorm(2, 4).backward(np.ones((1, 4)))


def test_torch_bridge_gradcheck_and_module(rng):
    from lnlib import torch_bridge as tb

    x = torch.from_numpy(rng.standard_normal((3, 4, 5))).requires_grad_()
    w = torch.from_numpy(rng.standard_normal(4)).requires_grad_()
    b = torch.from_numpy(rng.standard_normal(4)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, b: tb.group_norm(x, 2, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x: tb.group_norm(x, 4), (x,))
    ours, theirs = tb.GroupNorm(2, 4), torch.nn.GroupNorm(2, 4)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    xf = x.detach().float().requires_grad_()
    xt = x.detach().float().requires_grad_()
    ours(xf).square().sum().backward()
    theirs(xt).square().sum().backward()
    torch.testing.assert_close(xf.grad, xt.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-4, atol=1e-4)


@given(
    n=st.integers(1, 6),
    groups=st.sampled_from([1, 2, 3]),
    per=st.integers(1, 3),
    spatial=st.lists(st.integers(1, 5), max_size=2),
    seed=st.integers(0, 1000),
    dtype=st.sampled_from(DTYPES),
)
def test_one_sample_is_the_same_in_any_batch(n, groups, per, spatial, seed, dtype):
    """The book's batch-independence claim: a sample's output (and its dx) are bitwise the
    same whatever other samples share its batch."""
    r = np.random.default_rng(seed)
    shape = (n, groups * per, *spatial)
    x = (3 * r.standard_normal(shape) + 1).astype(dtype)
    dy = r.standard_normal(shape).astype(dtype)
    w = r.standard_normal(shape[1]).astype(dtype)
    i = int(r.integers(n))
    y, mean, rstd = lnlib.group_norm_forward(x, groups, w, w)
    dx = lnlib.group_norm_backward(dy, x, mean, rstd, groups, w)[0]
    y1, m1, r1 = lnlib.group_norm_forward(x[i : i + 1], groups, w, w)
    np.testing.assert_array_equal(y1[0], y[i])
    np.testing.assert_array_equal(
        lnlib.group_norm_backward(dy[i : i + 1], x[i : i + 1], m1, r1, groups, w)[0][0], dx[i]
    )


def _layouts():
    """(name, x maker, shape) for 4-D and 5-D inputs in several memory layouts."""
    cases = [
        ("channels_last", lambda t: t.to(memory_format=torch.channels_last), (2, 6, 5, 4)),
        ("channels_last_3d", lambda t: t.to(memory_format=torch.channels_last_3d), (2, 6, 3, 5, 4)),
        ("contiguous", lambda t: t, (2, 6, 5, 4)),
        (
            "other_permutation",
            lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
            (2, 6, 5, 4),
        ),
        ("strided", lambda t: t[..., ::2], (2, 6, 5, 8)),
    ]
    return [pytest.param(*case, id=case[0]) for case in cases]


@pytest.mark.parametrize("name,layout,shape", _layouts())
@pytest.mark.parametrize("affine", [True, False])
def test_torch_bridge_keeps_the_memory_format(rng, name, layout, shape, affine):
    """As torch.nn.functional.group_norm: the output and the gradient of x have the memory
    format of x (channels-last stays channels-last), with torch's values."""
    from lnlib import torch_bridge as tb

    base = torch.from_numpy(rng.standard_normal(shape))
    dy = torch.from_numpy(rng.standard_normal(layout(base).shape))
    w = torch.from_numpy(rng.standard_normal(6)).requires_grad_() if affine else None
    b = torch.from_numpy(rng.standard_normal(6)).requires_grad_() if affine else None
    results = {}
    for which, fn in (("lnlib", tb.group_norm), ("torch", F.group_norm)):
        x = layout(base.clone()).requires_grad_()
        y = fn(x, 3, w, b)
        (dx,) = torch.autograd.grad(y, x, dy)
        results[which] = (y, dx)
    for ours, theirs in zip(results["lnlib"], results["torch"]):
        assert ours.stride() == theirs.stride(), name
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
