"""Every CUDA kernel compiles for sm_80 and sm_90 without register spills (no GPU needed).

At run time CuPy compiles ``lnlib._cuda.build.source()`` with NVRTC, with lnlib's options
(``build.OPTIONS``) plus those CuPy adds itself in ``cupy.cuda.compiler``
(``_compile_with_cache_cuda`` adds ``-ftz=true``; ``_get_arch_for_options_for_nvrtc`` adds
``-arch=sm_XX`` to get a cubin; ``--device-as-default-execution-space`` and ``--pch`` are
NVRTC-only and change nothing for code that marks every function ``__device__``/``__global__``).
Here nvcc compiles the same source, every name expression instantiated by taking its address,
with the same options and ``-Xptxas -v``, and the test reads ptxas's resource report: one entry
per kernel, no spill stores or loads, no stack frame, no warning. Run this file as a script to
print the report.
"""

import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lnlib._cuda import build

ARCHS = ("80", "90")
#: What CuPy adds to a RawModule's options (besides include paths and the architecture).
CUPY_ADDED = ("-ftz=true",)


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc (the CUDA compiler) is not installed")


def instantiation_source(arch):
    """The kernel source plus one address-of per name expression of compute capability
    ``arch`` (the cluster kernels from sm_90 on), which instantiates it."""
    names = build.all_name_expressions(arch)
    refs = ",\n".join(f"        (const void*)&{n}" for n in names)
    return (
        build.source() + "\n// Instantiate what CuPy names at run time.\n"
        "const void* lnlib_kernel_address(int i) {\n"
        f"    static const void* const all[] = {{\n{refs}\n    }};\n    return all[i];\n}}\n"
    )


def nvcc_command(arch, src, out):
    return [
        NVCC,
        "-cubin",
        f"-arch=sm_{arch}",
        *build.OPTIONS,
        *CUPY_ADDED,
        "-Xptxas",
        "-v",
        "-o",
        str(out),
        str(src),
    ]


def _compile(arch, folder):
    src = Path(folder) / f"norms_cuda_sm{arch}.cu"
    if not src.exists():
        src.write_text(instantiation_source(arch))
    cmd = nvcc_command(arch, src, Path(folder) / f"norms_sm{arch}.cubin")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False)
    return done.returncode, done.stdout + done.stderr


def _read_name(s, i):
    j = i
    while s[j].isdigit():
        j += 1
    n = int(s[i:j])
    return s[j : j + n], j + n


_TYPE = {"f": "float", "d": "double"}


def demangle(sym):
    """``_Z14layer_norm_fwdIfLi32ELi1EEv...`` -> ``layer_norm_fwd<float, 32, 1>`` (the name
    expression form); only the template patterns of these kernels are understood: builtin
    types, named types and substitutions of them (``S0_`` for the first named type that repeats,
    as in ``add_layer_norm_fwd<__half, __half, float, 32, 1>``: ``I6__halfS0_f``)."""
    name, i = _read_name(sym, 2)
    assert sym[i] == "I", sym
    i += 1
    args, table = [], [name]  # the substitution table: the template's name, then named types
    while True:
        if sym[i] in _TYPE:
            args.append(_TYPE[sym[i]])
            i += 1
        elif sym[i].isdigit():
            t, i = _read_name(sym, i)
            args.append(t)
            table.append(t)
        elif m := re.match(r"S(\d*)_", sym[i:]):
            args.append(table[int(m.group(1)) + 1 if m.group(1) else 0])
            i += m.end()
        else:
            break
    while m := re.match(r"Li(\d+)E", sym[i:]):
        args.append(m.group(1))
        i += m.end()
    return f"{name}<{', '.join(args)}>"


def parse_report(log):
    """``{name expression: {"registers", "spill_stores", "spill_loads", "stack"}}`` from -v."""
    report, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = demangle(m.group(1))
            report[current] = {}
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m and current:
            report[current].update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            report[current]["registers"] = int(m.group(1))
    return report


@pytest.fixture(scope="module")
def builds():
    """Compile for every architecture (in parallel): ``{arch: (returncode, log)}``."""
    with tempfile.TemporaryDirectory() as folder:
        with ThreadPoolExecutor(len(ARCHS)) as pool:
            results = dict(zip(ARCHS, pool.map(lambda a: _compile(a, folder), ARCHS)))
    if os.environ.get("LNLIB_CUDA_REPORT") == "1":  # make gpu-check logs the table (with -s)
        print("\n" + "\n".join(resource_table(results)))
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills(builds, arch):
    code, log = builds[arch]
    assert code == 0, f"nvcc failed for sm_{arch}:\n{log[-4000:]}"
    bad = [line for line in log.splitlines() if re.search(r"warning|error", line, re.IGNORECASE)]
    assert not bad, f"sm_{arch}: compiler diagnostics:\n" + "\n".join(bad[:20])
    report = parse_report(log)
    assert set(report) == set(build.all_name_expressions(arch)), "kernels missing from the report"
    for name, r in report.items():
        assert r.get("spill_stores") == 0 and r.get("spill_loads") == 0, f"{name} spills: {r}"
        assert r.get("stack") == 0, f"{name} uses a stack frame (local memory): {r}"
        assert 0 < r["registers"] <= 255, f"{name}: {r}"


def test_options_are_those_cupy_uses():
    """The flags added here are the ones CuPy's compiler module adds (checked in its source)."""
    cupy_compiler = pytest.importorskip("cupy.cuda.compiler", reason="CuPy is not installed")
    text = inspect.getsource(cupy_compiler._compile_with_cache_cuda)
    for flag in CUPY_ADDED:
        assert f"'{flag}'" in text, f"CuPy no longer adds {flag}: update CUPY_ADDED"
    arch_text = inspect.getsource(cupy_compiler._get_arch_for_options_for_nvrtc)
    assert "-arch=sm_" in arch_text, "CuPy no longer compiles to a cubin for the device's sm"


@pytest.mark.parametrize("op", build.OPS)
@pytest.mark.parametrize("dtype", sorted(build.TYPE_NAMES))
def test_launch_shapes_cover_every_row_length(op, dtype):
    """Every row length 1 .. 2^20 maps to a compiled kernel whose tiles cover the row."""
    names = set(build.all_name_expressions())
    vec = 16 // build.ITEMSIZE[dtype]
    lengths = [
        1,
        2,
        3,
        7,
        31,
        33,
        127,
        513,
        768,
        1000,
        1024,
        4096,
        4097,
        8192,
        16384,
        65536,
        65537,
        2**20,
    ]
    for d in lengths:
        r, maxv, tiles = build.launch_shape(op, dtype, d)
        assert build.kernel_name(op, dtype, r, maxv) in names
        assert tiles * r * maxv * vec >= d > (tiles - 1) * r * maxv * vec
        assert (tiles == 1) or (r, maxv) == build.shapes(op, dtype)[-1]


@pytest.mark.parametrize("op", build.ADD_OPS)
def test_fused_kernels_lay_rows_out_as_the_norm_of_h(op):
    """A fused op has, for every dtype combination and row length, the launch shape of the
    unfused op on h's dtype (so the same reduction order: y bitwise the norm of h), and a
    compiled kernel of that shape; the combinations include the float32 stream under float16."""
    names = set(build.all_name_expressions())
    plain = op.removeprefix("add_")
    combos = build.FUSED[op[-3:]]
    assert any(c[0] == "float16" and c[-1] == "float32" for c in combos)
    for dtypes in combos:
        assert build.fused(op, dtypes)
        for d in (1, 7, 768, 1001, 4096, 16385, 65536):
            shape = build.launch_shape(op, dtypes, d)
            assert shape == build.launch_shape(plain, dtypes[-1], d), (op, dtypes, d)
            assert build.kernel_name(op, dtypes, *shape[:2]) in names
    assert not build.fused(op, ("float32",) * (len(combos[0]) - 1) + ("float64",))


def test_launch_shapes_stated_in_the_book():
    """Chapter 5: a warp per float32 row up to 512 elements, 1024 threads up to 16384, beyond
    that tiles of 8192 for blocks of 512 threads; the backward stops at 512 threads per row;
    16 float32 elements per thread."""
    fwd, bwd = "layer_norm_fwd", "layer_norm_bwd"
    assert build.launch_shape(fwd, "float32", 512) == (32, 4, 1)
    assert build.launch_shape(fwd, "float32", 513)[0] == 64
    assert build.launch_shape(fwd, "float32", 16384) == (1024, 4, 1)
    assert build.launch_shape(fwd, "float32", 16385) == (1024, 4, 2)
    assert build.long_shape(fwd, "float32", 16385) == (512, 4, 3)  # 2 blocks an SM: norms.cu
    assert "layer_norm_fwd_long(" in build.source() and "__launch_bounds__(R, 2)" in build.source()
    assert max(r for r, _ in build.shapes(bwd, "float32")) == 512
    assert max(4 * v for _, v in build.shapes(fwd, "float32")) == 16
    assert 16 // build.ITEMSIZE["float32"] == 4 and 16 // build.ITEMSIZE["float16"] == 8


def test_long_row_backward_figures_stated_in_the_book():
    """Chapter 5: the cluster kernel on compute capability 9.0, clusters of 8 blocks of 512
    threads, rows of up to 65536 elements (32768 float64), 128 KiB of shared memory a block for
    float32 rows of 65536, 32 clusters on 132 SMs, caps of 512 clusters and 1024 groups; x and
    dy read once (12 bytes an element, float32) against twice (20) by the two launches of 256
    threads; the modulated backward takes the cluster kernel too, with at least one cluster per
    parameter row (64 runs of one cluster where 32 clusters would do)."""
    op = "layer_norm_bwd"
    assert (build.CLUSTER, build.CLUSTER_R, build.LONG_R) == (8, 512, 256)
    assert build.backward_path(op, "float32", 65536, 90) == "cluster"
    assert build.backward_path(op, "float32", 65537, 90) == "long"
    assert build.backward_path(op, "float64", 32768, 90) == "cluster"
    assert build.backward_path(op, "float64", 32769, 90) == "long"
    assert build.backward_path("modulated_layer_norm_bwd", "float32", 20000, 90) == "cluster"
    assert build.backward_path("modulated_layer_norm_bwd", "float32", 65536, 80) == "long"
    assert build.cluster_run_units(128, 65536, 64, 132) == 1
    assert build.cluster_run_units(128, 65536, 4, 132) == 8  # the 32 clusters shared out
    gn = 4 * 128 * 128  # GroupNorm rows of 4 channels a group at 128 x 128
    assert gn == 65536 and build.backward_path("modulated_layer_norm_bwd", "float32", gn, 90) == (
        "cluster"
    )
    assert build.backward_path(op, "float32", 65536, 80) == "long"
    assert build.cluster_shared_bytes(op, "float32", 65536) == 128 * 1024
    assert build.cluster_units(10**6, 65536, 132) == 32
    assert build.GRID_THREADS["bwd"] // build.CLUSTER_R == 512
    assert build.GRID_THREADS["bwd"] // build.LONG_R == 1024
    item = build.ITEMSIZE["float32"]
    assert 2 * item + item == 12 and 2 * (2 * item) + item == 20  # x, dy (once / twice), dx


@pytest.mark.parametrize("op", build.OPS + build.ADD_OPS + build.MOD_OPS)
def test_long_rows_have_a_long_row_kernel(op):
    """Every module holds its long-row kernel, which covers every row that the largest
    one-tile shape does not: a backward's in blocks of LONG_R threads, at most two units an SM,
    a forward's in blocks of LONG_FWD_R threads."""
    fused = build.FUSED[op[-3:]] if op.startswith("add_") else None
    for dtype in fused or sorted(build.TYPE_NAMES):
        names = build.name_expressions(op, dtype)
        for d in (8193, 16385, 20001, 65536, 2**20):
            _r, _maxv, tiles = build.launch_shape(op, dtype, d)
            if tiles == 1:
                continue
            r, maxv, long_tiles = build.long_shape(op, dtype, d)
            assert build.kernel_name(op + "_long", dtype, r, maxv) in names
            vec = 16 // build.ITEMSIZE[build._layout(dtype)]
            assert long_tiles * r * maxv * vec >= d > (long_tiles - 1) * r * maxv * vec
            if op.endswith("fwd"):
                assert r == build.LONG_FWD_R == build.block_threads(r)
                continue
            assert r == build.LONG_R == build.block_threads(r)
            assert 1 <= build.long_units(10**6, d, 132) <= 2 * 132


def test_cluster_kernels_compile_for_sm90_only():
    """The sm_90 long-row backward (thread-block clusters) is in the sm_90 modules only, one per
    op of build.CLUSTER_OPS and dtype (fused: every combination), and norms.cu compiles it only
    where ``__CUDA_ARCH__ >= 900`` with the cluster size build.py launches; its launch bounds
    allow one block an SM (build.CLUSTER_BLOCKS_PER_SM)."""
    src = build.source()
    on80, on90 = set(build.all_name_expressions(80)), set(build.all_name_expressions(90))
    cluster = on90 - on80
    assert not any("_cluster" in n for n in on80) and on80 < on90
    want = {
        build.kernel_name(op + "_cluster", dt, *build.cluster_shape(op, dt, 1)[:2])
        for op in build.CLUSTER_OPS
        for dt in (build.FUSED["bwd"] if op.startswith("add_") else sorted(build.TYPE_NAMES))
    }
    assert cluster == want, sorted(cluster ^ want)
    assert f"#define LNLIB_CLUSTER {build.CLUSTER}\n" in src
    guard = "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
    first = src.index(guard)
    # the cluster through sm_90 built-ins only: no header NVRTC lacks (cooperative_groups.h
    # needs a matching libcu++) in a module that every kernel of an sm_90 GPU comes from
    assert "#include <cooperative_groups" not in src
    assert src.index("__cluster_barrier_arrive();") > first
    for op in build.CLUSTER_OPS:
        at = src.index(f"{op}_cluster(")
        assert src.rfind(guard, 0, at) > src.rfind("#endif", 0, at), f"{op}_cluster unguarded"
        head = src[src.rfind("template", 0, at) : at]
        assert f"__launch_bounds__(R, {build.CLUSTER_BLOCKS_PER_SM})" in head, head
        assert "__cluster_dims__(LNLIB_CLUSTER, 1, 1)" in head, head
    r, maxv, _s = build.cluster_shape("layer_norm_bwd", "float32", 1)
    assert r == build.CLUSTER_R and (r, maxv) == build.shapes("layer_norm_bwd", "float32")[-1]


@pytest.mark.parametrize("op", build.CLUSTER_OPS)
def test_backward_path_is_chosen_from_d_dtype_and_compute_capability(op):
    """Where each backward's rows go: one tile, the cluster kernel (compute capability 9.x, a
    slice of each row within the threads' registers and the shared-memory cap: 65536 elements
    of 16- and 32-bit types, 32768 of float64), or the two launches (sm_80, longer rows). No
    number of rows enters."""
    fused = build.FUSED["bwd"] if op.startswith("add_") else None
    for dtype in fused or sorted(build.TYPE_NAMES):
        layout = build._layout(dtype)
        top = 32768 if layout == "float64" else 65536
        one = 4096 if layout == "float64" else 8192
        for d in (one, one + 1, 20000, 20001, top, top + 1, 2**20):
            tiles = build.launch_shape(op, dtype, d)[2]
            got80, got90 = (build.backward_path(op, dtype, d, cc) for cc in (80, 90))
            assert got80 == ("tile" if tiles == 1 else "long"), (dtype, d, got80)
            if tiles == 1:
                assert got90 == "tile" and d == one, (dtype, d)
            elif op in build.CLUSTER_OPS and d <= top:
                assert got90 == "cluster", (dtype, d)
                r, maxv, per_block = build.cluster_shape(op, dtype, d)
                vec = 16 // build.ITEMSIZE[layout]
                assert per_block <= r * maxv and build.CLUSTER * per_block * vec >= d
                assert build.cluster_shared_bytes(op, dtype, d) <= build.CLUSTER_SHARED_CAP
                assert build.backward_path(op, dtype, d, 100) == "long"  # 9.x only
            else:
                assert got90 == "long", (dtype, d, got90)
    if op == "layer_norm_bwd":
        assert build.cluster_shared_bytes(op, "float32", 65536) == 128 * 1024
        assert build.cluster_shared_bytes(op, "float16", 65536) == 64 * 1024
        assert build.cluster_shared_bytes(op, "float64", 32768) == 128 * 1024
        assert build.cluster_units(10**6, 65536, 132) == 32  # 2 waves of 16 clusters of 8
        assert build.cluster_units(5, 65536, 132) == 5


def test_column_sum_width_is_the_kernels():
    """The row functions launch param_grad_sum with the columns per block norms.cu assumes."""
    m = re.search(r"#define LNLIB_SUM_COLS (\d+)", build.source())
    assert m and int(m.group(1)) == build.SUM_COLUMNS


def _nvrtc_missing():
    """Why CuPy's NVRTC path cannot be exercised here, or None if it can."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - no libnvrtc: CuPy cannot compile here
        return f"CuPy cannot load NVRTC ({exc})"
    return None


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("arch", ARCHS)
def test_cupy_nvrtc_compiles_every_module_by_name(arch):
    """The run-time path itself, without a GPU: CuPy's option assembly and NVRTC, with the name
    expressions of every (operation, dtype) module, the fused ones included, for sm_80 and
    sm_90 (with the cluster kernels); every name resolves."""
    from cupy._core import core
    from cupy.cuda import compiler

    options = (
        core.assemble_cupy_compiler_options(build.OPTIONS)
        + CUPY_ADDED
        + (f"-arch=sm_{arch}", "--device-as-default-execution-space")
    )
    for op, dtype in build.modules():
        names = build.name_expressions(op, dtype, arch)
        program = compiler._NVRTCProgram(
            build.source(), "norms.cu", name_expressions=names, method="cubin"
        )
        cubin, mapping = program.compile(options)
        assert cubin and set(mapping) == set(names), f"{op} {dtype}: names not resolved"


def resource_table(builds_by_arch):
    """Lines ``kernel  sm_80 registers  sm_90 registers  spills`` for the report."""
    reports = {a: parse_report(log) for a, (_, log) in builds_by_arch.items()}
    names = build.all_name_expressions(max(ARCHS))
    width = max(len(n) for n in names) + 2
    heads = "".join(f"{'sm_' + a + ' regs':>12}{'spills':>8}" for a in ARCHS)
    lines = [f"{'kernel':<{width}}" + heads]
    for name in names:
        row = f"{name:<{width}}"
        for a in ARCHS:
            r = reports[a].get(name, {"registers": "-", "spill_stores": "-", "spill_loads": "-"})
            spills = r.get("spill_stores", "?"), r.get("spill_loads", "?")
            row += f"{r.get('registers', '?'):>12}{'{}/{}'.format(*spills):>8}"
        lines.append(row)
    return lines


if __name__ == "__main__":
    if NVCC is None:
        sys.exit("nvcc not found")
    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(len(ARCHS)) as pool:
            out = dict(zip(ARCHS, pool.map(lambda a: _compile(a, tmp), ARCHS)))
    print("\n".join(resource_table(out)))
    sys.exit(max(code for code, _ in out.values()))


# The row functions' launches against the kernels' declarations, without a GPU -------------

_C_NAME = {"float": "float32", "double": "float64", "__half": "float16"}


def kernel_parameters():
    """``{kernel: (template parameter names, [(C type, is pointer, name), ...])}`` from
    norms.cu."""
    found = {}
    pattern = (
        r"template <([^>]*)>\s*__global__ void __launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*"
        r"(?:__cluster_dims__\([^()]*\)\s*)?(\w+)\((.*?)\)\s*\{"
    )
    for m in re.finditer(pattern, build.source(), re.S):
        names = [p.split()[-1] for p in m.group(1).split(",")]
        params = []
        for p in m.group(3).split(","):
            p = p.replace("const ", "").strip()
            pointer = "*" in p
            ctype, pname = p.replace("*", " ").rsplit(None, 1)
            params.append((ctype.strip(), pointer, pname))
        found[m.group(2)] = (names, params)
    return found


def _declared(ctype, binding):
    """The dtype name of a declared C type, template parameters bound by ``binding``."""
    if ctype in ("long long", "int"):
        return {"long long": "int64", "int": "int32"}[ctype]
    acc = re.fullmatch(r"typename Acc<(\w+)>::type", ctype)
    if acc:
        return "float64" if binding[acc.group(1)] == "double" else "float32"
    return _C_NAME[binding.get(ctype, ctype)]


def _fake_cupy(np):
    """A stand-in for CuPy: NumPy arrays with the ``.data.ptr`` the row functions read."""
    import types

    class Array(np.ndarray):
        @property
        def data(self):
            return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    def wrap(f):
        return lambda *a, **k: np.asarray(f(*a, **k)).view(Array)

    fake = types.ModuleType("cupy")
    for name in ("zeros", "ascontiguousarray", "add"):
        setattr(fake, name, wrap(getattr(np, name)))
    fake.empty = fake.zeros  # no kernel runs: zeros keep the stand-in's arithmetic quiet
    fake.can_cast = np.can_cast
    return fake, wrap(np.asarray)


def test_a_refused_cluster_launch_falls_back_to_the_two_launch_kernel(monkeypatch):
    """Where the driver refuses the cluster kernel's launch (no GPC with 8 SMs free to it), the
    call is made again by the two-launch kernel, with a warning, and that device takes the
    two-launch kernel for its long rows from then on (the modulated backward too); other
    devices keep the cluster kernel, and another error (an illegal address) is raised. Run with
    a stand-in for CuPy."""
    import types

    import numpy as np

    from lnlib._cuda import cuda_kernel as ck

    fake, put = _fake_cupy(np)

    class refused(Exception):  # CuPy's CUDADriverError: a CUresult in .status
        def __init__(self, status):
            self.status = status
            super().__init__(f"CUresult {status}")

    device = [0]
    runtime = types.SimpleNamespace(getDevice=lambda: device[0])
    fake.cuda = types.SimpleNamespace(runtime=runtime, driver=types.SimpleNamespace())
    fake.cuda.driver.CUDADriverError = refused
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(ck, "_NO_CLUSTERS", set())
    monkeypatch.setattr(ck, "_sm_count", lambda: 132)
    monkeypatch.setattr(build, "device_arch", lambda: 90)
    launched = []

    class Kernel:
        max_dynamic_shared_size_bytes = 48 * 1024

        def __init__(self, op):
            self.op = op

        def __call__(self, grid, block, args, shared_mem=0):
            launched.append((device[0], self.op))
            if self.op.endswith("_cluster") and device[0] != 1:
                raise refused(912 if device[0] in (0, 3) else 700)  # refused; illegal address

    class SumModule:
        def get_function(self, name):
            return lambda grid, block, args: None

    monkeypatch.setattr(build, "function", lambda op, dtype, r, maxv: Kernel(op))
    monkeypatch.setattr(build, "module", lambda op, dtype: SumModule())
    d = 20000
    assert build.backward_path("layer_norm_bwd", "float32", d, 90) == "cluster"
    x, dy = (put(np.ones((3, d)), dtype="float32") for _ in range(2))
    w, stats = put(np.ones(d), dtype="float32"), put(np.ones(3), dtype="float32")
    with pytest.warns(UserWarning, match="device 0 refused the cluster backward"):
        ck.layer_norm_backward_rows(dy, x, stats, stats, w)
    long = [(0, "layer_norm_bwd_long")] * 2
    assert launched == [(0, "layer_norm_bwd_cluster"), *long] and ck._NO_CLUSTERS == {0}
    ck.rms_norm_backward_rows(dy, x, stats, w)  # device 0: straight to the two launches
    device[0] = 1  # another device keeps the cluster kernel
    ck.layer_norm_backward_rows(dy, x, stats, stats, w)
    assert launched[3:] == [(0, "rms_norm_bwd_long")] * 2 + [(1, "layer_norm_bwd_cluster")]
    device[0] = 2  # an error that is no refusal of the launch is raised, the device kept
    with pytest.raises(refused):
        ck.layer_norm_backward_rows(dy, x, stats, stats, w)
    assert ck._NO_CLUSTERS == {0}
    device[0] = 3  # the modulated backward falls back alike, its runs and (mods, D) kept
    mw = put(np.ones((3, d)), dtype="float32")
    with pytest.warns(UserWarning, match="device 3 refused the cluster backward"):
        grads = ck.modulated_layer_norm_backward_rows(dy, x, stats, stats, mw, 1, 3)
    assert [g.shape for g in grads] == [(3, d)] * 3
    mod = "modulated_layer_norm_bwd"
    assert launched[-3:] == [(3, mod + "_cluster")] + [(3, mod + "_long")] * 2
    assert ck._NO_CLUSTERS == {0, 3}


@pytest.mark.parametrize("cc", [80, 90])
def test_row_functions_pass_what_each_kernel_declares(monkeypatch, cc):
    """Every launch of the CUDA row functions (fused and unfused, every dtype combination the
    tests of tests/test_gpu_add_norm.py use) passes, position by position, an argument of the
    dtype the kernel declares (a null pointer where a pointer may be absent), and names a
    kernel of its module for the device's compute capability ``cc``; run with a stand-in for
    CuPy, so a wrong order fails here. Long rows on sm_90 take the cluster kernel: whole
    clusters, blocks of CLUSTER_R threads, the dynamic shared memory build.py gives, opted into
    before the launch, and (units, D) partial buffers, one row per cluster; the modulated
    backward's clusters in runs, one per parameter row: a grid of runs * units * CLUSTER
    blocks, (runs * units, D) partial buffers (build.cluster_run_units)."""
    import numpy as np

    from lnlib._cuda import cuda_kernel as ck

    fake, put = _fake_cupy(np)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    declared, launched = kernel_parameters(), []

    def function(op, dtype, r, maxv):
        name = build.kernel_name(op, dtype, r, maxv)
        base = op.removesuffix("_long").removesuffix("_cluster")
        assert name in build.name_expressions(base, dtype, cc), (name, cc)
        names, params = declared[op]
        binding = dict(zip(names, (a.strip() for a in name[len(op) + 1 : -1].split(","))))

        class Kernel:  # the CUfunction's attribute starts at CUDA's default, 48 KiB
            max_dynamic_shared_size_bytes = 48 * 1024

            def __call__(self, grid, block, args, shared_mem=0):
                launch(self, grid, block, args, shared_mem)

        def launch(kernel, grid, block, args, shared_mem):
            assert len(args) == len(params), (name, len(args), len(params))
            assert shared_mem == 0 or op.endswith("_cluster"), (name, shared_mem)
            if op.endswith("_cluster"):
                value = {pname: a for a, (_c, _p, pname) in zip(args, params)}
                m, d = int(value["m"]), int(value["d"])
                runs = int(value.get("mods", 1))
                assert cc // 10 in build.CLUSTER_MAJORS and base in build.CLUSTER_OPS, name
                assert build.backward_path(base, dtype, d, cc) == "cluster", (name, d)
                assert block == (build.CLUSTER_R,) and len(grid) == 1, (name, grid, block)
                assert grid[0] % (runs * build.CLUSTER) == 0, (name, grid, runs)
                per_run = grid[0] // (runs * build.CLUSTER)
                assert per_run == build.cluster_run_units(m, d, runs, 132), (name, grid, m)
                assert 1 <= per_run <= m // runs, (name, grid, m, runs)
                if runs == 1:
                    assert per_run == build.cluster_units(m, d, 132), (name, grid, m)
                units = runs * per_run
                assert shared_mem == build.cluster_shared_bytes(base, dtype, d), (name, shared_mem)
                assert shared_mem <= kernel.max_dynamic_shared_size_bytes, (name, shared_mem)
                assert shared_mem <= build.CLUSTER_SHARED_CAP, (name, shared_mem)
                parts = [a for a, p in zip(args, params) if p[2].endswith("_part")]
                assert parts and all(p.shape == (units, d) for p in parts), (name, units)
            for i, (a, (ctype, pointer, _pname)) in enumerate(zip(args, params)):
                if pointer and isinstance(a, np.uintp):
                    assert a == 0, (name, i)
                    continue
                got = np.dtype(a.dtype).name
                assert isinstance(a, np.ndarray) == pointer, (name, i, type(a))
                assert got == _declared(ctype, binding), (name, i, got, ctype)
            phase = int(args[-1]) if op.endswith("bwd_long") else 1
            if op.endswith("bwd_long"):  # the rows' sums (a block a row), then units by tiles
                assert block == (build.LONG_R,) and args[-2].ndim == 1 and args[-2].size % 2 == 0
                assert phase in (0, 1) and (phase == 0) == (len(grid) == 1), (name, grid)
            if op.startswith("modulated_layer_norm_bwd") and phase == 1:  # runs of blocks
                part, m, mods = args[9], int(args[11]), int(args[15])
                assert grid[0] % mods == 0, (name, grid, mods)
                blocks, rows_per_block = grid[0] // mods, block[0] // int(binding["R"])
                if op.endswith("_long"):
                    per_run = blocks
                elif op.endswith("_cluster"):  # whole clusters in each run
                    assert blocks % build.CLUSTER == 0, (name, grid, mods)
                    per_run = blocks // build.CLUSTER
                else:
                    per_run = min(m // mods, blocks * rows_per_block)
                assert part.shape[0] == mods * per_run, (name, part.shape, grid, mods)
                assert per_run <= m // mods or op == base, (name, blocks, m)
            launched.append(op)

        return Kernel()

    monkeypatch.setattr(build, "function", function)

    class SumModule:  # param_grad_sum: its arguments, and the sums it would write
        def get_function(self, name):
            assert name in (build.sum_name("float32"), build.sum_name("float64")), name

            def launch(grid, block, args):
                part, units, d, out = args
                runs = grid[1]
                assert grid[0] * build.SUM_COLUMNS >= d and block == (32 * build.SUM_COLUMNS,)
                assert runs <= 65535 and part.shape[0] >= runs * units, (grid, part.shape)
                rows = part[: runs * int(units)].reshape(runs, int(units), int(d))
                out[:runs] = rows.sum(axis=1)

            return launch

    monkeypatch.setattr(build, "module", lambda op, dtype: SumModule())
    monkeypatch.setattr(ck, "_sm_count", lambda: 132)
    monkeypatch.setattr(ck, "_compute_capability", lambda: cc)
    rng = np.random.default_rng(0)
    combos = [
        ("float32",) * 3,
        ("float16",) * 3,
        ("float64",) * 3,
        ("float16", "float32", "float32"),
    ]
    combos += [("float16", "float16", "float32"), ("float32", "float64", "float64")]
    for (xd, rd, hd), d in itertools.product(combos, (32, 1001, 20000)):
        x, r, dy = (put(rng.standard_normal((3, d)), dtype=t) for t in (xd, rd, xd))
        w = put(np.ones(d), dtype="float64" if hd == "float64" else "float32")
        y, h, mean, rstd = ck.add_layer_norm_forward_rows(x, r, w, w, 1e-5, np.dtype(hd))
        ck.add_rms_norm_forward_rows(x, r, None, 1e-5, np.dtype(hd))
        for dh in (h, None, put(h, dtype="float64"), put(h, dtype="float16")):
            ck.add_layer_norm_backward_rows(dy, dh, h, mean, rstd, w)
            ck.add_rms_norm_backward_rows(dy, dh, h, rstd, None)
        ck.layer_norm_backward_rows(dy, h, mean, rstd, w)
        ck.rms_norm_backward_rows(dy, h, rstd, w)
    for dt, d, (m, group, mods) in itertools.product(
        ("float32", "float16", "float64"),
        (32, 1001, 20000),
        ((6, 2, 3), (40, 1, 4), (3, 1, 1), (400, 1, 2), (100, 50, 2)),
    ):
        x, dy = (put(rng.standard_normal((m, d)), dtype=dt) for _ in range(2))
        w = put(np.ones((mods, d)), dtype="float64" if dt == "float64" else "float32")
        y, mean, rstd = ck.modulated_layer_norm_forward_rows(x, w, w, 1e-5, group, mods)
        for weight in (w, None):
            grads = ck.modulated_layer_norm_backward_rows(dy, x, mean, rstd, weight, group, mods)
            assert [g.shape for g in grads] == [(m, d), (mods, d), (mods, d)]
    ops = build.OPS + build.ADD_OPS + build.MOD_OPS
    want = ops + tuple(op + "_long" for op in ops)
    if cc >= 90:  # d = 20000: every backward's cluster kernel (float64 too: 20000 <= 32768)
        assert "modulated_layer_norm_bwd" in build.CLUSTER_OPS
        want += tuple(op + "_cluster" for op in build.CLUSTER_OPS)
        want = tuple(k for k in want if not k.endswith("bwd_long"))
    assert set(launched) == set(want), sorted(set(launched) ^ set(want))
