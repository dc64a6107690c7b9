"""lnlib inside PyTorch: autograd functions and nn.Module drop-ins."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import lnlib  # noqa: E402
from lnlib import torch_bridge as tb  # noqa: E402


def _double(*shape, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift


def test_import_lnlib_does_not_import_torch():
    code = "import sys, lnlib; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_gradcheck(affine):
    x = _double(3, 2, 5, seed=1).requires_grad_()
    w = _double(5, seed=2, scale=0.5, shift=1.0).requires_grad_() if affine != "none" else None
    b = _double(5, seed=3).requires_grad_() if affine == "both" else None
    inputs = tuple(t for t in (x, w, b) if t is not None)
    assert torch.autograd.gradcheck(lambda x, *params: tb.layer_norm(x, (5,), *params), inputs)


def test_layer_norm_gradcheck_two_axes():
    x = _double(4, 3, 5, seed=4).requires_grad_()
    w = _double(3, 5, seed=5, shift=1.0).requires_grad_()
    b = _double(3, 5, seed=6).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, b: tb.layer_norm(x, (3, 5), w, b), (x, w, b))


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_gradcheck(with_weight):
    x = _double(4, 6, seed=7).requires_grad_()
    if with_weight:
        w = _double(6, seed=8, shift=1.0).requires_grad_()
        assert torch.autograd.gradcheck(lambda x, w: tb.rms_norm(x, 6, w, eps=1e-6), (x, w))
    else:
        assert torch.autograd.gradcheck(lambda x: tb.rms_norm(x, 6, eps=1e-6), (x,))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_layer_norm_equals_torch(dtype, tol):
    x = _double(8, 16, 32, seed=9, scale=3.0, shift=5.0).to(dtype)
    w = _double(32, seed=10, shift=1.0).to(dtype)
    b = _double(32, seed=11).to(dtype)
    dy = _double(8, 16, 32, seed=12).to(dtype)

    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    y1 = tb.layer_norm(ours[0], (32,), ours[1], ours[2], eps=1e-5)
    y2 = F.layer_norm(theirs[0], (32,), theirs[1], theirs[2], eps=1e-5)
    y1.backward(dy)
    y2.backward(dy)
    assert y1.dtype == dtype and y1.shape == x.shape
    torch.testing.assert_close(y1, y2, rtol=tol, atol=tol)
    for a, c in zip(ours, theirs):
        assert a.grad.dtype == dtype
        torch.testing.assert_close(a.grad, c.grad, rtol=tol, atol=tol * 10)


def test_rms_norm_equals_torch():
    x = _double(5, 7, 24, seed=13, scale=2.0)
    w = _double(24, seed=14, shift=1.0)
    dy = _double(5, 7, 24, seed=15)
    ours = [t.clone().requires_grad_() for t in (x, w)]
    theirs = [t.clone().requires_grad_() for t in (x, w)]
    tb.rms_norm(ours[0], 24, ours[1]).backward(dy)
    F.rms_norm(theirs[0], (24,), theirs[1]).backward(dy)
    for a, c in zip(ours, theirs):
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        tb.rms_norm(x, 24, w), F.rms_norm(x, (24,), w), rtol=1e-12, atol=1e-12
    )


def test_forward_is_zero_copy_on_input():
    x = torch.randn(4, 8)
    seen = {}
    real = tb.lnlib.layer_norm_forward

    def spy(xa, *args, **kwargs):
        seen["shares"] = np.shares_memory(xa, x.numpy())
        return real(xa, *args, **kwargs)

    tb.lnlib.layer_norm_forward = spy
    try:
        tb.layer_norm(x, 8)
    finally:
        tb.lnlib.layer_norm_forward = real
    assert seen["shares"]


def test_non_contiguous_and_bfloat16():
    x = _double(6, 10, seed=16).t()  # (10, 6), not contiguous
    torch.testing.assert_close(tb.layer_norm(x, 6), F.layer_norm(x, (6,)), rtol=1e-12, atol=1e-12)
    xb = x.to(torch.bfloat16)
    yb = tb.layer_norm(xb, 6)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, F.layer_norm(xb, (6,)), rtol=2e-2, atol=2e-2)


def test_modules_match_torch_modules():
    ours = tb.LayerNorm((3, 4), eps=1e-6, bias=False, dtype=torch.float64)
    theirs = nn.LayerNorm((3, 4), eps=1e-6, bias=False, dtype=torch.float64)
    assert ours.bias is None and ours.weight.shape == (3, 4)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = _double(2, 3, 4, seed=17)
    torch.testing.assert_close(ours(x), theirs(x))

    plain = tb.LayerNorm(4, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and not list(plain.parameters())
    assert "elementwise_affine=False" in repr(plain)

    r_ours = tb.RMSNorm(4, dtype=torch.float64)
    r_theirs = nn.RMSNorm(4, dtype=torch.float64)
    assert set(r_ours.state_dict()) == set(r_theirs.state_dict())
    torch.testing.assert_close(r_ours(x), r_theirs(x), rtol=1e-12, atol=1e-12)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="x"):
        tb.layer_norm(torch.ones(3, 4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="normalized_shape"):
        tb.layer_norm(torch.ones(3, 4), 5)
    with pytest.raises(ValueError, match="weight"):
        tb.layer_norm(torch.ones(3, 4), 4, torch.ones(3))


def _tiny_model(norm_cls, seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        norm_cls(16),
        nn.GELU(),
        nn.Linear(16, 16),
        norm_cls(16),
        nn.GELU(),
        nn.Linear(16, 1),
    ).double()


def _train(model, steps=30):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    target = (x[:, :1] * x[:, 1:2]).sin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
    return loss.item()


def test_drop_in_trains_to_the_same_loss():
    loss_ours = _train(_tiny_model(tb.LayerNorm, seed=3))
    loss_torch = _train(_tiny_model(nn.LayerNorm, seed=3))
    assert loss_ours == pytest.approx(loss_torch, rel=1e-9)
    loss_rms_ours = _train(_tiny_model(tb.RMSNorm, seed=4))
    loss_rms_torch = _train(_tiny_model(nn.RMSNorm, seed=4))
    assert loss_rms_ours == pytest.approx(loss_rms_torch, rel=1e-9)


def _second_derivative_paths(fn, x):
    """The three ways torch builds a graph through a backward."""
    y = fn(x)
    (g,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
    torch.autograd.grad(g.sum(), x)
    torch.autograd.functional.hessian(lambda v: (fn(v) ** 3).sum(), x)


SECOND = ["layer_norm", "rms_norm", "group_norm", "dynamic_tanh"]


@pytest.mark.parametrize("which", SECOND + ["LayerNorm", "RMSNorm", "GroupNorm", "DynamicTanh"])
def test_second_derivatives_raise_instead_of_returning_zeros(which):
    """Issue 8: create_graph=True and hessian gave None or zeros through the bridge."""
    x = _double(3, 5, seed=20).requires_grad_()
    w = _double(5, seed=21, shift=1.0).requires_grad_()
    fn = {
        "layer_norm": lambda v: tb.layer_norm(v, (5,), w),
        "rms_norm": lambda v: tb.rms_norm(v, 5, w, eps=1e-6),
        "group_norm": lambda v: tb.group_norm(v, 1, w),
        "dynamic_tanh": lambda v: tb.dynamic_tanh(v, torch.tensor(0.7), w),
        "LayerNorm": tb.LayerNorm(5, dtype=torch.float64),
        "RMSNorm": tb.RMSNorm(5, eps=1e-6, dtype=torch.float64),
        "GroupNorm": tb.GroupNorm(5, 5, dtype=torch.float64),
        "DynamicTanh": tb.DynamicTanh(5, dtype=torch.float64),
    }[which]
    with pytest.raises(RuntimeError, match="not differentiable \\(no double backward\\)"):
        _second_derivative_paths(fn, x)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.functional.hessian(lambda v: (fn(v) ** 3).sum(), x)
    y = fn(x)  # first derivatives still work
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("offset", [0.0, 1.0, -0.5])
def test_weight_offset_matches_torch_composition(offset):
    x = _double(4, 6, 8, seed=30, scale=2.0, shift=1.0).requires_grad_()
    w = _double(8, seed=31, scale=0.3).requires_grad_()
    b = _double(8, seed=32).requires_grad_()
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = tb.layer_norm(x, 8, w, b, weight_offset=offset)
    y_ref = F.layer_norm(ref[0], (8,), offset + ref[1], ref[2], 1e-5)
    r = tb.rms_norm(x, 8, w, eps=1e-6, weight_offset=offset)
    r_ref = F.rms_norm(ref[0], (8,), offset + ref[1], 1e-6)
    dy = _double(4, 6, 8, seed=33)
    torch.autograd.backward((y, r), (dy, dy))
    torch.autograd.backward((y_ref, r_ref), (dy, dy))
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r, r_ref, rtol=1e-12, atol=1e-12)
    for got, want in zip((x, w, b), ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-10)
    assert torch.autograd.gradcheck(
        lambda x, w: tb.rms_norm(x, 8, w, eps=1e-6, weight_offset=offset), (x, w)
    )


def test_zero_centred_modules_start_as_the_plain_ones():
    x = _double(3, 7, seed=34)
    for mod, plain in (
        (
            tb.LayerNorm(7, weight_offset=1.0, dtype=torch.float64),
            nn.LayerNorm(7, dtype=torch.float64),
        ),
        (
            tb.RMSNorm(7, eps=1e-6, weight_offset=1.0, dtype=torch.float64),
            nn.RMSNorm(7, eps=1e-6, dtype=torch.float64),
        ),
    ):
        assert torch.count_nonzero(mod.weight) == 0
        torch.testing.assert_close(mod(x), plain(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="weight_offset"):
        tb.LayerNorm(7, elementwise_affine=False, weight_offset=1.0)


# Each Function of the bridge through its function: the call, the shape of x, the inputs that
# can get gradients after x (the float ones are DynamicTanh's alpha, of shape ()).
FUNCTIONS = {
    "layer_norm": (lambda x, w, b: tb.layer_norm(x, 6, w, b), (4, 6), ((6,), (6,))),
    "rms_norm": (lambda x, w: tb.rms_norm(x, 6, w, eps=1e-6), (4, 6), ((6,),)),
    "group_norm": (lambda x, w, b: tb.group_norm(x, 2, w, b), (4, 6, 3), ((6,), (6,))),
    "dynamic_tanh": (lambda x, a, w, b: tb.dynamic_tanh(x, a, w, b), (4, 6), ((), (6,), (6,))),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_each_input_gets_its_gradient_only_where_torch_asks(name):
    """The one backward maps lnlib's gradients to the inputs of each Function (GroupNorm's
    num_groups and DynamicTanh's alpha sit between x and the parameters): for every subset of
    inputs that require grad, exactly those get a gradient, bit for bit the one they get when
    all of them require it."""
    fn, shape, param_shapes = FUNCTIONS[name]
    values = [_double(*shape, seed=40)]
    values += [_double(*s, seed=41 + i, shift=0.5) for i, s in enumerate(param_shapes)]
    dy = _double(*shape, seed=49)

    def grads(wants):
        inputs = [v.clone().requires_grad_(want) for v, want in zip(values, wants)]
        fn(*inputs).backward(dy)
        return [t.grad for t in inputs]

    full = grads([True] * len(values))
    assert all(g is not None for g in full)
    for wants in itertools.product([False, True], repeat=len(values)):
        if not any(wants):
            continue
        for want, got, ref in zip(wants, grads(wants), full):
            if want:
                torch.testing.assert_close(got, ref, rtol=0, atol=0)
            else:
                assert got is None


@pytest.mark.parametrize("name", ["layer_norm", "group_norm", "dynamic_tanh"])
def test_each_gradient_is_cast_to_the_dtype_of_its_own_input(name):
    """A float32 bias beside a bfloat16 x and weight gets lnlib's float32 gradient exactly,
    not one rounded through bfloat16 first (the dtype of the weight)."""
    fn, shape, param_shapes = FUNCTIONS[name]
    bf16 = torch.bfloat16
    x = _double(*shape, seed=50).to(bf16).requires_grad_()
    params = [_double(*s, seed=51 + i, shift=0.5) for i, s in enumerate(param_shapes)]
    params = [p.to(bf16) for p in params[:-1]] + [params[-1].float()]
    params = [p.requires_grad_() for p in params]
    dy = _double(*shape, seed=59).to(bf16)
    fn(x, *params).backward(dy)
    bias = params[-1]
    assert x.grad.dtype == bf16 and bias.grad.dtype == torch.float32
    # the same backward on the float32 arrays the bridge hands to lnlib
    args = [t.detach().float().numpy() for t in (dy, x, *params[:-1])]
    if name == "layer_norm":
        y, mean, rstd = lnlib.layer_norm_forward(args[1], args[2])
        dbias = lnlib.layer_norm_backward(args[0], args[1], mean, rstd, args[2])[2]
    elif name == "group_norm":
        y, mean, rstd = lnlib.group_norm_forward(args[1], 2, args[2])
        dbias = lnlib.group_norm_backward(args[0], args[1], mean, rstd, 2, args[2])[2]
    else:
        dbias = lnlib.dynamic_tanh_backward(args[0], args[1], args[2], args[3])[3]
    assert dbias.dtype == np.float32
    torch.testing.assert_close(bias.grad, torch.from_numpy(dbias), rtol=0, atol=0)
    assert not torch.equal(bias.grad, bias.grad.to(bf16).float()), "not a bfloat16 value"


@pytest.mark.parametrize(
    "num_groups, error, match",
    [
        (0, ValueError, "num_groups must be >= 1"),
        (-2, ValueError, "num_groups must be >= 1"),
        (4, ValueError, "divide num_channels = 6"),
        (2.0, TypeError, "num_groups must be an int"),
        (True, TypeError, "num_groups must be an int"),
    ],
)
def test_group_norm_module_names_a_bad_num_groups(num_groups, error, match):
    with pytest.raises(error, match=match):
        tb.GroupNorm(num_groups, 6)


@pytest.mark.parametrize("n, error", [(6.0, TypeError), (0, ValueError)])
def test_group_norm_module_names_a_bad_num_channels(n, error):
    with pytest.raises(error, match="^num_channels must be"):
        tb.GroupNorm(1, n)
