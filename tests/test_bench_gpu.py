"""The GPU benchmark (``lnlib/bench_gpu.py``) on any machine: NumPy arrays and torch's CPU
kernels stand in for CuPy and CUDA (a stand-in ``cupy`` module whose ``ndarray`` no NumPy array
is, so lnlib takes its CPU paths), so the contenders, the check between them, the byte counts,
the JSON rows and the command line run here. The byte count is compared with the bytes of the
arrays each pass reads and writes, taken from lnlib's own outputs. Nothing here needs a GPU:
on one, the benchmark step of ``make gpu-check`` runs the same contenders and check at full
size. tools/gpu_ncu_cases.py's AdaLN launches are run here the same way."""

import json
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import lnlib
from lnlib import bench_gpu

torch = pytest.importorskip("torch")

#: The fields of every row of the JSON result, whatever the op.
ROW_FIELDS = {
    "op",
    "pass",
    "dtype",
    "M",
    "D",
    "lnlib_ms",
    "torch_ms",
    "lnlib_GBps",
    "torch_GBps",
    "copy_fraction",
    "speedup_vs_torch",
}
#: Elements of one call here (the benchmark's 2^27 is for a GPU): 4 AdaLN examples at d = 64.
ELEMENTS = 1 << 16


class _Event:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` module (NumPy's generator, events on the host clock, a GPU named
    "Fake GPU 1") and a small call (:data:`ELEMENTS`); the copy bound is 1000 GB/s."""
    fake = types.ModuleType("cupy")
    fake.ndarray = type("ndarray", (), {})  # no NumPy array is one: lnlib's CPU paths run
    fake.float32 = np.float32
    fake.__version__ = "0+stand-in"
    fake.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    fake.cuda = types.SimpleNamespace(
        Event=_Event,
        get_elapsed_time=lambda start, stop: 1e3 * (stop.t - start.t),
        Device=lambda: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(
            getDeviceProperties=lambda i: {"name": b"Fake GPU 1"},
            runtimeGetVersion=lambda: 13000,
        ),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(bench_gpu, "ELEMENTS", ELEMENTS)
    monkeypatch.setattr(bench_gpu, "copy_bandwidth", lambda cp, repeats, calls: 1000.0)
    return fake


def _arrays(op, d, dtype, batch=None, seed=1):
    """x, dy and the parameters of ``op`` as the benchmark lays them out (the AdaLN's
    shift and scale (B, 1, D) for x (B, T, D))."""
    rng = np.random.default_rng(seed)
    if op == "ada_layer_norm":
        shape, pshape = (batch, bench_gpu.ADA_TOKENS, d), (batch, 1, d)
    else:
        shape, pshape = (ELEMENTS // d, d), (d,)
    x, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    w, b = (rng.standard_normal(pshape).astype(dtype) for _ in range(2))
    return x, dy, w, b


def _moved(op, x, dy, w, b):
    """``(forward, backward)``: the bytes of the arrays each pass reads and writes, lnlib's
    outputs included (y, the statistics, dx and the parameter gradients)."""
    if op == "layer_norm":
        fwd_in, fwd_out = (x, w, b), lnlib.layer_norm_forward(x, w, b)
        _y, mean, rstd = fwd_out
        bwd_in = (dy, x, mean, rstd, w)
        bwd_out = lnlib.layer_norm_backward(dy, x, mean, rstd, w)
    elif op == "rms_norm":
        fwd_in, fwd_out = (x, w), lnlib.rms_norm_forward(x, w)
        _y, rstd = fwd_out
        bwd_in, bwd_out = (dy, x, rstd, w), lnlib.rms_norm_backward(dy, x, rstd, w)
    else:  # AdaLN: w is the scale, b the shift
        fwd_in, fwd_out = (x, b, w), lnlib.ada_layer_norm_forward(x, b, w)
        _y, mean, rstd = fwd_out
        bwd_in = (dy, x, mean, rstd, w)
        bwd_out = lnlib.ada_layer_norm_backward(dy, x, mean, rstd, w)
        assert len(bwd_out) == 3  # dx, dshift, dscale
    assert len(fwd_out) == (2 if op == "rms_norm" else 3)
    return tuple(sum(a.nbytes for a in arrays) for arrays in (fwd_in + fwd_out, bwd_in + bwd_out))


CASES = [("layer_norm", 96), ("rms_norm", 64), ("ada_layer_norm", 64), ("ada_layer_norm", 96)]


def test_ada_shape():
    """AdaLN's x (B, T, D): T = 256 and B * T the other ops' rows rounded down to a multiple
    of T, at every default width (at most 0.2 % fewer elements); one example at least."""
    assert bench_gpu.ADA_TOKENS == 256
    for d in bench_gpu.ADA_WIDTHS:
        batch, tokens = bench_gpu.ada_shape(d)
        rows = bench_gpu.ELEMENTS // d
        assert tokens == 256 and rows - tokens < batch * tokens <= rows
        assert batch * tokens * d >= 0.998 * bench_gpu.ELEMENTS
    assert bench_gpu.ada_shape(768) == (682, 256)  # 174592 rows of 768
    assert bench_gpu.ada_shape(4096) == (128, 256)  # 2^27 elements exactly
    assert bench_gpu.ada_shape(1 << 20) == (1, 256)  # fewer rows than T: one example


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("op,d", CASES)
def test_pass_bytes_are_the_arrays_moved(op, d, dtype):
    """pass_bytes counts every array each pass reads or writes once: the bytes of the inputs
    and of lnlib's outputs (float64's statistics in float64)."""
    batch = 3
    x, dy, w, b = _arrays(op, d, dtype, batch)
    m = x.size // d
    assert bench_gpu.pass_bytes(op, m, d, dtype, w.size // d) == _moved(op, x, dy, w, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op,d", CASES)
def test_rows(fake_cupy, monkeypatch, op, d, dtype):
    """bench_shape's two rows: the JSON fields of every op, the shape (AdaLN's M = B * T), the
    bandwidths from the bytes the arrays move (every contender timed at 2 ms) and the copy
    fraction; lnlib (its CPU paths here) and torch's formulation agree in _check first."""
    monkeypatch.setattr(bench_gpu, "_events", lambda cp, fn, calls: (fn(), 2.0)[1])
    rng = np.random.default_rng(0)
    rows = bench_gpu.bench_shape(fake_cupy, torch, op, d, np.dtype(dtype), 2, 1, 1000.0, rng)
    batch = ELEMENTS // d // 256
    m = batch * 256 if op == "ada_layer_norm" else ELEMENTS // d
    fwd, bwd = _moved(op, *_arrays(op, d, dtype, batch))
    assert [r["pass"] for r in rows] == ["forward", "forward+backward"]
    for row, nbytes in zip(rows, (fwd, fwd + bwd)):
        assert set(row) == ROW_FIELDS
        assert (row["op"], row["dtype"], row["M"], row["D"]) == (op, np.dtype(dtype).name, m, d)
        assert row["lnlib_ms"] == row["torch_ms"] == 2.0
        assert row["lnlib_GBps"] == pytest.approx(nbytes / 2.0 / 1e6, rel=1e-12)
        assert row["torch_GBps"] == row["lnlib_GBps"]
        assert row["copy_fraction"] == pytest.approx(row["lnlib_GBps"] / 1000.0, rel=1e-12)
        assert row["speedup_vs_torch"] == 1.0
    assert json.loads(json.dumps(rows)) == rows  # plain JSON types


def _ada_runs(fake_cupy, dtype=np.float32, d=64, x_scale=1.0):
    x, dy, w, b = _arrays("ada_layer_norm", d, dtype, batch=3)
    x *= x_scale
    return bench_gpu._contenders(fake_cupy, torch, "ada_layer_norm", x, w, b, dy), (x, dy, w, b)


def test_ada_contenders_are_dit_adaln(fake_cupy):
    """torch's contender is DiT's modulate(LayerNorm(x), shift, scale) without affine, eps
    1e-6, with its gradients in lnlib's order (dx, dshift, dscale); lnlib's contender too:
    both compared here with the formulas in float64, on rows of variance 1e-6, where an eps of
    1e-5 would be seen."""
    runs, (x, dy, scale, shift) = _ada_runs(fake_cupy, x_scale=1e-3)
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6)
    xhat = (x - mu) * rstd
    g = dy * (1 + scale)
    want_fb = (
        rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)),
        dy.sum(1, keepdims=True),
        (dy * xhat).sum(1, keepdims=True),
    )
    for who in ("torch", "lnlib"):
        y = runs[(who, "forward")][0]()
        y = y[0] if who == "lnlib" else y.numpy()
        np.testing.assert_allclose(y, xhat * (1 + scale) + shift, atol=1e-4, err_msg=who)
        got = runs[(who, "forward+backward")][0]()
        assert len(got) == 3
        for a, want, name in zip(got, want_fb, ("dx", "dshift", "dscale")):
            a = np.asarray(a.detach() if who == "torch" else a, dtype=np.float64)
            assert a.shape == want.shape, (who, name)
            np.testing.assert_allclose(a, want, atol=2e-3, rtol=1e-4, err_msg=f"{who} {name}")


@pytest.mark.parametrize("op,d", [("layer_norm", 96), ("rms_norm", 64), ("ada_layer_norm", 64)])
def test_check_compares_every_output(fake_cupy, op, d):
    """_check passes the contenders as they are, and fails when torch's y or any one of its
    gradients (AdaLN's dscale, the last, included) is wrong, naming the output."""
    x, dy, w, b = _arrays(op, d, np.float32, batch=3)
    runs = bench_gpu._contenders(fake_cupy, torch, op, x, w, b, dy)
    bench_gpu._check(fake_cupy, torch, runs, np.float32)
    fwd, fb = runs[("torch", "forward")], runs[("torch", "forward+backward")]
    n = len(fb[0]())
    assert n == (2 if op == "rms_norm" else 3)
    wrong = dict(runs)
    wrong[("torch", "forward")] = (lambda: fwd[0]() * 1.5, fwd[1])
    with pytest.raises(AssertionError, match=r"forward, output 0"):
        bench_gpu._check(fake_cupy, torch, wrong, np.float32)
    for i in range(n):

        def grads(i=i):
            return tuple(t * 3 if j == i else t for j, t in enumerate(fb[0]()))

        wrong = dict(runs)
        wrong[("torch", "forward+backward")] = (grads, fb[1])
        with pytest.raises(AssertionError, match=rf"forward\+backward, output {i}"):
            bench_gpu._check(fake_cupy, torch, wrong, np.float32)


def test_check_fails_without_dits_one_plus_scale(fake_cupy):
    """A torch AdaLN that scales by ``scale`` instead of ``1 + scale`` fails the check."""
    runs, (x, _dy, scale, shift) = _ada_runs(fake_cupy)
    xt, st, bt = (torch.from_numpy(a) for a in (x, scale, shift))
    wrong = dict(runs)
    f = torch.nn.functional.layer_norm
    wrong[("torch", "forward")] = (lambda: f(xt, (64,), eps=1e-6) * st + bt, 0)
    with pytest.raises(AssertionError, match="forward, output 0"):
        bench_gpu._check(fake_cupy, torch, wrong, np.float32)


def test_main_writes_every_op(fake_cupy, tmp_path, capsys):
    """The whole run through the command line: every op, pass, dtype and width in order (AdaLN
    at --ada-widths only), timed by the (stand-in) events, written as JSON named after the GPU."""
    argv = ["--widths", "64,96", "--ada-widths", "64", "--dtypes", "float32,float16"]
    argv += ["--repeats", "2", "--calls", "1", "--out-dir", str(tmp_path)]
    result = bench_gpu.main(argv)
    path = tmp_path / "gpu_fake_gpu_1.json"
    assert json.loads(path.read_text()) == result
    assert result["gpu"] == "Fake GPU 1" and result["copy_GBps"] == 1000.0
    assert result["ada_tokens"] == 256 and result["elements_per_call"] == ELEMENTS
    assert result["repeats"] == 2 and result["calls_per_timing"] == 1
    assert result["command"] == "python -m lnlib.bench --gpu " + " ".join(argv)
    got = [(r["dtype"], r["op"], r["D"], r["pass"]) for r in result["results"]]
    want = [
        (dt, op, d, kind)
        for dt in ("float32", "float16")
        for op, widths in (
            ("layer_norm", (64, 96)),
            ("rms_norm", (64, 96)),
            ("ada_layer_norm", (64,)),
        )
        for d in widths
        for kind in ("forward", "forward+backward")
    ]
    assert got == want
    for r in result["results"]:
        assert set(r) == ROW_FIELDS
        assert r["lnlib_ms"] > 0 and r["torch_ms"] > 0 and np.isfinite(r["lnlib_GBps"])
    ada = [r for r in result["results"] if r["op"] == "ada_layer_norm"]
    assert {r["M"] for r in ada} == {ELEMENTS // 64 // 256 * 256}
    out = capsys.readouterr().out
    assert "ada_layer_norm forward+backward float16     64" in out
    assert f"wrote {path}" in out


def test_a_failing_shape_is_recorded_and_the_rest_still_run(fake_cupy, tmp_path, monkeypatch):
    """A shape whose check or run raises (a first run on a new GPU) is listed under "failures"
    with its error, the other shapes still run and the JSON is still written."""
    real = bench_gpu.bench_shape

    def failing(cp, torch, op, d, dtype, *args):
        if op == "ada_layer_norm" and dtype == np.float32:
            raise AssertionError("AdaLN: lnlib and torch differ")
        return real(cp, torch, op, d, dtype, *args)

    monkeypatch.setattr(bench_gpu, "bench_shape", failing)
    argv = ["--widths", "64", "--ada-widths", "64", "--dtypes", "float32,float16"]
    result = bench_gpu.main(argv + ["--repeats", "1", "--calls", "1", "--out-dir", str(tmp_path)])
    assert result["failures"] == [
        {"op": "ada_layer_norm", "dtype": "float32", "D": 64,
         "error": "AssertionError('AdaLN: lnlib and torch differ')"}
    ]  # fmt: skip
    got = {(r["dtype"], r["op"]) for r in result["results"]}
    assert got == {(dt, op) for dt in ("float32", "float16") for op in bench_gpu.OPS} - {
        ("float32", "ada_layer_norm")
    }
    assert json.loads((tmp_path / "gpu_fake_gpu_1.json").read_text()) == result


def test_main_ops_subset(fake_cupy, tmp_path):
    """--ops ada_layer_norm runs AdaLN alone."""
    argv = ["--ops", "ada_layer_norm", "--ada-widths", "64", "--dtypes", "float32"]
    result = bench_gpu.main(argv + ["--repeats", "1", "--calls", "1", "--out-dir", str(tmp_path)])
    assert [(r["op"], r["pass"]) for r in result["results"]] == [
        ("ada_layer_norm", "forward"),
        ("ada_layer_norm", "forward+backward"),
    ]


@pytest.mark.parametrize(
    "argv,name",
    [
        (["--ops", "layer_norm,ada"], "--ops"),
        (["--widths", "0,768"], "--widths"),
        (["--widths", "768,"], "--widths"),
        (["--ada-widths", "x"], "--ada-widths"),
        (["--dtypes", "int8"], "--dtypes"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bad_arguments(argv, name, capsys):
    """Bad input stops before anything runs, with an error naming the argument."""
    with pytest.raises(SystemExit) as exc:
        bench_gpu.main(argv)
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_help():
    """``python -m lnlib.bench_gpu --help`` and ``python -m lnlib.bench --gpu --help`` list the
    AdaLN options without CuPy."""
    for cmd in (["lnlib.bench_gpu"], ["lnlib.bench", "--gpu"]):
        done = subprocess.run(
            [sys.executable, "-m", *cmd, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "--ada-widths" in done.stdout and "ada_layer_norm" in done.stdout


def test_ncu_cases_run_adaln(monkeypatch, capsys):
    """tools/gpu_ncu_cases.py, with NumPy standing in for CuPy and lnlib's CPU paths for the
    CUDA kernels (its shapes made small): the AdaLN forward and backward run, in the warm-up
    and in the profiled range, on DiT's layout; its real case is 64 MiB of x at d = 4096."""
    import importlib.util
    from contextlib import contextmanager, nullcontext
    from pathlib import Path

    calls, profiled = [], []

    @contextmanager
    def profile():
        profiled.append(len(calls))
        yield
        profiled.append(len(calls))

    fake = types.ModuleType("cupy")
    fake.ndarray = type("ndarray", (), {})
    fake.asarray = np.asarray
    fake.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: 0))
    cupyx = types.ModuleType("cupyx")
    cupyx.profiler = types.SimpleNamespace(profile=profile)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    monkeypatch.setitem(sys.modules, "cupyx.profiler", cupyx.profiler)
    path = Path(__file__).resolve().parents[1] / "tools" / "gpu_ncu_cases.py"
    spec = importlib.util.spec_from_file_location("gpu_ncu_cases", path)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    (b, t, d), dtype = cases.ADA_CASE
    assert (d, np.dtype(dtype)) == (4096, np.float32) and b * t * d * 4 == 64 << 20
    forward, backward = lnlib.ada_layer_norm_forward, lnlib.ada_layer_norm_backward

    def fwd(x, shift, scale, **kw):
        assert x.shape == (3, 256, 64) and shift.shape == scale.shape == (3, 1, 64)
        calls.append("fwd")
        return forward(x, shift, scale, **kw)

    def bwd(dy, x, mean, rstd, scale, **kw):
        calls.append("bwd")
        return backward(dy, x, mean, rstd, scale, **kw)

    monkeypatch.setattr(cases.lnlib, "ada_layer_norm_forward", fwd)
    monkeypatch.setattr(cases.lnlib, "ada_layer_norm_backward", bwd)
    monkeypatch.setattr(cases.lnlib, "use_implementation", lambda name: nullcontext(name))
    monkeypatch.setattr(cases, "CASES", ((64, np.float32),))
    monkeypatch.setattr(cases, "ADA_CASE", ((3, 256, 64), np.float32))
    small = (np.ones((4, 64), np.float32), np.ones((4, 64), np.float32), np.ones(64, np.float32))
    monkeypatch.setattr(cases, "arrays", lambda d, dtype, rng: small)
    assert cases.main() == 0
    assert calls == ["fwd", "bwd", "fwd", "bwd"] and profiled == [2, 4]
    assert "AdaLN 3x256x64 float32" in capsys.readouterr().err
