"""The residual add fused with the norm: lnlib.add_layer_norm* and lnlib.add_rms_norm*."""

import numpy as np
import pytest

import lnlib

# (x dtype, residual dtype, residual_dtype argument): one dtype; float16 activations with a
# float32 stream, given by the residual or asked for; narrower h than the inputs.
DTYPES = [
    ("float32", "float32", None),
    ("float64", "float64", None),
    ("float16", "float16", None),
    ("float16", "float32", None),
    ("float16", "float16", "float32"),
    ("float32", "float16", None),
    ("float64", "float32", "float16"),
]
SHAPES = [(3, 7), (300, 1000), (40, 4096), (2, 3, 5)]


def _data(rng, shape, xd, rd):
    x = rng.standard_normal(shape).astype(xd)
    r = (3 * rng.standard_normal(shape) + 1).astype(rd)
    return x, r


def _h(x, r, hd):
    wide = np.result_type(x.dtype, r.dtype, hd)
    return (r.astype(wide) + x.astype(wide)).astype(hd)


@pytest.mark.parametrize("xd,rd,hd", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_forward_is_bitwise_layer_norm_of_h(any_path, xd, rd, hd, shape):
    rng = np.random.default_rng(1)
    x, r = _data(rng, shape, xd, rd)
    n = shape[-1]
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    x0, r0 = x.copy(), r.copy()
    y, h, mean, rstd = lnlib.add_layer_norm_forward(x, r, w, b, eps=1e-5, residual_dtype=hd)
    hdt = np.dtype(hd or rd)
    assert h.dtype == hdt and y.dtype == x.dtype
    assert np.array_equal(h, _h(x, r, hdt))
    y0, m0, r0_ = lnlib.layer_norm_forward(h, w, b, eps=1e-5)
    assert np.array_equal(y, y0.astype(x.dtype))
    assert np.array_equal(mean, m0) and np.array_equal(rstd, r0_)
    assert np.array_equal(x, x0) and np.array_equal(r, r0)  # inputs never modified
    y2, h2 = lnlib.add_layer_norm(x, r, w, b, residual_dtype=hd)
    assert np.array_equal(y2, y) and np.array_equal(h2, h)


@pytest.mark.parametrize("xd,rd,hd", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_forward_is_bitwise_rms_norm_of_h(any_path, xd, rd, hd, shape):
    rng = np.random.default_rng(2)
    x, r = _data(rng, shape, xd, rd)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    y, h, rstd = lnlib.add_rms_norm_forward(x, r, w, residual_dtype=hd)
    y0, r0 = lnlib.rms_norm_forward(_h(x, r, np.dtype(hd or rd)), w)
    assert np.array_equal(y, y0.astype(x.dtype)) and np.array_equal(rstd, r0)
    assert np.array_equal(lnlib.add_rms_norm(x, r, w, residual_dtype=hd)[0], y)


@pytest.mark.parametrize("xd,rd,hd", DTYPES)
@pytest.mark.parametrize("with_dh", [True, False])
def test_backward_is_dh_plus_the_norms_dx(any_path, xd, rd, hd, with_dh):
    rng = np.random.default_rng(3)
    shape = (300, 1000)
    x, r = _data(rng, shape, xd, rd)
    w = rng.standard_normal(1000).astype(np.float32)
    y, h, mean, rstd = lnlib.add_layer_norm_forward(x, r, w, None, residual_dtype=hd)
    dy = rng.standard_normal(shape).astype(xd)
    dh = rng.standard_normal(shape).astype(h.dtype) if with_dh else None
    dsum, dw, db = lnlib.add_layer_norm_backward(dy, dh, h, mean, rstd, w)
    dx, dw0, db0 = lnlib.layer_norm_backward(dy, h, mean, rstd, w)
    want = dx if dh is None else (dx.astype(np.float64) + dh).astype(h.dtype)
    assert dsum.dtype == h.dtype and np.array_equal(dsum, want)
    tol = 1e-5 if h.dtype == np.float64 else 2e-3
    assert np.allclose(dw, dw0, rtol=tol, atol=tol) and np.allclose(db, db0, rtol=tol, atol=tol)
    y, h, rstd = lnlib.add_rms_norm_forward(x, r, w, residual_dtype=hd)
    dsum, dw = lnlib.add_rms_norm_backward(dy, dh, h, rstd, w)
    dx, dw0 = lnlib.rms_norm_backward(dy, h, rstd, w)
    want = dx if dh is None else (dx.astype(np.float64) + dh).astype(h.dtype)
    assert np.array_equal(dsum, want) and np.allclose(dw, dw0, rtol=tol, atol=tol)


def test_against_torch_composition(any_path):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(4)
    x, r = _data(rng, (64, 96), "float64", "float64")
    w, b = rng.standard_normal(96), rng.standard_normal(96)
    dy, dh = rng.standard_normal((64, 96)), rng.standard_normal((64, 96))
    tx, tr, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, r, w, b))
    th = tr + tx
    ty = F.layer_norm(th, (96,), tw, tb, eps=1e-5)
    torch.autograd.backward([ty, th], [torch.tensor(dy), torch.tensor(dh)])
    y, h, mean, rstd = lnlib.add_layer_norm_forward(x, r, w, b)
    dsum, dw, db = lnlib.add_layer_norm_backward(dy, dh, h, mean, rstd, w)
    assert np.allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert np.array_equal(h, th.detach().numpy())
    for got, want in [(dsum, tx.grad), (dsum, tr.grad), (dw, tw.grad), (db, tb.grad)]:
        assert np.allclose(got, want.numpy(), rtol=1e-10, atol=1e-10)
    tx.grad = tr.grad = tw.grad = None
    th = tr + tx
    ty = F.rms_norm(th, (96,), tw, eps=1e-6)
    torch.autograd.backward([ty, th], [torch.tensor(dy), torch.tensor(dh)])
    y, h, rstd = lnlib.add_rms_norm_forward(x, r, w)
    dsum, dw = lnlib.add_rms_norm_backward(dy, dh, h, rstd, w)
    assert np.allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    for got, want in [(dsum, tx.grad), (dsum, tr.grad), (dw, tw.grad)]:
        assert np.allclose(got, want.numpy(), rtol=1e-10, atol=1e-10)


def test_finite_differences(any_path):
    rng = np.random.default_rng(5)
    x, r = _data(rng, (4, 6), "float64", "float64")
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    cy, ch = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))

    def both(x_, r_):  # y and h side by side: the loss sum(cy * y) + sum(ch * h)
        return np.concatenate(lnlib.add_layer_norm(x_, r_, w, b), axis=1)

    cyh = np.concatenate([cy, ch], axis=1)
    _, h, mean, rstd = lnlib.add_layer_norm_forward(x, r, w, b)
    dsum, _, _ = lnlib.add_layer_norm_backward(cy, ch, h, mean, rstd, w)
    gx = lnlib.numerical_grad(lambda a: both(a, r), x, cyh)
    gr = lnlib.numerical_grad(lambda a: both(x, a), r, cyh)
    assert np.allclose(dsum, gx, rtol=1e-6, atol=1e-7) and np.allclose(dsum, gr, atol=1e-7)


def test_rows_are_bitwise_independent_of_the_batch(any_path):
    rng = np.random.default_rng(6)
    x, r = _data(rng, (700, 768), "float32", "float32")
    w = rng.standard_normal(768).astype(np.float32)
    y, h, mean, rstd = lnlib.add_layer_norm_forward(x, r, w)
    for lo, hi in [(0, 1), (3, 4), (17, 400), (699, 700)]:
        y1, h1, m1, r1 = lnlib.add_layer_norm_forward(x[lo:hi], r[lo:hi], w)
        assert np.array_equal(y1, y[lo:hi]) and np.array_equal(h1, h[lo:hi])
        assert np.array_equal(m1, mean[lo:hi]) and np.array_equal(r1, rstd[lo:hi])
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dsum = lnlib.add_rms_norm_backward(dy, None, *lnlib.add_rms_norm_forward(x, r, w)[1:], w)[0]
    part = lnlib.add_rms_norm_backward(
        dy[5:9], None, *lnlib.add_rms_norm_forward(x[5:9], r[5:9], w)[1:], w
    )[0]
    assert np.array_equal(part, dsum[5:9])


def test_out_in_place_over_the_residual(any_path):
    rng = np.random.default_rng(7)
    x, r = _data(rng, (256, 512), "float32", "float32")
    y0, h0, m0, s0 = lnlib.add_layer_norm_forward(x, r)
    stream = r.copy()
    y, h, m, s = lnlib.add_layer_norm_forward(x, stream, out=(None, stream, None, None))
    assert h is stream and np.array_equal(stream, h0) and np.array_equal(y, y0)
    outs = (
        np.empty_like(x),
        np.empty_like(x),
        np.empty(256, np.float32),
        np.empty(256, np.float32),
    )
    got = lnlib.add_layer_norm_forward(x, r, out=outs)
    assert all(a is b for a, b in zip(got, outs))
    assert all(np.array_equal(a, b) for a, b in zip(got, (y0, h0, m0, s0)))
    # dsum over dh: computed from the unmodified dh
    dy, dh = rng.standard_normal(x.shape).astype(np.float32), rng.standard_normal(x.shape)
    dh = dh.astype(np.float32)
    want = lnlib.add_layer_norm_backward(dy, dh, h0, m0, s0)[0]
    buf = dh.copy()
    got = lnlib.add_layer_norm_backward(dy, buf, h0, m0, s0, out=(buf, None, None))[0]
    assert got is buf and np.array_equal(buf, want)


def test_bad_inputs_are_named_before_anything_is_written():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        lnlib.add_layer_norm(x, np.ones((4, 7), np.float32))
    with pytest.raises(TypeError, match="residual must have a floating dtype"):
        lnlib.add_rms_norm(x, np.ones((4, 8), np.int32))
    with pytest.raises(TypeError, match="residual_dtype"):
        lnlib.add_layer_norm(x, x, residual_dtype=np.int64)
    with pytest.raises(TypeError, match="residual_dtype"):
        lnlib.add_layer_norm(x, x, residual_dtype="nonsense")
    with pytest.raises(ValueError, match="weight"):
        lnlib.add_layer_norm(x, x, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="eps"):
        lnlib.add_rms_norm(x, x, eps=-1.0)
    out = (None, np.zeros((4, 8), np.float16), None, None)
    with pytest.raises(ValueError, match=r"out\[1\] \(h\)"):
        lnlib.add_layer_norm_forward(x, x, out=out)
    assert not out[1].any()
    _, h, mean, rstd = lnlib.add_layer_norm_forward(x, x)
    with pytest.raises(ValueError, match="dh must have the shape of h"):
        lnlib.add_layer_norm_backward(x, np.ones((4, 7), np.float32), h, mean, rstd)
    with pytest.raises(ValueError, match="dy must have the shape of h"):
        lnlib.add_layer_norm_backward(x[:, :7], None, h, mean, rstd)
    with pytest.raises(TypeError, match="h must have a floating dtype"):
        lnlib.add_rms_norm_backward(x, None, h.astype(np.int32), rstd)
    with pytest.raises(ValueError, match="normalized_ndim must be h.ndim - mean.ndim = 1"):
        lnlib.add_layer_norm_backward(x, None, h, mean, rstd, normalized_ndim=2)


@pytest.mark.parametrize(
    "xd,rd",
    [
        ("float32", "float32"),
        ("float64", "float64"),
        ("float16", "float16"),
        ("float16", "float32"),
    ],
)
@pytest.mark.parametrize("shape", [(2200, 1024), (130, 70000), (257, 33)])
def test_kernel_one_pass_is_bitwise_the_unfused_kernel(xd, rd, shape):
    """The C pass (norms.c, "fused residual add"): blocks, threads and streamed outputs
    (2200 x 1024 float64 writes 18 MiB) give bitwise the unfused kernel's results of h."""
    from conftest import _skip_without_kernel

    _skip_without_kernel()
    rng = np.random.default_rng(5)
    x, r = _data(rng, shape, xd, rd)
    n = shape[1]
    w = rng.standard_normal(n).astype(np.result_type(rd, np.float32))
    b = rng.standard_normal(n).astype(w.dtype)
    with lnlib.use_implementation("kernel"):
        for fwd, bwd, nf, nb, ps in (
            (
                lnlib.add_layer_norm_forward,
                lnlib.add_layer_norm_backward,
                lnlib.layer_norm_forward,
                lnlib.layer_norm_backward,
                (w, b),
            ),
            (
                lnlib.add_rms_norm_forward,
                lnlib.add_rms_norm_backward,
                lnlib.rms_norm_forward,
                lnlib.rms_norm_backward,
                (w,),
            ),
        ):
            y, h, *stats = fwd(x, r, *ps)
            assert np.array_equal(h, _h(x, r, np.dtype(rd)))
            ref = nf(h, *ps)
            assert np.array_equal(y, ref[0].astype(x.dtype))
            assert all(np.array_equal(s, t) for s, t in zip(stats, ref[1:]))
            dy = rng.standard_normal(shape).astype(xd)
            dh = rng.standard_normal(shape).astype(rd)
            dsum, *grads = bwd(dy, dh, h, *stats, w)
            dx, *rgrads = nb(dy, h, *stats, w)
            assert np.array_equal(dsum, (dx + dh).astype(h.dtype))
            assert all(np.array_equal(g, t) for g, t in zip(grads, rgrads))
