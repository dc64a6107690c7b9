"""AdaLN and GroupNorm on the CUDA kernels' modulated LayerNorm (norms.cu: MOD, ModRows), whose
weight and bias change with the row: row i takes parameter row (i // group) % mods.

Three layers of checks:

- on every machine, the row numbering of the backward's runs (ModRows) and the layout the public
  functions give the parameters (``ada_norm._param_layout``, ``group_norm._group_rows``), run
  through a NumPy model of the modulated row functions in place of the kernels, against the
  CPU paths;
- on a GPU (marker ``gpu``: skipped with the reason elsewhere, failing under
  ``LNLIB_REQUIRE_GPU=1``), the kernels against the float64 CPU results, with many rows per
  unit, long rows, several parameter rows and every dtype, and bitwise batch invariance.
"""

import contextlib
import importlib

import numpy as np
import pytest
from conftest import _cupy_with_gpu, assert_close, skip_or_fail

import lnlib
from lnlib._cuda import build, cuda_kernel
from lnlib._rows import sum_to_shape

# the modules (lnlib.group_norm is also the function)
ada_norm = importlib.import_module("lnlib.ada_norm")
group_norm = importlib.import_module("lnlib.group_norm")

# (x shape, shift shape, scale shape, normalized_ndim): a row per sample, per position, one for
# all rows, varying along consecutive middle axes, along axes that are not consecutive (laid out
# per row of x), shift and scale of different shapes, broadcast inside the normalized axes.
ADA_CASES = [
    ((6, 8), (6, 8), (6, 8), 1),
    ((3, 5, 8), (3, 1, 8), (3, 1, 8), 1),
    ((3, 5, 8), (8,), (8,), 1),
    ((2, 4, 6), (1, 4, 1), (1, 4, 1), 1),
    ((2, 3, 4, 8), (1, 3, 1, 8), (1, 3, 1, 8), 1),
    ((2, 3, 4, 8), (2, 1, 4, 8), (2, 1, 4, 8), 1),
    ((3, 5, 8), (3, 1, 8), (8,), 1),
    ((3, 4, 5, 6), (3, 1, 1, 6), (3, 1, 5, 6), 2),
]
GROUP_CASES = [((4, 6), 3), ((3, 6, 5), 2), ((2, 8, 3, 4), 4), ((3, 6, 2, 5), 1), ((2, 6, 7), 6)]


def run_rows(m, group, mods, p):
    """The rows run ``p`` of a modulated backward takes, in order: p * group + ModRows.row(k)
    of norms.cu for k = 0 .. m / mods - 1, transcribed (the host gives group 1 or m rows)."""
    cuda_kernel._check_mod(m, group, mods)
    stride = mods if group == 1 else 1
    return [p * group + k * stride for k in range(m // mods)]


@pytest.mark.parametrize(
    "m,group,mods", [(12, 1, 3), (12, 4, 3), (24, 1, 24), (5, 5, 1), (8, 1, 1)]
)
def test_each_run_takes_exactly_the_rows_of_its_parameter_row(m, group, mods):
    seen = []
    for p in range(mods):
        rows = run_rows(m, group, mods, p)
        assert all((i // group) % mods == p for i in rows), (p, rows)
        seen += rows
    assert sorted(seen) == list(range(m))


# A NumPy model of the modulated row functions, in float64 -------------------------------------


def _param_index(m, group, mods):
    cuda_kernel._check_mod(m, group, mods)  # only the layouts the kernels take
    return (np.arange(m) // group) % mods


def model_forward(x, weight, bias, eps, group, mods):
    """y = xhat * weight[p] + bias[p] with p = (i // group) % mods, as the kernels define it."""
    p = _param_index(x.shape[0], group, mods)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=1)
    rstd = 1 / np.sqrt(((x64 - mean[:, None]) ** 2).mean(axis=1) + eps)
    y = (x64 - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight[p]
    if bias is not None:
        y = y + bias[p]
    return y.astype(x.dtype), mean, rstd


#: What a cluster of the modulated cluster kernel may get wrong (a flawed model, which the
#: checks below must catch): rows numbered over the whole grid, as without MOD, so a cluster
#: mixes parameter rows; its partial sums written at u * mods + p, runs interleaved, not at
#: p * units + u, the layout _column_sum reduces run by run.
CLUSTER_FLAWS = ("rows of the whole grid", "runs interleaved")


def cluster_partials(terms, group, mods, flaw=None):
    """The partial buffers (mods * units, D) the modulated cluster kernel writes for each of
    ``terms`` ((M, D) arrays: dy * xhat, dy), transcribed from norms.cu (norm_bwd_cluster with
    MOD, ModRows) and the launch (cuda_kernel._launch_backward): ``units`` =
    build.cluster_run_units clusters a run; the u-th cluster of run p adds the run's rows u,
    u + units, ... (run_rows) in that order and writes row p * units + u."""
    m, d = terms[0].shape
    units = build.cluster_run_units(m, d, mods, build.DEFAULT_SMS)
    parts = [np.zeros((mods * units, d)) for _ in terms]
    for p in range(mods):
        rows = run_rows(m, group, mods, p)
        for u in range(units):
            at = u * mods + p if flaw == CLUSTER_FLAWS[1] else p * units + u
            taken = rows[u::units]
            if flaw == CLUSTER_FLAWS[0]:
                taken = list(range(m))[p * units + u :: mods * units]
            for part, t in zip(parts, terms):
                for row in taken:
                    part[at] += t[row]
    return parts, units


def model_backward(dy, x, mean, rstd, weight, group, mods, flaw=None):
    """dx with per-row weight weight[p]; dweight, dbias (mods, D) summed per parameter row: for
    rows the cluster kernel takes (build.backward_path on build.DEFAULT_CC, an H100/H200), by
    its units (cluster_partials) then each run's units added (_column_sum with runs), else
    row by row."""
    m, d = x.shape
    p = _param_index(m, group, mods)
    dy64 = dy.astype(np.float64)
    xhat = (x.astype(np.float64) - mean[:, None]) * rstd[:, None]
    g = dy64 if weight is None else dy64 * weight[p]
    dx = rstd[:, None] * (g - g.mean(1, keepdims=True) - xhat * (g * xhat).mean(1, keepdims=True))
    path = build.backward_path("modulated_layer_norm_bwd", x.dtype, d, build.DEFAULT_CC)
    if path == "cluster":
        (pw, pb), units = cluster_partials((dy64 * xhat, dy64), group, mods, flaw)
        dw, db = (part.reshape(mods, units, d).sum(axis=1) for part in (pw, pb))
    else:
        dw, db = np.zeros((mods, d)), np.zeros((mods, d))
        np.add.at(dw, p, dy64 * xhat)
        np.add.at(db, p, dy64)
    return dx.astype(x.dtype), dw, db


MODELS = {
    "modulated_layer_norm_forward": model_forward,
    "modulated_layer_norm_backward": model_backward,
}

#: (m, d, group, mods) of long rows the cluster kernel takes on an H100/H200: group 1 (AdaLN per
#: position, GroupNorm: G runs of N rows) and mods * group = m (AdaLN per sample), float32 rows
#: of 20000 and 65536, with one to several rows a cluster.
LONG_MOD = [(64, 20000, 1, 4), (48, 20000, 12, 4), (12, 65536, 1, 3), (48, 65536, 16, 3)]


@pytest.mark.parametrize("m,d,group,mods", LONG_MOD)
def test_cluster_runs_take_each_row_once_for_its_parameter_row(m, d, group, mods):
    """The modulated backward of long rows takes the cluster kernel on an H100/H200, in runs of
    build.cluster_run_units clusters (at least one a run, at most a run's rows), which take every
    row of their parameter row once; the model's parameter gradients by those units equal the
    row-by-row sums, and each flawed model (CLUSTER_FLAWS) gives others."""
    op = "modulated_layer_norm_bwd"
    assert build.backward_path(op, "float32", d, build.DEFAULT_CC) == "cluster"
    assert build.backward_path(op, "float32", d, 80) == "long"
    units = build.cluster_run_units(m, d, mods, build.DEFAULT_SMS)
    assert 1 <= units <= m // mods
    assert units == min(-(-build.cluster_units(m, d) // mods), m // mods)
    # each row of the run its own term: which partial row took which row
    ident = np.eye(m)
    (part,), got_units = cluster_partials((ident,), group, mods)
    assert got_units == units and part.shape == (mods * units, m)
    owner = np.argmax(part, axis=0)  # the partial row of each row
    assert np.array_equal(part.sum(axis=0), np.ones(m))  # every row once
    assert np.array_equal(owner // units, _param_index(m, group, mods))  # in its own run
    rng = np.random.default_rng(1)
    x = rng.standard_normal((m, d)).astype(np.float32)
    dy = rng.standard_normal((m, d)).astype(np.float32)
    weight = 1 + 0.1 * rng.standard_normal((mods, d))
    _y, mean, rstd = model_forward(x, weight, weight, 1e-5, group, mods)
    dx, dw, db = model_backward(dy, x, mean, rstd, weight, group, mods)
    p = _param_index(m, group, mods)
    xhat = (x.astype(np.float64) - mean[:, None]) * rstd[:, None]
    for got, terms in ((dw, dy * xhat), (db, dy.astype(np.float64))):
        want = np.stack([terms[p == q].sum(axis=0) for q in range(mods)])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        for flaw in CLUSTER_FLAWS:
            flawed = model_backward(dy, x, mean, rstd, weight, group, mods, flaw)
            bad = flawed[1] if got is dw else flawed[2]
            assert not np.allclose(bad, want, rtol=1e-6, atol=1e-6), flaw


@pytest.mark.parametrize("d", [20000, 65536])
def test_long_rows_through_the_model_match_the_cpu_path(rng, d):
    """AdaLN (per sample and per position) and GroupNorm with rows the cluster kernel takes,
    through the model of its runs and units, against the CPU paths."""
    per = d // 8
    cases = [((2, 3, d), (2, 1, d), (2, 1, d), 1), ((4, 2, 8, per), (1, 2, 1, per), (8, per), 1)]
    for case in cases:
        x, shift, scale, dy, k = _ada_data(rng, case)
        want = _ada(x, shift, scale, dy, k)
        with through_the_model():
            got = _ada(x, shift, scale, dy, k)
        for name, g, w in zip(("y", "mean", "rstd", "dx", "dshift", "dscale"), got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"{name} {case}")
    x = rng.standard_normal((6, 8, d // 4)) * 2 + 0.5  # GroupNorm, 2 groups: rows of d
    w, b = 1 + 0.5 * rng.standard_normal(8), rng.standard_normal(8)
    dy = rng.standard_normal(x.shape)
    assert build.backward_path("modulated_layer_norm_bwd", x.dtype, d, build.DEFAULT_CC) == (
        "cluster" if d <= 32768 else "long"  # float64 rows: up to 32768 in the cluster kernel
    )
    want = lnlib.group_norm_forward(x, 2, w, b)
    want += lnlib.group_norm_backward(dy, x, *want[1:], 2, w)
    with through_the_model():
        got = lnlib.group_norm_forward(x, 2, w, b)
        got += lnlib.group_norm_backward(dy, x, *got[1:], 2, w)
    for name, a, e in zip(("y", "mean", "rstd", "dx", "dweight", "dbias"), got, want):
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12, err_msg=name)


#: The lines of norms.cu that number the modulated cluster kernel's blocks, rows and partial
#: rows (ModRows's constructor and row(), norm_bwd_cluster with MOD), which cluster_grid below
#: transcribes: the test fails if one of them changes, so the transcription follows the kernel.
CLUSTER_SOURCE_LINES = {
    "ModRows": [
        "blocks = MOD ? gridDim.x / mods : gridDim.x;",
        "param = MOD ? blockIdx.x / blocks : 0;",
        "block = blockIdx.x - param * blocks;",
        "count = MOD ? m / mods : m;",
        "first = param * group;",
        "stride = MOD && group == 1 ? mods : 1;",
        "__device__ __forceinline__ long long row(long long k) const"
        " { return MOD ? k * stride : k; }",
    ],
    "norm_bwd_cluster": [
        "const ModRows<MOD> rows(m, group, mods);",
        "const long long units = rows.blocks / C, u = rows.block / C;",
        "dy += rows.first * lddy, x += rows.first * ldx, dx += rows.first * lddx;",
        "mean += rows.first, rstd += rows.first;",
        "if (weight) weight += rows.param * d;",
        "dw_part += rows.param * units * d;",
        "if (CENTER) db_part += rows.param * units * d;",
        "if (u < rows.count) stage(rows.row(u), 0);",
        "for (long long k = u; k < rows.count; k += units, buf ^= 1) {",
        "const long long row = rows.row(k);",
        "if (u >= rows.count) return;",
        "dw_part[u * d + i] = pw[s][j];",
    ],
}


def _cuda_source_parts():
    """ModRows and norm_bwd_cluster's body in norms.cu, each as its stripped lines."""
    import re

    src = build.source()
    mod_rows = re.search(r"template <bool MOD> struct ModRows \{\n(.*?)\n\};", src, re.DOTALL)
    body = re.search(r"void norm_bwd_cluster\((.*?)\n#endif", src, re.DOTALL)
    assert mod_rows and body, "ModRows or norm_bwd_cluster not found in norms.cu"
    return {
        name: {line.strip() for line in part.group(1).splitlines()}
        for name, part in (("ModRows", mod_rows), ("norm_bwd_cluster", body))
    }


def cluster_grid(m, group, mods, blocks_in_grid, cluster=build.CLUSTER):
    """What each block of the modulated cluster kernel's grid takes, transcribed from the lines
    of CLUSTER_SOURCE_LINES: for blockIdx.x b, ``(cluster b // CLUSTER, parameter row, partial
    row p * units + u, its rows)``, the rows as global row numbers (rows.first added)."""
    out = []
    for b in range(blocks_in_grid):
        blocks = blocks_in_grid // mods  # ModRows (MOD): the run's blocks, its parameter row
        param = b // blocks
        block = b - param * blocks
        count, first = m // mods, param * group
        stride = mods if group == 1 else 1
        units, u = blocks // cluster, block // cluster  # norm_bwd_cluster
        rows = [first + k * stride for k in range(u, count, units)]
        out.append((b // cluster, param, param * units + u if u < count else None, rows))
    return out


@pytest.mark.parametrize(
    "m,group,mods", [(64, 1, 4), (48, 12, 4), (12, 1, 3), (48, 16, 3), (7, 7, 1), (9, 1, 9)]
)
@pytest.mark.parametrize("grid_threads", [None, 4096, 512])
def test_the_cluster_kernels_grid_takes_each_row_once_in_whole_clusters(
    monkeypatch, m, group, mods, grid_threads
):
    """The blocks of the grid the host launches (cuda_kernel._launch_backward: runs *
    build.cluster_run_units * CLUSTER), numbered as norms.cu numbers them (cluster_grid, its
    lines pinned to the source): the CLUSTER blocks of a cluster take the same rows (the same
    trip count: the cluster barriers of each row pair up), of their own parameter row; every
    row is taken once; each cluster writes one partial row, p * units + u, and the partial rows
    (runs * units, D) are each written once, run p's at p * units .. p * units + units - 1 (what
    _column_sum adds for parameter row p)."""
    found = _cuda_source_parts()
    for name, lines in CLUSTER_SOURCE_LINES.items():
        missing = [line for line in lines if line not in found[name]]
        assert not missing, f"norms.cu {name} changed; update cluster_grid: {missing}"
    if grid_threads:
        monkeypatch.setitem(build.GRID_THREADS, "bwd", grid_threads)
    for d, sms in ((20000, 132), (65536, 114), (30000, 8)):
        per_run = build.cluster_run_units(m, d, mods, sms)
        taken = cluster_grid(m, group, mods, mods * per_run * build.CLUSTER)
        clusters = {}
        for cluster, param, part_row, rows in taken:
            clusters.setdefault(cluster, []).append((param, part_row, rows))
        written, seen = {}, []
        for cluster, blocks in clusters.items():
            assert len(blocks) == build.CLUSTER and all(b == blocks[0] for b in blocks), cluster
            param, part_row, rows = blocks[0]
            assert part_row is not None, (cluster, "no partial row written: uninitialized sums")
            assert part_row // per_run == param, (cluster, part_row, param)
            assert all((i // group) % mods == param for i in rows), (cluster, param, rows)
            written[part_row] = written.get(part_row, 0) + 1
            seen += rows
        assert sorted(seen) == list(range(m)), (d, sms)
        assert written == dict.fromkeys(range(mods * per_run), 1), (d, sms)


@contextlib.contextmanager
def through_the_model():
    """AdaLN and GroupNorm on NumPy arrays take the path they take on the CUDA kernels, with the
    model in place of the kernels."""
    with pytest.MonkeyPatch.context() as mp:
        for module in (ada_norm, group_norm):
            real = module.select
            mp.setattr(module, "select", lambda op, xp, real=real: MODELS.get(op) or real(op, xp))
        yield


def _ada_data(rng, case, dtype=np.float64):
    xshape, shift_shape, scale_shape, k = case
    x = (rng.standard_normal(xshape) * 2 + 1).astype(dtype)
    shift = (0.3 * rng.standard_normal(shift_shape)).astype(dtype)
    scale = (0.3 * rng.standard_normal(scale_shape)).astype(dtype)
    return x, shift, scale, rng.standard_normal(xshape).astype(dtype), k


def _ada(x, shift, scale, dy, k):
    y, mean, rstd = lnlib.ada_layer_norm_forward(x, shift, scale, normalized_ndim=k)
    grads = lnlib.ada_layer_norm_backward(dy, x, mean, rstd, scale, shift_shape=shift.shape)
    return (y, mean, rstd, *grads)


@pytest.mark.parametrize("case", ADA_CASES)
def test_ada_layout_through_the_model_matches_the_cpu_path(rng, case):
    x, shift, scale, dy, k = _ada_data(rng, case)
    want = _ada(x, shift, scale, dy, k)
    layout = ada_norm._param_layout(x.shape, k, shift.shape, scale.shape)
    with through_the_model():
        got = _ada(x, shift, scale, dy, k)
    for name, g, w in zip(("y", "mean", "rstd", "dx", "dshift", "dscale"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, layout)
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"{name} {layout}")


def test_ada_layouts_are_those_intended():
    """Consecutive varying lead axes give (group, mods) without expanding where group is 1 or
    they start at the first axis; others are laid out over more rows."""
    assert ada_norm._param_layout((3, 5, 8), 1, (3, 1, 8), (3, 1, 8)) == ((3, 1, 8), 5, 3)
    assert ada_norm._param_layout((3, 5, 8), 1, (8,), (8,)) == ((1, 1, 8), 1, 1)
    assert ada_norm._param_layout((2, 4, 6), 1, (1, 4, 1), (1, 4, 1)) == ((1, 4, 6), 1, 4)
    assert ada_norm._param_layout((2, 3, 4, 8), 1, (1, 3, 1, 8), (8,)) == ((1, 3, 4, 8), 1, 12)
    assert ada_norm._param_layout((2, 3, 4, 8), 1, (2, 1, 4, 8), (8,)) == ((2, 3, 4, 8), 1, 24)
    assert ada_norm._param_layout((3, 4, 5, 6), 2, (3, 1, 1, 6), (1, 5, 6)) == ((3, 1, 5, 6), 4, 3)


@pytest.mark.parametrize("shape,g", GROUP_CASES)
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_layout_through_the_model_matches_the_cpu_path(rng, shape, g, affine):
    x = rng.standard_normal(shape) * 2 + 0.5
    w, b = (1 + 0.5 * rng.standard_normal(shape[1]), rng.standard_normal(shape[1]))
    w, b = (w, b) if affine else (None, None)
    dy = rng.standard_normal(shape)
    want = lnlib.group_norm_forward(x, g, w, b)
    want += lnlib.group_norm_backward(dy, x, *want[1:], g, w)
    with through_the_model():
        got = lnlib.group_norm_forward(x, g, w, b)
        got += lnlib.group_norm_backward(dy, x, *got[1:], g, w)
    for name, a, e in zip(("y", "mean", "rstd", "dx", "dweight", "dbias"), got, want):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12, err_msg=name)


# On a GPU --------------------------------------------------------------------------------------


@pytest.fixture
def cupy():
    found, reason = _cupy_with_gpu()
    if found is None:
        skip_or_fail(reason)
    with lnlib.use_implementation("auto"):
        yield found


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


DTYPES = [np.float32, np.float16, np.float64]
# (x shape, modulation shape): DiT's (B, T, D) with (B, 1, D), many rows a unit when the grid
# is capped; rows longer than a tile of the backward (the long-row kernel); per-position rows;
# float16 rows of 512 threads, whose backward loads each unit's next row early (PREFETCH)
GPU_ADA = [
    ((4, 300, 768), (4, 1, 768)),
    ((3, 7, 20000), (3, 1, 20000)),
    ((5, 64, 96), (1, 64, 96)),
    ((2, 40, 6144), (2, 1, 6144)),
]
UNIT = {np.float16: 2.0**-11, np.float32: 2.0**-24, np.float64: 2.0**-53}


def assert_sums_close(got, want, abs_sum, terms, dtype, what):
    """Parameter gradients: sums of ``terms`` terms whose magnitudes add to ``abs_sum``,
    accumulated in float32 (float64 for float64) and rounded to ``dtype``: the error is at most
    terms * u_acc * abs_sum plus the rounding of the result (and of the float32 xhat, which the
    first part covers). A lost, doubled or misplaced unit is far outside."""
    u_acc = UNIT[np.float64] if dtype == np.float64 else UNIT[np.float32]
    tol = terms * u_acc * abs_sum + 2 * UNIT[dtype] * np.abs(want)
    err = np.abs(got.astype(np.float64) - want)
    assert got.shape == want.shape and np.all(err <= tol), (what, float(np.max(err - tol)))


def _xhat64(x, axes):
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes, keepdims=True)
    return (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("xshape,mshape", GPU_ADA)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid_threads", [None, 1024])
def test_ada_on_the_gpu_against_float64(
    rng, cupy, monkeypatch, xshape, mshape, dtype, grid_threads
):
    if grid_threads:  # a few blocks a run: each unit takes many rows
        monkeypatch.setitem(build.GRID_THREADS, "bwd", grid_threads)
    check_ada_against_float64(rng, cupy, xshape, mshape, dtype)


def check_ada_against_float64(rng, cupy, xshape, mshape, dtype):
    """AdaLN on the GPU against float64: y, mean, rstd, dx within the file's tolerances, dshift
    and dscale within assert_sums_close."""
    x, shift, scale, dy, k = _ada_data(rng, (xshape, mshape, mshape, 1), dtype)
    got = [_host(a) for a in _ada(*(cupy.asarray(a) for a in (x, shift, scale, dy)), k)]
    want = _ada(*(a.astype(np.float64) for a in (x, shift, scale, dy)), k)
    for name, g, w, factor in zip(("y", "mean", "rstd", "dx"), got, want, (2, 1, 1, 4)):
        assert g.shape == w.shape, name
        assert_close(g, w, dtype, factor=factor)
    dy64, terms = dy.astype(np.float64), x.size // scale.size
    abs_dy = sum_to_shape(np.abs(dy64), scale.shape)
    abs_dy_xhat = sum_to_shape(np.abs(dy64 * _xhat64(x, -1)), scale.shape)
    assert_sums_close(got[4], want[4], abs_dy, terms, dtype, "dshift")
    assert_sums_close(got[5], want[5], abs_dy_xhat, terms, dtype, "dscale")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,g", GROUP_CASES + [((16, 64, 32, 32), 32), ((2, 32, 100, 100), 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_on_the_gpu_against_float64(rng, cupy, shape, g, dtype):
    check_group_norm_against_float64(rng, cupy, shape, g, dtype)


def check_group_norm_against_float64(rng, cupy, shape, g, dtype):
    """GroupNorm on the GPU, with and without the affine, against float64 as the AdaLN check."""
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w = (1 + 0.5 * rng.standard_normal(shape[1])).astype(dtype)
    b = rng.standard_normal(shape[1]).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    for affine in (True, False):
        params = (w, b) if affine else (None, None)
        on = [None if a is None else cupy.asarray(a) for a in (x, dy, *params)]
        fwd = lnlib.group_norm_forward(on[0], g, *on[2:])
        got = [_host(a) for a in fwd + lnlib.group_norm_backward(on[1], on[0], *fwd[1:], g, on[2])]
        x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
        p64 = [None if p is None else p.astype(np.float64) for p in params]
        fwd = lnlib.group_norm_forward(x64, g, *p64)
        want = fwd + lnlib.group_norm_backward(dy64, x64, *fwd[1:], g, p64[0])
        for name, a, e, factor in zip(("y", "mean", "rstd", "dx"), got, want, (2, 1, 1, 4)):
            assert a.shape == e.shape, name
            assert_close(a, e, dtype, factor=factor)
        rows = x64.reshape(shape[0] * g, -1)
        xhat = _xhat64(rows, -1).reshape(shape[0], shape[1], -1)  # (N, C, L)
        dyc = dy64.reshape(shape[0], shape[1], -1)
        terms = dyc.shape[0] * dyc.shape[2]
        abs_dw, abs_db = (np.abs(t).sum(axis=(0, 2)) for t in (dyc * xhat, dyc))
        assert_sums_close(got[4], want[4], abs_dw, terms, dtype, "dweight")
        assert_sums_close(got[5], want[5], abs_db, terms, dtype, "dbias")


# The modulated cluster kernel (compute capability 9.x: H100, H200) -------------------------

#: AdaLN rows the cluster kernel takes: per sample (group = T, mods = B) and per position (group
#: 1), rows of 20000 and 65536; GroupNorm (group 1, G runs of N rows) rows of 16384 and 65536.
#: With the grid as shipped (32 clusters on 132 SMs) 5, 4, 2, 2 and 2 rows a cluster; capped
#: to 8 clusters (GRID_THREADS["bwd"] = 4096), 20, 16, 8, 8 and 8.
GPU_CLUSTER_ADA = [
    ((4, 40, 20000), (4, 1, 20000)),
    ((32, 4, 20000), (1, 4, 20000)),
    ((2, 32, 65536), (2, 1, 65536)),
]
GPU_CLUSTER_GROUP = [((32, 8, 64, 64), 2), ((16, 16, 128, 128), 4)]
CLUSTER_GRID = [None, 4096]


def use_cluster_kernel(cupy, d, dtype):
    """Skip unless the modulated backward of ``dtype`` rows of ``d`` takes the cluster kernel on
    this GPU (compute capability 9.x, and 32768 elements at most for float64)."""
    cc = cuda_kernel._compute_capability()
    if build.backward_path("modulated_layer_norm_bwd", dtype, d, cc) != "cluster":
        pytest.skip(f"no cluster kernel for {np.dtype(dtype).name} rows of {d} on cc {cc}")


def _rows_a_cluster(m, d, mods):
    units = build.cluster_run_units(m, d, mods, cuda_kernel._sm_count())
    return (m // mods) // units


@pytest.mark.gpu
@pytest.mark.parametrize("grid_threads", CLUSTER_GRID)
@pytest.mark.parametrize("xshape,mshape", GPU_CLUSTER_ADA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ada_cluster_kernel_against_float64(
    rng, cupy, monkeypatch, xshape, mshape, dtype, grid_threads
):
    """The modulated cluster kernel under AdaLN's layouts, several rows a cluster."""
    use_cluster_kernel(cupy, xshape[-1], dtype)
    if grid_threads:
        monkeypatch.setitem(build.GRID_THREADS, "bwd", grid_threads)
    layout, group, mods = ada_norm._param_layout(xshape, 1, mshape, mshape)
    assert _rows_a_cluster(int(np.prod(xshape[:-1])), xshape[-1], mods) >= 2, (group, mods)
    check_ada_against_float64(rng, cupy, xshape, mshape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("grid_threads", CLUSTER_GRID)
@pytest.mark.parametrize("shape,g", GPU_CLUSTER_GROUP)
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_cluster_kernel_against_float64(
    rng, cupy, monkeypatch, shape, g, dtype, grid_threads
):
    """The modulated cluster kernel under GroupNorm's layout (G runs), several rows a cluster."""
    d = shape[1] // g * int(np.prod(shape[2:]))
    use_cluster_kernel(cupy, d, dtype)
    if grid_threads:
        monkeypatch.setitem(build.GRID_THREADS, "bwd", grid_threads)
    assert _rows_a_cluster(shape[0] * g, d, g) >= 2
    check_group_norm_against_float64(rng, cupy, shape, g, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [20000, 65536])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cluster_kernel_dx_is_bitwise_independent_of_the_batch(rng, cupy, d, dtype):
    """dx of AdaLN (per sample) and GroupNorm rows by the modulated cluster kernel: the same bits
    for rows 2-3 of 6 samples as for those two samples alone (other runs, units and mods)."""
    use_cluster_kernel(cupy, d, dtype)
    x, shift, scale, dy, k = _ada_data(rng, ((6, 5, d), (6, 1, d), (6, 1, d), 1), dtype)
    on = [cupy.asarray(a) for a in (x, shift, scale, dy)]
    full = [_host(a) for a in _ada(*on, k)[:4]]
    part = [_host(a) for a in _ada(*(a[2:4] for a in on), k)[:4]]
    for name, f, p in zip(("y", "mean", "rstd", "dx"), full, part):
        assert np.array_equal(f[2:4], p, equal_nan=True), name
    xg = cupy.asarray((rng.standard_normal((6, 8, d // 4)) * 2).astype(dtype))  # rows of d
    dyg = cupy.asarray(rng.standard_normal((6, 8, d // 4)).astype(dtype))
    wg = cupy.asarray(rng.standard_normal(8).astype(dtype))
    dx = []
    for sl in (slice(None), slice(2, 4)):
        fwd = lnlib.group_norm_forward(xg[sl], 2, wg, wg)
        dx.append(_host(lnlib.group_norm_backward(dyg[sl], xg[sl], *fwd[1:], 2, wg)[0]))
    assert np.array_equal(dx[0][2:4], dx[1], equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_bitwise_independent_of_the_batch_on_the_gpu(rng, cupy, dtype):
    x, shift, scale, dy, k = _ada_data(rng, ((6, 50, 384), (6, 1, 384), (6, 1, 384), 1), dtype)
    on = [cupy.asarray(a) for a in (x, shift, scale, dy)]
    full = [_host(a) for a in _ada(*on, k)[:4]]
    part = [_host(a) for a in _ada(*(a[2:4] for a in on), k)[:4]]
    for name, f, p in zip(("y", "mean", "rstd", "dx"), full, part):
        assert np.array_equal(f[2:4], p, equal_nan=True), name
    xg = cupy.asarray((rng.standard_normal((8, 32, 9, 9)) * 2).astype(dtype))
    wg = cupy.asarray(rng.standard_normal(32).astype(dtype))
    full = _host(lnlib.group_norm(xg, 8, wg, wg))
    part = _host(lnlib.group_norm(xg[3:5], 8, wg, wg))
    assert np.array_equal(full[3:5], part)
