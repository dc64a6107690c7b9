"""The torch bridge on CUDA tensors: zero-copy through DLPack, lnlib's CUDA kernels on torch's
current stream, results against torch's own functions on the same device.

Needs CuPy, torch with CUDA and a GPU: every test is skipped with the reason when one is
missing, and fails instead when ``LNLIB_REQUIRE_GPU=1``, so a GPU machine cannot pass this
file without running it.
"""

import pytest
from conftest import skip_or_fail

pytestmark = pytest.mark.gpu


def _why_not():
    try:
        import cupy
        import torch
    except ImportError as exc:
        return f"needs CuPy and torch with CUDA: {exc}"
    try:
        if not (torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0):
            return "needs a CUDA GPU that both torch and CuPy see"
    except Exception as exc:  # noqa: BLE001 - a broken driver means no GPU for these tests
        return f"needs a CUDA GPU: CuPy cannot reach the driver ({exc})"
    return None


REASON = _why_not()


@pytest.fixture(autouse=True)
def _gpu_present():
    if REASON is not None:
        skip_or_fail(f"the test {REASON}")


@pytest.fixture
def torch():
    import torch

    return torch


def _leaves(torch, *arrays):
    return [a.detach().clone().requires_grad_(True) for a in arrays]


def _check_pair(torch, ours, theirs, dy, tol):
    """Outputs and the gradients of the leaves of two ``(output, leaves)`` computations agree."""
    (y1, in1), (y2, in2) = ours, theirs
    torch.testing.assert_close(y1, y2, atol=tol, rtol=tol)
    y1.backward(dy)
    y2.backward(dy)
    for a, b in zip(in1, in2):
        torch.testing.assert_close(a.grad, b.grad, atol=tol * 20, rtol=tol * 20)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float64", 1e-10)])
def test_layer_norm_and_rms_norm_on_cuda_tensors(torch, dtype, tol):
    import torch.nn.functional as F

    from lnlib import torch_bridge

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    # x is a strided view [..., :80] of a (64, 48, 96) leaf: the bridge must not need a copy
    xb = torch.randn(64, 48, 96, device="cuda", dtype=dt, generator=g)
    w, b = (torch.randn(80, device="cuda", dtype=dt, generator=g) for _ in range(2))
    dy = torch.randn(64, 48, 80, device="cuda", dtype=dt, generator=g)
    a, c = _leaves(torch, xb, w, b), _leaves(torch, xb, w, b)
    _check_pair(
        torch,
        (torch_bridge.layer_norm(a[0][..., :80], 80, a[1], a[2]), a),
        (F.layer_norm(c[0][..., :80], (80,), c[1], c[2]), c),
        dy,
        tol,
    )
    a, c = _leaves(torch, xb, w), _leaves(torch, xb, w)
    _check_pair(
        torch,
        (torch_bridge.rms_norm(a[0][..., :80], 80, a[1], 1e-6), a),
        (F.rms_norm(c[0][..., :80], (80,), c[1], 1e-6), c),
        dy,
        tol,
    )


def test_group_norm_and_dynamic_tanh_on_cuda_tensors(torch):
    import torch.nn.functional as F

    from lnlib import torch_bridge

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 12, 5, 7, device="cuda", generator=g)
    w, b = (torch.randn(12, device="cuda", generator=g) for _ in range(2))
    dy = torch.randn(8, 12, 5, 7, device="cuda", generator=g)
    a, c = _leaves(torch, x, w, b), _leaves(torch, x, w, b)
    _check_pair(
        torch,
        (torch_bridge.group_norm(a[0], 4, a[1], a[2]), a),
        (F.group_norm(c[0], 4, c[1], c[2]), c),
        dy,
        1e-4,
    )
    x2 = x.reshape(8, -1, 7)
    w2, b2, alpha = w[:7], b[:7], torch.tensor(0.7, device="cuda")
    a, c = _leaves(torch, x2, alpha, w2, b2), _leaves(torch, x2, alpha, w2, b2)
    _check_pair(
        torch,
        (torch_bridge.dynamic_tanh(*a), a),
        (c[2] * torch.tanh(c[1] * c[0]) + c[3], c),
        dy.reshape(8, -1, 7),
        1e-4,
    )


def test_cuda_tensors_cross_without_a_copy_and_on_torchs_stream(torch):
    import torch.nn.functional as F

    from lnlib import torch_bridge

    t = torch.randn(32, 40, device="cuda")[:, :32]  # strided
    assert torch_bridge._to_array(t).data.ptr == t.data_ptr(), "the CUDA tensor was copied"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(256, 1024, device="cuda") * 3 + 1  # queued on the side stream only
        y = torch_bridge.layer_norm(x, 1024)  # must run behind it, on the same stream
    side.synchronize()
    torch.testing.assert_close(y, F.layer_norm(x, (1024,)), atol=1e-4, rtol=1e-4)
