"""Layer classes: parameters, gradients and state, checked against the functions and torch."""

import numpy as np
import pytest
import torch
from conftest import torch_tensor

import lnlib

# Every test here runs with the compiled CPU kernel and with the NumPy fast path.
pytestmark = pytest.mark.usefixtures("cpu_path")


def test_layer_norm_layer_matches_torch_module(rng):
    x = rng.standard_normal((4, 3, 6))
    layer = lnlib.LayerNorm((3, 6), dtype=np.float64)
    layer.weight[...] = rng.standard_normal((3, 6))
    layer.bias[...] = rng.standard_normal((3, 6))
    ref = torch.nn.LayerNorm((3, 6), dtype=torch.float64)
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


def test_layers_without_parameters_report_no_parameter_gradients(rng):
    x = rng.standard_normal((2, 5)).astype(np.float32)
    ln = lnlib.LayerNorm(5, elementwise_affine=False)
    ln(x)
    ln.backward(np.ones_like(x))
    assert ln.weight is None and ln.dweight is None and ln.dbias is None
    ln2 = lnlib.LayerNorm(5, bias=False)
    ln2(x)
    ln2.backward(np.ones_like(x))
    assert ln2.bias is None and ln2.dbias is None and ln2.dweight.shape == (5,)


def test_rms_norm_layer(rng):
    x = rng.standard_normal((3, 8))
    layer = lnlib.RMSNorm(8, dtype=np.float64)
    layer.weight[...] = rng.standard_normal(8)
    dy = rng.standard_normal(x.shape)
    y = layer(x)
    dx = layer.backward(dy)
    y2, rstd = lnlib.rms_norm_forward(x, layer.weight)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(dx, lnlib.rms_norm_backward(dy, x, rstd, layer.weight)[0])
    lnlib.check_grad(lambda w: lnlib.rms_norm(x, w), layer.weight, dy, layer.dweight)


def test_backward_before_forward_is_an_error():
    with pytest.raises(RuntimeError, match="backward called before forward"):
        lnlib.LayerNorm(3).backward(np.ones((1, 3)))


def test_batch_norm_layer_train_and_eval(rng):
    x = rng.standard_normal((16, 3, 4)) * 2 + 5
    layer = lnlib.BatchNorm(3, dtype=np.float64, momentum=0.5)
    y = layer(x)
    np.testing.assert_allclose(y.mean(axis=(0, 2)), 0, atol=1e-12)
    assert np.all(layer.running_mean > 2)
    dy = rng.standard_normal(x.shape)
    dx = layer.backward(dy)
    lnlib.check_grad(
        lambda v: lnlib.batch_norm(v, None, None, layer.weight, layer.bias, training=True),
        x,
        dy,
        dx,
    )
    layer.eval()
    y_eval = layer(x)
    assert not np.allclose(y_eval, y)
    dx_eval = layer.backward(dy)
    rm, rv = layer.running_mean.copy(), layer.running_var.copy()
    lnlib.check_grad(
        lambda v: lnlib.batch_norm(v, rm, rv, layer.weight, layer.bias, training=False),
        x,
        dy,
        dx_eval,
    )


@pytest.mark.parametrize("xshape", [(4, 6), (4, 5, 6)])
def test_adaln_layer_gradients(rng, xshape):
    layer = lnlib.AdaLN(6, 3, zero_init=False, rng=rng, dtype=np.float64)
    x = rng.standard_normal(xshape)
    c = rng.standard_normal((4, 3))
    y, gate = layer(x, c)
    assert y.shape == x.shape and gate.shape == (4,) + (1,) * (len(xshape) - 2) + (6,)
    dy = rng.standard_normal(xshape)
    dgate = rng.standard_normal(gate.shape)
    dx, dc = layer.backward(dy, dgate)

    def loss_of(x_, c_, weight):
        saved = layer.weight
        layer.weight = weight
        try:
            y_, g_ = lnlib.AdaLN.forward(layer, x_, c_)
        finally:
            layer.weight = saved
        return np.sum(dy * y_) + np.sum(dgate * g_)

    one = np.ones(1)
    lnlib.check_grad(lambda v: one * loss_of(v, c, layer.weight), x, one, dx)
    lnlib.check_grad(lambda v: one * loss_of(x, v, layer.weight), c, one, dc)
    lnlib.check_grad(lambda v: one * loss_of(x, c, v), layer.weight, one, layer.dweight)


def test_adaln_layer_dgate_none_is_zero_and_a_full_dgate_is_summed_over_t(rng):
    """dgate=None counts as zero; a dgate of the shape of x (B, T, dim) is the gradient of the
    gate broadcast over T, the same as its sum over T."""
    layer = lnlib.AdaLN(6, 3, zero_init=False, rng=rng, dtype=np.float64)
    x, c = rng.standard_normal((4, 5, 6)), rng.standard_normal((4, 3))
    dy, dgate = rng.standard_normal(x.shape), rng.standard_normal(x.shape)

    def grads(dgate):
        return (*layer.backward(dy, dgate), layer.dweight, layer.dbias)

    layer(x, c)
    for a, b in zip(grads(None), grads(np.zeros_like(dgate))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(grads(dgate), grads(dgate.sum(axis=1, keepdims=True))):  # that of gate
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(grads(dgate)[1], grads(None)[1]), "the gate's gradient reaches dc"


@pytest.mark.parametrize(
    "num_groups, error, match",
    [
        (0, ValueError, "num_groups must be >= 1, got 0"),
        (4, ValueError, "num_groups must divide num_channels = 6, got 4"),
        (2.0, TypeError, "num_groups must be an int, got float"),
        (True, TypeError, "num_groups must be an int, got bool"),
    ],
)
def test_group_norm_layer_checks_num_groups_as_the_function_does(num_groups, error, match):
    """The layer's check is lnlib's (_validate.num_groups_value): a float or a bool is refused,
    not truncated by int() as it was before."""
    with pytest.raises(error, match=match):
        lnlib.GroupNorm(num_groups, 6)
    assert lnlib.GroupNorm(np.int64(3), 6).num_groups == 3


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda n: lnlib.AdaLN(n, 3), "dim"),
        (lambda n: lnlib.AdaLN(6, n), "cond_dim"),
        (lambda n: lnlib.BatchNorm(n), "num_features"),
        (lambda n: lnlib.GroupNorm(1, n), "num_channels"),
    ],
)
@pytest.mark.parametrize("n, error", [(2.5, TypeError), (True, TypeError), (0, ValueError)])
def test_layer_sizes_are_checked_not_truncated(make, name, n, error):
    """A size that is not a positive int is refused naming it (AdaLN and GroupNorm took int()
    of it: 2.5 became 2)."""
    with pytest.raises(error, match=f"^{name} must be"):
        make(n)


def test_adaln_zero_layer_starts_with_zero_gate_and_plain_norm(rng):
    layer = lnlib.AdaLN(6, 3)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    y, gate = layer(x, rng.standard_normal((2, 3)).astype(np.float32))
    assert not gate.any()
    np.testing.assert_allclose(y, lnlib.layer_norm(x, eps=1e-6), atol=1e-6)


def test_zero_centred_layers_start_as_the_plain_ones(rng):
    """Issue 12: weight_offset=1.0 with the weight starting at zero is the same layer."""
    x = rng.standard_normal((4, 6))
    dy = rng.standard_normal((4, 6))
    for cls in (lnlib.LayerNorm, lnlib.RMSNorm):
        zc, plain = cls(6, dtype=np.float64, weight_offset=1.0), cls(6, dtype=np.float64)
        assert not zc.weight.any()
        np.testing.assert_array_equal(zc(x), plain(x))
        np.testing.assert_array_equal(zc.backward(dy), plain.backward(dy))
        np.testing.assert_array_equal(zc.dweight, plain.dweight)
    with pytest.raises(ValueError, match="weight_offset"):
        lnlib.RMSNorm(6, elementwise_affine=False, weight_offset=1.0)
