"""lnlib's CUDA row functions where the other GPU tests do not reach: parameter gradients
accumulated over many rows per unit (the partial sums that one-tile rows keep in registers, and
those of long rows: on compute capability 9.x, in the registers of the clusters of the cluster
kernel, which read each row once; elsewhere, in registers tile by tile of columns after a
launch that forms the rows' sums), one-tile float16/bfloat16 rows in blocks of 512
threads, which load each unit's next row early, grid-stride loops of many passes, bfloat16
forward and backward at several row lengths, and long rows' dx bitwise the same in a batch of
one row and of many, by either long-row kernel.

Each check runs on the CUDA kernels (marker ``gpu``: skipped with the reason where CuPy or a GPU
is missing, failing instead under ``LNLIB_REQUIRE_GPU=1``; ``make gpu-check`` runs them) and,
on every machine, on :class:`KernelModel`, a NumPy model of the kernels' arithmetic and of how
they share rows out to units. The model runs keep the checks tested without a GPU, and models
with a flaw (a lost pass, partial sums overwritten, ...) show that the checks fail a kernel
that groups rows wrongly.

Few units taking many rows: :data:`lnlib._cuda.build.GRID_THREADS` caps the grid and is read at
every launch; the cases with ``grid_threads`` lower it (monkeypatch), so that one or two blocks
take every row.

bfloat16 arrays are passed as their bit patterns, uint16 arrays that the test maps to the
bfloat16 kernels (``build.TYPE_NAMES``): CuPy holds bfloat16 arrays only where ml_dtypes is
installed, which the GPU machine may lack. Where CuPy holds them, the bfloat16 dtype is checked
to give the same bits.
"""

import functools
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import _cupy_with_gpu, skip_or_fail
from error_bounds import column_sum_bound, summand_errors

from lnlib import reference
from lnlib._cuda import build, cuda_kernel

DTYPES = ("float32", "float16", "bfloat16", "float64")
NORMS = ("layer_norm", "rms_norm")
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}
#: Largest error of a row result (y, dx) or a statistic (mean, rstd) against the float64
#: reference, relative to the values' scale: twice the unit roundoff of the result's dtype for its
#: rounding, plus the float32 arithmetic (tests/test_gpu.py allows the same 4e-5 for float32).
ROW_TOL = {
    "float64": 1e-10,
    "float32": 4e-5,
    "float16": 2 * 2.0**-11 + 4e-5,
    "bfloat16": 2 * 2.0**-8 + 4e-5,
}


def acc_name(dtype):
    """The accumulation dtype of the kernels for ``dtype`` (that of their statistics and
    parameter gradients)."""
    return "float64" if dtype == "float64" else "float32"


# bfloat16 as bit patterns ------------------------------------------------------------------


def bf16_bits(a, xp):
    """The bfloat16 numbers nearest the values of ``a`` (ties to even), as uint16 bit patterns."""
    b = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    half = xp.uint32(0x7FFF) + ((b >> xp.uint32(16)) & xp.uint32(1))
    return ((b + half) >> xp.uint32(16)).astype(xp.uint16)


def bf16_values(bits, xp):
    """The float32 values of bfloat16 bit patterns (exact)."""
    return (bits.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def dtype_name(a):
    """The dtype a row array holds: a uint16 array holds bfloat16 bit patterns."""
    return "bfloat16" if a.dtype == np.uint16 else a.dtype.name


class _Rows:
    """Row functions under test and the moves of data to and from them (``xp`` arrays)."""

    xp = np

    def put(self, values, dtype):
        """``values`` rounded to ``dtype`` (bfloat16: its bit patterns), on ``xp``."""
        a = self.xp.asarray(values)
        return bf16_bits(a, self.xp) if dtype == "bfloat16" else a.astype(dtype)

    def get(self, a):
        """The values of a row array, as float64 (exact)."""
        if a.dtype == np.uint16:
            a = bf16_values(a, self.xp)
        return a.astype(self.xp.float64)


class CudaRows(_Rows):
    """lnlib's CUDA row functions (lnlib._cuda.cuda_kernel) on CuPy arrays."""

    name = "cuda"

    def __init__(self, cupy):
        from lnlib._cuda import cuda_kernel

        self.xp, self._kernel = cupy, cuda_kernel

    def __call__(self, op, *args):
        return getattr(self._kernel, f"{op}_rows")(*args)


#: What a flawed KernelModel gets wrong (each a way to share rows out to units wrongly).
FLAWS = (
    "skips the last pass of the grid-stride loop",
    "overwrites its partial sums instead of adding (long rows)",
    "leaves the last unit out of the column sum",
    "keeps the partial sums in the data's dtype",
    "adds the cluster's block sums in reverse rank order",
)


class KernelModel(_Rows):
    """A NumPy model of the CUDA kernels, standing in for them where no GPU is present.

    The arithmetic is the kernels': statistics, ``xhat``, ``dx`` and the summands of the
    parameter gradients in the accumulation dtype, results rounded to the data's dtype. The
    parameter gradients are summed as the kernels do: the launch geometry of
    :func:`geometry` (``lnlib._cuda.build``, so the hook on ``GRID_THREADS`` moves it too), unit
    ``u`` adding rows ``u, u + units, u + 2 units, ...`` in that order, then the units added as
    ``param_grad_sum`` does (32 lanes, lane ``l`` adding units ``l, l + 32, ...``, then a tree).
    The long-row kernels' units (tile by tile of columns, or a cluster's blocks each its own
    columns) add the same values in the same order, so one model covers them all, with the
    units of the path :func:`geometry` gives.
    ``flaw`` (one of :data:`FLAWS`) makes it wrong on purpose.
    """

    name = "model"

    def __init__(self, flaw=None):
        assert flaw is None or flaw in FLAWS, flaw
        self.flaw = flaw

    def __call__(self, op, *args):
        return getattr(self, op)(*args)

    def layer_norm_forward(self, x, weight, bias, eps):
        return self._forward(x, weight, bias, eps, center=True)

    def rms_norm_forward(self, x, weight, eps):
        y, _mean, rstd = self._forward(x, weight, None, eps, center=False)
        return y, rstd

    def layer_norm_backward(self, dy, x, mean, rstd, weight):
        return self._backward("layer_norm", dy, x, mean, rstd, weight)

    def rms_norm_backward(self, dy, x, rstd, weight):
        return self._backward("rms_norm", dy, x, None, rstd, weight)[:2]

    def _store(self, a, dtype):
        return bf16_bits(a, np) if dtype == "bfloat16" else a.astype(dtype)

    def _forward(self, x, weight, bias, eps, center):
        dtype = dtype_name(x)
        acc = np.dtype(acc_name(dtype))
        xa = self.get(x).astype(acc)  # (M, D)
        mean = xa.mean(axis=1, dtype=acc) if center else np.zeros(len(xa), acc)  # (M,)
        xc = xa - mean[:, None]  # (M, D)
        rstd = (1 / np.sqrt((xc * xc).mean(axis=1, dtype=acc) + acc.type(eps))).astype(acc)
        y = xc * rstd[:, None]  # (M, D)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return self._store(y, dtype), mean, rstd

    def _backward(self, norm, dy, x, mean, rstd, weight):
        dtype = dtype_name(x)
        acc = np.dtype(acc_name(dtype))
        m, d = x.shape
        xa, dya = self.get(x).astype(acc), self.get(dy).astype(acc)  # (M, D)
        mean = np.zeros(m, acc) if mean is None else mean
        xh = (xa - mean[:, None]) * rstd[:, None]  # (M, D)
        g = dya if weight is None else dya * weight  # (M, D)
        geo = geometry(norm, dtype, m, d)
        if geo.path == "cluster":  # the kernel's order of the row sums, so dx to the bit
            reverse = self.flaw == FLAWS[4]
            sums = cluster_row_sums((g, g * xh), f"{norm}_bwd", dtype, reverse)
        else:  # NumPy's order: dx within the rounding only
            sums = (g.sum(axis=1), (g * xh).sum(axis=1))
        c1 = sums[0] / acc.type(d) if norm == "layer_norm" else np.zeros(m, acc)  # (M,)
        c2 = sums[1] / acc.type(d)  # (M,)
        dx = rstd[:, None] * (g - c1[:, None] - xh * c2[:, None])  # (M, D)
        done = m
        if self.flaw == FLAWS[0]:
            done = geo.units * (geo.most - 1)
            dx[done:] = 0
        sums = (
            self._param_grad(dya * xh, dtype, geo, done),
            self._param_grad(dya, dtype, geo, done),
        )
        return self._store(dx, dtype), *sums

    def _param_grad(self, terms, dtype, geo, done):
        """Column sums of ``terms`` (M, D) the kernels' way: partial sums per unit, then lanes."""
        acc = terms.dtype
        part = np.zeros((geo.units, terms.shape[1]), acc)  # (units, D)
        for lo in range(0, done, geo.units):  # a pass of the grid-stride loop: a row per unit
            rows = terms[lo : min(lo + geo.units, done)]
            if self.flaw == FLAWS[1] and geo.tiles > 1:
                part[: len(rows)] = rows
            else:
                part[: len(rows)] += rows
            if self.flaw == FLAWS[3]:
                part = self.get(self._store(part, dtype)).astype(acc)
        units = geo.units - 1 if self.flaw == FLAWS[2] else geo.units
        lanes = np.zeros((32, terms.shape[1]), acc)  # (32, D)
        for q in range(0, units, 32):
            block = part[q : min(q + 32, units)]
            lanes[: len(block)] += block
        for half in (16, 8, 4, 2, 1):
            lanes[:half] += lanes[half : 2 * half]
        return lanes[0]


# The cluster kernel's row sums -----------------------------------------------------------------


def cluster_chunks(op, dtype, d, per_block=None):
    """The chunk (V elements) that thread t of block ``rank`` of a cluster holds in slot s, as
    norms.cu's norm_bwd_cluster numbers them: ``rank * S + s * R + t`` where below the block's
    share of the row's chunks, else -1. Shape (CLUSTER, MAXV, R). ``per_block``: another S
    (a flaw), instead of build.cluster_shape's."""
    r, maxv, shipped = build.cluster_shape(op, dtype, d)
    per_block = shipped if per_block is None else per_block
    vec = 16 // build.ITEMSIZE[build._layout(dtype)]
    chunks = -(-d // vec)
    rank = np.arange(build.CLUSTER)[:, None, None]
    q = np.arange(maxv)[None, :, None] * r + np.arange(r)[None, None, :]  # (1, MAXV, R)
    own = np.clip(chunks - rank * per_block, 0, per_block)  # (CLUSTER, 1, 1)
    return np.where(q < own, rank * per_block + q, -1)


def _tree32(v):
    """Lane 0 of the kernels' warp_sum over the last axis (32 lanes): lane i adds lane i + 16,
    then i + 8, 4, 2, 1."""
    for half in (16, 8, 4, 2, 1):
        v = v[..., :half] + v[..., half : 2 * half]
    return v[..., 0]


def cluster_row_sums(terms, op, dtype, reverse=False):
    """Each row's sums of each of ``terms`` ((M, D) arrays in the accumulation dtype) in the
    cluster kernel's order: a thread adds its slots' elements (slot, then element), each block
    its threads by row_sum's trees (a warp's 32 lanes, then its 16 warps), then every block the
    blocks' sums in rank order 0, 1, ..., CLUSTER - 1 (``reverse``: the other way, a flaw)."""
    m, d = terms[0].shape
    vec = 16 // build.ITEMSIZE[build._layout(dtype)]
    chunks = -(-d // vec)
    held = cluster_chunks(op, dtype, d)
    held = np.where(held < 0, chunks, held)  # a zero chunk for the slots a thread leaves empty
    ranks = range(build.CLUSTER - 1, -1, -1) if reverse else range(build.CLUSTER)
    out = []
    for a in terms:
        padded = np.zeros((m, (chunks + 1) * vec), a.dtype)
        padded[:, :d] = a
        padded = padded.reshape(m, chunks + 1, vec)  # (M, chunks + 1, V)
        threads = np.zeros((m, *held[:, 0].shape), a.dtype)  # (M, CLUSTER, R)
        for s in range(held.shape[1]):
            for j in range(vec):
                threads += padded[:, held[:, s], j]
        warps = _tree32(threads.reshape(m, build.CLUSTER, -1, 32))  # (M, CLUSTER, R / 32)
        lanes = np.zeros((m, build.CLUSTER, 32), a.dtype)
        lanes[..., : warps.shape[-1]] = warps
        blocks = _tree32(lanes)  # (M, CLUSTER)
        total = np.zeros(m, a.dtype)
        for rank in ranks:
            total = total + blocks[:, rank]
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", ("float16", "float32")])
def test_cluster_blocks_hold_every_chunk_once(dtype):
    """The cluster kernel's blocks and threads hold every chunk of a row once, each thread at
    most MAXV (the partial sums it keeps in registers), for every row length it takes; an
    ownership cut with S = chunks // CLUSTER (rounded down) would lose chunks."""
    op = "add_layer_norm_bwd" if isinstance(dtype, tuple) else "layer_norm_bwd"
    vec = 16 // build.ITEMSIZE[build._layout(dtype)]
    top = 32768 if build._layout(dtype) == "float64" else 65536
    flawed = 0
    for d in (top // 8 + 1, 9001, 20000, 20001, 32767, top - 1, top):
        assert build.backward_path(op, dtype, d, 90) == "cluster", (dtype, d)
        chunks = -(-d // vec)
        held = cluster_chunks(op, dtype, d)
        assert np.array_equal(np.sort(held[held >= 0]), np.arange(chunks)), (dtype, d)
        if chunks % build.CLUSTER:
            cut = cluster_chunks(op, dtype, d, chunks // build.CLUSTER)
            assert not np.array_equal(np.sort(cut[cut >= 0]), np.arange(chunks)), (dtype, d)
            flawed += 1
    assert flawed >= 2, dtype


# Launch geometry and the cases --------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    tiles: int  # row tiles of the backward's largest shape (more than 1: a long-row kernel)
    path: str  # the backward's kernel: "tile", "cluster" or "long" (build.backward_path)
    units: int  # row groups of the backward, each with its own partial parameter gradients
    most: int  # rows of the busiest unit
    fewest: int  # rows of the idlest unit
    forward_passes: int  # passes of the forward's grid-stride loop


def sm_count():
    """The SM count the long-row backward sizes its units by: the GPU's where CuPy sees one,
    else build.DEFAULT_SMS (the model then shares rows out as on an H100 or H200)."""
    cupy, _reason = _cupy_with_gpu()
    if cupy is None:
        return build.DEFAULT_SMS
    return cuda_kernel._sm_count()


def compute_capability():
    """The compute capability the backward picks its long-row kernel by: the GPU's where CuPy
    sees one, else build.DEFAULT_CC (an H100 or H200: the cluster kernel where rows fit)."""
    cupy, _reason = _cupy_with_gpu()
    if cupy is None:
        return build.DEFAULT_CC
    return cuda_kernel._compute_capability()


def geometry(norm, dtype, m, d):
    """How the kernels of ``norm`` share ``m`` rows of ``d`` elements out, launched as
    lnlib._cuda.cuda_kernel launches them (units: ``min(m, blocks * rows per block)``; rows of
    several tiles: the forward's blocks of one row, and the backward's clusters,
    build.cluster_units, or the two-launch kernel's blocks, build.long_units)."""
    _kernel, r, _maxv = cuda_kernel._forward_shape(f"{norm}_fwd", dtype, d)
    per_pass = build.grid("fwd", m, r) * (build.block_threads(r) // r)
    r, _maxv, tiles = build.launch_shape(f"{norm}_bwd", dtype, d)
    path = build.backward_path(f"{norm}_bwd", dtype, d, compute_capability())
    if path == "cluster":
        units = build.cluster_units(m, d, sm_count())
    else:
        blocks = build.grid("bwd", m, r, d, tiles, sm_count())
        units = min(m, blocks * (1 if tiles > 1 else build.block_threads(r) // r))
    return Geometry(tiles, path, units, -(-m // units), m // units, -(-m // per_pass))


@dataclass(frozen=True)
class Case:
    d: int
    m: int
    grid_threads: tuple  # (forward, backward) caps for build.GRID_THREADS; None: as shipped
    path: str  # "registers": one-tile rows; "long": rows of several tiles (a long-row kernel)

    def __str__(self):
        cap = "" if self.grid_threads is None else f"-grid{self.grid_threads[1]}"
        return f"d{self.d}-m{self.m}{cap}"


#: Every case has several rows per unit with some units one row short (the last pass only part
#: full) and forward passes; test_each_case_reaches_what_it_is_for checks it for every dtype.
#: Rows of 99 and 20001 elements are not whole 16-byte vectors: they take the element-wise loads.
CASES = (
    Case(768, 20000, None, "registers"),  # float32: 4096 units of 4-5 rows, 3 forward passes
    # long rows: on an H100/H200 32 clusters of 34-35 rows; on sm_80, 2 units an SM (108 SMs:
    # 216 units of 5-6 rows)
    Case(20000, 1100, None, "long"),
    Case(99, 1003, (256, 256), "registers"),  # a warp per row, 4 rows a block: 8 units
    Case(768, 1001, (128, 256), "registers"),  # float32: 4 units of 250-251 rows, 501 passes
    # long rows: 2 clusters of 22-23 rows (sm_90), or 4 units of 11-12 rows; 45 fwd passes
    Case(20001, 45, (1024, 1024), "long"),
)
#: The large cases (no grid cap) the model runs too: one, the largest partial sums (CPU time);
#: the GPU runs them all, for every norm and dtype.
LARGE = {CASES[0], CASES[1]}
MODEL_LARGE = {(CASES[0], "layer_norm", "float32")}


def _cap_grid(monkeypatch, case):
    if case.grid_threads is not None:
        monkeypatch.setitem(build.GRID_THREADS, "fwd", case.grid_threads[0])
        monkeypatch.setitem(build.GRID_THREADS, "bwd", case.grid_threads[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_case_reaches_what_it_is_for(monkeypatch, case, dtype):
    _cap_grid(monkeypatch, case)
    for norm in NORMS:
        geo = geometry(norm, dtype, case.m, case.d)
        what = f"{norm} {dtype} {case}: {geo}"
        assert (geo.tiles > 1) == (case.path == "long"), what
        assert geo.most >= 2 and geo.fewest < geo.most, what
        assert geo.forward_passes >= 2, what


# The checks ---------------------------------------------------------------------------------


@pytest.fixture
def cuda_rows(monkeypatch):
    """CudaRows, with uint16 arrays mapped to the bfloat16 kernels."""
    cupy, reason = _cupy_with_gpu()
    if cupy is None:
        skip_or_fail(f"needs CuPy and a CUDA GPU: {reason}")
    monkeypatch.setitem(build.TYPE_NAMES, "uint16", build.TYPE_NAMES["bfloat16"])
    monkeypatch.setitem(build.ITEMSIZE, "uint16", build.ITEMSIZE["bfloat16"])
    return CudaRows(cupy)


def _rows(kind, request):
    return KernelModel() if kind == "model" else request.getfixturevalue("cuda_rows")


KINDS = ("model", pytest.param("cuda", marks=pytest.mark.gpu))


def _scale(xp, want):
    return max(1.0, float(xp.max(xp.abs(want))))


def _close(rows, got, want, tol, what):
    """``got`` (a row array) within ``tol`` times the scale of ``want`` (float64)."""
    xp = rows.xp
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = float(xp.max(xp.abs(rows.get(got) - want)))
    assert err <= tol * _scale(xp, want), f"{what}: max error {err:.3g} > {tol:.3g} x scale"


def _within(rows, got, want, bound, what):
    """``got`` within ``bound`` (per element, float64) of ``want``."""
    xp = rows.xp
    excess = xp.abs(rows.get(got) - want) - bound
    worst = int(xp.argmax(excess))
    assert float(excess[worst]) <= 0, (
        f"{what}: {int(xp.count_nonzero(excess > 0))} of {want.size} columns outside the bound; "
        f"column {worst}: error {float(abs(rows.get(got)[worst] - want[worst])):.3g}, "
        f"bound {float(bound[worst]):.3g}"
    )


def _exact(rows, got, want, what):
    xp = rows.xp
    bad = int(xp.count_nonzero(rows.get(got) != want))
    err = float(xp.max(xp.abs(rows.get(got) - want)))
    assert bad == 0, (
        f"{what}: {bad} of {want.size} columns differ from the exact sum (max {err:.3g})"
    )


@dataclass
class Exact:
    """Rows whose parameter gradients every order of float32 additions gets exactly: x, dy and
    weight on a grid of 1/8, the backward's mean on that grid and its rstd a power of two (near
    the row's own), so every x - mean, xhat and dy * xhat is exact in float32 and every partial
    sum over rows is too (checked below: under 2**24 steps of the summands' grid). Any result of
    the kernels that differs from the exact sum lost, repeated or misplaced a row.
    Arrays of ``xp``, float64; the values are exact in bfloat16, float16 and float32."""

    x: object
    dy: object
    weight: object
    bias: object
    mean: object  # the statistics handed to the backward
    rstd: object


def exact_data(xp, m, d, norm, seed=25):
    rng = np.random.default_rng(seed)
    shift = 3.0 if norm == "layer_norm" else 0.0  # a mean far from zero tests the variance
    x = rng.integers(-24, 25, (m, d), dtype=np.int8) / 8 + shift  # (M, D)
    dy = rng.integers(-8, 9, (m, d), dtype=np.int8) / 8  # (M, D)
    weight, bias = (rng.integers(-16, 17, d) / 8 for _ in range(2))
    true_mean = x.mean(axis=1) if norm == "layer_norm" else np.zeros(m)
    mean = np.round(true_mean * 8) / 8  # (M,)
    spread = np.sqrt(((x - true_mean[:, None]) ** 2).mean(axis=1))
    rstd = 2.0 ** np.round(-np.log2(spread))  # (M,)
    step = 2.0**-6 * rstd.min()  # every dy * xhat is a multiple of step
    largest = np.abs(x - mean[:, None]).max() * rstd.max() * np.abs(dy).max()
    assert largest * m / step < 2**24, "partial sums would not be exact in float32"
    arrays = (x, dy, weight, bias, mean, rstd)
    return Exact(*(xp.asarray(a) for a in arrays))


_cache = {}


def exact_case(xp, case, norm):
    """The data of ``case`` and its float64 reference results (the last case's kept only)."""
    key = (xp.__name__, case.m, case.d, norm)
    if key not in _cache:
        _cache.clear()
        data = exact_data(xp, case.m, case.d, norm)
        if norm == "layer_norm":
            fwd = reference.layer_norm_forward(data.x, data.weight, data.bias, eps=EPS[norm])
            back = reference.layer_norm_backward(data.dy, data.x, data.mean, data.rstd, data.weight)
        else:
            fwd = reference.rms_norm_forward(data.x, data.weight, eps=EPS[norm])
            back = reference.rms_norm_backward(data.dy, data.x, data.rstd, data.weight)
        _cache[key] = data, fwd, back
    return _cache[key]


@pytest.fixture(scope="module", autouse=True)
def _free_cache():
    yield
    _cache.clear()
    invariance_rows.cache_clear()


def check_many_rows_per_unit(rows, case, norm, dtype):
    """Forward and backward of ``case`` on ``rows``: y, mean, rstd and dx against the float64
    reference within ROW_TOL, dweight and dbias equal to the exact sums (Exact)."""
    data, fwd, back = exact_case(rows.xp, case, norm)
    acc = acc_name(dtype)
    x, dy = rows.put(data.x, dtype), rows.put(data.dy, dtype)
    weight, bias = rows.put(data.weight, acc), rows.put(data.bias, acc)
    mean, rstd = rows.put(data.mean, acc), rows.put(data.rstd, acc)
    what = f"{rows.name} {norm} {dtype} {case}"
    if norm == "layer_norm":
        got = rows("layer_norm_forward", x, weight, bias, EPS[norm])
        names = ("y", "mean", "rstd")
        back_got = rows("layer_norm_backward", dy, x, mean, rstd, weight)
        back_names = ("dx", "dweight", "dbias")
    else:
        got = rows("rms_norm_forward", x, weight, EPS[norm])
        names = ("y", "rstd")
        back_got = rows("rms_norm_backward", dy, x, rstd, weight)
        back_names = ("dx", "dweight")
    assert dtype_name(got[0]) == dtype and dtype_name(back_got[0]) == dtype, what
    for a, want, name in zip(got, fwd, names):
        _close(rows, a, want, ROW_TOL[dtype if name == "y" else acc], f"{what} {name}")
    _close(rows, back_got[0], back[0], ROW_TOL[dtype], f"{what} dx")
    for a, want, name in zip(back_got[1:], back[1:], back_names[1:]):
        assert dtype_name(a) == acc, f"{what} {name}: {a.dtype}"
        _exact(rows, a, want, f"{what} {name}")


def _kind_params(cases, dtypes, model_skips=lambda case, norm, dtype: False):
    """(kind, case, norm, dtype) for the CPU model and the GPU (marked ``gpu``), every case,
    norm and dtype, less the model runs ``model_skips`` names."""
    params = []
    for case in cases:
        for norm in NORMS:
            for dtype in dtypes:
                for kind in ("model", "cuda"):
                    if kind == "model" and model_skips(case, norm, dtype):
                        continue
                    marks = [pytest.mark.gpu] if kind == "cuda" else []
                    ident = f"{kind}-{norm}-{dtype}-{case}"
                    params.append(pytest.param(kind, case, norm, dtype, marks=marks, id=ident))
    return params


def _many_rows_params():
    return _kind_params(
        CASES,
        DTYPES,
        lambda case, norm, dtype: case in LARGE and (case, norm, dtype) not in MODEL_LARGE,
    )


@pytest.mark.parametrize("kind,case,norm,dtype", _many_rows_params())
def test_parameter_gradients_over_many_rows_per_unit(request, monkeypatch, kind, case, norm, dtype):
    """Every output of the forward and the backward when units take many rows: dweight and
    dbias exact, the rest within the dtype's rounding."""
    rows = _rows(kind, request)
    _cap_grid(monkeypatch, case)
    check_many_rows_per_unit(rows, case, norm, dtype)


# One-tile rows of 512 threads, 16-bit: the next row loaded before the barriers -----------------

#: Rows that the one-tile backward gives blocks of 512 threads in float16 and bfloat16, where it
#: loads each unit's next row before the current row's barriers (norms.cu, PREFETCH): two units
#: of 150 rows each (6001: not whole vectors, element by element).
PREFETCH_CASES = (
    Case(8000, 300, (4096, 1024), "registers"),
    Case(6001, 300, (4096, 1024), "registers"),
)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", PREFETCH_CASES, ids=str)
def test_prefetch_cases_reach_what_they_are_for(monkeypatch, case, dtype):
    _cap_grid(monkeypatch, case)
    for norm in NORMS:
        r, _maxv, tiles = build.launch_shape(f"{norm}_bwd", dtype, case.d)
        geo = geometry(norm, dtype, case.m, case.d)
        assert (r, tiles) == (512, 1) and geo.units == 2 and geo.most >= 100, (norm, geo)


@pytest.mark.parametrize(
    "kind,case,norm,dtype", _kind_params(PREFETCH_CASES, ("float16", "bfloat16"))
)
def test_rows_loaded_ahead_give_every_output(request, monkeypatch, kind, case, norm, dtype):
    """Every output of the forward and the backward where each unit loads its next row early:
    dweight and dbias exact, the rest within the dtype's rounding."""
    rows = _rows(kind, request)
    _cap_grid(monkeypatch, case)
    check_many_rows_per_unit(rows, case, norm, dtype)


# Long rows ----------------------------------------------------------------------------------

#: Long rows (20001: not whole vectors, element by element; 9000: a tile and a little more).
LONG_CASES = (Case(20001, 45, (1024, 1024), "long"), Case(9000, 300, (1024, 1024), "long"))
#: The long-row backward's two kernels: the cluster kernel (compute capability 9.x, rows that
#: fit) and the two launches (every GPU; on 9.x with build.CLUSTER_MAJORS emptied).
LONG_KERNELS = ("cluster", "two-launch")


def use_long_kernel(monkeypatch, kernel, norm, dtype, d):
    """Make the backward of ``norm`` on rows of ``d`` take the long-row ``kernel``: the cluster
    kernel where this GPU (or, for the model, build.DEFAULT_CC) and ``d`` allow it, else skip;
    the two launches by emptying build.CLUSTER_MAJORS (the hook backward_path reads)."""
    if kernel == "two-launch":
        monkeypatch.setattr(build, "CLUSTER_MAJORS", ())
        return
    cc = compute_capability()
    if build.backward_path(f"{norm}_bwd", dtype, d, cc) != "cluster":
        pytest.skip(
            f"the cluster kernel does not take {dtype} rows of {d} on compute capability {cc}"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", LONG_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("case", LONG_CASES, ids=str)
def test_long_rows_by_either_kernel(cuda_rows, monkeypatch, case, norm, dtype, kernel):
    """The long-row backward, by the cluster kernel or the two launches (the rows' sums, then
    dx and the partial sums tile by tile of columns): dweight and dbias exact, dx within
    ROW_TOL, and the same bits from a second call."""
    _cap_grid(monkeypatch, case)
    use_long_kernel(monkeypatch, kernel, norm, dtype, case.d)
    assert geometry(norm, dtype, case.m, case.d).path == ("long" if kernel != "cluster" else kernel)
    check_many_rows_per_unit(cuda_rows, case, norm, dtype)
    data = exact_case(cuda_rows.xp, case, norm)[0]
    acc = acc_name(dtype)
    x, dy = cuda_rows.put(data.x, dtype), cuda_rows.put(data.dy, dtype)
    args = [cuda_rows.put(a, acc) for a in (data.mean, data.rstd, data.weight)]
    if norm == "rms_norm":
        args = args[1:]
    runs = [
        [a.get().tobytes() for a in cuda_rows(f"{norm}_backward", dy, x, *args)] for _ in range(2)
    ]
    assert runs[0] == runs[1], f"{norm} {dtype} {case}: other bits on a second call"


#: Rows the cluster kernel takes on an H100 or H200, with many rows a cluster (32 clusters with
#: the grid as shipped: 20 and 10 rows each): the largest row it takes (65536) and one of
#: 20000, whose slices end inside a block's last slot.
CLUSTER_CASES = (Case(20000, 640, None, "long"), Case(65536, 320, None, "long"))


def _cluster_params():
    params = []
    for case in CLUSTER_CASES:
        for norm in NORMS:
            for dtype in ("float32", "float16", "bfloat16"):
                for kind in ("model", "cuda"):
                    if kind == "model" and (case.d, norm, dtype) != (
                        65536,
                        "layer_norm",
                        "float32",
                    ):
                        continue  # the model once (CPU time)
                    marks = [pytest.mark.gpu] if kind == "cuda" else []
                    ident = f"{kind}-{norm}-{dtype}-{case}"
                    params.append(pytest.param(kind, case, norm, dtype, marks=marks, id=ident))
    return params


@pytest.mark.parametrize("kind,case,norm,dtype", _cluster_params())
def test_cluster_kernel_over_many_rows_per_cluster(request, monkeypatch, kind, case, norm, dtype):
    """The cluster kernel where each cluster takes 10 or 20 rows: every output of the forward
    and the backward against the float64 reference, dweight and dbias exact (Exact)."""
    rows = _rows(kind, request)
    use_long_kernel(monkeypatch, "cluster", norm, dtype, case.d)
    geo = geometry(norm, dtype, case.m, case.d)
    assert geo.path == "cluster" and geo.fewest >= 10, geo
    check_many_rows_per_unit(rows, case, norm, dtype)


#: The cluster kernel in every 16/32-bit dtype, the two launches in float32 (tests/test_gpu.py
#: checks long rows' batch invariance too), at rows of 20001 (element by element) and 65536.
INVARIANCE_PARAMS = [
    (d, norm, dtype, kernel)
    for d in (20001, 65536)
    for norm in NORMS
    for kernel, dtypes in (
        ("cluster", ("float32", "bfloat16", "float16")),
        ("two-launch", ("float32",)),
    )
    for dtype in dtypes
]


@functools.lru_cache(maxsize=1)
def invariance_rows(d):
    """The host data of test_long_rows_dx_is_batch_invariant for rows of ``d``: x, dy (200, d),
    weight, mean and rstd, drawn once for the 8 cases of each d (the parameters run d by d;
    2 x 200 x 65536 normal draws take about 0.5 s on a laptop core)."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((200, d)) + 1.0  # (M, D)
    dy = rng.standard_normal((200, d))
    weight = rng.standard_normal(d)
    mean = rng.standard_normal(200) * 0.01 + 1.0
    return x, dy, weight, mean, rng.uniform(0.5, 2.0, 200)


@pytest.mark.gpu
@pytest.mark.parametrize("d,norm,dtype,kernel", INVARIANCE_PARAMS)
def test_long_rows_dx_is_batch_invariant(cuda_rows, monkeypatch, d, norm, dtype, kernel):
    """A long row's dx has the same bits in a batch of 1, of 3 and of 200 rows (a different
    number of units each time, and a different unit taking the row), by either kernel."""
    use_long_kernel(monkeypatch, kernel, norm, dtype, d)
    xp = cuda_rows.xp
    x, dy, weight, mean, rstd = invariance_rows(d)
    x, dy = cuda_rows.put(x, dtype), cuda_rows.put(dy, dtype)  # (M, D)
    weight, mean, rstd = (xp.asarray(a, dtype=xp.float32) for a in (weight, mean, rstd))

    def dx(rows):
        if norm == "layer_norm":
            got = cuda_rows(
                "layer_norm_backward", dy[rows], x[rows], mean[rows], rstd[rows], weight
            )
        else:
            got = cuda_rows("rms_norm_backward", dy[rows], x[rows], rstd[rows], weight)
        return xp.asnumpy(got[0]).view(np.uint8).reshape(got[0].shape[0], -1)

    whole = dx(slice(0, 200))
    for rows in (slice(37, 38), slice(36, 39), slice(199, 200)):
        assert (dx(rows) == whole[rows]).all(), f"{norm} {dtype} d={d} {kernel}: rows {rows}"


@pytest.mark.gpu
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cluster_kernel_reads_strided_aligned_rows(cuda_rows, monkeypatch, norm, dtype):
    """Rows 16 elements apart beyond d (every row still 16-byte aligned, so the cp.async path,
    not the element path) give the bits of their contiguous copy: dx and the parameter
    gradients, so the kernel steps by ldx and lddy, not by d."""
    d, m = 65536, 40
    use_long_kernel(monkeypatch, "cluster", norm, dtype, d)
    xp = cuda_rows.xp
    rng = np.random.default_rng(5)
    wide = [cuda_rows.put(rng.standard_normal((m, d + 16)), dtype) for _ in range(2)]
    x, dy = (w[:, :d] for w in wide)  # (M, D), rows D + 16 apart
    weight = xp.asarray(rng.standard_normal(d), dtype=xp.float32)
    stats = [xp.asarray(rng.uniform(0.5, 2.0, m), dtype=xp.float32) for _ in range(2)]
    args = (*stats, weight) if norm == "layer_norm" else (stats[1], weight)

    def bits(dy, x):
        return [xp.asnumpy(a).tobytes() for a in cuda_rows(f"{norm}_backward", dy, x, *args)]

    assert bits(dy, x) == bits(xp.ascontiguousarray(dy), xp.ascontiguousarray(x)), norm


def check_cluster_order(rows, norm, dtype, d, m=40):
    """dx of ``rows`` on random rows of ``d`` elements (where the order of a row's sums changes
    bits) bitwise that of KernelModel, which adds each row's sums in the cluster kernel's order
    (cluster_row_sums) where the rows take it: the order norms.cu documents."""
    xp = rows.xp
    rng = np.random.default_rng(d + 1)
    acc = acc_name(dtype)
    x = rows.put(rng.standard_normal((m, d)) * 2 + 0.5, dtype)  # (M, D)
    dy = rows.put(rng.standard_normal((m, d)), dtype)
    weight = rows.put(rng.standard_normal(d), acc)
    mean = rows.put(rng.standard_normal(m) * 0.1 + 0.5, acc)  # (M,)
    rstd = rows.put(rng.uniform(0.4, 0.6, m), acc)
    args = (dy, x, mean, rstd, weight) if norm == "layer_norm" else (dy, x, rstd, weight)
    got = rows(f"{norm}_backward", *args)[0]
    host = [a if isinstance(a, np.ndarray) else xp.asnumpy(a) for a in args]
    want = KernelModel()(f"{norm}_backward", *host)[0]
    got = got if isinstance(got, np.ndarray) else xp.asnumpy(got)
    bad = int(np.count_nonzero(got.view(np.uint8) != want.view(np.uint8)))
    what = f"{rows.name} {norm} {dtype} d={d} dx"
    assert bad == 0, f"{what}: {bad} bytes differ from the cluster kernel's order of the sums"


ORDER_PARAMS = [
    (norm, dtype, d) for norm in NORMS for dtype in ("float32", "bfloat16") for d in (20001, 65536)
]


@pytest.mark.gpu
@pytest.mark.parametrize("norm,dtype,d", ORDER_PARAMS)
def test_cluster_kernel_adds_the_row_sums_in_the_documented_order(
    cuda_rows, monkeypatch, norm, dtype, d
):
    """The cluster kernel's dx to the bit: its row sums added as norms.cu says (slots, the
    block's trees, then the blocks in rank order), the rest of dx as written."""
    use_long_kernel(monkeypatch, "cluster", norm, dtype, d)
    check_cluster_order(cuda_rows, norm, dtype, d)


@pytest.mark.parametrize("norm,dtype,d", ORDER_PARAMS)
def test_the_order_check_fails_other_orders(monkeypatch, norm, dtype, d):
    """A model that adds the cluster's block sums in the reverse order fails the check: the
    check's rows are ones where the order changes dx. (The model shares rows out as on an H100
    or H200 here, whatever GPU this machine has.)"""
    monkeypatch.setattr(sys.modules[__name__], "compute_capability", lambda: build.DEFAULT_CC)
    with pytest.raises(AssertionError, match="differ from the cluster kernel's order"):
        check_cluster_order(KernelModel(FLAWS[4]), norm, dtype, d)


#: For each flaw: a case and dtype where it changes the results, and the first result it spoils.
FLAWED = (
    pytest.param(FLAWS[0], CASES[3], "float32", "dx", id="lost-pass"),
    pytest.param(FLAWS[1], CASES[4], "float32", "dweight", id="overwrites"),
    pytest.param(FLAWS[2], CASES[2], "float16", "dweight", id="lost-unit"),
    pytest.param(FLAWS[3], CASES[3], "bfloat16", "dweight", id="bfloat16-partials"),
)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("flaw,case,dtype,spoilt", FLAWED)
def test_the_check_fails_a_kernel_that_shares_rows_out_wrongly(
    monkeypatch, flaw, case, dtype, spoilt, norm
):
    """The model with a flaw fails check_many_rows_per_unit, at the result the flaw spoils."""
    _cap_grid(monkeypatch, case)
    with pytest.raises(AssertionError, match=f"{norm} {dtype} {case} {spoilt}:"):
        check_many_rows_per_unit(KernelModel(flaw), case, norm, dtype)


# bfloat16 at several row lengths -------------------------------------------------------------


def check_bfloat16(rows, norm, d):
    """bfloat16 forward and backward of ``norm`` on rows of ``d`` against the float64 reference:
    y, dx, mean and rstd within ROW_TOL, dweight and dbias within the bound that float32
    accumulation gives (tests/error_bounds.py), from the statistics the forward returned."""
    xp = rows.xp
    m = max(2, min(48, 2**21 // d))
    rng = np.random.default_rng(d)
    shift = 3.0 if norm == "layer_norm" else 1.0
    x_bits = rows.put(rng.standard_normal((m, d)) + shift, "bfloat16")  # (M, D)
    dy_bits = rows.put(rng.standard_normal((m, d)), "bfloat16")
    weight = rows.put(rng.standard_normal(d), "float32")
    bias = rows.put(rng.standard_normal(d), "float32")
    x, dy, w64, b64 = (rows.get(a) for a in (x_bits, dy_bits, weight, bias))  # exact values
    what = f"{rows.name} {norm} bfloat16 d={d}"
    if norm == "layer_norm":
        y, mean, rstd = rows("layer_norm_forward", x_bits, weight, bias, EPS[norm])
        y_ref, mean_ref, rstd_ref = reference.layer_norm_forward(x, w64, b64, eps=EPS[norm])
        _close(rows, mean, mean_ref, ROW_TOL["float32"], f"{what} mean")
        dx, dweight, dbias = rows("layer_norm_backward", dy_bits, x_bits, mean, rstd, weight)
        back = reference.layer_norm_backward(dy, x, mean_ref, rstd_ref, w64)
        mean_err = xp.abs(rows.get(mean) - mean_ref)[:, None]  # (M, 1)
    else:
        y, rstd = rows("rms_norm_forward", x_bits, weight, EPS[norm])
        y_ref, rstd_ref = reference.rms_norm_forward(x, w64, eps=EPS[norm])
        dx, dweight = rows("rms_norm_backward", dy_bits, x_bits, rstd, weight)
        back = reference.rms_norm_backward(dy, x, rstd_ref, w64)
        mean_ref, mean_err = xp.zeros(m), 0.0
    assert dtype_name(y) == "bfloat16" and dtype_name(dx) == "bfloat16", what
    _close(rows, y, y_ref, ROW_TOL["bfloat16"], f"{what} y")
    _close(rows, rstd, rstd_ref, ROW_TOL["float32"], f"{what} rstd")
    _close(rows, dx, back[0], ROW_TOL["bfloat16"], f"{what} dx")
    rstd_err = xp.abs(rows.get(rstd) / rstd_ref - 1)[:, None]  # (M, 1)
    mu, r = mean_ref[:, None], rstd_ref[:, None]
    errors = summand_errors(dy, x, mu, r, mean_err, rstd_err, "float32")
    bound = column_sum_bound(dy * (x - mu) * r, errors, "float32")
    _within(rows, dweight, back[1], bound, f"{what} dweight")
    if norm == "layer_norm":
        _within(rows, dbias, back[2], column_sum_bound(dy, 0.0, "float32"), f"{what} dbias")


@pytest.mark.parametrize("d", [96, 768, 1000, 4096, 20000])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_forward_and_backward(request, kind, norm, d):
    check_bfloat16(_rows(kind, request), norm, d)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [768, 20000])
def test_bfloat16_arrays_give_the_bits_of_their_bit_patterns(cuda_rows, d):
    """Where CuPy holds bfloat16 arrays (ml_dtypes), lnlib's row functions on them give the
    bits that the bit-pattern arrays of the tests above give."""
    cupy = cuda_rows.xp
    try:
        import ml_dtypes

        bf16 = np.dtype(ml_dtypes.bfloat16)
        cupy.asarray(np.zeros(2, bf16))
    except Exception as exc:  # noqa: BLE001 - CuPy builds without bfloat16 arrays
        pytest.skip(f"CuPy cannot hold bfloat16 arrays here ({type(exc).__name__}: {exc})")
    rng = np.random.default_rng(7)
    bits = [bf16_bits(rng.standard_normal((8, d)), np) for _ in range(2)]
    weight, bias = (cupy.asarray(rng.standard_normal(d), dtype=cupy.float32) for _ in range(2))

    def run(x, dy):
        y, mean, rstd = cuda_rows("layer_norm_forward", x, weight, bias, 1e-5)
        back = cuda_rows("layer_norm_backward", dy, x, mean, rstd, weight)
        y2, rstd2 = cuda_rows("rms_norm_forward", x, weight, 1e-6)
        back2 = cuda_rows("rms_norm_backward", dy, x, rstd2, weight)
        return [
            cupy.asnumpy(a).view(np.uint16 if a.itemsize == 2 else a.dtype)
            for a in (y, mean, rstd, *back, y2, rstd2, *back2)
        ]

    as_bits = run(*(cupy.asarray(b) for b in bits))
    as_dtype = run(*(cupy.asarray(b.view(bf16)) for b in bits))
    for a, b, name in zip(
        as_dtype,
        as_bits,
        ("y", "mean", "rstd", "dx", "dw", "db", "rms y", "rms rstd", "rms dx", "rms dw"),
    ):
        assert a.tobytes() == b.tobytes(), f"{name}: the bfloat16 dtype gives other bits"
