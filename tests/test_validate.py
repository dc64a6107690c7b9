"""Bad input: every public function raises a clear error naming the argument, before any work."""

import subprocess
import sys

import numpy as np
import pytest

import lnlib

X = np.ones((2, 3, 4))
STATS = (np.zeros((2, 3)), np.ones((2, 3)))

FORWARDS = {
    "layer_norm_forward": lambda x, **kw: lnlib.layer_norm_forward(x, **kw),
    "layer_norm": lambda x, **kw: lnlib.layer_norm(x, **kw),
    "rms_norm_forward": lambda x, **kw: lnlib.rms_norm_forward(x, **kw),
    "rms_norm": lambda x, **kw: lnlib.rms_norm(x, **kw),
    "ada_layer_norm_forward": lambda x, **kw: lnlib.ada_layer_norm_forward(
        x, np.zeros(x.shape[-1:] or 1), np.zeros(x.shape[-1:] or 1), **kw
    ),
}


@pytest.mark.parametrize("fn", FORWARDS.values(), ids=FORWARDS.keys())
@pytest.mark.parametrize(
    "x",
    [
        np.ones((2, 3), int),
        np.ones((2, 3), bool),
        np.ones((2, 3), complex),
        np.array([[1.0, "a"]], dtype=object),
        np.ones((2, 3), np.uint8),
    ],
    ids=["int", "bool", "complex", "object", "uint8"],
)
def test_non_floating_x_is_a_type_error(fn, x):
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        fn(x)


@pytest.mark.parametrize("fn", FORWARDS.values(), ids=FORWARDS.keys())
@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf")])
def test_bad_eps(fn, eps):
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        fn(X, eps=eps)


@pytest.mark.parametrize("fn", FORWARDS.values(), ids=FORWARDS.keys())
@pytest.mark.parametrize("k", [0, 4, -1])
def test_bad_normalized_ndim(fn, k):
    with pytest.raises(ValueError, match="normalized_ndim must be between 1 and x.ndim = 3"):
        fn(X, normalized_ndim=k)


@pytest.mark.parametrize("fn", FORWARDS.values(), ids=FORWARDS.keys())
def test_normalized_ndim_must_be_an_int(fn):
    with pytest.raises(TypeError, match="normalized_ndim must be an int"):
        fn(X, normalized_ndim=1.0)


@pytest.mark.parametrize(
    "fn", [lnlib.layer_norm_forward, lnlib.rms_norm_forward], ids=["ln", "rms"]
)
def test_empty_normalized_axis(fn):
    with pytest.raises(ValueError, match="empty normalized axis"):
        fn(np.ones((3, 0)))
    with pytest.raises(ValueError, match="empty normalized axis"):
        fn(np.ones((3, 0, 2)), normalized_ndim=2)
    with pytest.raises(ValueError, match="0-d"):
        fn(np.float64(1.0))


def test_wrong_parameter_shapes():
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        lnlib.layer_norm(X, np.ones(3))
    with pytest.raises(ValueError, match=r"bias must have shape \(3, 4\)"):
        lnlib.layer_norm(X, np.ones((3, 4)), np.ones(4), normalized_ndim=2)
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        lnlib.rms_norm(X, np.ones((1, 4)))
    with pytest.raises(ValueError, match="shift must broadcast against x"):
        lnlib.ada_layer_norm(X, np.zeros((2, 4)), np.zeros(4))
    with pytest.raises(ValueError, match="scale must broadcast against x"):
        lnlib.ada_layer_norm(X, np.zeros(4), np.zeros((5, 3, 4)))
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        lnlib.layer_norm(X, np.ones(4, int))


def test_backward_shape_errors():
    dy = np.ones_like(X)
    with pytest.raises(ValueError, match=r"dy must have the shape of x, \(2, 3, 4\)"):
        lnlib.layer_norm_backward(dy[:1], X, *STATS)
    with pytest.raises(ValueError, match="mean must have the shape of the leading"):
        lnlib.layer_norm_backward(dy, X, np.zeros((3, 2)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="rstd must have the shape of mean"):
        lnlib.layer_norm_backward(dy, X, STATS[0], np.ones(2))
    with pytest.raises(ValueError, match="mean must have the shape of the leading"):
        lnlib.layer_norm_backward(dy, X, np.zeros((2, 3, 4)), np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        lnlib.layer_norm_backward(dy, X, *STATS, np.ones(5))
    with pytest.raises(ValueError, match="rstd must have the shape of the leading"):
        lnlib.rms_norm_backward(dy, X, np.ones(3))
    with pytest.raises(ValueError, match="dy must have the shape of x"):
        lnlib.rms_norm_backward(dy.T, X, STATS[1])
    with pytest.raises(ValueError, match="scale must broadcast"):
        lnlib.ada_layer_norm_backward(dy, X, *STATS, np.ones(5))
    with pytest.raises(TypeError, match="dy must have a floating dtype"):
        lnlib.layer_norm_backward(dy.astype(int), X, *STATS)
    with pytest.raises(TypeError, match="mean must have a floating dtype"):
        lnlib.layer_norm_backward(dy, X, STATS[0].astype(int), STATS[1])


def test_errors_come_before_any_work_and_leave_inputs_alone():
    """A call refused for its last-checked argument has written nothing: not the running
    statistics, not the out arrays, not the inputs."""
    x = np.random.default_rng(0).standard_normal((4, 3))
    x0 = x.copy()
    rm, rv = np.zeros(3), np.ones(3)
    for bad in ({"weight": np.ones(2)}, {"bias": np.ones(2)}, {"momentum": 2.0}, {"eps": -1.0}):
        args = {"weight": np.ones(3), "bias": np.zeros(3), "momentum": 0.1, "eps": 1e-5, **bad}
        with pytest.raises(ValueError):
            lnlib.batch_norm(x, rm, rv, training=True, **args)
        np.testing.assert_array_equal(rm, 0)  # running statistics untouched by the failed call
        np.testing.assert_array_equal(rv, 1)
    y, stat = np.full_like(x, 7.0), np.full(4, 7.0)
    with pytest.raises(ValueError, match="eps"):
        lnlib.layer_norm_forward(x, out=(y, stat, None), eps=-1.0)
    with pytest.raises(ValueError, match="weight_offset"):
        lnlib.rms_norm_forward(x, out=(y, stat), weight_offset=1.0)
    dx = np.full_like(x, 7.0)
    with pytest.raises(ValueError, match=r"out\[1\] \(dweight\)"):
        lnlib.layer_norm_backward(x, x, np.zeros(4), np.ones(4), out=(dx, np.empty(2), None))
    for a in (y, stat, dx):
        np.testing.assert_array_equal(a, 7.0)
    np.testing.assert_array_equal(x, x0)


def test_mixed_array_libraries_are_a_type_error():
    class FakeCupy:  # stands in for the cupy module, so this runs without a GPU
        class ndarray:
            pass

    sys.modules["cupy"] = FakeCupy
    try:
        with pytest.raises(
            TypeError, match="different array libraries: weight is a CuPy array but x is not"
        ):
            lnlib.layer_norm(X, FakeCupy.ndarray())
        with pytest.raises(TypeError, match="different array libraries"):
            lnlib.rms_norm_backward(np.ones((2, 3)), FakeCupy.ndarray(), np.ones(2))
    finally:
        del sys.modules["cupy"]


def test_eps_must_be_a_number():
    with pytest.raises(TypeError, match="eps must be a real number"):
        lnlib.layer_norm(X, eps="1e-5")


def test_lists_are_accepted_as_arrays():
    y = lnlib.layer_norm([[1.0, 2.0, 3.0]])
    np.testing.assert_allclose(y, lnlib.layer_norm(np.array([[1.0, 2.0, 3.0]])))


def test_import_needs_numpy_only_and_is_fast():
    code = (
        "import sys, time; t = time.perf_counter(); import lnlib; dt = time.perf_counter() - t; "
        "bad = [m for m in ('torch', 'cupy', 'matplotlib', 'scipy') if m in sys.modules]; "
        "print(dt, bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    dt, bad = out.split(" ", 1)
    assert bad.strip() == "[]", f"import lnlib pulled in {bad}"
    assert float(dt) < 1.0, f"import lnlib took {float(dt):.2f} s"


def test_masked_arrays_are_refused():
    """Issue 8: the mask of a masked array was silently ignored."""
    xm = np.ma.masked_array(X, mask=X > 0)
    with pytest.raises(TypeError, match="x is a masked array"):
        lnlib.layer_norm(xm)
    with pytest.raises(TypeError, match="weight is a masked array"):
        lnlib.rms_norm(X, np.ma.masked_array(np.ones(4)))
    with pytest.raises(TypeError, match="x is a masked array"):
        lnlib.batch_norm(xm, None, None, training=True)


def test_errors_name_the_argument_for_odd_values():
    """Issue 8: eps=10**400, shift_shape=(-1,) or 8 and an empty doutputs list."""
    with pytest.raises(ValueError, match="eps must be finite"):
        lnlib.layer_norm(X, eps=10**400)
    scale = np.zeros((2, 1, 4))
    y, mean, rstd = lnlib.ada_layer_norm_forward(X, scale, scale)
    for bad, kind in (((-1,), ValueError), (8, TypeError), ((2, 5), ValueError)):
        with pytest.raises(kind, match="shift_shape"):
            lnlib.ada_layer_norm_backward(X, X, mean, rstd, scale, shift_shape=bad)
    with pytest.raises(ValueError, match="momentum must be a number in"):
        lnlib.batch_norm(X, None, None, training=True, momentum=10**400)
    with pytest.raises(ValueError, match="doutputs must be a non-empty sequence"):
        lnlib.adaln_modulation_backward([], np.ones((2, 3)), np.ones((3, 6)))


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF"])
def test_kernel_switched_off_by_every_off_value(monkeypatch, value):
    """Issue 8: LNLIB_CPU_KERNEL=false kept the kernel."""
    from lnlib import _backend

    monkeypatch.setenv("LNLIB_CPU_KERNEL", value)
    kernel = lnlib.show_config(file=False)["implementations"]["kernel"]
    assert not kernel["available"] and "LNLIB_CPU_KERNEL" in kernel["reason"]
    assert _backend.select("layer_norm_forward", np).__module__ == "lnlib._cpu.numpy_path"
    with pytest.raises(RuntimeError, match="not available here: disabled by LNLIB_CPU_KERNEL"):
        with lnlib.use_implementation("kernel"):
            lnlib.layer_norm(X.astype(np.float32))


def test_unknown_kernel_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("LNLIB_CPU_KERNEL", "maybe")
    with pytest.raises(ValueError, match="LNLIB_CPU_KERNEL must be one of .* got 'maybe'"):
        lnlib.layer_norm(X)
    config = lnlib.show_config(file=False)  # reports it instead of failing
    assert "LNLIB_CPU_KERNEL must be one of" in config["implementations"]["kernel"]["reason"]


def test_use_implementation_names_and_errors():
    with pytest.raises(ValueError, match="name must be one of .*'numpy'.* got 'fast'"):
        with lnlib.use_implementation("fast"):
            pass
    with pytest.raises(TypeError, match=r"use_implementation\('cuda'\).*cupy arrays.*numpy"):
        with lnlib.use_implementation("cuda"):
            lnlib.layer_norm(X)


@pytest.mark.parametrize("name", ["kernel", "numpy", "reference", "auto"])
def test_forced_implementations_compute_the_same(rng, name):
    """Each forced implementation is the one selected, and computes what the reference does."""
    from lnlib import _backend

    if (
        name == "kernel"
        and not lnlib.show_config(file=False)["implementations"]["kernel"]["available"]
    ):
        pytest.skip("compiled kernel not available")
    modules = {"kernel": "lnlib._cpu.c_kernel", "numpy": "lnlib._cpu.numpy_path"}
    modules["reference"] = "lnlib.reference"
    x = rng.standard_normal((5, 7))
    with lnlib.use_implementation(name):
        assert lnlib.show_config(file=False)["forced"] == name
        if name in modules:
            fn = _backend.select("layer_norm_forward", np)
            assert fn.__module__ == modules[name], f"{name} selected {fn.__module__}"
        got = lnlib.layer_norm_forward(x, np.ones(7), np.zeros(7))
    for g, w in zip(got, lnlib.reference.layer_norm_forward(x, np.ones(7), np.zeros(7))):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    assert lnlib.show_config(file=False)["forced"] == "auto"


def test_show_config_prints_and_returns(capsys):
    config = lnlib.show_config()
    printed = capsys.readouterr().out
    assert set(config["implementations"]) >= {"kernel", "numpy", "reference", "cuda"}
    for name, row in config["implementations"].items():
        assert name in printed and row["reason"]
    assert config["implementations"]["numpy"]["available"]


def test_other_byte_order_is_read_as_its_values():
    """Arrays in the non-native byte order (as read from a file) are floats too: same result."""
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    swapped = x.astype(x.dtype.newbyteorder())
    before = swapped.copy()
    np.testing.assert_array_equal(lnlib.layer_norm(swapped), lnlib.layer_norm(x))
    np.testing.assert_array_equal(lnlib.rms_norm(swapped), lnlib.rms_norm(x))
    np.testing.assert_array_equal(swapped, before)
    assert swapped.dtype == before.dtype
