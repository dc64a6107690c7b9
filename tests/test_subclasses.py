"""ndarray subclasses: one behaviour on every implementation.

An ndarray subclass (``numpy.matrix``, ``numpy.memmap``, a subclass of one's own) is taken as
``numpy.asarray`` takes it: a plain ndarray viewing the same memory. So every public function
that takes arrays gives, on the kernel, the NumPy path and the reference, bitwise the results of
the same values as plain arrays, as plain ndarrays, and modifies nothing; an ``out=`` of a
subclass is written and returned. Masked arrays are refused (their mask would be ignored).
"""

import numpy as np
import pytest

import lnlib

# numpy.matrix is what the tests pass on purpose
pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")


class Tagged(np.ndarray):
    """A subclass that adds nothing, as libraries make them (units, metadata, ...)."""


def _data(rng, dtype=np.float32):
    """Named arrays for every op: x (N, C) = (4, 6), so that numpy.matrix can hold x."""
    a = {
        "x": (rng.standard_normal((4, 6)) * 2 + 1).astype(dtype),
        "dy": rng.standard_normal((4, 6)).astype(dtype),
        "w": (1 + 0.3 * rng.standard_normal(6)).astype(dtype),
        "b": rng.standard_normal(6).astype(dtype),
        "shift": rng.standard_normal((4, 6)).astype(dtype),
        "scale": rng.standard_normal((4, 6)).astype(dtype),
        "c": rng.standard_normal((4, 3)).astype(dtype),
        "mw": rng.standard_normal((3, 18)).astype(dtype),
        "mb": rng.standard_normal(18).astype(dtype),
        "d0": rng.standard_normal((4, 6)).astype(dtype),
        "d1": rng.standard_normal((4, 6)).astype(dtype),
        "d2": rng.standard_normal((4, 6)).astype(dtype),
        "alpha": np.array(0.7, dtype),
        "rm": rng.standard_normal(6).astype(dtype),
        "rv": (1 + rng.random(6)).astype(dtype),
    }
    a["mean"], a["rstd"] = lnlib.layer_norm_forward(a["x"], a["w"], a["b"])[1:]
    a["rrstd"] = lnlib.rms_norm_forward(a["x"], a["w"])[1]
    a["gmean"], a["grstd"] = lnlib.group_norm_forward(a["x"], 3, a["w"], a["b"])[1:]
    a["bmean"], a["brstd"] = lnlib.batch_norm_forward(
        a["x"], None, None, a["w"], a["b"], training=True
    )[1:]
    return a


#: Every public function that takes arrays, as ``name -> call(arrays)``.
CALLS = {
    "layer_norm": lambda a: lnlib.layer_norm(a["x"], a["w"], a["b"]),
    "layer_norm_forward": lambda a: lnlib.layer_norm_forward(a["x"], a["w"], a["b"]),
    "layer_norm_backward": lambda a: lnlib.layer_norm_backward(
        a["dy"], a["x"], a["mean"], a["rstd"], a["w"]
    ),
    "rms_norm": lambda a: lnlib.rms_norm(a["x"], a["w"]),
    "rms_norm_forward": lambda a: lnlib.rms_norm_forward(a["x"], a["w"]),
    "rms_norm_backward": lambda a: lnlib.rms_norm_backward(a["dy"], a["x"], a["rrstd"], a["w"]),
    "ada_layer_norm": lambda a: lnlib.ada_layer_norm(a["x"], a["shift"], a["scale"]),
    "ada_layer_norm_forward": lambda a: lnlib.ada_layer_norm_forward(
        a["x"], a["shift"], a["scale"]
    ),
    "ada_layer_norm_backward": lambda a: lnlib.ada_layer_norm_backward(
        a["dy"], a["x"], a["mean"], a["rstd"], a["scale"]
    ),
    "adaln_modulation": lambda a: lnlib.adaln_modulation(a["c"], a["mw"], a["mb"]),
    "adaln_modulation_backward": lambda a: lnlib.adaln_modulation_backward(
        [a["d0"], a["d1"], a["d2"]], a["c"], a["mw"]
    ),
    "batch_norm": lambda a: lnlib.batch_norm(
        a["x"], a["rm"], a["rv"], a["w"], a["b"], training=True
    ),
    "batch_norm_forward": lambda a: lnlib.batch_norm_forward(
        a["x"], a["rm"], a["rv"], a["w"], a["b"], training=True
    ),
    "batch_norm_forward_eval": lambda a: lnlib.batch_norm_forward(
        a["x"], a["rm"], a["rv"], a["w"], a["b"], training=False
    ),
    "batch_norm_backward": lambda a: lnlib.batch_norm_backward(
        a["dy"], a["x"], a["bmean"], a["brstd"], a["w"]
    ),
    "group_norm": lambda a: lnlib.group_norm(a["x"], 3, a["w"], a["b"]),
    "group_norm_forward": lambda a: lnlib.group_norm_forward(a["x"], 3, a["w"], a["b"]),
    "group_norm_backward": lambda a: lnlib.group_norm_backward(
        a["dy"], a["x"], a["gmean"], a["grstd"], 3, a["w"]
    ),
    "dynamic_tanh": lambda a: lnlib.dynamic_tanh(a["x"], a["alpha"], a["w"], a["b"]),
    "dynamic_tanh_backward": lambda a: lnlib.dynamic_tanh_backward(
        a["dy"], a["x"], a["alpha"], a["w"]
    ),
    "numerical_grad": lambda a: lnlib.numerical_grad(
        lambda v: lnlib.layer_norm(v, a["w"]), a["x"], a["dy"], h=1e-3
    ),
    "check_grad": lambda a: np.asarray(
        lnlib.check_grad(
            lambda v: lnlib.dynamic_tanh(v, 0.5),
            a["x"].astype(np.float64),
            a["dy"],
            lnlib.dynamic_tanh_backward(a["dy"].astype(np.float64), a["x"].astype(np.float64), 0.5)[
                0
            ],
        )
    ),
}


def _memmap(a, path):
    m = np.memmap(path, dtype=a.dtype, mode="w+", shape=a.shape)
    m[...] = a
    return m


def _wrap(kind, arrays, tmp_path):
    """The arrays as subclasses of ``kind``: numpy.matrix for the 2-D ones (a matrix has two
    axes), a memmap or a Tagged view for all."""
    out = {}
    for name, a in arrays.items():
        if kind == "matrix":
            out[name] = np.asmatrix(a) if a.ndim == 2 else a
        elif kind == "memmap":
            out[name] = _memmap(a, tmp_path / f"{name}.bin") if a.ndim else a
        else:
            out[name] = a.view(Tagged)
    return out


def _results(r):
    return r if isinstance(r, tuple) else (r,)


@pytest.mark.parametrize("kind", ["matrix", "memmap", "tagged"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_subclasses_give_the_plain_results_on_every_path(any_path, rng, tmp_path, name, kind):
    plain = _data(rng)
    wrapped = _wrap(kind, {k: v.copy() for k, v in plain.items()}, tmp_path)
    before = {k: np.array(v) for k, v in wrapped.items()}
    want = _results(CALLS[name](plain))
    got = _results(CALLS[name](wrapped))
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert type(g) is np.ndarray, f"{name} result {i} is a {type(g).__name__}"
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name} result {i}"
        np.testing.assert_array_equal(g, w, err_msg=f"{name} result {i} ({any_path})")
    for k, v in wrapped.items():
        # only batch_norm's running statistics change (in place, by design): as the plain ones
        expect = plain[k] if k in ("rm", "rv") else before[k]
        np.testing.assert_array_equal(np.asarray(v), expect, err_msg=f"{name} changed {k}")


@pytest.mark.parametrize("kind", ["matrix", "tagged"])
def test_out_of_a_subclass_is_written_and_returned(any_path, rng, tmp_path, kind):
    a = _data(rng)
    want = lnlib.layer_norm_forward(a["x"], a["w"], a["b"])
    want_dx = lnlib.layer_norm_backward(a["dy"], a["x"], a["mean"], a["rstd"], a["w"])
    wrap = np.asmatrix if kind == "matrix" else (lambda v: v.view(Tagged))
    y = wrap(np.full_like(a["x"], np.nan))
    assert lnlib.layer_norm(a["x"], a["w"], a["b"], out=y) is y
    np.testing.assert_array_equal(np.asarray(y), want[0])
    y = wrap(np.full_like(a["x"], np.nan))
    got = lnlib.layer_norm_forward(a["x"], a["w"], a["b"], out=(y, None, None))
    assert got[0] is y
    np.testing.assert_array_equal(np.asarray(y), want[0])
    dx = wrap(np.full_like(a["x"], np.nan))
    got = lnlib.layer_norm_backward(
        a["dy"], a["x"], a["mean"], a["rstd"], a["w"], out=(dx, None, None)
    )
    assert got[0] is dx
    np.testing.assert_array_equal(np.asarray(dx), want_dx[0])
    ry = wrap(np.full_like(a["x"], np.nan))
    lnlib.rms_norm_forward(a["x"], a["w"], out=(ry, None))
    np.testing.assert_array_equal(np.asarray(ry), lnlib.rms_norm(a["x"], a["w"]))


def test_masked_arrays_are_refused_everywhere(any_path, rng):
    a = _data(rng)
    masked = np.ma.masked_array(a["x"], mask=a["x"] > 2)
    for call in (
        lambda: lnlib.layer_norm(masked),
        lambda: lnlib.rms_norm_backward(a["dy"], masked, a["rrstd"]),
        lambda: lnlib.group_norm(masked, 3),
        lambda: lnlib.dynamic_tanh(masked, 0.5),
        lambda: lnlib.batch_norm(masked, None, None, training=True),
        lambda: lnlib.numerical_grad(lnlib.layer_norm, masked, a["dy"]),
    ):
        with pytest.raises(TypeError, match="x is a masked array"):
            call()
    y = np.ma.masked_array(np.zeros_like(a["x"]))
    with pytest.raises(TypeError, match="out is a masked array"):
        lnlib.layer_norm(a["x"], out=y)
    assert not y.data.any(), "the refused out was written"
