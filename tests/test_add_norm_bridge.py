"""The fused residual add through the torch bridge (issue 24): against the torch composition,
by finite differences, through both outputs, with mixed dtypes, and its errors."""

import pytest

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

from lnlib import torch_bridge as tb  # noqa: E402


def _double(*shape, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) + shift


def _composition(which, x, r, w, b):
    h = r + x
    y = F.layer_norm(h, (8,), w, b, 1e-5) if which == "ln" else F.rms_norm(h, (8,), w, 1e-6)
    return y, h


def _ours(which, x, r, w, b):
    if which == "ln":
        return tb.add_layer_norm(x, r, 8, w, b)
    return tb.add_rms_norm(x, r, 8, w, eps=1e-6)


@pytest.mark.parametrize("which", ["ln", "rms"])
def test_matches_the_torch_composition_through_both_outputs(which):
    values = [_double(3, 5, 8, seed=1), _double(3, 5, 8, seed=2)]
    values += [_double(8, seed=3, shift=1.0), _double(8, seed=4)]
    ours = [v.clone().requires_grad_() for v in values]
    ref = [v.clone().requires_grad_() for v in values]
    (y, h), (y_ref, h_ref) = _ours(which, *ours), _composition(which, *ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    dy, dh = _double(3, 5, 8, seed=5), _double(3, 5, 8, seed=6)
    torch.autograd.backward((y, h), (dy, dh))
    torch.autograd.backward((y_ref, h_ref), (dy, dh))
    used = ours if which == "ln" else ours[:3]
    for got, want in zip(used, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[0].grad, ours[1].grad, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["ln", "rms"])
def test_gradcheck_float64(which):
    inputs = [_double(4, 8, seed=10).requires_grad_(), _double(4, 8, seed=11).requires_grad_()]
    inputs += [_double(8, seed=12, shift=1.0).requires_grad_(), _double(8, seed=13)]
    inputs[3].requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: _ours(which, *a), inputs)


@pytest.mark.parametrize("which", ["ln", "rms"])
def test_only_one_output_used(which):
    x, r = _double(4, 8, seed=20).requires_grad_(), _double(4, 8, seed=21).requires_grad_()
    y, h = _ours(which, x, r, None, None)
    h.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))
    x.grad = r.grad = None
    y, h = _ours(which, x, r, None, None)
    y_ref, _ = _composition(which, x, r, None, None)
    (g_ref,) = torch.autograd.grad((y_ref**2).sum(), x)
    (y**2).sum().backward()
    torch.testing.assert_close(x.grad, g_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(r.grad, g_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("module", ["AddLayerNorm", "AddRMSNorm"])
def test_float16_x_with_float32_residual(module):
    x = _double(6, 8, seed=30).half().requires_grad_()
    r = _double(6, 8, seed=31).float().requires_grad_()
    layer = getattr(tb, module)(8, eps=1e-5)
    y, h = layer(x, r)
    assert y.dtype == torch.float16 and h.dtype == torch.float32
    torch.testing.assert_close(h, r + x.float(), rtol=0, atol=0)
    plain = tb.LayerNorm(8) if module == "AddLayerNorm" else tb.RMSNorm(8, eps=1e-5)
    torch.testing.assert_close(y, plain(h.detach()).half(), rtol=0, atol=0)
    (y.float().sum() + h.sum()).backward()
    assert x.grad.dtype == torch.float16 and r.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, r.grad.half(), rtol=0, atol=0)
    assert layer.weight.grad is not None


def test_residual_dtype_keeps_the_stream_in_float32():
    x, r = _double(2, 8, seed=40).half(), _double(2, 8, seed=41).half()
    y, h = tb.add_layer_norm(x, r, 8, residual_dtype=torch.float32)
    assert y.dtype == torch.float16 and h.dtype == torch.float32
    torch.testing.assert_close(h, r.float() + x.float(), rtol=0, atol=0)


def test_errors_are_named():
    x = torch.ones(3, 8)
    with pytest.raises(TypeError, match="residual: expected a torch.Tensor"):
        tb.add_layer_norm(x, x.numpy(), 8)
    with pytest.raises(TypeError, match="residual: expected a floating tensor"):
        tb.add_rms_norm(x, torch.ones(3, 8, dtype=torch.int64), 8)
    with pytest.raises(ValueError, match="residual"):
        tb.add_layer_norm(x, torch.ones(3, 7), 8)
    with pytest.raises(ValueError, match="x: expected trailing axes"):
        tb.add_layer_norm(x, x, 7)
    with pytest.raises(TypeError, match="residual_dtype"):
        tb.add_rms_norm(x, x, 8, residual_dtype="float32")


@pytest.mark.parametrize("name", ["AddLayerNorm", "AddRMSNorm"])
def test_numpy_layers_match_the_plain_layer_on_h(name):
    import numpy as np

    import lnlib

    rng = np.random.default_rng(50)
    x, r = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8))
    dy, dh = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8))
    fused = getattr(lnlib, name)((3, 8), dtype=np.float64, weight_offset=0.5)
    plain = getattr(lnlib, name.removeprefix("Add"))((3, 8), dtype=np.float64, weight_offset=0.5)
    fused.weight[...] = plain.weight[...] = rng.standard_normal((3, 8))
    y, h = fused(x, r)
    np.testing.assert_array_equal(h, r + x)
    np.testing.assert_array_equal(y, plain(h))
    np.testing.assert_allclose(fused.backward(dy, dh), dh + plain.backward(dy), atol=1e-12)
    np.testing.assert_allclose(fused.dweight, plain.dweight, atol=1e-12)
    if name == "AddLayerNorm":
        np.testing.assert_allclose(fused.dbias, plain.dbias, atol=1e-12)
    np.testing.assert_allclose(fused.backward(dy), plain.backward(dy), atol=1e-12)
    with pytest.raises(RuntimeError, match=f"{name}.backward called before forward"):
        getattr(lnlib, name)(8).backward(dy)


def test_numpy_layer_keeps_the_stream_in_float32():
    import numpy as np

    import lnlib

    x = np.linspace(-1, 1, 16, dtype=np.float16).reshape(2, 8)
    layer = lnlib.AddRMSNorm(8, residual_dtype=np.float32, elementwise_affine=False)
    y, h = layer(x, x)
    assert y.dtype == np.float16 and h.dtype == np.float32
    assert layer.backward(np.ones_like(x)).dtype == np.float32 and layer.dweight is None


@pytest.mark.parametrize("which", ["ln", "rms"])
def test_second_derivatives_raise(which):
    x, r = _double(3, 8, seed=60).requires_grad_(), _double(3, 8, seed=61)
    y, h = _ours(which, x, r, None, None)
    with pytest.raises(RuntimeError, match="Add.*NormFunction: .*no double backward"):
        torch.autograd.grad(((y**3).sum() + h.sum()), x, create_graph=True)
